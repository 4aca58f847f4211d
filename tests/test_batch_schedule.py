"""Batch-size schedules in tokens (``BatchSchedule``): the marks, the helpers, the plain loop.

Truths: the schedule's own marks (the batch of every window is the schedule's batch at
the units seen before it, at the first window boundary at or after each mark), a
float64 autograd mean of the window's microbatches (the gradient), the bare scheduler
stepped once per starting-batch step (the LR at the same data, times the coupling), and
the uninterrupted run (a resume mid-schedule).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from cbs_tracker import BatchSchedule, CBSTracker
from cbs_tracker.theory.schedule import plan_doubling

MICRO = 128  # units (tokens) one microbatch counts
ROWS = 4  # the rows that microbatch really has
A0 = 4  # 512 units
B0 = A0 * MICRO
# 512 -> 1,536 in steps of 256 between 2,048 and 10,240 units: accumulation 4, 6, 8, 10, 12
RAMP = dict(start=512, end=1536, step=256, over=(2048, 10240))


def _data(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + index)
    x = torch.randn(ROWS, 6, generator=g, dtype=torch.float64)
    y = x @ torch.linspace(-1, 1, 6, dtype=torch.float64) + 2.0 * torch.randn(ROWS, generator=g, dtype=torch.float64)
    return x, y


def _loss(model_or_params, x, y):
    if isinstance(model_or_params, nn.Module):
        out = model_or_params(x).squeeze(-1)
    else:
        out = torch.func.functional_call(_MODEL_SHAPE, model_or_params, (x,)).squeeze(-1)
    return 0.5 * (out - y).pow(2).mean()


_MODEL_SHAPE = nn.Linear(6, 1).double()


def _build(schedule: BatchSchedule, coupling: str = "auto", state=None, measure_every=1):
    torch.manual_seed(0)
    model = nn.Linear(6, 1).double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1.0 + 0.05 * e))
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
    tracker = CBSTracker(model, opt, accumulation_steps=A0, unit="tokens", controller=schedule,
                         lr_scheduler=sched, lr_coupling=coupling, measure_every=measure_every)
    if state is not None:
        tracker.load_state_dict(state["tracker"])
    return model, opt, sched, tracker


def _train(model, opt, sched, tracker, *, until_units: float, rows: list, check_grads: bool = False) -> None:
    """Windows until ``until_units`` units are seen; per step: (units before, A, lr, noise scale)."""
    while tracker.session.units_seen < until_units:
        acc = tracker.accumulation_steps
        step = tracker.steps
        batches = [_data(step, j) for j in range(acc)]
        for x, y in batches:
            with tracker.microbatch(size=MICRO):
                (_loss(model, x, y) / acc).backward()
        before = tracker.session.units_seen
        rec = tracker.step()
        if check_grads:  # the slow reference: the float64 mean of each microbatch's own gradient
            params = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
            grads = [torch.autograd.grad(_loss(params, x, y), list(params.values())) for x, y in batches]
            for i, p in enumerate(model.parameters()):
                want = torch.stack([g[i] for g in grads]).mean(0)
                torch.testing.assert_close(p.grad, want, rtol=1e-12, atol=1e-14)
        rows.append((before, acc, opt.param_groups[0]["lr"], rec.noise_scale, rec.global_batch))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)


def _constant_lrs(n: int = 200) -> list[float]:
    """The constant-batch run's LR at each of its steps: the bare scheduler, stepped once per step."""
    opt = torch.optim.AdamW(nn.Linear(6, 1).parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1.0 + 0.05 * e))
    lrs = []
    for _ in range(n):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


_CONST = _constant_lrs()


def _constant_lr(position: int) -> float:
    return _CONST[position]


