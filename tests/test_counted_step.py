"""A window the cadence does not measure, on one rank, takes the short path (``_step_counted``): its
labels are counted at ``step()``, its record is the last one's with the counts, the position and the
learning rate moved on. The truth it must match is the general path (``reduce_window`` and
``finish_step``), which the same run takes when the short path is switched off."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from cbs_tracker import BatchSizeController, CBSTracker, NoiseScaleEstimator
from cbs_tracker.core import cadence as cadence_module
from cbs_tracker.core import engine as engine_module
from cbs_tracker.core import loop as loop_module
from cbs_tracker.core import session as session_module
from cbs_tracker.core.loop import LoopTracker
from tests.doubles import assert_same

V, H, SEQ, ROWS = 16, 8, 6, 2


def _lm(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(V, H), nn.Linear(H, V))


def _batch(step: int, k: int):
    """Tokens and labels of microbatch ``k`` of window ``step``: a varying share of the labels ignored,
    and every label of microbatch 1 of window 5 ignored (a microbatch of padding only)."""
    g = torch.Generator().manual_seed(1000 * step + k)
    x = torch.randint(0, V, (ROWS, SEQ), generator=g)
    y = torch.randint(0, V, (ROWS, SEQ), generator=g)
    y[torch.rand(ROWS, SEQ, generator=g) < 0.1 + 0.05 * (k % 3)] = -100
    if (step, k) == (5, 1):
        y[:] = -100
    return x, y


class _Clock:
    """A clock the test advances: each microbatch costs 1 s, each measured one 0.05 s more."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(steps: int, every, *, short_path: bool, clock: _Clock | None = None, rewind=None,
         controller: bool = True, size: bool = False, normalization: str = "mean", batch=_batch, run_short=None):
    """A tiny LM in a plain loop with an LR schedule and a controller that grows the batch; returns the
    records, the tracker's state, the parameters and how many windows took the short path."""
    taken = [0]
    real = LoopTracker._step_counted

    def counted(self):
        taken[0] += 1
        return real(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LoopTracker, "_step_counted", counted)
        if not short_path:
            mp.setattr(session_module.TrackingSession, "counted_step_ready", lambda self, acc: False)
        return (*_loop(steps, every, clock, rewind, controller, size, normalization, batch, run_short), taken[0])


def _loop(steps, every, clock, rewind, controller, size, normalization, batch=_batch, run_short=None):
    model = _lm()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.02 * s))
    ctl = BatchSizeController(warmup_steps=4, warmup_tokens=200, cooldown_tokens=100, window=4, patience=2,
                              kappa=4.0, max_accumulation_steps=8) \
        if controller else None
    tracker = CBSTracker(model, opt, accumulation_steps=2, controller=ctl, lr_scheduler=sched, measure_every=every,
                         estimator=NoiseScaleEstimator(min_steps=3), loss_normalization=normalization)
    records, saved, s = [], None, 0
    while s < steps:
        if rewind is not None and s == rewind[0]:
            saved = (tracker.state_dict(), model.state_dict(), opt.state_dict(), sched.state_dict(), s)
        for k in range(tracker.accumulation_steps - int(run_short is not None and run_short(s))):
            x, y = batch(s, k)
            ctx = tracker.microbatch(size=float((y != -100).sum())) if size else tracker.microbatch(labels=y)
            with ctx:
                logits = model(x)
                loss = nn.functional.cross_entropy(logits.reshape(-1, V), y.reshape(-1), ignore_index=-100,
                                                   reduction="sum") / max(int((y != -100).sum()), 1)
                (loss / tracker.accumulation_steps).backward()
            if clock is not None:
                clock.now += 1.0 + (0.05 if tracker.engine.measure else 0.0)
        records.append(tracker.step())
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        s += 1
        if rewind is not None and s == rewind[1] and saved is not None:  # back to the saved window, same tracker
            state, m, o, sc, s = saved
            tracker.load_state_dict(state)
            model.load_state_dict(m)
            opt.load_state_dict(o)
            sched.load_state_dict(sc)
            rewind = None
    params = [p.detach().clone() for p in model.parameters()]
    cadence = tracker.session.cadence  # what "auto" timed (its pairs and direct timings) is part of the state
    return records, (tracker.state_dict(), list(cadence._pairs), list(cadence._direct), list(cadence._plain)), params


