"""LR schedules under growth: every optimizer step's LR equals the constant-batch run's LR at the same units, times the coupling.

The truth is the constant-batch run itself: the same scheduler stepped once per
optimizer step at the starting accumulation. A run with growth must use, at a step
that starts after ``p`` starting-batch steps' worth of data, the constant run's LR of
step ``p`` times ``factor(A / A0)``; it must end at the same data, with the scheduler
at the same position. Plain loop (with a resume mid-run) and Lightning.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from cbs_tracker import CBSCallback, CBSTracker
from cbs_tracker.policy.lr import token_schedule
from tests.lightning_workers import PlanController, Regression, regression_data
from tests.spawning import spawn

A0 = 2
TOTAL = 48  # optimizer steps of the constant run
# accumulation decided at step s (takes effect at the next window): 2 -> 4 -> 8 -> 16, each
# change at a position its new multiple divides, so the run ends exactly at TOTAL
PLAN = {2: 4, 3: 8, 4: 16}


def _schedulers() -> dict[str, Callable[[torch.optim.Optimizer], object]]:
    S = torch.optim.lr_scheduler
    return {
        "lambda": lambda o: S.LambdaLR(o, lambda e: 1.0 / (1.0 + 0.1 * e)),
        "cosine": lambda o: S.CosineAnnealingLR(o, T_max=TOTAL, eta_min=0.01),
        "onecycle": lambda o: S.OneCycleLR(o, max_lr=0.1, total_steps=TOTAL + 1),
        "linear": lambda o: S.LinearLR(o, start_factor=1.0, end_factor=0.1, total_iters=TOTAL),
        "sequential": lambda o: S.SequentialLR(
            o, [S.LinearLR(o, start_factor=0.1, total_iters=6), S.CosineAnnealingLR(o, T_max=TOTAL - 6)], milestones=[6]
        ),
        "wsd": lambda o: S.LambdaLR(o, lambda e: token_schedule(1.0, TOTAL, warmup=4, decay="wsd")(e)),
    }


SCHEDULERS = _schedulers()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 1)


def _loop(tracker: CBSTracker, optimizer, scheduler, model, *, until: int, lrs: list) -> None:
    """Train until ``until`` starting-batch steps; log (position, accumulation, lr) of every optimizer step."""
    g = torch.Generator().manual_seed(tracker.starting_batch_steps)
    while tracker.starting_batch_steps + tracker.accumulation_steps // A0 <= until:  # never beyond
        acc = tracker.accumulation_steps
        for _ in range(acc):
            x = torch.randn(3, 4, generator=g)
            with tracker.microbatch(size=3):
                (model(x).pow(2).mean() / acc).backward()
        position = tracker.starting_batch_steps
        tracker.step()
        lrs.append((position, acc, optimizer.param_groups[0]["lr"]))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)


def _constant_lrs(name: str, make_opt) -> list[float]:
    """The LR of each of the TOTAL constant-batch steps: the bare scheduler, stepped once per step (no tracker)."""
    model = _model()
    opt = make_opt(model)
    sched = SCHEDULERS[name](opt)
    lrs = []
    for _ in range(TOTAL):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()  # no gradients: nothing moves; keeps the scheduler's order check quiet
        sched.step()
    return lrs


OPTIMIZERS = {
    "sgd": (lambda m: torch.optim.SGD(m.parameters(), lr=0.1), lambda r: r),
    "adamw": (lambda m: torch.optim.AdamW(m.parameters(), lr=0.1), math.sqrt),
}


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_plain_loop_lr_follows_the_constant_run_in_units_times_the_coupling(name, opt_name):
    make_opt, factor = OPTIMIZERS[opt_name]
    const = _constant_lrs(name, make_opt)
    model = _model()
    opt = make_opt(model)
    sched = SCHEDULERS[name](opt)
    tracker = CBSTracker(model, opt, accumulation_steps=A0, unit="samples", controller=PlanController(PLAN),
                         lr_scheduler=sched)
    lrs: list = []
    _loop(tracker, opt, sched, model, until=TOTAL, lrs=lrs)
    assert max(a for _, a, _ in lrs) == 16  # the plan ran
    for position, acc, lr in lrs:
        assert lr == pytest.approx(const[position] * factor(acc / A0), rel=1e-9, abs=1e-15), (position, acc)
    # the same data as the constant run, and the scheduler at the same position
    assert tracker.starting_batch_steps == TOTAL
    assert sched.last_epoch == TOTAL
    assert len(lrs) < TOTAL / 4


def test_plain_loop_resume_mid_run_continues_the_same_schedule():
    make_opt, factor = OPTIMIZERS["adamw"]
    name = "sequential"

    def build(state=None):
        model = _model()
        opt = make_opt(model)
        sched = SCHEDULERS[name](opt)
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            sched.load_state_dict(state["sched"])
        tracker = CBSTracker(model, opt, accumulation_steps=A0, unit="samples", controller=PlanController(PLAN),
                             lr_scheduler=sched)
        if state is not None:
            tracker.load_state_dict(state["tracker"])
        return model, opt, sched, tracker

    model, opt, sched, tracker = build()
    full: list = []
    _loop(tracker, opt, sched, model, until=TOTAL, lrs=full)

    model, opt, sched, tracker = build()
    first: list = []
    _loop(tracker, opt, sched, model, until=6, lrs=first)  # stops between two doublings
    assert 4 <= tracker.accumulation_steps < 16
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
             "tracker": tracker.state_dict()}
    model, opt, sched, tracker = build(state)
    second: list = []
    _loop(tracker, opt, sched, model, until=TOTAL, lrs=second)
    assert [(p, a) for p, a, _ in first + second] == [(p, a) for p, a, _ in full]
    assert [lr for _, _, lr in first + second] == pytest.approx([lr for _, _, lr in full], rel=1e-12)


def test_a_scheduler_stepped_twice_per_step_is_refused():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0)
    tracker = CBSTracker(model, opt, accumulation_steps=2, unit="samples", lr_scheduler=sched)
    for _ in range(2):
        with tracker.microbatch(size=1):
            model(torch.ones(1, 4)).sum().backward()
    tracker.step()
    opt.step()
    sched.step()
    with pytest.raises(RuntimeError, match=r"lr_scheduler.step\(\) was called twice for one optimizer step"):
        sched.step()
    with pytest.raises(RuntimeError, match=r"already timed by another tracker"):
        CBSTracker(model, opt, accumulation_steps=2, lr_scheduler=sched)
    with pytest.raises(TypeError, match=r"CBSTracker\(lr_scheduler='cosine'\): expected a torch.optim.lr_scheduler"):
        CBSTracker(_model(), torch.optim.SGD(_model().parameters(), lr=0.1), lr_scheduler="cosine")
    # the scheduler's own state never carries the tracker (checkpoints stay plain)
    assert "_cbs_timer" not in sched.state_dict() and "step" not in sched.state_dict()
    tracker.remove_hooks()
    assert type(sched) is torch.optim.lr_scheduler.LambdaLR


def test_cap_at_peak_keeps_the_coupled_lr_at_or_below_the_peak():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = SCHEDULERS["cosine"](opt)
    tracker = CBSTracker(model, opt, accumulation_steps=A0, unit="samples", controller=PlanController(PLAN),
                         lr_scheduler=sched, cap_lr_at_peak=True)
    lrs: list = []
    _loop(tracker, opt, sched, model, until=TOTAL, lrs=lrs)
    const = _constant_lrs("cosine", OPTIMIZERS["adamw"][0])
    for position, acc, lr in lrs:
        assert lr == pytest.approx(min(0.1, const[position] * math.sqrt(acc / A0)), rel=1e-9)
    assert any(const[p] * math.sqrt(a / A0) > 0.1 for p, a, _ in lrs)  # the cap was reached


@pytest.mark.parametrize(("cap", "capped"), [(None, True), (False, False), (True, True)])
def test_a_budget_caps_the_coupled_lr_at_its_peak_unless_told_not_to(cap, capped):
    # The budget's plan grows the batch whatever the noise scale says; by default (cap_lr_at_peak
    # left unset) the coupling must then never raise the LR above where it started (a constant LR:
    # the peak). Truth: the starting LR, and sqrt(A / A0) times it where the cap is switched off.
    from cbs_tracker import BatchSizeController

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ctrl = BatchSizeController(budget_tokens=6_000, max_accumulation_steps=16)
    kwargs = {} if cap is None else {"cap_lr_at_peak": cap}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker = CBSTracker(model, opt, accumulation_steps=A0, unit="tokens", controller=ctrl, **kwargs)
    assert sum("budget_tokens" in str(w.message) for w in caught) == (1 if cap is False else 0)
    g = torch.Generator().manual_seed(0)
    seen = []
    while tracker.session.units_seen < 6_000:
        acc = tracker.accumulation_steps
        for _ in range(acc):
            with tracker.microbatch(size=24):
                (model(torch.randn(3, 4, generator=g)).pow(2).mean() / acc).backward()
        tracker.step()
        seen.append((acc, opt.param_groups[0]["lr"]))
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert max(a for a, _ in seen) >= 4 * A0  # the plan grew the batch
    for acc, lr in seen:
        expected = 0.1 if capped else 0.1 * math.sqrt(acc / A0)
        assert lr == pytest.approx(expected, rel=1e-9), (acc, lr)


def test_token_schedule_shapes():
    cos = token_schedule(1.0, 100.0, warmup=10.0, decay="cosine", final_ratio=0.1)
    assert cos(0) == 0.0 and cos(5) == pytest.approx(0.5) and cos(10) == pytest.approx(1.0)
    assert cos(55) == pytest.approx(0.1 + 0.9 * 0.5)
    assert cos(100) == pytest.approx(0.1) and cos(1e9) == pytest.approx(0.1)
    wsd = token_schedule(2.0, 100.0, decay="wsd", decay_fraction=0.2, final_ratio=0.1)
    assert wsd(80) == 2.0 and wsd(90) == pytest.approx(2.0 - 1.8 * 0.5) and wsd(100) == pytest.approx(0.2)
    lin = token_schedule(1.0, 100.0, decay="linear", final_ratio=0.0)
    assert lin(25) == pytest.approx(0.75)
    for kwargs, match in (({"warmup": 100.0}, r"warmup=100.0"), ({"final_ratio": 1.5}, r"final_ratio=1.5"),
                          ({"decay": "step"}, r"decay='step'")):
        with pytest.raises(ValueError, match=match):
            token_schedule(1.0, 100.0, **kwargs)


# ---------------------------------------------------------------------------- Lightning
class _LRLog(pl.Callback):
    def __init__(self) -> None:
        self.rows: list[tuple[int, int, float]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        cbs = next((c for c in trainer.callbacks if isinstance(c, CBSCallback)), None)
        # position before this step: the starting-batch steps already counted (this step is measured now);
        # without the callback, the optimizer steps taken
        position = trainer.global_step if cbs is None else cbs.starting_batch_steps
        self.rows.append((position, trainer.accumulate_grad_batches, optimizer.param_groups[0]["lr"]))


def _lightning_run(controller, *, scheduler: str, batches: int = 32, epochs: int = 2, tracked: bool = True):
    log = _LRLog()
    cbs = CBSCallback(controller=controller, unit="samples") if tracked else None
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, max_epochs=epochs,
                         accumulate_grad_batches=A0, callbacks=[log] + ([cbs] if tracked else []))
    module = Regression(lr=0.05, scheduler=scheduler, optimizer="adam")
    trainer.fit(module, torch.utils.data.DataLoader(regression_data(batches * 2), batch_size=2, shuffle=False))
    sched = trainer.lr_scheduler_configs[0].scheduler
    return log.rows, cbs, sched, trainer


@pytest.mark.filterwarnings("ignore:.*does not have many workers.*")
@pytest.mark.parametrize("scheduler", ["cosine", "onecycle"])
def test_lightning_schedule_sized_from_estimated_stepping_batches_finishes_with_the_data(scheduler):
    # the truth: the same Trainer without the callback (Lightning steps its own scheduler)
    const, _, const_sched, _ = _lightning_run(None, scheduler=scheduler, tracked=False)
    assert [p for p, _, _ in const] == list(range(len(const)))
    # callbacks run in list order: _LRLog sees the position before CBSCallback counts this step
    const_lr = [lr for _, _, lr in const]
    grown, cbs, sched, trainer = _lightning_run(PlanController({2: 4, 5: 8}), scheduler=scheduler)
    assert max(a for _, a, _ in grown) == 8
    for position, acc, lr in grown:
        assert lr == pytest.approx(const_lr[position] * math.sqrt(acc / A0), rel=1e-9), (position, acc)
    # an epoch-budgeted run: the schedule ends exactly with the data, as without growth
    assert sched.last_epoch == const_sched.last_epoch == len(const)
    assert cbs.starting_batch_steps == len(const)
    assert trainer.global_step < len(const) / 2


def test_fsdp2_on_two_gloo_ranks_follows_the_same_timing(tmp_path):
    import json

    from tests import engine_workers

    spawn(engine_workers.fsdp_schedule, args=(2, str(tmp_path / "pg"), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"fsdp{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    const = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=48, eta_min=0.01)
    reference = []
    for _ in range(48):
        reference.append(opt.param_groups[0]["lr"])
        opt.step()
        const.step()
    rows = ranks[0]["rows"]
    assert max(a for _, a, _ in rows) == 16
    for position, acc, lr in rows:  # SGD: linear coupling
        assert lr == pytest.approx(reference[position] * acc / A0, rel=1e-9), (position, acc)
    assert ranks[0]["position"] == ranks[0]["last_epoch"] == 48


class _EpochLRLog(pl.Callback):
    def __init__(self) -> None:
        self.rows: list[tuple[int, int, float]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.rows.append((trainer.current_epoch, trainer.accumulate_grad_batches, optimizer.param_groups[0]["lr"]))


class _EpochScheduled(Regression):
    def __init__(self, gamma: float) -> None:
        super().__init__(lr=0.05, optimizer="adam")
        self.gamma = gamma

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=self.gamma)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}


class _BudgetPlan(PlanController):
    budget_tokens = 1e9  # a budget-aware controller, as far as the LR cap is concerned


@pytest.mark.filterwarnings("ignore:.*does not have many workers.*")
@pytest.mark.parametrize(("gamma", "controller", "kwargs", "capped"), [
    (0.5, PlanController, {}, False),        # a decaying epoch schedule, coupled, not capped
    (1.0, _BudgetPlan, {}, True),            # with a budget the coupled LR stays at the peak by default
    (1.0, _BudgetPlan, {"cap_lr_at_peak": False}, False),
])
def test_lightning_epoch_interval_scheduler_under_growth(gamma, controller, kwargs, capped):
    # Truth: the bare StepLR, one step per epoch (an epoch holds the same data at any batch size),
    # times sqrt(A / A0), capped at the peak where the cap is on. An epoch-interval scheduler once
    # crashed the run at the first epoch end (Lightning 2.6 steps it before on_train_epoch_end).
    log = _EpochLRLog()
    cbs = CBSCallback(controller=controller({2: 4, 5: 8}), unit="samples", **kwargs)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, max_epochs=3,
                         accumulate_grad_batches=A0, callbacks=[log, cbs])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        trainer.fit(_EpochScheduled(gamma), torch.utils.data.DataLoader(regression_data(64), batch_size=2))
    assert {e for e, _, _ in log.rows} == {0, 1, 2} and max(a for _, a, _ in log.rows) == 8
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 3
    for epoch, acc, lr in log.rows:
        coupled = 0.05 * gamma**epoch * math.sqrt(acc / A0)
        assert lr == pytest.approx(min(coupled, 0.05) if capped else coupled, rel=1e-9), (epoch, acc, lr)
    if gamma == 1.0:  # the cap binds after an epoch end (the epoch scheduler's own write)
        assert any(math.sqrt(a / A0) > 1.0 for e, a, _ in log.rows if e > 0)


class _EveryThirdStep(Regression):
    """A step scheduler Lightning steps only where (batch_idx + 1) % 3 == 0 at an optimizer step."""

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 3}}


@pytest.mark.filterwarnings("ignore:.*does not have many workers.*")
@pytest.mark.parametrize(("batches", "epochs", "expected"), [(96, 1, 16), (14, 3, 6)])
def test_lightning_step_scheduler_with_a_frequency_keeps_its_pace_in_data(batches, epochs, expected):
    # Truth: the same Trainer without the callback. At A0 = 2 and frequency 3 Lightning steps the
    # scheduler once every 3 optimizer steps (6 batches), 16 times in 96 batches. Under growth it must
    # still take one step per 3 starting-batch steps of data (the tracker once advanced it by every
    # starting-batch step owed, 3x too fast), lagging the constant run by at most one call's worth.
    # Lightning's count restarts each epoch: 14 batches hold floor(14 / 6) = 2 scheduler steps per epoch,
    # and what an epoch leaves is not carried into the next.
    def run(tracked: bool):
        log = _LRLog()
        cbs = CBSCallback(controller=PlanController({2: 4, 5: 8}), unit="samples") if tracked else None
        trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, max_epochs=epochs,
                             accumulate_grad_batches=A0, callbacks=[log] + ([cbs] if tracked else []))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            trainer.fit(_EveryThirdStep(lr=0.05, optimizer="adam"),
                        torch.utils.data.DataLoader(regression_data(2 * batches), batch_size=2))
        return log.rows, trainer.lr_scheduler_configs[0].scheduler

    const, const_sched = run(False)
    grown, sched = run(True)
    assert const_sched.last_epoch == expected and len(const) == epochs * batches // A0
    assert sched.last_epoch == const_sched.last_epoch
    const_lr = [lr for _, _, lr in const]
    assert max(a for _, a, _ in grown) >= 4
    for position, acc, lr in grown:
        scheduled = lr / math.sqrt(acc / A0)
        lag = 3 * acc // A0  # starting-batch steps between two of Lightning's calls at this accumulation
        assert any(scheduled == pytest.approx(const_lr[q], rel=1e-9)
                   for q in range(max(0, position - lag), position + 1)), (position, acc, lr)


@pytest.mark.parametrize(("carry", "error"), [("x", TypeError), (-1, ValueError), (1.5, TypeError)])
def test_a_bad_schedule_carry_in_a_checkpoint_is_refused_before_anything_changes(carry, error):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    tracker = CBSTracker(model, opt, accumulation_steps=A0, unit="samples",
                         lr_scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0))
    state = tracker.state_dict()
    before = tracker.state_dict()
    with pytest.raises(error, match=r"schedule: state\['carry'\]=.*: expected an int >= 0"):
        tracker.load_state_dict({**state, "step": 7, "schedule": {**state["schedule"], "carry": carry}})
    assert tracker.state_dict() == before
    tracker.load_state_dict({**state, "schedule": {k: v for k, v in state["schedule"].items() if k != "carry"}})
    assert tracker.session.timer.carry == 0  # a checkpoint from before the carry existed


@pytest.mark.filterwarnings("ignore:.*does not have many workers.*")
def test_lightning_epoch_interval_scheduler_resumes_with_the_coupling_applied_once(tmp_path):
    # Resumed, the optimizer's LR comes back coupled; the epoch scheduler's own value is that over the
    # coupling. Truth: the bare StepLR per epoch times sqrt(A / A0), before and after the resume
    # (once applied twice: sqrt(A / A0) squared after the resume).
    def fit(epochs: int, ckpt: str | None):
        log = _EpochLRLog()
        # growth also after the resume (step 9), so the coupling changes on the restored schedule
        cbs = CBSCallback(controller=PlanController({2: 4, 5: 8, 9: 16}), unit="samples")
        trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, max_epochs=epochs,
                             accumulate_grad_batches=A0, callbacks=[log, cbs])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            trainer.fit(_EpochScheduled(0.5), torch.utils.data.DataLoader(regression_data(64), batch_size=2),
                        ckpt_path=ckpt)
        return trainer, log.rows

    first, rows = fit(1, None)
    assert max(a for _, a, _ in rows) == 8
    path = str(tmp_path / "epoch1.ckpt")
    first.save_checkpoint(path)
    _, resumed = fit(3, path)
    assert {e for e, _, _ in resumed} == {1, 2} and max(a for _, a, _ in resumed) == 16
    for epoch, acc, lr in rows + resumed:
        assert lr == pytest.approx(0.05 * 0.5**epoch * math.sqrt(acc / A0), rel=1e-9), (epoch, acc, lr)
