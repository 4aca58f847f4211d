"""The measuring cadence: one window in ``n`` measured, exactly, and ``"auto"`` choosing ``n`` from timings."""

from __future__ import annotations

import math
import types
from contextlib import nullcontext

import pytest
import torch
from torch import nn

from cbs_tracker import CBSTracker, NoiseScaleEstimator
from cbs_tracker.core import collector as collector_module
from cbs_tracker.core import session as session_module
from cbs_tracker.core.cadence import MAX_EVERY, MeasureCadence
from cbs_tracker.core.collector import GradStatsCollector
from tests.doubles import PlanController

D, SIGMA, MICRO, ACC = 8, 0.5, 16, 4


def _data(steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(0)
    w_star = torch.randn(D, generator=g)
    delta = 0.3 * torch.randn(D, generator=g)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps * ACC * MICRO, D, generator=g)
    y = x @ w_star + SIGMA * torch.randn(len(x), generator=g)
    dd = float(delta.pow(2).sum())
    return w_star + delta, x, y, (D * (dd + SIGMA**2) + dd) / dd


def _run(steps: int, *, controller=None, clock=None, **kw):
    """A frozen linear regression in a plain loop; returns the tracker and its records."""
    weight, x, y, _ = _data(steps)
    model = nn.Linear(D, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(weight[None])
    tracker = CBSTracker(model, accumulation_steps=ACC, unit="samples", controller=controller,
                         estimator=NoiseScaleEstimator(horizon_steps=1e9, min_steps=10), **kw)
    records = []
    for s in range(steps):
        for k in range(ACC):
            i = (s * ACC + k) * MICRO
            with tracker.microbatch(size=MICRO):
                (0.5 * (model(x[i : i + MICRO]).squeeze(-1) - y[i : i + MICRO]).pow(2).mean() / ACC).backward()
            if clock is not None:
                clock.work(tracker)
        records.append(tracker.step())
        model.zero_grad(set_to_none=True)
    return tracker, records


def test_every_fourth_window_is_measured_exactly_and_the_others_still_count():
    steps = 400
    full, every = _run(steps)
    sparse, some = _run(steps, measure_every=4)
    assert [r.measured for r in some] == [s % 4 == 0 for s in range(steps)]
    for a, b in zip(every, some, strict=True):
        # the counters see every window
        assert (a.step, a.tokens_seen, a.global_batch, a.accumulation_steps) == (
            b.step, b.tokens_seen, b.global_batch, b.accumulation_steps)
        if b.measured:  # a measured window gives exactly the numbers of the every-window run
            assert b.step_grad_sq_norm == pytest.approx(a.step_grad_sq_norm, rel=1e-9)
            assert b.step_trace_cov == pytest.approx(a.step_trace_cov, rel=1e-9)
        else:
            assert b.step_grad_sq_norm is None and b.step_trace_cov is None
    # the estimate is that of the measured windows alone (an estimator fed only those), with a wider interval
    ref = NoiseScaleEstimator(horizon_steps=1e9, min_steps=10)
    for stats in _measured_stats(steps, 4):
        ref.update(*stats)
    assert sparse.noise_scale == pytest.approx(ref.noise_scale, rel=1e-5)  # float32 gradients vs float64
    lo_full, hi_full = full.noise_scale_interval
    lo, hi = sparse.noise_scale_interval
    assert hi - lo > 1.5 * (hi_full - lo_full)  # a quarter of the units: about twice as wide
    assert lo <= full.noise_scale <= hi


def _measured_stats(steps: int, n: int):
    """(small, big, B_small, B_big, units) of every ``n``-th window, computed from the data by hand."""
    weight, x, y, _ = _data(steps)
    for s in range(0, steps, n):
        grads = []
        for k in range(ACC):
            i = (s * ACC + k) * MICRO
            xs, ys = x[i : i + MICRO].double(), y[i : i + MICRO].double()
            grads.append(((xs @ weight.double() - ys)[:, None] * xs).mean(0))
        g = torch.stack(grads)
        yield (float(g.pow(2).sum(1).mean()), float(g.mean(0).pow(2).sum()), float(MICRO), float(ACC * MICRO),
               float(ACC * MICRO))


def test_an_unmeasured_window_takes_no_norm(monkeypatch):
    calls = []
    real = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    tracker, records = _run(8, measure_every=4)
    measured = sum(r.measured for r in records)
    assert measured == 2
    per_measured = len(calls) / measured
    calls.clear()
    _run(8, measure_every=1)
    assert len(calls) == pytest.approx(8 * per_measured)  # every norm pass belongs to a measured window


def test_the_controller_decides_on_measured_windows_only():
    seen = []

    class Recording(PlanController):
        def update(self, *, step, **kw):
            seen.append(step)
            return super().update(step=step, **kw)

    _run(24, controller=Recording({}), measure_every=3)
    assert seen == list(range(1, 25, 3))


class FakeClock:
    """A clock the test advances: each microbatch costs 1 s per sample, and measuring it ``hidden`` more
    (work no host timer of the tracker sees, e.g. autograd calling its hooks)."""

    def __init__(self, hidden: float = 0.0) -> None:
        self.now, self.hidden = 0.0, hidden

    def __call__(self) -> float:
        return self.now

    def work(self, tracker) -> None:
        self.now += MICRO * (1.0 + (self.hidden if tracker.engine.measure else 0.0))


@pytest.mark.parametrize("extra, hidden, want", [
    (0.06, 0.0, 8), (0.004, 0.0, 1), (5.0, 0.0, MAX_EVERY),
    # the same cost outside the tracker's timers: only the step clock sees it
    (0.0, 0.075, 8), (0.03, 0.0375, 8),
])
def test_auto_picks_the_smallest_cadence_within_the_target(monkeypatch, extra, hidden, want):
    """K + 1 norm passes of ``extra`` s per sample each (timed by the tracker) and ``hidden`` s per sample
    and microbatch (not timed) in a window of K microbatches of 1 s per sample: measuring adds
    d = ((K + 1) extra + K hidden) / K to an unmeasured step (7.5% at 0.06: one window in 8 keeps 1%)."""
    clock = FakeClock(hidden)
    monkeypatch.setattr(session_module.time, "perf_counter", clock)
    real_total = collector_module._sq_total

    def sq_total(groups):  # one norm pass (K per window, and the step's): the tracker's own work
        clock.now += MICRO * extra
        return real_total(groups)

    monkeypatch.setattr(collector_module, "_sq_total", sq_total)
    tracker, records = _run(200, clock=clock, measure_every="auto")
    assert tracker.session.cadence.every == want
    late = records[100:]
    share = sum(r.measured for r in late) / len(late)
    assert share == pytest.approx(1 / want, abs=0.02)
    # what the cadence measured is the step clock's
    d_want = ((ACC + 1) * extra + ACC * hidden) / ACC
    assert tracker.session.cadence.overhead == pytest.approx(d_want, rel=1e-6)
    assert tracker.session.cadence.floor == 0.0  # the unmeasured windows' tracker work took no clock time
    assert want == min(MAX_EVERY, math.ceil(d_want / 0.01 - 1e-9))


def test_auto_counts_the_unmeasured_windows_own_work(monkeypatch):
    """The tracker's work in an unmeasured window (here its step's reduction, 0.4% of the step) is timed in
    the window before a measured one and charged to every unmeasured window: d / n + u <= 1%."""
    clock = FakeClock()
    monkeypatch.setattr(session_module.time, "perf_counter", clock)
    from cbs_tracker.core import measure as measure_module

    real_counts = measure_module._reduce_counts

    def counts(*a, **k):
        clock.now += 0.004 * ACC * MICRO
        return real_counts(*a, **k)

    monkeypatch.setattr(measure_module, "_reduce_counts", counts)
    real_total = collector_module._sq_total

    def sq_total(groups):
        clock.now += MICRO * 0.03
        return real_total(groups)

    monkeypatch.setattr(collector_module, "_sq_total", sq_total)
    tracker, _ = _run(200, clock=clock, measure_every="auto")
    cadence = tracker.session.cadence
    u = 0.004 * ACC / (ACC + 0.004 * ACC)  # its share of an unmeasured window's time
    assert cadence.floor == pytest.approx(u, rel=1e-6)
    d = (ACC + 1) * 0.03 / (ACC + 0.004 * ACC)
    assert cadence.overhead == pytest.approx(d, rel=1e-6)
    assert cadence.every == math.ceil(d / (0.01 - u))  # 13, where u = 0 would give 7


def test_no_clock_is_read_in_an_unmeasured_window(monkeypatch):
    """An integer cadence reads no clock at all; "auto" only in a measured window and the two before it
    (the start and the end of the measured window and of the unmeasured one it is compared with)."""
    import time as time_module

    real = time_module.perf_counter
    reads = [0]

    def counting():
        reads[0] += 1
        return real()

    monkeypatch.setattr(time_module, "perf_counter", counting)
    for every in (4, "auto"):
        weight, x, y, _ = _data(120)
        model = nn.Linear(D, 1, bias=False)
        tracker = CBSTracker(model, accumulation_steps=ACC, unit="samples", measure_every=every)
        per_window, measured = [], []
        for s in range(120):
            reads[0] = 0
            for k in range(ACC):
                i = (s * ACC + k) * MICRO
                with tracker.microbatch(size=MICRO):
                    (0.5 * (model(x[i : i + MICRO]).squeeze(-1) - y[i : i + MICRO]).pow(2).mean() / ACC).backward()
            measured.append(tracker.step().measured)
            model.zero_grad(set_to_none=True)
            per_window.append(reads[0])
        if every == 4:
            assert sum(per_window) == 0
            continue
        assert tracker.session.cadence.every > 2  # (the clock of this tiny model: the norms dominate)
        for s in range(40, 120):
            near = any(measured[s:s + 3])
            assert (per_window[s] > 0) == near, (s, per_window[s - 3:s + 3], measured[s - 3:s + 3])


def test_cadence_alone_alternates_until_it_has_timed_enough():
    c = MeasureCadence("auto", 0.01)
    pattern = []
    for _ in range(40):
        m = c.measure_next()
        pattern.append(m)
        c.agree(c.proposal())
        c.window_done(m, 1.025 if m else 1.0, 0.01 if m else 0.0)
    assert pattern[:3] == [True] * 3  # 3 warm-up windows untimed
    assert pattern[3:19] == [False, True] * 8  # 8 measured windows, each after an unmeasured one
    # d = 2.5% on the step clock (the host timer saw 1%): one window in 3 keeps 1%
    assert c.every == 3 and pattern[20:27] == [False, False, True, False, False, True, False]


@pytest.mark.parametrize("floor, want", [(0.0, 7), (0.005, 14), (0.01, MAX_EVERY)])
def test_auto_counts_what_the_windows_not_measured_cost(floor, want):
    """Mean share d / n + u <= 1%: d = 6.98% added by measuring, u the tracker's work in the others."""
    c = MeasureCadence("auto", 0.01)
    for _ in range(60):
        m = c.measure_next()
        c.agree(c.proposal())
        c.window_done(m, 1.0698 if m else 1.0, 0.0698 if m else floor)
    assert c.every == want
    if want < MAX_EVERY:
        assert 0.0698 / want + floor <= 0.01 < 0.0698 / (want - 1) + floor


def test_cadence_state_round_trips():
    tracker, _ = _run(30, measure_every=5)
    state = tracker.state_dict()
    assert state["cadence"]["every_now"] == 5
    fresh = CBSTracker(nn.Linear(D, 1, bias=False), accumulation_steps=ACC, unit="samples", controller=None,
                       measure_every=5)
    fresh.load_state_dict(state)
    assert fresh.session.cadence.state_dict() == tracker.session.cadence.state_dict()


def _windows_measured(tracker, model, x, y, start, stop, read=lambda record: record.measured):
    """Windows ``start`` to ``stop`` of the linear model's run: ``read`` of each step's record."""
    out = []
    for s in range(start, stop):
        for k in range(ACC):
            i = (s * ACC + k) * MICRO
            with tracker.microbatch(size=MICRO):
                (0.5 * (model(x[i : i + MICRO]).squeeze(-1) - y[i : i + MICRO]).pow(2).mean() / ACC).backward()
        out.append(read(tracker.step()))
        model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("save_at", [0, 13, 14, 15, 16])
def test_a_resumed_run_measures_the_windows_the_uninterrupted_run_measures(save_at):
    """``measure_every=4``, saved before the first window or 1, 2, 3 or 4 windows into a cycle (``since_measured``
    0, 1, 2, 3): the resumed tracker measures every fourth window from the run's start, as the run not
    interrupted does (it used to measure its first window, so that its decisions came up to three windows
    late). The count of windows is the state's step; the state has no key of its own for it."""
    steps = 24
    weight, x, y, _ = _data(steps)

    def fresh():
        model = nn.Linear(D, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_(weight[None])
        return model, CBSTracker(model, accumulation_steps=ACC, unit="samples", controller=None, measure_every=4,
                                 estimator=NoiseScaleEstimator(horizon_steps=1e9, min_steps=10))

    model, tracker = fresh()
    before = _windows_measured(tracker, model, x, y, 0, save_at)
    model, resumed = fresh()
    resumed.load_state_dict(tracker.state_dict())
    after = _windows_measured(resumed, model, x, y, save_at, steps)
    assert before + after == [s % 4 == 0 for s in range(steps)]


@pytest.mark.parametrize(("saved_every", "resumed_every"), [(4, 2), (2, 4), ("auto", 3)])
def test_a_run_resumed_with_another_integer_cadence_measures_on_the_cadence_it_was_given(saved_every, resumed_every):
    """Saved with one ``measure_every`` and resumed with an integer one: the resumed run measures one window in
    ``resumed_every``, counted from the last window the saved run measured (it used to keep the saved run's ``n``,
    ignoring the argument). The truth: the windows since the last measured one at the checkpoint, then every
    ``resumed_every``-th."""
    steps, save_at = 24, 14
    weight, x, y, _ = _data(steps)

    def fresh(every):
        model = nn.Linear(D, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_(weight[None])
        return model, CBSTracker(model, accumulation_steps=ACC, unit="samples", controller=None, measure_every=every,
                                 estimator=NoiseScaleEstimator(horizon_steps=1e9, min_steps=10))

    model, tracker = fresh(saved_every)
    before = _windows_measured(tracker, model, x, y, 0, save_at)
    since = save_at - 1 - max(i for i, m in enumerate(before) if m)
    model, resumed = fresh(resumed_every)
    resumed.load_state_dict(tracker.state_dict())
    after = _windows_measured(resumed, model, x, y, save_at, steps)
    first = next(i for i in range(steps - save_at) if since + 1 + i >= resumed_every)
    expected = [i >= first and (i - first) % resumed_every == 0 for i in range(steps - save_at)]
    assert after == expected


class _Converting:
    """A controller that converts one LR halving at each decision: its decisions and its own count carry it."""

    observe_only = False
    kappa = 1.0

    def __init__(self) -> None:
        self.lr_conversions = 0

    def update(self, *, accumulation_steps, noise_scale, **_):
        self.lr_conversions += 1
        return types.SimpleNamespace(accumulation_steps=accumulation_steps, changed=False, critical_batch=noise_scale,
                                     lr_factor=1.0, reason="count", lr_conversions=self.lr_conversions)

    def state_dict(self):
        return {"version": 1, "lr_conversions": self.lr_conversions}

    def load_state_dict(self, state):
        self.lr_conversions = state["lr_conversions"]


def test_the_records_of_a_resumed_runs_first_unmeasured_windows_show_the_controllers_conversions():
    """Resumed two windows after a measured one (``measure_every=4``): before its first decision the records show
    the conversions the controller made before the checkpoint and the critical batch it decided last, as the run
    not interrupted shows them (they showed 0 and ``None``), also when loaded into a tracker that had decided on
    (its own last decision is forgotten); a tracker without a controller shows no critical batch."""
    steps, save_at = 24, 14
    weight, x, y, _ = _data(steps)

    def fresh(controller=_Converting):
        model = nn.Linear(D, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_(weight[None])
        return model, CBSTracker(model, accumulation_steps=ACC, unit="samples",
                                 controller=None if controller is None else controller(), measure_every=4,
                                 estimator=NoiseScaleEstimator(horizon_steps=1e9, min_steps=2))

    def conversions(tracker, model, start, stop):
        return _windows_measured(tracker, model, x, y, start, stop,
                                 read=lambda record: (record.lr_conversions, record.critical_batch))

    model, whole = fresh()
    everything = conversions(whole, model, 0, steps)
    assert [c for c, _ in everything] == [s // 4 + 1 for s in range(steps)]  # a decision at every fourth window
    decided = [b for _, b in everything]
    assert decided[12] is not None and decided[13:16] == [decided[12]] * 3  # the decision at window 12 stands
    model, tracker = fresh()
    conversions(tracker, model, 0, save_at)
    model, resumed = fresh()
    resumed.load_state_dict(tracker.state_dict())
    assert conversions(resumed, model, save_at, steps) == everything[save_at:]
    model, ahead = fresh()
    conversions(ahead, model, 0, 21)  # decided at window 20
    model.weight.data.copy_(weight[None])
    ahead.load_state_dict(tracker.state_dict())
    assert conversions(ahead, model, save_at, steps) == everything[save_at:]
    model, plain = fresh(controller=None)
    plain.load_state_dict(tracker.state_dict())
    assert [b for _, b in conversions(plain, model, save_at, steps)] == [None] * (steps - save_at)
    assert "critical_batch" in tracker.state_dict() and "critical_batch" not in plain.state_dict()


@pytest.mark.parametrize("kwargs, match", [
    (dict(measure_every=0), r"measure_every=0\): must be an integer >= 1 or 'auto'"),
    (dict(measure_every="fast"), r"measure_every='fast'\): must be an integer >= 1 or 'auto'"),
    (dict(measure_every=True), r"measure_every=True\)"),
    (dict(measure_every="auto", measure_target=1.5), r"measure_target=1.5\): must be a fraction"),
])
def test_bad_cadence_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CBSTracker(nn.Linear(D, 1), **kwargs)


def test_a_step_on_the_accelerator_path_reads_the_host_once(monkeypatch):
    """A CPU stand-in for CUDA's sync debug mode: inside ``step()`` on the device path, count every
    tensor-to-host read (``item``, ``float``, ``bool``, ``int``, ``tolist``): one in a measured window, the
    reduced vector; none in a window not measured (``tests/test_host_reads.py`` has the whole window)."""
    from torch.overrides import TorchFunctionMode

    reads = []
    host_reads = {torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.__int__,
                  torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__index__}

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in host_reads:
                reads.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(GradStatsCollector, "host_window_sums", lambda self: None)
    monkeypatch.setattr(GradStatsCollector, "read_each_on_cpu", False)
    weight, x, y, _ = _data(4)
    model = nn.Linear(D, 1, bias=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for every in (1, 2):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        tracker = CBSTracker(model, opt, accumulation_steps=ACC, unit="tokens", measure_every=every,
                             grad_scaler=scaler, loss_normalization="window")
        for s in range(4):
            for k in range(ACC):
                i = (s * ACC + k) * MICRO
                labels = y[i : i + MICRO]
                with tracker.microbatch(labels=labels):  # the size stays a tensor
                    loss = 0.5 * (model(x[i : i + MICRO]).squeeze(-1) - labels).pow(2).sum() / (ACC * MICRO)
                    scaler.scale(loss).backward()
            reads.clear()
            with Count():
                record = tracker.step()
            # a window not measured reads nothing: its label counts reach the host later
            assert reads == (["tolist"] if record.measured else []), (every, s, reads)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        tracker.remove_hooks()
    assert math.isfinite(tracker.noise_scale or 0.0)


def _two_layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 4), nn.Tanh(), nn.Linear(4, 1))


def _loop(model, tracker, steps, *, each_step=None):
    """Runs ``steps`` windows of ACC microbatches; returns per window (measured, the .grad before zeroing)."""
    weight, x, y, _ = _data(steps)
    out = []
    for s in range(steps):
        if each_step is not None:
            each_step(s)
        for k in range(ACC):
            i = (s * ACC + k) * MICRO
            ctx = tracker.microbatch(size=MICRO) if tracker is not None else nullcontext()
            with ctx:
                (0.5 * (model(x[i : i + MICRO]).squeeze(-1) - y[i : i + MICRO]).pow(2).mean() / ACC).backward()
        measured = tracker.step().measured if tracker is not None else None
        out.append((measured, [p.grad.clone() for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
    return out


def test_an_unmeasured_window_calls_no_hook(monkeypatch):
    """Autograd calls none of the tracker's hooks in a window the cadence lets pass (counted calls)."""
    calls = [0]
    real = GradStatsCollector._make_hook

    def make_hook(self, param):
        fn = real(self, param)

        def counted(grad):
            calls[0] += 1
            return fn(grad)

        return counted

    monkeypatch.setattr(GradStatsCollector, "_make_hook", make_hook)
    model = _two_layers()
    tracker = CBSTracker(model, accumulation_steps=ACC, unit="samples", measure_every=4)
    per_window = []

    def mark(s):
        per_window.append(calls[0])

    runs = _loop(model, tracker, 12, each_step=mark)
    per_window = [b - a for a, b in zip(per_window, per_window[1:] + [calls[0]])]
    assert [m for m, _ in runs] == [s % 4 == 0 for s in range(12)]
    # 4 parameters; a measured window's first microbatch is read from .grad, with no hook either
    assert per_window == [4 * (ACC - 1) if s % 4 == 0 else 0 for s in range(12)]
    assert tracker.collector.hooks_attached == 0  # the last window was not measured
    tracker.remove_hooks()
    assert all(p._backward_hooks is None for p in model.parameters())  # nothing left for autograd to call


def test_hooks_of_others_keep_working_while_the_trackers_are_off():
    """A parameter with the user's own hook keeps it (and ours) through unmeasured windows; a hook the user
    registers between two measured windows works at once and after; the gradients are the untracked run's."""
    def run(with_tracker):
        model = _two_layers()
        seen = {"scale": 0, "late": 0}
        first, last = list(model.parameters())[0], list(model.parameters())[-1]

        def scale(g):
            seen["scale"] += 1
            return 2.0 * g

        first.register_hook(scale)
        tracker = CBSTracker(model, accumulation_steps=ACC, unit="samples", measure_every=3) if with_tracker else None

        def late_hook(s):
            if s == 5:  # after an unmeasured window: the tracker's dict is off the parameter
                def late(g):
                    seen["late"] += 1
                    return g + 1.0
                last.register_hook(late)

        runs = _loop(model, tracker, 9, each_step=late_hook)
        if tracker is not None:
            tracker.remove_hooks()
        return runs, seen

    tracked, seen_tracked = run(True)
    plain, seen_plain = run(False)
    assert seen_tracked == seen_plain == {"scale": 9 * ACC, "late": 4 * ACC}
    for (_, a), (_, b) in zip(tracked, plain, strict=True):
        for ga, gb in zip(a, b, strict=True):
            torch.testing.assert_close(ga, gb, rtol=0, atol=0)
    # the tracker still measured after the user's late hook (its norms see the gradient as autograd makes it)
    assert [m for m, _ in tracked] == [s % 3 == 0 for s in range(9)]