@pytest.mark.parametrize("every", [3, "auto"])
def test_the_short_path_gives_the_general_paths_records_state_and_weights(monkeypatch, every):
    clock = _Clock() if every == "auto" else None
    if clock is not None:
        monkeypatch.setattr(session_module.time, "perf_counter", clock)
    steps = 40 if clock is None else 60
    short = _run(steps, every, short_path=True, clock=clock)
    if clock is not None:
        clock.now = 0.0
    general = _run(steps, every, short_path=False, clock=clock)
    assert general[3] == 0 and short[3] >= 15  # the short path ran in most windows (and not when switched off)
    records = short[0]
    assert any(not r.measured for r in records) and any(r.measured for r in records)
    assert len({r.accumulation_steps for r in records}) > 1  # the controller grew the batch during the run
    assert len({r.lr for r in records}) > 30  # the schedule moved the LR in every window
    assert_same(short[0], general[0], "records", exact_types=True)
    assert_same(short[1], general[1], "state", exact_types=True)
    assert_same(short[2], general[2], "params", exact_types=True)


def _dense_batch(step: int, k: int):
    """Labels with none ignored (every window of a given size counts the same tokens), except in windows
    3, 4 and 11 (some ignored: those windows' sizes differ from the windows' around them)."""
    x, y = _batch(step, k)
    return (x, y) if step in (3, 4, 11) else (x, y.clamp(min=0))


