"""The branched measurement of the critical batch: the selection rule, a critical batch known by
construction (noisy quadratic model), and a run that continues bit for bit after a calibration."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from cbs_tracker import BatchSizeController, CBSTracker
from cbs_tracker.calibrate import Calibration, measure_critical_batch
from cbs_tracker.policy.critical import BranchLosses, critical_batch_interval
from cbs_tracker.policy.kappa import KappaSchedule

# ---------------------------------------------------------------------------- the selection rule


def _b(batch, losses, label=""):
    return BranchLosses(float(batch), batch / 4.0, 1.0, tuple(losses), label)


def test_critical_batch_is_the_last_batch_before_the_first_one_that_falls_behind():
    branches = [_b(2, [3.00, 3.02]), _b(4, [3.005, 3.021]), _b(8, [3.008, 3.026]), _b(16, [3.05, 3.07]),
                _b(32, [3.00, 3.01])]  # 32 is good again: the rule stops at the first failure
    got = critical_batch_interval(branches, epsilon=0.01)
    assert (got.low, got.high) == (8.0, 16.0)
    # paired differences: 8 against the best below it (2): +0.008 and +0.006 -> 0.007 +- 0.001
    c8 = got.comparisons[1]
    assert (c8.batch, c8.against) == (8.0, 2.0)
    assert c8.difference == pytest.approx(0.007) and c8.stderr == pytest.approx(0.001)
    assert c8.within and c8.resolved  # |0.007 - 0.01| = 0.003 >= 1.645 * 0.001
    assert got.comparisons[2].within is False and got.resolved


def test_an_unresolved_comparison_is_reported_and_an_open_interval_is_a_lower_bound():
    branches = [_b(2, [3.00, 3.00]), _b(4, [3.00, 3.019])]  # 0.0095 +- 0.0095: not resolved
    got = critical_batch_interval(branches, epsilon=0.01)
    assert got.low == 4.0 and math.isinf(got.high) and got.lower_bound_only
    assert not got.resolved and not got.comparisons[0].resolved
    one = critical_batch_interval([_b(2, [3.0]), _b(4, [3.0])], epsilon=0.01)
    assert one.comparisons[0].stderr is None and not one.resolved  # one replicate: no standard error


def test_the_lr_control_joins_the_pool_so_a_better_lr_does_not_pass_for_an_affordable_batch():
    # the run's batch 4 at the large branches' LR reaches 2.90: 16 (2.95) is then 0.05 behind
    branches = [_b(2, [3.00, 3.00]), _b(4, [3.00, 3.00]), _b(8, [2.97, 2.97]), _b(16, [2.95, 2.95])]
    assert critical_batch_interval(branches).low == 16.0
    control = _b(4, [2.90, 2.90], "control")
    got = critical_batch_interval(branches, control=control)
    assert (got.low, got.high) == (4.0, 8.0) and got.comparisons[1].against == 4.0


@pytest.mark.parametrize("kwargs, match", [
    (dict(epsilon=0.0), r"epsilon=0\.0\): must be a finite number > 0"),
    (dict(epsilon=float("nan")), r"epsilon=nan"),
])
def test_bad_epsilon_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        critical_batch_interval([_b(2, [1.0]), _b(4, [1.0])], **kwargs)


def test_too_few_or_repeated_batches_are_refused():
    with pytest.raises(ValueError, match="at least two"):
        critical_batch_interval([_b(2, [1.0])])
    with pytest.raises(ValueError, match="repeat a batch"):
        critical_batch_interval([_b(2, [1.0]), _b(2, [1.1])])


# ---------------------------------------------------------------------------- known by construction
# Noisy quadratic model: loss(theta; x) = 1/2 sum_i h_i (theta_i - x_i)^2 with x ~ N(0, sigma^2),
# SGD at LR eta * k for the batch k * B (the linear coupling). The expected excess loss after
# each branch has a closed form, so the critical batch of the expected losses is known exactly.
D, SIG2, ETA, B0, MICRO, DELTA = 32, 4.0, 0.05, 4, 2, 4096
H = np.logspace(0, -2, D)
MULTIPLES = (1, 2, 4, 8, 16, 32)


class Quadratic(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.theta = torch.nn.Parameter(torch.ones(D, dtype=torch.float64))
        self.register_buffer("h", torch.tensor(H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * (self.h * (self.theta - x) ** 2).sum(1).mean()


def _expected_loss(k: float) -> float:
    lr, bk, m2 = ETA * k, k * B0, np.ones(D)
    for _ in range(int(DELTA // bk)):
        m2 = (1 - lr * H) ** 2 * m2 + lr**2 * H**2 * SIG2 / bk
    return float(0.5 * np.sum(H * m2))


def _truth(epsilon: float) -> float:
    """The largest batch whose expected loss is within epsilon of every smaller batch's best."""
    losses = [_expected_loss(k) for k in MULTIPLES]
    crit = MULTIPLES[0]
    for i in range(1, len(MULTIPLES)):
        if losses[i] > min(losses[:i]) + epsilon:
            break
        crit = MULTIPLES[i]
    return crit * B0


