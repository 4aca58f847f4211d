"""Tests of the noisy quadratic model (cbs_tracker.theory.nqm): closed forms against slow loops, the reference table."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest

from cbs_tracker.commands import nqm as nqm_cmd
from cbs_tracker.theory import nqm as N
from cbs_tracker.theory.nqm import (
    ExactNQM,
    MonteCarloNQM,
    NQMConfig,
    OnlineObservation,
    ScheduleResult,
    compare_schedules,
    register_row,
    run_online,
    unregister_row,
)
from cbs_tracker.theory.schedule import plan_doubling, solve_batch_scale


@pytest.fixture(scope="module")
def model() -> ExactNQM:
    return ExactNQM()


@pytest.fixture(scope="module")
def seed_table(model: ExactNQM) -> N.Comparison:
    return compare_schedules(3e6, 8.0, 8192.0, model=model, extra_rows=False)


def _slow_loss(model: ExactNQM, batches: np.ndarray) -> float:
    """Plain per-step recursion v <- (1 - eta h)^2 v + eta^2 sigma^2 / B (the reference)."""
    h, eta = model.curvatures, model.lr
    v = model.initial_second_moment.copy()
    for b in batches:
        v = (1 - eta * h) ** 2 * v + eta**2 * model.noise_variance / b
    return float(0.5 * np.sum(h * v))


# ----------------------------------------------------------------------------- the model


def test_the_seed_setting_is_normalised(model: ExactNQM) -> None:
    h = model.curvatures
    assert h.size == 1500 and h[0] == pytest.approx(1e-5) and h[-1] == pytest.approx(1.0)
    assert 0.5 * np.sum(h * model.initial_second_moment) == pytest.approx(1.0, rel=1e-12)
    assert model.noise_floor(8.0) == pytest.approx(0.5, rel=1e-12)
    # the floor is exactly ∝ 1/B, and a long constant run reaches it
    assert model.noise_floor(64.0) * 64 == pytest.approx(model.noise_floor(8.0) * 8, rel=1e-12)
    assert model.constant_loss(64.0, 10**8) == pytest.approx(model.noise_floor(64.0), rel=1e-9)
    # v_0 ∝ h^(0.3 - 1), sigma^2 ∝ h^0.5
    assert np.polyfit(np.log(h), np.log(model.initial_second_moment), 1)[0] == pytest.approx(-0.7)
    assert np.polyfit(np.log(h), np.log(model.noise_variance), 1)[0] == pytest.approx(0.5)


def test_kernel_formula_recursion_and_slow_loop_agree(model: ExactNQM) -> None:
    rng = np.random.default_rng(0)
    batches = np.concatenate([np.full(300, 8.0), rng.uniform(8, 512, 200), np.full(50, 1024.0)])
    slow = _slow_loss(model, batches)
    assert model.final_loss(batches) == pytest.approx(slow, rel=1e-12)
    assert model.trajectory(batches).final_loss == pytest.approx(slow, rel=1e-12)
    assert model.constant_loss(32.0, 777) == pytest.approx(_slow_loss(model, np.full(777, 32.0)), rel=1e-12)
    # kernel: kappa(j) = 1/2 eta^2 sum h sigma^2 (1 - eta h)^(2j)
    j = np.array([0, 1, 5, 1023, 1024, 5000])
    h, s2, eta = model.curvatures, model.noise_variance, model.lr
    direct = [0.5 * eta**2 * np.sum(h * s2 * (1 - eta * h) ** (2 * k)) for k in j]
    np.testing.assert_allclose(model.kernel(j), direct, rtol=1e-12)


def test_trajectory_records_start_and_end(model: ExactNQM) -> None:
    batches = np.concatenate([np.full(1000, 8.0), np.full(100, 64.0)])
    traj = model.trajectory(batches, num_points=50)
    assert traj.steps[0] == 0 and traj.loss[0] == pytest.approx(1.0)
    assert traj.steps[-1] == batches.size and traj.tokens[-1] == pytest.approx(batches.sum())
    assert traj.loss[-1] == pytest.approx(traj.final_loss)
    i = int(np.searchsorted(traj.steps, 500))
    assert traj.loss[i] == pytest.approx(_slow_loss(model, batches[: traj.steps[i]]), rel=1e-12)


def test_step_matches_the_closed_form_and_the_noise_scale_is_exact() -> None:
    m = ExactNQM()
    for _ in range(100):
        st = m.step(16.0)
    assert st.step == 100 and st.tokens_seen == 1600.0 and st.batch == 16.0
    assert st.loss == pytest.approx(m.constant_loss(16.0, 100), rel=1e-12)
    h, s2, eta = m.curvatures, m.noise_variance, m.lr
    a = (1 - eta * h) ** 2
    v = m.initial_second_moment * a**100 + eta**2 * s2 / 16 * (1 - a**100) / (1 - a)
    assert st.grad_sq_norm == pytest.approx(np.sum(h**2 * v), rel=1e-12)
    assert st.trace_cov == pytest.approx(np.sum(s2))
    assert st.noise_scale == pytest.approx(np.sum(s2) / np.sum(h**2 * v), rel=1e-12)
    assert st.noise_scale_hessian == pytest.approx(np.sum(h * s2) / np.sum(h**3 * v), rel=1e-12)
    assert m.reset().loss == pytest.approx(1.0)


def test_noise_scale_follows_the_batch_at_the_floor(model: ExactNQM) -> None:
    # the feedback trap (docs/design.md): at the floor v = eta^2 sigma^2 / (B (1 - a)), so B_simple / B is a constant
    h, s2, eta = model.curvatures, model.noise_variance, model.lr
    ratio = np.sum(s2) / (eta**2 * np.sum(h**2 * s2 / (1 - (1 - eta * h) ** 2)))
    assert ratio == pytest.approx(10.06, abs=0.01)
    for b in (8.0, 256.0):
        m = ExactNQM()
        m._v = eta**2 * s2 / (b * (1 - (1 - eta * h) ** 2))  # start on the floor
        st = m.step(b)
        assert st.noise_scale / b == pytest.approx(ratio, rel=1e-9)


def _continuum_exponents(config: NQMConfig, s_window: tuple[float, float], beta_window: tuple[float, float]
                         ) -> tuple[float, float]:
    """``s`` and ``beta`` of the spectrum as a continuum, fitted the way ``measure_exponents`` fits them.

    The model's coordinates are log-spaced curvatures with ``h v_0 ∝ h^source_exponent`` and
    ``h sigma^2 ∝ h^(1 + noise_exponent)``, so ``S(T) ∝ ∫ h^a (1 - eta h)^(2T) dlog h`` and the
    kernel ``kappa(j) ∝ ∫ h^(1 + b) (1 - eta h)^(2j) dlog h`` over ``[h_min, h_max]``: integrated
    here on a grid 100x finer than the model's, without the model's code.
    """
    u = np.linspace(math.log(config.curvature_min), math.log(config.curvature_max), 100 * config.dims)
    h = np.exp(u)
    a = (1 - config.lr * h) ** 2

    def slope(window: tuple[float, float], weight: np.ndarray) -> float:
        ts = np.unique(np.round(np.geomspace(window[0], window[1], 200)).astype(np.int64))
        vals = [np.trapezoid(weight * a**t, u) for t in ts]
        return float(np.polyfit(np.log(ts), np.log(vals), 1)[0])

    s = -slope(s_window, h**config.source_exponent)
    beta = 1.0 / (slope(beta_window, h ** (1 + config.noise_exponent)) + 2.0)
    return s, beta


@pytest.mark.parametrize(
    ("s_window", "beta_window"), [(N.S_WINDOW, N.BETA_WINDOW), ((10, 1e3), (10, 1e4)), ((2, 20), (2, 20))]
)
def test_measured_exponents_are_those_of_the_continuum_spectrum(model: ExactNQM, s_window, beta_window) -> None:
    # The 1500 modes sample the continuum 300 times per decade; the sum differs from the
    # integral by its end terms (the two cutoff modes, ~1/1500 of the weight) and by
    # O(spacing^2): a few 1e-4 in a fitted slope, so 2e-3 holds. Where a window reaches a
    # cutoff of the spectrum the slope leaves its power-law limit: s rises to ~0.49 over
    # [10, 1e5] (the default window) and to ~0.35 over [10, 1e3].
    e = model.measure_exponents(s_window=s_window, beta_window=beta_window)
    s, beta = _continuum_exponents(model.config, s_window, beta_window)
    assert e.s == pytest.approx(s, abs=2e-3)
    assert e.beta == pytest.approx(beta, abs=2e-3)


def test_signal_exponent_at_short_times_is_the_power_law_limit(model: ExactNQM) -> None:
    # away from the slow cutoff S(T) ∝ T^-source_exponent; only the fast end (h ~ 1) bends the
    # local slope at T < 20, by a few hundredths. (The kernel weighs the fast end by h^1.5, so
    # beta nears its limit 1/(1 - noise_exponent) = 2 only at longer lags: 1.95 over [10, 1e3].)
    assert model.measure_exponents(s_window=(2, 20)).s == pytest.approx(model.config.source_exponent, abs=0.05)


# ----------------------------------------------------------------------------- the reference table


def test_seed_table_is_reproduced(seed_table: N.Comparison) -> None:
    comp = seed_table
    assert comp.ratio_vs_constant("constant") == 1.0
    # reference results of the default NQM: two-stage 3.8x, doubling 9.9x, optimum 10.2x lower than the best constant batch
    # (printed to two significant digits: half a unit of the last digit; the README's
    # three-digit values of the same table are checked in test_claims)
    assert comp.ratio_vs_constant("two_stage") == pytest.approx(3.8, abs=0.05)
    assert comp.ratio_vs_constant("doubling") == pytest.approx(9.9, abs=0.05)
    assert comp.ratio_vs_constant("optimal") == pytest.approx(10.2, abs=0.05)
    assert comp.exponents == ExactNQM().measure_exponents()  # derived in the continuum test above
    # the optimum ends below the best constant batch's noise floor
    const_batch = comp.row("constant").batches[0]
    assert comp.row("optimal").final_loss < ExactNQM().noise_floor(const_batch)


def test_every_row_spends_the_budget_within_the_bounds(seed_table: N.Comparison) -> None:
    for r in seed_table.rows:
        assert math.fsum(r.batches) == pytest.approx(3e6, rel=1e-12), r.name
        assert r.batches.min() >= 8.0 * (1 - 1e-12) and r.batches.max() <= 8192.0 * (1 + 1e-12), r.name
        assert r.steps == r.batches.size
    opt = seed_table.row("optimal").final_loss
    assert all(r.final_loss >= opt for r in seed_table.rows)


def test_best_constant_is_the_best_constant(model: ExactNQM, seed_table: N.Comparison) -> None:
    best = seed_table.row("constant").final_loss
    for b in 2.0 ** np.arange(3, 14):
        t = int(3e6 // b)
        assert model.constant_loss(3e6 / t, t) >= best


def test_optimum_is_sqrt_kernel_and_beats_perturbations(model: ExactNQM, seed_table: N.Comparison) -> None:
    b = seed_table.row("optimal").batches
    t = b.size
    kappa = model.kernel(np.arange(t - 1, -1, -1))  # kappa(T - 1 - k)
    ramp = (b > 8.0 * 1.001) & (b < 8192.0 * 0.999)
    c2 = b[ramp] ** 2 / kappa[ramp]
    assert c2.std() / c2.mean() < 1e-10
    assert np.all(np.diff(b) >= 0)
    rng = np.random.default_rng(3)
    best = model.final_loss(b)
    for scale in (0.02, 0.3):
        for _ in range(5):
            w = b * np.exp(scale * rng.standard_normal(t))
            c = solve_batch_scale(w, 3e6, 8.0, 8192.0)
            assert model.final_loss(np.clip(c * w, 8.0, 8192.0)) > best
    for dt in (-3000, 3000):
        assert model.final_loss(model.optimal_batches(3e6, 8.0, 8192.0, steps=t + dt)) > best


def test_two_stage_is_stationary(model: ExactNQM, seed_table: N.Comparison) -> None:
    b = seed_table.row("two_stage").batches
    b1, b2 = b[0], b[-1]
    n1 = int(np.sum(b == b1))
    best = model.final_loss(b)
    for dn in (-400, 400):
        m1 = n1 + dn
        rest = 3e6 - m1 * b1
        n2 = round(rest / b2)
        assert model.final_loss(np.concatenate([np.full(m1, b1), np.full(n2, rest / n2)])) > best


# ----------------------------------------------------------------------------- Monte Carlo


def test_microbatch_gradients_have_the_right_moments() -> None:
    mc = MonteCarloNQM(seed=1)
    g = mc.microbatch_gradients(4000, 4.0)
    assert g.shape == (4000, 1500)
    assert mc.tokens_seen == 16000.0
    sq = np.einsum("kd,kd->k", g, g)
    expected = mc.grad_sq_norm() + mc.trace_cov / 4.0  # E|g_k|^2 = |G|^2 + tr(Sigma)/m
    assert sq.mean() == pytest.approx(expected, abs=5 * sq.std() / math.sqrt(sq.size))
    # the mean of the 4000 draws is h theta with per-coordinate standard error sigma_i / sqrt(4000 m):
    # the standardised errors are 1500 independent N(0, 1), so their mean is within 5 / sqrt(1500)
    # and their sum of squares (chi^2, 1500 degrees of freedom) within 5 sd = 5 sqrt(3000) of 1500
    model = ExactNQM(mc.config)
    z = (g.mean(axis=0) - model.curvatures * mc.theta) / np.sqrt(model.noise_variance / (4000 * 4.0))
    assert abs(z.mean()) < 5 / math.sqrt(z.size)
    assert np.sum(z**2) == pytest.approx(z.size, abs=5 * math.sqrt(2 * z.size))


def test_monte_carlo_averages_to_the_exact_model(model: ExactNQM) -> None:
    batches = np.concatenate([np.full(150, 8.0), np.full(50, 64.0)])
    losses = []
    for seed in range(40):
        mc = MonteCarloNQM(seed=seed)
        for b in batches:
            g = mc.microbatch_gradients(2, b / 2)
            mc.apply(g.mean(axis=0))
        losses.append(mc.loss())
    losses = np.asarray(losses)
    assert losses.mean() == pytest.approx(model.final_loss(batches), abs=5 * losses.std() / math.sqrt(losses.size))


# ----------------------------------------------------------------------------- online runner


def test_run_online_with_a_constant_policy_is_the_constant_run(model: ExactNQM) -> None:
    run = run_online(lambda obs: None, budget=8000.0, initial_batch=8.0)
    assert run.steps == 1000 and run.model == "exact"
    assert run.final_loss == pytest.approx(model.constant_loss(8.0, 1000), rel=1e-12)
    assert run.expected_final_loss == pytest.approx(run.final_loss, rel=1e-12)
    assert run.losses.size == 1000 and run.noise_scales.size == 1000


def test_run_online_follows_a_plan_and_spends_the_budget_exactly(model: ExactNQM) -> None:
    plan = plan_doubling(5e4, 8.0, 1024.0, 0.3, 2.0)
    seen: list[OnlineObservation] = []

    def policy(obs: OnlineObservation) -> float:
        seen.append(obs)
        return plan.batch_at_tokens(obs.tokens_seen)

    run = run_online(policy, budget=5e4, initial_batch=8.0)
    assert math.fsum(run.batches) == pytest.approx(5e4, rel=1e-12)
    before = np.concatenate([[0.0], np.cumsum(run.batches)[:-1]])
    np.testing.assert_array_equal(run.batches[:-1], plan.batch_at_tokens(before[:-1]))
    obs = seen[10]
    assert obs.step == 11 and obs.budget == 5e4 and obs.remaining == pytest.approx(5e4 - obs.tokens_seen)
    assert obs.micro_sq_norms is None and obs.small_sq_norm is None
    assert obs.noise_scale == pytest.approx(obs.trace_cov / obs.grad_sq_norm)
    assert run.expected_final_loss == pytest.approx(model.final_loss(run.batches), rel=1e-12)


def test_run_online_monte_carlo_gives_unbiased_norms() -> None:
    estimates = []

    def policy(obs: OnlineObservation) -> float:
        # McCandlish et al. App. A: tr(Sigma) ≈ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)
        assert obs.micro_sq_norms is not None and obs.micro_sq_norms.size == 8
        estimates.append((obs.small_sq_norm - obs.big_sq_norm) / (1 / obs.micro_batch - 1 / obs.batch))
        return 32.0

    run = run_online(policy, budget=32.0 * 400, initial_batch=32.0, model="monte_carlo", micro_batch=4.0, seed=5)
    assert run.model == "monte_carlo" and run.steps == 400
    est = np.asarray(estimates)
    trace = ExactNQM().trace_cov
    assert est.mean() == pytest.approx(trace, abs=5 * est.std() / math.sqrt(est.size))


def test_run_online_monte_carlo_cuts_the_last_step() -> None:
    run = run_online(lambda obs: 24.0, budget=1000.0, initial_batch=8.0, model="monte_carlo", micro_batch=4.0)
    assert math.fsum(run.batches) == pytest.approx(1000.0)
    assert run.batches[0] == 8.0 and run.batches[1] == 24.0 and run.batches[-1] <= 24.0


# ----------------------------------------------------------------------------- registry and command


@pytest.fixture
def no_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Isolate the registry from other modules' rows (cbs_tracker.theory.nqm_online registers its own)."""
    monkeypatch.setattr(N, "ROW_PLUGIN_MODULE", "cbs_tracker._no_such_plugin")
    monkeypatch.setattr(N, "_EXTRA_ROWS", {})


