"""A ``BatchSchedule`` in a Lightning ``Trainer`` (``CBSCallback(controller=schedule)``).

Truths: the schedule's marks (every window runs the batch the schedule gives at the units
before it, as in the plain loop, wherever it starts in the epoch), the autograd mean of
each window's microbatches, the same Trainer without the callback (its
LR per step), and the uninterrupted fit (a resume from a checkpoint mid-schedule).
"""

from __future__ import annotations

import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from cbs_tracker import BatchSchedule, CBSCallback
from tests.lightning_workers import (
    GradCheck,
    LambdaRegression,
    RankSlice,
    SavedGradCheck,
    regression_data,
    window_accumulation,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
    pytest.mark.filterwarnings("ignore:.*litlogger.*"),
    pytest.mark.filterwarnings("ignore:.*isinstance.*treespec.*"),
]

A0, ROWS = 2, 2  # loader batches of 2 samples, 2 per window: 4 samples
B0 = A0 * ROWS
PER_EPOCH = 32  # loader batches
# accumulation 2 -> 4 -> 6 -> 8 -> 12 over two epochs of 64 samples (where Lightning's counter allows)
MARKS = ((0, 4), (12, 8), (40, 12), (76, 16), (100, 24))


class _Rows(pl.Callback):
    """Per optimizer step: (units seen before it, Lightning's accumulation, position in the epoch, lr)."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, int, int, float]] = []
        self.units = 0.0
        self.start = 0
        self._new = True
        self.cbs = None  # the CBSCallback, whose window_accumulation is the window's length

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._new:
            self.start, self._new = batch_idx, False

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._new = True
        acc = window_accumulation(trainer, self.cbs)
        self.rows.append((self.units, acc, self.start, optimizer.param_groups[0]["lr"]))
        self.units += acc * ROWS if self.start + acc <= PER_EPOCH else (PER_EPOCH - self.start) * ROWS


def _fit(epochs: int, *, tracked: bool = True, ckpt: str | None = None, save: str | None = None,
         coupling: str = "auto"):
    rows = _Rows()
    cbs = CBSCallback(controller=BatchSchedule(MARKS), unit="samples", lr_coupling=coupling) if tracked else None
    check = GradCheck(cbs) if tracked else None
    rows.cbs = cbs
    callbacks = [rows] + ([cbs, check] if tracked else [])
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, max_epochs=epochs,
                         accumulate_grad_batches=A0, callbacks=callbacks)
    module = LambdaRegression(lr=0.05, optimizer="adam")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        trainer.fit(module, torch.utils.data.DataLoader(regression_data(PER_EPOCH * ROWS), batch_size=ROWS),
                    ckpt_path=ckpt)
    if save is not None:
        trainer.save_checkpoint(save)
    return rows.rows, cbs, check, trainer


def _check_rule(rows) -> int:
    """Every window runs the schedule's accumulation at the units before it, wherever it starts in the
    epoch; returns how many windows start where their accumulation does not divide the position."""
    schedule = BatchSchedule(MARKS)
    for before, acc, start, _ in rows:
        assert acc == int(schedule.batch_at(before) // ROWS), (before, acc, start)
    return sum(start % acc != 0 for _, acc, start, _ in rows)


def test_the_schedule_in_lightning_windows_gradients_and_lr_per_token():
    const, _, _, _ = _fit(2, tracked=False)
    const_lr = [lr for _, _, _, lr in const]
    rows, cbs, check, _ = _fit(2)
    # every stage runs where the schedule puts it, 8 at 76 samples (position 6 of epoch 1) included
    assert sorted({a for _, a, _, _ in rows}) == [2, 4, 6, 8, 12]
    unaligned = _check_rule(rows)
    assert unaligned >= 3  # windows Lightning's own counter could not have started there
    for r in check.rows:  # the optimizer's gradient is the mean of the window's microbatches
        k, a = r["microbatches"], r["lightning_accumulation"]
        # an epoch's short last window: Lightning divides its K losses by the full A (rescale_short_window=False)
        torch.testing.assert_close(r["got"], r["mean"] * (k / a), rtol=1e-5, atol=1e-6)
    assert sum(r["microbatches"] == r["lightning_accumulation"] for r in check.rows) >= 10
    for before, acc, _, lr in rows:
        assert lr == pytest.approx(const_lr[int(before // B0)] * math.sqrt(acc / A0), rel=1e-9), before
    assert cbs.starting_batch_steps == len(const)  # the run ends at the same data as the constant run
    keep, _, _, _ = _fit(2, coupling="keep")
    assert [lr for _, _, _, lr in keep] == [const_lr[int(b // B0)] for b, _, _, _ in keep]


def test_a_lightning_resume_mid_schedule_continues_at_the_right_batch(tmp_path):
    full, _, _, _ = _fit(2)
    first, _, _, _ = _fit(1, save=str(tmp_path / "epoch0.ckpt"))
    assert 4 <= first[-1][1] < 12  # mid-schedule
    resumed_rows, cbs, _, _ = _fit(2, ckpt=str(tmp_path / "epoch0.ckpt"))
    tail = full[len(first):]
    assert [(a, s) for _, a, s, _ in resumed_rows] == [(a, s) for _, a, s, _ in tail]
    assert [lr for *_, lr in resumed_rows] == pytest.approx([lr for *_, lr in tail], rel=1e-12)


def _spawn_fit(out, marks, epochs: int, *, save: bool = False, ckpt: str | None = None) -> None:
    """A ``ddp_spawn`` fit on 2 ranks; each rank's rows in ``out/rank{r}.pt`` (``save``: ``out/last.ckpt``)."""
    out.mkdir(exist_ok=True)
    cbs = CBSCallback(controller=BatchSchedule(marks), unit="samples")
    callbacks = [cbs, SavedGradCheck(cbs, str(out))]
    if save:
        callbacks.append(ModelCheckpoint(dirpath=str(out), save_last=True, save_top_k=0))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", logger=False,
                         enable_checkpointing=save, enable_progress_bar=False, enable_model_summary=False,
                         max_epochs=epochs, accumulate_grad_batches=A0, use_distributed_sampler=False,
                         callbacks=callbacks)
    n = 2 * PER_EPOCH * ROWS
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        trainer.fit(LambdaRegression(lr=0.05, optimizer="adam"),
                    torch.utils.data.DataLoader(regression_data(n), batch_size=ROWS, sampler=RankSlice(n, 2)),
                    ckpt_path=ckpt)