def _quadratic_data(replicate: int):
    gen = torch.Generator().manual_seed(1000 + replicate)
    while True:
        yield torch.randn(MICRO, D, generator=gen, dtype=torch.float64) * math.sqrt(SIG2)


@pytest.mark.parametrize("epsilon", [0.01])
def test_branches_recover_a_critical_batch_known_by_construction_within_a_factor_of_two(epsilon):
    truth = _truth(epsilon)
    assert B0 < truth < MULTIPLES[-1] * B0  # interior: the measurement can miss on either side
    model = Quadratic()
    opt = torch.optim.SGD(model.parameters(), lr=ETA)
    excess = 0.5 * float(np.sum(H * SIG2))  # E loss = excess + 1/2 sum h sigma^2: evaluate the excess exactly

    point = measure_critical_batch(
        model, opt, loss_fn=lambda m, x: m(x), data=_quadratic_data,
        evaluate=lambda m: float(0.5 * (m.h * m.theta.detach() ** 2).sum()),
        microbatch_size=MICRO, batch=B0, branch_tokens=DELTA, multiples=MULTIPLES, replicates=4,
        epsilon=epsilon, fuse_microbatches=64, frozen_microbatches=64, control=False)
    assert point.lr_coupling == "linear"  # SGD
    assert truth / 2 <= point.critical.low <= truth * 2, (truth, point.critical)
    # every branch's mean within a few standard errors of its closed-form expectation
    for br in point.branches:
        expected = _expected_loss(br.multiple)
        assert abs(br.mean - expected) <= 4 * br.stderr + 1e-4, (br.multiple, br.mean, expected)
    # the frozen noise scale at theta = 1: tr(Sigma) / |G|^2 = sum h^2 sigma^2 / sum h^2
    assert point.frozen is not None and point.frozen.noise_scale == pytest.approx(SIG2, rel=0.5)
    assert excess > 0 and point.kappa == pytest.approx(point.critical.low / point.frozen.noise_scale)


# ---------------------------------------------------------------------------- the run is untouched


def _tiny_gpt_run(calibrate_at: int | None, steps: int = 14):
    from cbs_tracker.demo.gpt import GPT, GPTConfig, make_adamw

    torch.manual_seed(0)
    model = GPT(GPTConfig(context_length=16, n_layer=1, d_model=16, n_head=2, dropout=0.1))
    opt = make_adamw(model, 3e-3, 0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: min(1.0, (e + 1) / 5))
    from tests.estimators import NoIntervalEstimator

    tracker = CBSTracker(model, opt, accumulation_steps=2, lr_scheduler=sched,
                         estimator=NoIntervalEstimator(horizon_steps=5, min_steps=3),
                         controller=BatchSizeController(warmup_steps=0, warmup_tokens=0, patience=1, window=2,
                                                        cooldown_tokens=0, kappa=64.0))
    gen = torch.Generator().manual_seed(7)

    def batch(g):
        x = torch.randint(0, 256, (2, 17), generator=g)
        return x[:, :-1], x[:, 1:]

    def data(r):
        g = torch.Generator().manual_seed(100 + r)
        return iter(lambda: batch(g), None)

    rows, point = [], None
    for step in range(steps):
        for _ in range(tracker.accumulation_steps):
            x, y = batch(gen)
            with tracker.microbatch(labels=y):
                (model(x, y)[1] / tracker.accumulation_steps).backward()
        rec = tracker.step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        rows.append((rec.noise_scale, rec.next_accumulation_steps, rec.lr, torch.rand(()).item(),
                     rec.tokens_seen, rec.global_batch))
        if step == calibrate_at:
            point = measure_critical_batch(
                model, opt, tracker=tracker, loss_fn=lambda m, b: m(*b)[1], data=data,
                evaluate=lambda m: float(m(*batch(torch.Generator().manual_seed(5)))[1].detach()),
                microbatch_size=32, branch_tokens=600, multiples=(1, 2, 4), replicates=2, frozen_microbatches=8)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return rows, state, opt.state_dict(), tracker.state_dict(), point