# ---------------------------------------------------------------------------- the marks
def test_marks_are_checked_and_the_batch_follows_them():
    s = BatchSchedule({1000: 1024, 0: 512, 3000: 2048})
    assert s.marks == ((0.0, 512.0), (1000.0, 1024.0), (3000.0, 2048.0))
    assert [s.batch_at(t) for t in (0, 999, 1000, 2999.5, 3000, 1e9)] == [512, 512, 1024, 1024, 2048, 2048]
    assert BatchSchedule([(500, 1024)]).batch_at(499) is None  # before the first mark: the starting batch
    for marks, error, match in [
        ([], ValueError, r"at least one \(tokens, batch\) mark"),
        ([(0, 512), (0, 1024)], ValueError, r"two marks at tokens=0"),
        ([(-1, 512)], ValueError, r"tokens=-1.0\): must be finite and >= 0"),
        ([(0, 0)], ValueError, r"batch=0.0\): must be finite and > 0"),
        ([(0, True)], TypeError, r"batch=True\): expected a number"),
        ([(0, 1, 2)], TypeError, r"is not a \(tokens, batch\) pair"),
        (5, TypeError, r"expected \(tokens, batch\) pairs"),
    ]:
        with pytest.raises(error, match=match):
            BatchSchedule(marks)
    with pytest.raises(ValueError, match=r"warn_after=0"):
        BatchSchedule([(0, 512)], warn_after=0)
    with pytest.raises(ValueError, match=r"BatchSchedule\(kappa=-1\)"):
        BatchSchedule([(0, 512)], kappa=-1)


def test_ramps_are_megatrons_in_tokens_and_geometric():
    linear = BatchSchedule.ramp(**RAMP)
    # four increments of 256, evenly over (2,048, 10,240]: one every 2,048 units
    assert linear.marks == ((0, 512), (4096, 768), (6144, 1024), (8192, 1280), (10240, 1536))
    geo = BatchSchedule.ramp(512, 4096, over=(0, 3e6), kind="geometric")
    assert geo.marks == ((0, 512), (1e6, 1024), (2e6, 2048), (3e6, 4096))
    for kwargs, match in [
        (dict(start=512, end=256, over=(0, 10)), r"a ramp goes up"),
        (dict(start=512, end=1536, step=300, over=(0, 10)), r"step=300\): must divide end - start = 1024"),
        (dict(start=512, end=1536, over=(10, 10)), r"begin < finish"),
        (dict(start=512, end=1536, over=(0, 10), kind="geometric"), r"end / start must be a power of factor"),
        (dict(start=512, end=1024, over=(0, 10), kind="cubic"), r"kind='cubic'"),
    ]:
        with pytest.raises(ValueError, match=match):
            BatchSchedule.ramp(**kwargs)


def test_a_budget_plan_becomes_its_marks():
    plan = plan_doubling(5e6, 512, 8192, 0.5, 2.0)
    s = BatchSchedule.from_plan(plan)
    assert [b for _, b in s.marks] == list(plan.batches)
    assert [t for t, _ in s.marks[1:]] == list(plan.switch_tokens)
    for z, b in zip(plan.switch_tokens, plan.batches[1:]):
        assert s.batch_at(z) == b == plan.batch_at_tokens(z)
        assert s.batch_at(z - 1) == plan.batch_at_tokens(z - 1)
    with pytest.raises(TypeError, match=r"expected a DoublingPlan"):
        BatchSchedule.from_plan(object())


def test_a_mark_that_cannot_be_laid_out_is_refused_naming_the_nearest_batches():
    # microbatch given: refused when the schedule is built, then again with the ranks when the adapter is
    with pytest.raises(ValueError, match=r"mark \(1000, 600\) cannot be laid out.*nearest feasible batches are "
                                         r"512 and 640"):
        BatchSchedule([(0, 512), (1000, 600)], microbatch=MICRO)
    s = BatchSchedule([(0, 512), (1000, 640)], microbatch=MICRO)  # fine on one rank
    with pytest.raises(ValueError, match=r"microbatch x 2 rank\(s\) = 256 units; the nearest feasible batches "
                                         r"are 512 and 768"):
        s.bind(owner="CBSTracker", dp_degree=2, starting_accumulation=2)
    with pytest.raises(ValueError, match=r"CBSTracker: the schedule's batch at 0 units is 512 but the run starts "
                                         r"at accumulation_steps=2 x 128"):
        CBSTracker(nn.Linear(6, 1), accumulation_steps=2, controller=BatchSchedule([(0, 512)], microbatch=MICRO))
    # without microbatch: the first step's units per microbatch decide, before the optimizer steps
    model = nn.Linear(6, 1).double()
    tracker = CBSTracker(model, accumulation_steps=A0, controller=BatchSchedule([(0, 512), (2000, 700)]))
    for j in range(A0):
        with tracker.microbatch(size=MICRO):
            _loss(model, *_data(0, j)).backward()
    with pytest.raises(ValueError, match=r"\(2000, 700\) cannot be laid out.*640 and 768.*pass microbatch="):
        tracker.step()