def test_the_schedule_on_two_ddp_spawn_ranks_and_a_resume_there(tmp_path):
    # per rank the single process's windows; global units twice theirs (2 samples x 2 ranks per slot)
    marks = tuple((2 * t, 2 * b) for t, b in MARKS)
    _spawn_fit(tmp_path, marks, 2)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    assert [r["record"] for r in r0] == [r["record"] for r in r1]
    rows = []
    for a, b in zip(r0, r1, strict=True):
        torch.testing.assert_close(a["got"], b["got"], rtol=0, atol=0)
        k, acc = a["microbatches"], a["lightning_accumulation"]
        torch.testing.assert_close(a["got"], (a["mean"] + b["mean"]) / 2 * (k / acc), rtol=1e-5, atol=1e-6)
        rec = a["record"]
        assert rec["dp_degree"] == 2 and rec["global_batch"] == 2 * ROWS * k
        rows.append((rec["tokens_seen"] - rec["global_batch"], acc, a["batch_idx"] + 1 - k, a["lr"]))
    assert sorted({acc for _, acc, _, _ in rows}) == [2, 4, 6, 8, 12]
    assert _check_rule([(t / 2, acc, s, lr) for t, acc, s, lr in rows]) >= 3
    # the LR: the constant run's (the bare scheduler, one step per starting batch of 2 x B0) x sqrt(A / A0)
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=0.05)
    bare = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1.0 + 0.1 * e))
    const_lr = []
    for _ in range(64):
        const_lr.append(opt.param_groups[0]["lr"])
        opt.step()
        bare.step()
    for before, acc, _, lr in rows:
        assert lr == pytest.approx(const_lr[int(before // (2 * B0))] * math.sqrt(acc / A0), rel=1e-9), before
    # one epoch on both ranks, checkpointed mid-schedule, then resumed on both: the rest of the full fit
    _spawn_fit(tmp_path / "first", marks, 1, save=True)
    first = torch.load(tmp_path / "first" / "rank0.pt", weights_only=False)
    assert 4 <= first[-1]["lightning_accumulation"] < 12
    _spawn_fit(tmp_path / "resumed", marks, 2, ckpt=str(tmp_path / "first" / "last.ckpt"))
    for r, full in enumerate((r0, r1)):
        again = torch.load(tmp_path / "resumed" / f"rank{r}.pt", weights_only=False)
        tail = full[len(first):]
        assert len(tail) >= 4 and {x["lightning_accumulation"] for x in tail} >= {6, 12}
        assert [x["record"] for x in again] == [x["record"] for x in tail]
        assert [x["lr"] for x in again] == pytest.approx([x["lr"] for x in tail], rel=1e-12)
        for x, y in zip(again, tail, strict=True):
            torch.testing.assert_close(x["got"], y["got"], rtol=1e-12, atol=0)


# ---------------------------------------------------------------------------- a ramp of odd accumulations
RAMP_ROWS, RAMP_BATCHES = 16, 1000  # one epoch of 1,000 loader batches of 16 samples


def _ramp() -> BatchSchedule:
    # DeepSeek-style: 48 -> 240 samples in steps of 32 over the first 3,000: accumulation 3, 5, 7, ..., 15
    return BatchSchedule.ramp(48, 240, step=32, over=(0, 3000), microbatch=RAMP_ROWS)


def _ramp_data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(RAMP_BATCHES * RAMP_ROWS, 4, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64) + torch.randn(len(x), generator=g,
                                                                                 dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, y)


def _ramp_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1, dtype=torch.float64)


def _ramp_loss(net, batch) -> torch.Tensor:
    x, y = batch
    return 0.5 * (net(x).squeeze(-1) - y).pow(2).mean()


def _ramp_optim(params):
    opt = torch.optim.Adam(params, lr=0.01)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1.0 + 0.05 * e))