@pytest.mark.parametrize("every", [3, "auto", "auto, n moving"])
def test_counted_windows_of_equal_sizes_reuse_the_stats_and_give_the_general_paths_records(monkeypatch, every):
    """Windows of equal sizes and arguments take the counts of the window before (count_sizes runs once for
    a run of them); a window of other sizes, another accumulation (the controller grows it), a cadence
    that proposes another n, or a short window (one microbatch less than set, twice in a row) counts again:
    records, state and weights are the general path's."""
    steps = 50
    if every == "auto, n moving":  # the cadence's proposal moves from 5 to 7 while the sizes stay equal
        every, steps = "auto", 90
        monkeypatch.setattr(cadence_module.MeasureCadence, "proposal", lambda self: float(self.every) if
                            self._calibrating() else (5.0 if self._windows < 50 else 7.0))
    clock = _Clock() if every == "auto" else None
    if clock is not None:
        monkeypatch.setattr(session_module.time, "perf_counter", clock)
    calls = [0]
    real = engine_module.count_sizes

    def counting(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(engine_module, "count_sizes", counting)
    short_windows = (16, 17)
    runs, said = [], []
    for short_path in (True, False):
        if clock is not None:
            clock.now = 0.0
        with warnings.catch_warnings(record=True) as caught:  # the short windows warn: alike on both paths
            warnings.simplefilter("always")
            runs.append(_run(steps, every, short_path=short_path, clock=clock, batch=_dense_batch,
                             run_short=short_windows.__contains__))
        said.append([str(w.message) for w in caught])
        if short_path:
            reused = runs[0][3] - calls[0]
    short, general = runs
    assert short[3] >= 10 and reused >= 8, (short[3], calls[0])  # most counted windows reused the stats
    assert said[0] == said[1]
    records = short[0]
    assert len({r.accumulation_steps for r in records}) > 1 and len({r.global_batch for r in records}) > 2
    assert_same(short[0], general[0], "records", exact_types=True)
    assert_same(short[1], general[1], "state", exact_types=True)
    assert_same(short[2], general[2], "params", exact_types=True)


def test_the_short_path_after_a_rewind_and_with_sizes_and_without_a_controller():
    """A state loaded into the same tracker in the middle of the run (the last record is then not the
    estimator's: the next window takes the general path); sizes given as numbers; no controller."""
    for kw in ({"rewind": (7, 14)}, {"rewind": (6, 14)}, {"rewind": (8, 13)}, {"size": True}, {"controller": False}, {"normalization": "window"},
               {"normalization": "group"}):
        short = _run(24, 3, short_path=True, **kw)
        general = _run(24, 3, short_path=False, **kw)
        assert short[3] >= 10, kw
        assert_same(short[0], general[0], f"records {kw}", exact_types=True)
        assert_same(short[1], general[1], f"state {kw}", exact_types=True)
        assert_same(short[2], general[2], f"params {kw}", exact_types=True)


def test_labels_changed_in_place_before_the_step_are_counted_as_they_are_then_and_warned():
    """Labels are counted at step() in a window not measured: a loop reusing one label buffer is told,
    with how many microbatches were changed; the tokens are what the buffer holds at step()."""
    model = _lm()
    tracker = CBSTracker(model, accumulation_steps=3, measure_every=4)
    buffer = torch.zeros(ROWS, SEQ, dtype=torch.long)
    records = []
    with pytest.warns(UserWarning, match=r"labels of 2 microbatch\(es\) of this window were changed in place"):
        for s in range(2):
            for k in range(3):
                x, y = _batch(s, k)
                buffer.copy_(y)
                with tracker.microbatch(labels=buffer):
                    loss = nn.functional.cross_entropy(model(x).reshape(-1, V), buffer.reshape(-1))
                    (loss / 3).backward()
            records.append(tracker.step())
            model.zero_grad(set_to_none=True)
    assert [r.measured for r in records] == [True, False]
    last = int((_batch(1, 2)[1] != -100).sum())
    assert records[1].global_batch == 3 * last  # three counts of the buffer as it was at step()


def test_the_short_path_is_not_taken_where_the_general_one_must_run(monkeypatch):
    """A clock due ("auto" timing the window before a measured one), one microbatch per window, a
    controller deciding on every window: the general path, whose record the short one copies."""
    taken = [0]
    real = LoopTracker._step_counted
    monkeypatch.setattr(LoopTracker, "_step_counted", lambda self: taken.__setitem__(0, taken[0] + 1) or real(self))
    model = _lm()
    tracker = CBSTracker(model, accumulation_steps=1, measure_every=3)
    with pytest.warns(UserWarning, match="single microbatch"):
        for s in range(9):
            x, y = _batch(s, 0)
            with tracker.microbatch(labels=y):
                nn.functional.cross_entropy(model(x).reshape(-1, V), y.reshape(-1)).backward()
            tracker.step()
    assert taken[0] == 0 and tracker.session.step == 9


def test_a_counted_microbatch_keeps_the_sync_context_of_an_adapter_that_has_one():
    """An adapter with its own gradient-sync context (DDP's no_sync, Accelerate's) gets it in a window not
    measured too, entered on every microbatch but the window's last."""
    seen = []

    class Synced(CBSTracker):
        def _sync_context(self, last):
            seen.append(last)
            return super()._sync_context(last)

    class Own(LoopTracker):  # an adapter of its own (FSDPTracker's kind) with a sync context
        def _sync_context(self, last):
            seen.append(last)
            return super()._sync_context(last)

    for kind in (Synced, Own):
        _count_syncs(kind)
    assert seen == 2 * [False, False, True, False, False, True]
    assert CBSTracker(_lm(), measure_every=2)._sync_free and LoopTracker(_lm(), measure_every=2)._sync_free


def _count_syncs(kind):
    model = _lm()
    tracker = kind(model, accumulation_steps=3, measure_every=2)
    assert not tracker._sync_free
    for s in range(2):
        for k in range(3):
            x, y = _batch(s, k)
            with tracker.microbatch(labels=y):
                nn.functional.cross_entropy(model(x).reshape(-1, V), y.reshape(-1)).backward()
        assert tracker.step().measured == (s == 0)
    assert isinstance(tracker._counted, loop_module._CountedMicrobatch)


def test_a_counted_window_checks_every_size_and_times_every_microbatch_when_its_clock_is_due(monkeypatch):
    """A microbatch past a counted window's first takes the reused context at once, but only with a size it
    can keep as it is: a bad size is refused there as in any window; and in the window "auto" times (the
    one before a measured window) every microbatch is timed (two clock reads each, a clock that moves 1 s
    per read)."""
    model = _lm()
    tracker = CBSTracker(model, accumulation_steps=3, measure_every=2)
    for s in range(2):
        for k in range(3):
            x, y = _batch(s, k)
            if (s, k) == (1, 1):  # the second microbatch of a window not measured
                for bad, error in ((-1.0, ValueError), (float("nan"), ValueError), (True, TypeError),
                                   (torch.ones(2), TypeError)):
                    with pytest.raises(error, match="microbatch"):
                        tracker.microbatch(bad)
                with pytest.raises(TypeError, match="exactly one"):
                    tracker.microbatch(3.0, labels=y)
            with tracker.microbatch(labels=y):
                nn.functional.cross_entropy(model(x).reshape(-1, V), y.reshape(-1)).backward()
        assert tracker.step().measured == (s == 0)

    reads = [0.0]

    def clock():
        reads[0] += 1.0
        return reads[0]

    model = _lm()
    tracker = CBSTracker(model, accumulation_steps=3, measure_every="auto")
    timed = 0
    for s in range(40):
        due = tracker.session.timing  # known before the window starts
        with monkeypatch.context() as mp:
            mp.setattr(loop_module.time, "perf_counter", clock)
            for k in range(3):
                x, y = _batch(s, k)
                with tracker.microbatch(labels=y):
                    nn.functional.cross_entropy(model(x).reshape(-1, V), y.reshape(-1)).backward()
            own = tracker.session.own_extra
        if due:
            timed += 1
            assert own == 6.0, s  # entry and exit of each of the 3 microbatches
        tracker.step()
        model.zero_grad(set_to_none=True)
    assert timed >= 3


def test_a_window_handed_out_by_windows_after_counted_windows_starts_in_full(monkeypatch):
    """A counted step starts the next window ahead when nothing its start reads has moved; a loader taken
    over by windows() sets the window's layout itself (here a window cut short by the loader's end, one
    microbatch of two): the records are the general path's."""

    def run(short_path):
        with pytest.MonkeyPatch.context() as mp:
            if not short_path:
                mp.setattr(session_module.TrackingSession, "counted_step_ready", lambda self, acc: False)
            model = _lm()
            tracker = CBSTracker(model, accumulation_steps=2, measure_every=5)
            records = []
            for s in range(3):  # a plain loop first: windows 1 and 2 are counted
                for k in range(2):
                    x, y = _batch(s, k)
                    with tracker.microbatch(labels=y):
                        nn.functional.cross_entropy(model(x).reshape(-1, V), y.reshape(-1), ignore_index=-100).backward()
                records.append(tracker.step())
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for window in tracker.windows([_batch(9, 0)]):
                    for x, y in window:
                        with tracker.microbatch(labels=y):
                            nn.functional.cross_entropy(model(x).reshape(-1, V), y.reshape(-1), ignore_index=-100).backward()
                    records.append(tracker.step())
            return records, tracker.state_dict(), [str(w.message) for w in caught]

    short, general = run(True), run(False)
    assert [r.accumulation_steps for r in short[0]] == [2, 2, 2, 1]
    assert [r.measured for r in short[0]] == [True, False, False, False]
    assert_same(short, general, "records, state and warnings", exact_types=True)
    assert len(short[2]) == 1 and "single microbatch" in short[2][0]  # a short window, not a mismatched one