# ---------------------------------------------------------------------------- the plain loop
def test_a_gradual_ramp_runs_exactly_in_the_plain_loop():
    schedule = BatchSchedule.ramp(**RAMP)
    model, opt, sched, tracker = _build(schedule)
    rows: list = []
    _train(model, opt, sched, tracker, until_units=16_000, rows=rows, check_grads=True)
    accs = [a for _, a, _, _, _ in rows]
    assert sorted(set(accs)) == [4, 6, 8, 10, 12]  # non-power-of-two accumulation, every stage
    for before, acc, lr, _, batch in rows:
        # the window that starts after `before` units runs the schedule's batch there
        assert batch == acc * MICRO == schedule.batch_at(before), before
        # the LR: the constant-batch run's at the same data (its step floor(units / B0)) times sqrt(B / B0)
        assert lr == pytest.approx(_constant_lr(int(before // B0)) * math.sqrt(acc / A0), rel=1e-12), before
    # each change lands at the first window boundary at or after its mark
    for mark, batch in schedule.marks[1:]:
        first = next(i for i, r in enumerate(rows) if r[4] == batch)
        assert rows[first][0] >= mark > rows[first - 1][0]
    # the tracker measured beside the schedule, and the controller's tags hold kappa x B_simple
    first_measured = next(i for i, r in enumerate(rows) if r[3] is not None)
    assert first_measured <= 10 and all(r[3] is not None for r in rows[first_measured:])
    assert tracker.last_record.critical_batch == pytest.approx(0.5 * tracker.last_record.noise_scale)
    assert tracker.starting_batch_steps == int(rows[-1][0] + rows[-1][4]) // B0


def test_with_keep_the_lr_is_the_constant_runs_exactly_and_unmeasured_windows_change_on_time():
    schedule = BatchSchedule.ramp(**RAMP)
    model, opt, sched, tracker = _build(schedule, coupling="keep", measure_every=3)
    rows: list = []
    _train(model, opt, sched, tracker, until_units=12_000, rows=rows)
    assert sorted(set(a for _, a, _, _, _ in rows)) == [4, 6, 8, 10, 12]
    for before, _, lr, _, batch in rows:
        assert batch == schedule.batch_at(before)  # also where the window before was not measured
        assert lr == _constant_lr(int(before // B0))


def test_a_resume_mid_schedule_continues_at_the_right_batch_and_a_run_replays_as_a_schedule():
    full: list = []
    parts = _build(BatchSchedule.ramp(**RAMP))
    _train(*parts, until_units=14_000, rows=full)
    model, opt, sched, tracker = _build(BatchSchedule.ramp(**RAMP))
    first: list = []
    _train(model, opt, sched, tracker, until_units=4_800, rows=first)  # between two marks, a carry pending
    assert first[-1][1] == 6 and tracker.session.starting_batch_carry == 2
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
             "tracker": tracker.state_dict()}
    model, opt, sched, tracker = _build(BatchSchedule.ramp(**RAMP), state=state)
    second: list = []
    _train(model, opt, sched, tracker, until_units=14_000, rows=second)
    assert [r[:3] for r in first + second] == [r[:3] for r in full]
    for p, q in zip(model.parameters(), parts[0].parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    # the run's own records, replayed as a schedule in another run, give the same batches at the same units
    records = [{"tokens_seen": b + g, "global_batch": g, "accumulation_steps": a, "dp_degree": 1}
               for b, a, _, _, g in full]
    replay = BatchSchedule.from_records(records)
    assert replay.marks == BatchSchedule.ramp(**RAMP).marks[:1] + tuple(
        (next(r[0] for r in full if r[4] == b), b) for _, b in BatchSchedule.ramp(**RAMP).marks[1:])
    again: list = []
    _train(*_build(replay), until_units=14_000, rows=again)
    assert [r[:3] for r in again] == [r[:3] for r in full]


def test_the_schedule_warns_once_when_it_runs_far_above_the_measured_critical_batch():
    # the noise scale of this regression settles near 1,800 units: a schedule to 768 stays below kappa x
    # B_simple and is quiet, one to 8,192 (about 9 x kappa x B_simple) warns, once, after 8 measured steps there
    def run(marks, **kw):
        model, opt, sched, tracker = _build(BatchSchedule(marks, warn_after=8, **kw))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _train(model, opt, sched, tracker, until_units=100_000, rows=[])
        noise = tracker.last_record.noise_scale
        return [str(w.message) for w in caught if "BatchSchedule" in str(w.message)], noise

    quiet, noise = run([(0, 512), (4096, 768)])
    assert quiet == [] and 768 < 0.5 * noise
    loud, noise = run([(0, 512), (4096, 8192)])
    assert len(loud) == 1 and 8192 > 4 * 0.5 * noise
    assert "above kappa x B_simple" in loud[0] and "batch of 8,192" in loud[0] and "kappa=0.5" in loud[0]
    # a measured kappa (a calibration's points) replaces the constant: at kappa 20 the same schedule is below
    calm, _ = run([(0, 512), (4096, 8192)], kappa=[(0, 20.0), (1e6, 20.0)])
    assert calm == []


def test_a_controllers_growth_logged_to_tensorboard_replays_as_a_schedule(tmp_path):
    # a real BatchSizeController grows the batch; its TensorBoard log, read back as a schedule, makes a
    # new run take the same batches at the same units (truth: the controller's own run)
    from cbs_tracker import BatchSizeController, TensorBoardLogger

    def build(controller, logger=None):
        torch.manual_seed(0)
        model = nn.Linear(6, 1).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        return model, opt, CBSTracker(model, opt, accumulation_steps=A0, unit="tokens", controller=controller,
                                      logger=logger)

    def run(model, opt, tracker, n=60):
        rows = []
        for step in range(n):
            acc = tracker.accumulation_steps
            for j in range(acc):
                with tracker.microbatch(size=MICRO):
                    (_loss(model, *_data(step, j)) / acc).backward()
            rows.append((tracker.session.units_seen, acc))
            tracker.step()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return rows

    controller = BatchSizeController(kappa=4.0, warmup_steps=5, warmup_tokens=0, cooldown_tokens=0, patience=2,
                                     window=3, feedback_guard=False, max_batch=8 * B0)
    with TensorBoardLogger(tmp_path / "run", flush_secs=1) as logger:
        grown = run(*build(controller, logger))
    assert len({a for _, a in grown}) >= 3  # it grew at least twice
    replay = BatchSchedule.from_tensorboard(str(tmp_path / "run"))
    assert replay.marks[0] == (0, B0) and len(replay.marks) == len({a for _, a in grown})
    assert run(*build(replay)) == grown


def test_observe_only_reports_the_schedule_and_changes_nothing():
    schedule = BatchSchedule.ramp(**RAMP, observe_only=True)
    model, opt, sched, tracker = _build(schedule)
    rows: list = []
    _train(model, opt, sched, tracker, until_units=8_000, rows=rows)
    assert {a for _, a, _, _, _ in rows} == {A0}
    assert tracker.session.last_decision.planned_batch == schedule.batch_at(rows[-1][0] + rows[-1][4]) > B0


def test_with_microbatch_given_the_accumulation_ignores_how_full_the_batches_are():
    # tokens counted from labels: a step of 2 ranks x 2 microbatches of nominally 128 tokens ran 70% full.
    # The accumulation for 1,024 tokens is 1,024 / (128 x 2 ranks) = 4, not what the units seen suggest
    s = BatchSchedule([(0, 512), (300, 1024)], microbatch=MICRO)
    s.bind(owner="CBSTracker", dp_degree=2, starting_accumulation=2)
    first = s.update(step=1, tokens_seen=0.7 * 512, global_batch=0.7 * 512, accumulation_steps=2, noise_scale=None)
    assert (first.accumulation_steps, first.changed) == (4, True) and first.global_batch == 1024