def test_a_run_after_calibration_equals_the_run_without_it_step_for_step():
    plain_rows, plain_state, plain_opt, plain_tracker, _ = _tiny_gpt_run(None)
    rows, state, opt_state, tracker_state, point = _tiny_gpt_run(calibrate_at=9)
    # the branch point: the run's tokens, and the batch of its next window (the doubling decided at
    # step 9 from 2 x 32 to 4 x 32 tokens)
    assert point is not None and point.tokens == rows[9][4] and (rows[9][5], point.batch) == (64, 128)
    assert point.total_branch_tokens == 512 * 3 * 2 + 512 * 2  # branch tokens rounded to the batch 512
    assert point.noise_scale == rows[9][0]
    assert any(a > 4 for _, a, *_ in plain_rows[10:])  # the batch grew after the branch point too
    assert rows == plain_rows  # noise scale, decisions, LR and the torch RNG, every step
    for k in plain_state:
        assert torch.equal(state[k], plain_state[k]), k
    for p, st in plain_opt["state"].items():
        for key, v in st.items():
            assert torch.equal(opt_state["state"][p][key], v), (p, key)
    assert tracker_state == plain_tracker


def test_calibration_gives_kappa_to_the_controller_and_a_plan():
    point = _tiny_gpt_run(calibrate_at=9, steps=10)[4]
    assert point.kappa == pytest.approx(point.critical.low / point.noise_scale)
    ctrl = BatchSizeController()
    point.apply_to(ctrl)
    assert ctrl.kappa_schedule == KappaSchedule([(point.tokens, point.kappa)])
    cal = Calibration([point])
    assert cal.kappa_schedule().value_at(1e9) == pytest.approx(point.kappa)
    marks = cal.batch_schedule(point.batch / 8)  # the critical batch is >= the run's batch / 2
    assert marks[0] == (0.0, point.batch / 8)
    assert marks[-1][1] * 2 > point.critical.low >= marks[-1][1]
    assert "critical batch" in cal.table()


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(multiples=(0.25, 1)), ValueError, r"0\.25 x batch 64 = 16 is not a whole number of microbatches of 32"),
    (dict(branch_tokens=100), ValueError, r"branch_tokens=100\): less than one step of the largest batch 512"),
    (dict(replicates=0), ValueError, r"replicates=0\): must be finite and > 0"),
    (dict(replicates=1.5), TypeError, r"replicates=1\.5\): expected an int"),
    (dict(epsilon=-1), ValueError, r"epsilon=-1\)"),
    (dict(frozen_microbatches=3), ValueError, r"frozen_microbatches=3\): 0 \(skip\) or >= 8"),
    (dict(lr_coupling="cubic"), ValueError, r"lr_coupling='cubic'"),
    (dict(multiples=(1, 2, 3)), ValueError, r"multiples=\[1, 2, 3\]\): the largest batch is not a whole number of "
                                            r"steps of \['2'\] x batch"),
    (dict(multiples=(1, True)), TypeError, r"multiples=\(1, True\)\): expected a sequence of numbers"),
    (dict(data=5), TypeError, r"data=5\): expected a callable"),
])
def test_bad_arguments_are_refused(kwargs, error, match):
    model = torch.nn.Linear(2, 1)
    args = dict(loss_fn=lambda m, b: m(b).mean(), data=lambda r: iter(()), evaluate=lambda m: 0.0,
                microbatch_size=32, batch=64, branch_tokens=1024)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        measure_critical_batch(model, torch.optim.SGD(model.parameters(), lr=0.1), **args)