def test_registered_rows_join_the_comparison(no_plugins: None) -> None:
    def online_row(ctx: N.RowContext) -> ScheduleResult:
        assert set(ctx.rows) >= {"constant", "two_stage", "doubling", "optimal", "planner"}
        best = ctx.rows["constant"].batches[0]
        run = run_online(lambda obs: None, budget=ctx.budget, initial_batch=best)
        return run.as_row("same_as_constant", "constant, driven online")

    register_row("same_as_constant", online_row)
    try:
        comp = compare_schedules(2e5, 8.0, 1024.0)
    finally:
        unregister_row("same_as_constant")
    assert comp.rows[-1].name == "same_as_constant"
    assert comp.ratio_vs_constant("same_as_constant") == pytest.approx(1.0, rel=1e-9)
    assert "same_as_constant" in comp.to_dict()
    assert "same_as_constant" not in N.registered_rows()


def test_row_plugin_module_loading(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    monkeypatch.setattr(N, "ROW_PLUGIN_MODULE", "cbs_tracker._no_such_plugin")
    assert N.load_row_plugins() is False
    (tmp_path / "broken_rows_plugin.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(N, "ROW_PLUGIN_MODULE", "broken_rows_plugin")
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_xyz"):
        N.load_row_plugins()
    sys.modules.pop("broken_rows_plugin", None)


def test_nqm_command_table_json_and_png(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    png = tmp_path / "nqm.png"
    rc = nqm_cmd.main(["--budget", "2e5", "--b-max", "1024", "--json", "--no-extra", "-o", str(png)])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    data = json.loads(out[-1])
    assert list(data) == ["constant", "two_stage", "doubling", "optimal", "planner"]
    for row in data.values():
        assert set(row) == {"final_loss", "ratio_vs_constant", "ratio_vs_optimal", "steps"}
    assert data["constant"]["ratio_vs_constant"] == 1.0
    assert any(line.startswith("optimal") for line in out)
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_nqm_command_reports_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert nqm_cmd.main(["--budget", "100", "--no-extra"]) == 2
    assert "budget=100.0 must be at least one step of b_max=8192.0" in capsys.readouterr().err


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: NQMConfig(dims=0), ValueError, r"NQMConfig\(dims=0\): must be >= 1"),
        (lambda: NQMConfig(dims=10.0), TypeError, r"NQMConfig\(dims=10.0\): expected an int"),
        (lambda: NQMConfig(lr=3.0), ValueError, r"NQMConfig\(lr=3.0\): lr \* curvature_max must be < 2"),
        (lambda: NQMConfig(curvature_min=2.0), ValueError, r"curvature_max=1.0\): must be >= curvature_min=2.0"),
        (lambda: NQMConfig(noise_floor=0.0), ValueError, r"NQMConfig\(noise_floor=...\)=0.0 must be > 0"),
        (lambda: ExactNQM("seed"), TypeError, r"config='seed' has type str"),
        (lambda: ExactNQM().step(0.0), ValueError, r"batch=0.0 must be > 0"),
        (lambda: ExactNQM().final_loss(np.array([])), ValueError, r"non-empty 1-D array"),
        (lambda: ExactNQM().optimal_batches(3e6, 8, 8192, steps=10), ValueError, r"steps=10 must be in 367..375000"),
        (lambda: MonteCarloNQM(seed=1.5), TypeError, r"seed=1.5 has type float"),
        (lambda: MonteCarloNQM().microbatch_gradients(0, 4.0), ValueError, r"num_micro=0 must be >= 1"),
        (lambda: MonteCarloNQM().apply(np.zeros(1500)), RuntimeError, r"apply\(\) called before microbatch_gradients"),
        (lambda: run_online(lambda o: None, budget=100.0, model="sampled"), ValueError,
         r"model='sampled' is not one of \['exact', 'monte_carlo'\]"),
        (lambda: run_online(lambda o: -1.0, budget=100.0), ValueError,
         r"the policy returned batch=-1.0 at step 1; expected a finite number > 0"),
        (lambda: register_row("x", 3), TypeError, r"register_row\('x'\): 3 is not callable"),
        (lambda: compare_schedules(1e5, 16, 8), ValueError, r"b_max=8 must be >= b_min=16"),
    ],
)
def test_errors_name_the_argument(call, exc, match) -> None:  # noqa: ANN001
    with pytest.raises(exc, match=match):
        call()


def test_mc_apply_checks_the_shape() -> None:
    mc = MonteCarloNQM()
    mc.microbatch_gradients(1, 1.0)
    with pytest.raises(ValueError, match=r"mean_gradient has shape \(3,\); expected \(1500,\)"):
        mc.apply(np.zeros(3))


def test_row_function_must_return_schedule_results(no_plugins: None) -> None:
    register_row("bad_row", lambda ctx: 42)
    try:
        with pytest.raises(TypeError, match=r"row function 'bad_row' returned int; expected ScheduleResult"):
            compare_schedules(2e5, 8.0, 1024.0)
    finally:
        unregister_row("bad_row")