class _RampModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _ramp_net()

    def training_step(self, batch, batch_idx):
        return _ramp_loss(self.net, batch)

    def configure_optimizers(self):
        opt, sched = _ramp_optim(self.parameters())
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class _ExactWindows(pl.Callback):
    """Per optimizer step: (samples before it, its microbatches, lr), and the largest difference between the
    optimizer's float64 gradient and the mean of the window's microbatch gradients by autograd."""

    def __init__(self, cbs: CBSCallback) -> None:
        self.cbs, self.window, self.rows, self.worst, self.units = cbs, [], [], 0.0, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.window.append([t.clone() for t in batch])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        params = list(pl_module.net.parameters())
        got = torch.cat([p.grad.flatten() for p in params])
        grads = [torch.cat([g.flatten() for g in torch.autograd.grad(_ramp_loss(pl_module.net, b), params)])
                 for b in self.window]
        # (an epoch's cut last window: each of its K losses divided by the window's length, rescale_short_window=False)
        want = torch.stack(grads).mean(0) * (len(self.window) / self.cbs.window_accumulation)
        self.worst = max(self.worst, float((got - want).abs().max() / got.abs().max()))
        self.rows.append((self.units, len(self.window), optimizer.param_groups[0]["lr"]))
        assert self.cbs.window_accumulation == len(self.window) or self.units + len(self.window) * RAMP_ROWS == \
            RAMP_BATCHES * RAMP_ROWS  # the window Lightning ran is the callback's (or the epoch's cut last one)
        self.units += len(self.window) * RAMP_ROWS
        self.window = []


def _plain_ramp() -> list[tuple[int, int, float]]:
    """The plain loop with the same schedule, data, optimizer and scheduler: (samples before, microbatches, lr)."""
    from cbs_tracker import CBSTracker

    net = _ramp_net()
    opt, sched = _ramp_optim(net.parameters())
    tracker = CBSTracker(net, opt, accumulation_steps=3, unit="samples", controller=_ramp(), lr_scheduler=sched)
    batches = iter(torch.utils.data.DataLoader(_ramp_data(), batch_size=RAMP_ROWS))
    rows, left = [], RAMP_BATCHES
    while left >= tracker.accumulation_steps:
        a = tracker.accumulation_steps
        for _ in range(a):
            with tracker.microbatch(size=RAMP_ROWS):
                (_ramp_loss(net, next(batches)) / a).backward()
        rows.append((int(tracker.tokens_seen), a, opt.param_groups[0]["lr"]))
        tracker.step()
        opt.step()
        sched.step()
        opt.zero_grad()
        left -= a
    return rows


def test_a_ramp_of_odd_accumulations_in_lightning_runs_every_stage_where_the_plain_loop_does():
    plain = _plain_ramp()
    cbs = CBSCallback(controller=_ramp(), unit="samples", prog_bar=False)
    check = _ExactWindows(cbs)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, max_epochs=1,
                         accumulate_grad_batches=3, callbacks=[cbs, check])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        trainer.fit(_RampModule(), torch.utils.data.DataLoader(_ramp_data(), batch_size=RAMP_ROWS))
    rows = check.rows
    stages = [3, 5, 7, 9, 11, 13, 15]
    assert sorted({a for _, a, _ in plain}) == stages
    first = {a: next(u for u, b, _ in rows if b == a) for a in stages if any(b == a for _, b, _ in rows)}
    plain_first = {a: next(u for u, b, _ in plain if b == a) for a in stages}
    assert sorted(first) == stages  # every stage runs
    for a in stages:  # each where the plain loop starts it, to within one window
        assert abs(first[a] - plain_first[a]) <= a * RAMP_ROWS, (a, first[a], plain_first[a])
    # the same windows as the plain loop, with its LR, up to the epoch's cut last window
    assert rows[:len(plain)] == [(u, a, pytest.approx(lr, rel=1e-12)) for u, a, lr in plain]
    assert len(rows) == len(plain) + 1 and rows[-1][1] < 15
    assert check.worst < 1e-12  # each window's gradient is the mean of its microbatches' (float64)
    unaligned = [(u // RAMP_ROWS, a) for u, a, _ in rows if (u // RAMP_ROWS) % a]
    assert len(unaligned) > 50  # windows Lightning's own counter could not have started there
