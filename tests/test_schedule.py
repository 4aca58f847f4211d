"""Tests of the FSL schedule theory (cbs_tracker.theory.schedule) against brute force and analytic truth."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from cbs_tracker.commands import plan as plan_cmd
from cbs_tracker.theory import schedule as S
from cbs_tracker.theory.schedule import (
    DoublingPlan,
    ScalingLaw,
    _power_sum,
    best_two_stage,
    doubling_plan,
    doubling_plan_from_batches,
    optimal_schedule,
    plan_doubling,
    power_law_schedule,
    solve_batch_scale,
    two_stage_optimum,
)

SEED_S, SEED_BETA = 0.49, 1.96
LAW = ScalingLaw.from_noise_floor(s=SEED_S, beta=SEED_BETA, b_min=8.0, floor_ratio=0.5)


# ----------------------------------------------------------------------------- power sums


@pytest.mark.parametrize("q", [-0.745, -1.49, -0.51])
@pytest.mark.parametrize("n", [0, 1, 7, 65536, 65537, 200_000, 1_000_003])
def test_power_sum_matches_brute_force(q: float, n: int) -> None:
    # beyond the table the sum is Euler-Maclaurin; compare with the plain float64 sum
    exact = float(np.sum(np.arange(1, n + 1, dtype=np.float64) ** q)) if n else 0.0
    assert float(_power_sum(q, n)) == pytest.approx(exact, rel=1e-12, abs=1e-300)


# ----------------------------------------------------------------------------- budget


@pytest.mark.parametrize(
    ("budget", "steps", "beta"),
    [(3e6, 178_000, 1.96), (3e6, 120_000, 1.3), (1e6, 1_000, 3.0), (5e4, 6_000, 1.96), (2.5e9, 400_000, 2.5)],
)
def test_power_law_meets_the_budget_exactly(budget: float, steps: int, beta: float) -> None:
    sched = power_law_schedule(budget, 8.0, 8192.0, beta, steps=steps)
    b = sched.batches()
    assert b.size == steps
    assert math.fsum(b) == pytest.approx(budget, rel=1e-12)
    assert sched.tokens_before(steps + 1) == pytest.approx(budget, rel=1e-12)
    assert b.min() >= 8.0 and b.max() <= 8192.0


def test_solve_batch_scale_meets_the_budget_for_arbitrary_weights() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        w = rng.lognormal(0.0, 2.0, size=rng.integers(5, 2000))
        budget = rng.uniform(w.size * 8.0, w.size * 8192.0)
        c = solve_batch_scale(w, budget, 8.0, 8192.0)
        assert math.fsum(np.clip(c * w, 8.0, 8192.0)) == pytest.approx(budget, rel=1e-12)


def test_solve_batch_scale_agrees_with_the_closed_form_power_law() -> None:
    steps, beta = 50_000, 1.96
    sched = power_law_schedule(1e6, 8.0, 8192.0, beta, steps=steps)
    w = np.arange(steps, 0, -1, dtype=np.float64) ** S.power_law_exponent(beta)  # (T - t + 1)^p
    c = solve_batch_scale(w, 1e6, 8.0, 8192.0)
    assert c == pytest.approx(sched.scale, rel=1e-10)


# ----------------------------------------------------------------------------- the optimum


def test_optimum_is_monotone_and_its_exponent_is_half_the_kernel_slope() -> None:
    sched = optimal_schedule(LAW, 3e6, 8.0, 8192.0)
    b = sched.batches()
    assert np.all(np.diff(b) >= 0)
    assert b[0] == 8.0 and b[-1] > 8.0
    ramp = (b > 8.0 * 1.01) & (b < 8192.0 * 0.99)
    assert ramp.sum() > 100
    m = (sched.steps - np.arange(1, sched.steps + 1) + 1.0)[ramp]  # T - t + 1
    slope_b = np.polyfit(np.log(m), np.log(b[ramp]), 1)[0]
    slope_k = np.polyfit(np.log(m), np.log(LAW.kernel(m - 1)), 1)[0]  # K(T - t)
    assert slope_b == pytest.approx(0.5 * slope_k, abs=1e-9)
    # the capacity exponent read back from the schedule: p = 1/(2 beta) - 1
    assert 0.5 / (slope_b + 1.0) == pytest.approx(SEED_BETA, rel=1e-8)


def test_closed_form_loss_matches_the_direct_sum() -> None:
    sched = optimal_schedule(LAW, 1e6, 8.0, 8192.0)
    assert sched.excess_loss == pytest.approx(LAW.excess_loss(sched.batches()), rel=1e-10)


def test_optimum_beats_random_perturbations_at_equal_budget() -> None:
    # Cauchy-Schwarz: at a fixed T, clip(c sqrt(K)) is the unique minimiser of sum K/b.
    sched = optimal_schedule(LAW, 1e6, 8.0, 8192.0)
    b_opt = sched.batches()
    e_opt = LAW.excess_loss(b_opt)
    rng = np.random.default_rng(1)
    for scale in (0.01, 0.1, 0.5):
        for _ in range(10):
            w = b_opt * np.exp(scale * rng.standard_normal(b_opt.size))
            c = solve_batch_scale(w, 1e6, 8.0, 8192.0)
            b = np.clip(c * w, 8.0, 8192.0)
            assert math.fsum(b) == pytest.approx(1e6, rel=1e-12)
            assert LAW.excess_loss(b) > e_opt
    # and the chosen T beats its neighbours
    for dt in (-2000, -50, 50, 2000):
        other = optimal_schedule(LAW, 1e6, 8.0, 8192.0, steps=sched.steps + dt)
        assert other.excess_loss > sched.excess_loss


def test_optimal_steps_follow_the_predicted_scaling_in_the_easy_regime() -> None:
    # unclipped easy regime: E(T) ≍ A T^-s + C T^(1/beta)/D, so T* ∝ D^(beta/(1 + s beta))
    law = ScalingLaw(s=1.0, beta=2.0, noise_coef=1.0)
    ts = [optimal_schedule(law, d, 1e-6, 1e12).steps for d in (1e5, 1e6, 1e7)]
    slope = np.polyfit(np.log([1e5, 1e6, 1e7]), np.log(ts), 1)[0]
    assert slope == pytest.approx(S.optimal_steps_exponent(1.0, 2.0), abs=0.02)


# ----------------------------------------------------------------------------- regimes


def test_regime_boundary() -> None:
    assert S.regime(0.3, 2.0) == "hard"
    assert S.regime(0.5, 2.0) == "hard"  # s = 1 - 1/beta is hard (<=)
    assert S.regime(0.51, 2.0) == "easy"
    assert S.is_hard_regime(0.2, 1.5)
    # the default NQM's exponents sit on the boundary: 1 - 1/1.96 = 0.4898 < 0.49
    assert S.regime(SEED_S, SEED_BETA) == "easy"


# ----------------------------------------------------------------------------- two stages


@pytest.mark.parametrize(("b1", "b2"), [(8.0, 1024.0), (16.0, 2048.0), (8.0, 64.0)])
def test_two_stage_satisfies_its_balance_equation(b1: float, b2: float) -> None:
    two = two_stage_optimum(LAW, 3e6, b1, b2)
    assert two.interior
    assert abs(two.balance_residual) < 1e-9
    lhs = LAW.signal_coef * LAW.s * two.steps ** (-LAW.s - 1)
    rhs = LAW.noise_coef * (LAW.kernel(two.steps) / b1 + LAW.kernel(two.stage2_steps) / b2)
    assert float(lhs) == pytest.approx(float(rhs), rel=1e-9)
    assert two.steps == pytest.approx(two.switch_tokens / b1 + (3e6 - two.switch_tokens) / b2)
    # the root is the minimum: brute force over the switch point
    q = LAW.kernel_exponent

    def loss(d1: np.ndarray) -> np.ndarray:
        big_s, r = d1 / b1 + (3e6 - d1) / b2, (3e6 - d1) / b2
        ik = lambda x: ((x + 1) ** (q + 1) - 1) / (q + 1)  # noqa: E731
        return LAW.signal_coef * big_s ** (-LAW.s) + LAW.noise_coef * ((ik(big_s) - ik(r)) / b1 + ik(r) / b2)

    grid = np.linspace(0.0, 3e6, 300_001)
    assert loss(grid).min() >= two.excess_loss - 1e-12
    assert abs(grid[np.argmin(loss(grid))] - two.switch_tokens) <= 20.0


def test_two_stage_per_step_schedule_spends_the_budget() -> None:
    two = best_two_stage(LAW, 3e6, 8.0, 8192.0)
    b = two.batches()
    assert math.fsum(b) == pytest.approx(3e6, rel=1e-12)
    assert set(np.unique(b[:-1])) <= {two.b1, two.b2}


# ----------------------------------------------------------------------------- doubling


def test_doubling_plan_switches_where_the_optimum_crosses_the_thresholds() -> None:
    sched = optimal_schedule(LAW, 3e6, 8.0, 8192.0)
    b = sched.batches()
    for rule in ("geometric_mean", "reach"):
        plan = doubling_plan(sched, switch_at=rule)
        assert plan.batches == tuple(8.0 * 2.0**j for j in range(len(plan.batches)))
        assert np.all(np.diff(plan.switch_tokens) > 0)
        for j, (t, z) in enumerate(zip(plan.switch_steps, plan.switch_tokens, strict=True), start=1):
            th = plan.batches[j] if rule == "reach" else plan.batches[j] / math.sqrt(2.0)
            assert b[t - 1] >= th * (1 - 1e-12) and b[t - 2] < th
            assert z == pytest.approx(math.fsum(b[: t - 1]), rel=1e-10)
            # the closed form t_j = T + 1 - (theta_j / c)^(1/p)
            assert t == math.ceil(sched.steps + 1 - (th / sched.scale) ** (1 / sched.exponent) - 1e-9)
        steps = plan.batches_per_step()
        assert steps.size == plan.steps
        assert math.fsum(steps) == pytest.approx(3e6, rel=1e-12)
    gm = doubling_plan(sched, switch_at="geometric_mean")
    reach = doubling_plan(sched, switch_at="reach")
    assert LAW.excess_loss(gm.batches_per_step()) < LAW.excess_loss(reach.batches_per_step())


def test_batch_at_tokens_is_the_staircase() -> None:
    plan = plan_doubling(3e6, 8.0, 8192.0, SEED_S, SEED_BETA)
    steps = plan.batches_per_step()
    assert math.fsum(steps) == pytest.approx(3e6, rel=1e-12)
    assert set(np.unique(steps)) == set(plan.batches)  # every rung exact (3e6 is a multiple of 8)
    before = np.concatenate([[0.0], np.cumsum(steps)[:-1]])
    for j, z in enumerate(plan.switch_tokens, start=1):
        first = int(np.argmax(steps == plan.batches[j]))
        assert abs(before[first] - z) <= plan.batches[j] / 2 + 1e-6  # nearest step boundary to z_j
    # away from the boundaries the per-step schedule is batch_at_tokens
    planned = plan.batch_at_tokens(before)
    assert np.mean(planned == steps) > 0.999
    assert plan.batch_at_tokens(0.0) == 8.0
    assert plan.batch_at_tokens(plan.switch_tokens[0]) == 16.0
    assert plan.batch_at_tokens(np.nextafter(plan.switch_tokens[0], 0.0)) == 8.0
    assert plan.next_switch_tokens(0.0) == plan.switch_tokens[0]
    assert plan.next_switch_tokens(3e6) is None
    assert plan.switch_fractions[0] == pytest.approx(plan.switch_tokens[0] / 3e6)


def test_staircase_spreads_an_odd_remainder_over_the_first_stage() -> None:
    plan = plan_doubling(3e6 + 5.0, 8.0, 8192.0, SEED_S, SEED_BETA)
    steps = plan.batches_per_step()
    assert math.fsum(steps) == pytest.approx(3e6 + 5.0, rel=1e-12)
    first = steps[steps < 16.0]
    assert np.all(first > 8.0) and np.all(first < 8.0 + 1e-3)
    assert set(np.unique(steps[steps >= 16.0])) == set(plan.batches[1:])


def test_plan_from_batches_matches_plan_from_the_power_law() -> None:
    sched = optimal_schedule(LAW, 3e6, 8.0, 8192.0)
    a = doubling_plan(sched)
    b = doubling_plan_from_batches(sched.batches(), 8.0, 8192.0, budget=3e6)
    assert a.batches == b.batches
    assert a.switch_steps == b.switch_steps
    np.testing.assert_allclose(a.switch_tokens, b.switch_tokens, rtol=1e-10)


def test_plan_doubling_scale_options() -> None:
    # floor ratio: C such that the b_min floor is floor_ratio * A
    law = ScalingLaw.from_noise_floor(s=0.4, beta=2.0, b_min=16.0, floor_ratio=0.25)
    assert law.noise_floor(16.0) == pytest.approx(0.25, rel=1e-12)
    # reference batch: the law's best constant batch is the reference
    law = ScalingLaw.from_reference_batch(s=0.4, beta=2.0, reference_batch=300.0, budget=3e6)
    grid = np.geomspace(100, 900, 4001)
    losses = [law.constant_batch_loss(b, 3e6) for b in grid]
    assert grid[int(np.argmin(losses))] == pytest.approx(300.0, rel=0.01)
    plan = plan_doubling(3e6, 8.0, 8192.0, 0.4, 2.0, reference_batch=300.0)
    assert isinstance(plan, DoublingPlan)
    plan = plan_doubling(3e6, 8.0, 8192.0, 0.4, 2.0, steps=150_000)
    assert plan.source_steps == 150_000
    plan = plan_doubling(3e6, 8.0, 8192.0, 0.4, 2.0, law=ScalingLaw(s=0.4, beta=2.0, noise_coef=2.0))
    assert plan.batches[0] == 8.0


def test_plan_with_b_max_not_a_power_of_two_multiple_stops_below_it() -> None:
    plan = plan_doubling(1e6, 8.0, 1000.0, SEED_S, SEED_BETA)
    assert plan.batches[-1] == 512.0
    assert math.fsum(plan.batches_per_step()) == pytest.approx(1e6, rel=1e-12)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: S.regime(0.5, 1.0), ValueError, r"beta=1.0 must be > 1"),
        (lambda: S.regime(0.0, 2.0), ValueError, r"s=0.0 must be > 0"),
        (lambda: S.regime("0.5", 2.0), TypeError, r"s='0.5' has type str"),
        (lambda: ScalingLaw(s=0.5, beta=2.0, noise_coef=-1.0), ValueError, r"noise_coef=-1.0 must be > 0"),
        (lambda: power_law_schedule(3e6, 8, 4, 2.0, steps=1000), ValueError, r"b_max=4 must be >= b_min=8"),
        (lambda: power_law_schedule(3e6, 8, 8192, 2.0, steps=10), ValueError,
         r"steps=10 cannot spend budget=3000000.0 .* allowed steps are 367..375000"),
        (lambda: power_law_schedule(3e6, 8, 8192, 2.0, steps=1e4), TypeError, r"steps=10000.0 has type float"),
        (lambda: power_law_schedule(4, 8, 8192, 2.0, steps=1), ValueError, r"budget=4 is smaller than one step"),
        (lambda: two_stage_optimum(LAW, 3e6, 64, 64), ValueError, r"b2=64 must be > b1=64"),
        (lambda: plan_doubling(3e6, 8, 8192, 0.5, 2.0, factor=1.0), ValueError, r"factor=1.0 must be > 1"),
        (lambda: plan_doubling(3e6, 8, 8192, 0.5, 2.0, switch_at="middle"), ValueError,
         r"switch_at='middle' is not one of \['geometric_mean', 'reach'\]"),
        (lambda: plan_doubling(3e6, 8, 8192, 0.5, 2.0, law=ScalingLaw(s=0.4, beta=2.0)), ValueError,
         r"law has s=0.4, beta=2.0 but plan_doubling got s=0.5"),
        (lambda: plan_doubling(3e6, 8, 8192, 0.5, 2.0, law="x"), TypeError, r"law='x' has type str"),
        (lambda: solve_batch_scale(np.ones(10), 1e6, 8, 8192), ValueError,
         r"budget=1000000.0 cannot be spent in 10 steps"),
        (lambda: solve_batch_scale(np.array([1.0, -1.0]), 100, 8, 8192), ValueError, r"weights must be"),
        (lambda: doubling_plan_from_batches(np.array([16.0, 8.0]), 8, 16), ValueError, r"non-decreasing"),
        (lambda: ScalingLaw.from_reference_batch(s=0.5, beta=2.0, reference_batch=1e7, budget=1e6), ValueError,
         r"reference_batch=10000000.0 exceeds budget=1000000.0"),
        (lambda: LAW.excess_loss(np.array([1.0, 0.0])), ValueError, r"positive batch sizes"),
    ],
)
def test_errors_name_the_argument(call, exc, match) -> None:  # noqa: ANN001
    with pytest.raises(exc, match=match):
        call()


# ----------------------------------------------------------------------------- command


def test_plan_command_prints_the_plan_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc = plan_cmd.main(
        ["--budget", "3e6", "--b-min", "8", "--b-max", "8192", "--s", "0.3", "--beta", "2", "--json"]
    )
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    assert out[0].startswith("regime: hard")
    data = json.loads(out[-1])
    expected = plan_doubling(3e6, 8, 8192, 0.3, 2.0)
    assert data["batches"] == list(expected.batches)
    np.testing.assert_allclose(data["switch_tokens"], expected.switch_tokens)
    assert data["staircase_steps"] == expected.steps
    # one table line per rung
    assert sum(1 for line in out if line.strip().startswith(("8 ", "16 ", "8192 "))) == 3


def test_plan_command_reports_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    rc = plan_cmd.main(["--budget", "3e6", "--b-min", "8", "--b-max", "8192", "--s", "0.3", "--beta", "0.5"])
    assert rc == 2
    assert "beta=0.5 must be > 1" in capsys.readouterr().err