def test_cli_calibrate_prints_the_table_and_draws_the_branches(tmp_path, capsys):
    from cbs_tracker.cli import main

    assert main(["calibrate", "--quick", "--out", str(tmp_path), "--marks", "4096,8192", "--multiples", "0.5,1,2,4"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("critical batch"):]
    rows = [line.split() for line in table.splitlines()[1:3]]
    assert [r[0] for r in rows] == ["4,096", "8,192"]  # one row per mark, the tokens first
    saved = json.loads((tmp_path / "calibration.json").read_text())
    for row, point in zip(rows, saved):
        low = f"[{point['critical']['low']:,.0f},"
        assert row[2] == low and f"{point['kappa']:.2f}" in row  # the interval and kappa printed as measured
        assert point["kappa"] == pytest.approx(point["critical"]["low"] / point["noise_scale"])
    png = (tmp_path / "calibration.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "BatchSizeController(kappa=[(4096" in out


@pytest.mark.parametrize("cap", [True, False])
def test_branches_cap_the_coupled_lr_where_the_tracker_does(cap):
    # 1-D quadratic without noise: theta <- theta (1 - lr), so each branch's end says its LR
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5)  # the run sits at half its peak, 0.05
    tracker = CBSTracker(model, opt, accumulation_steps=2, unit="samples", lr_scheduler=sched, cap_lr_at_peak=cap)
    point = measure_critical_batch(
        model, opt, tracker=tracker, batch=2, tokens=0, loss_fn=lambda m, x: 0.5 * (m.weight ** 2).sum(),
        data=lambda r: iter(lambda: torch.zeros(1, 1), None), evaluate=lambda m: float(m.weight.detach()),
        microbatch_size=1, branch_tokens=8, multiples=(1, 4), replicates=1, frozen_microbatches=0, control=False)
    one, four = point.branches
    assert one.losses[0] == pytest.approx((1 - 0.05) ** 4)  # 4 steps of 2 samples at 0.05
    # one step of 8 samples at 4 x 0.05 (linear coupling for SGD), capped at the peak 0.1 when the tracker caps
    assert four.losses[0] == pytest.approx(1 - (0.1 if cap else 0.2))
    assert float(model.weight) == 1.0 and opt.param_groups[0]["lr"] == pytest.approx(0.05)


class _Point(torch.nn.Module):
    """loss(theta; x) = 1/2 |theta - x|^2 per sample: G = theta - E x, Sigma = Cov x."""

    def __init__(self, theta) -> None:
        super().__init__()
        self.theta = torch.nn.Parameter(torch.tensor(theta, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * ((self.theta - x) ** 2).sum(1).mean()


def test_a_doubling_decided_but_not_applied_runs_the_branches_at_the_next_windows_batch_and_lr():
    from tests.doubles import PlanController

    model = _Point([1.0])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    tracker = CBSTracker(model, opt, accumulation_steps=2, unit="samples", controller=PlanController({1: 4}))
    for _ in range(2):
        with tracker.microbatch(1):
            (model(torch.zeros(1, 1)) / 2).backward()
    tracker.step()  # the plan doubles the accumulation here; the next window applies it (LR x 2, SGD)
    opt.step()
    opt.zero_grad()
    theta = float(model.theta)
    point = measure_critical_batch(
        model, opt, tracker=tracker, loss_fn=lambda m, x: m(x), data=lambda r: iter(lambda: torch.zeros(1, 1), None),
        evaluate=lambda m: float(m.theta.detach()), microbatch_size=1, branch_tokens=8, multiples=(1, 2),
        replicates=1, frozen_microbatches=0, control=False)
    assert point.batch == 4.0  # the next window's 4 samples, not the last one's 2
    one, two = point.branches
    assert one.losses[0] == pytest.approx(theta * (1 - 0.1) ** 2)  # two steps at the coupled LR 2 x 0.05
    assert two.losses[0] == pytest.approx(theta * (1 - 0.2))  # one step of 8 at 2 x that
    assert opt.param_groups[0]["lr"] == 0.05  # the run's own LR is applied by the run, not here


def test_the_preconditioned_frozen_noise_scale_is_the_update_directions():
    # theta = (1, 0.1), x ~ N(0, I): raw B = 2 / 1.01; Adam's P = diag(1, 10):
    # tr(P Sigma P) / |P G|^2 = (1 + 100) / (1 + 1) = 50.5 (tr(P Sigma) / G^T P G would be 10)
    model = _Point([1.0, 0.1])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.zeros(1, 2)).backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        model.theta.copy_(torch.tensor([1.0, 0.1], dtype=torch.float64))
        st = opt.state[model.theta]
        st["exp_avg_sq"].copy_((1 - 0.999) / torch.tensor([1.0, 100.0], dtype=torch.float64))  # v_hat = 1 / p^2
    gen = torch.Generator().manual_seed(3)
    from cbs_tracker.calibrate import frozen_noise_scale

    got = frozen_noise_scale(model, opt, loss_fn=lambda m, x: m(x), microbatch_size=64, count=4000, group=4,
                             microbatches=iter(lambda: torch.randn(64, 2, generator=gen, dtype=torch.float64), None))
    assert abs(got.noise_scale - 2 / 1.01) <= 4 * got.stderr and got.stderr < 0.2
    assert abs(got.preconditioned - 50.5) <= 4 * got.preconditioned_stderr and got.preconditioned_stderr < 5


class _Stub:
    """The tracker interface CalibrateAt reads (no session: the batch is the last step's)."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.tokens_seen, self.last_record, self.noise_scale = 0.0, None, 1.0
        self.controller = BatchSizeController()
        self._rec = SimpleNamespace

    def step(self, tokens: float) -> None:
        self.tokens_seen = tokens
        self.last_record = self._rec(global_batch=2.0, accumulation_steps=2)


def test_calibrate_at_marks_a_mark_at_zero_several_in_one_step_and_skips_those_before_a_resume():
    from cbs_tracker.calibrate import CalibrateAt

    model = _Point([1.0])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    kw = dict(loss_fn=lambda m, x: m(x), data=lambda r: iter(lambda: torch.zeros(1, 1), None),
              evaluate=lambda m: float(m.theta.detach()), microbatch_size=1, branch_tokens=4, multiples=(1, 2),
              replicates=1, frozen_microbatches=0, control=False)
    at, run = CalibrateAt([0, 3, 5, 100], **kw), _Stub()
    hits = []
    for tokens in (2.0, 4.0, 6.0, 8.0):  # steps of 2: 0 is hit at the first step, 3 at 4, 5 at 6
        run.step(tokens)
        hits.append(at.after_step(model, opt, run) is not None)
    assert hits == [True, True, True, False] and at.marks == [100.0]
    assert at.calibration.points[0].tokens == 2.0
    assert run.controller.kappa_schedule is not None  # kappa applied (the frozen scale is skipped: tracker's 1.0)
    both = CalibrateAt([3, 4], **kw)
    run = _Stub()
    run.step(4.0)  # one step passes two marks: one point
    assert both.after_step(model, opt, run) is not None and both.marks == [] and len(both.calibration.points) == 1
    resumed = CalibrateAt([3, 50], **kw)
    run = _Stub()
    run.step(40.0)  # a resumed run's first step ends at 40: the mark at 3 was passed before it
    assert resumed.after_step(model, opt, run) is None and resumed.marks == [50.0]


@pytest.mark.parametrize("kwargs, match", [
    (dict(tracker=None), r"\['tracker'\] are not arguments of measure_critical_batch"),
    (dict(replicats=2), r"\['replicats'\] are not arguments"),
    (dict(branch_tokens=0), r"branch_tokens=0\): must be finite and > 0"),
    (dict(evaluate=3), r"evaluate=3: expected a callable"),
])
def test_calibrate_at_checks_its_arguments_when_built(kwargs, match):
    from cbs_tracker.calibrate import CalibrateAt

    kw = dict(loss_fn=len, data=len, evaluate=len, microbatch_size=1, branch_tokens=4)
    kw.update(kwargs)
    with pytest.raises((TypeError, ValueError), match=match):
        CalibrateAt([10], **kw)
