"""A ``BatchSchedule`` in a Lightning ``Trainer`` (``CBSCallback(controller=schedule)``).

Truths: the schedule's marks with Lightning's own rule for where an accumulation may
change (it steps when ``(batch_idx + 1) % A == 0``, so a new ``A`` takes effect at the
first window boundary at or after the mark whose position in the epoch it divides), the
autograd mean of each window's microbatches, the same Trainer without the callback (its
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

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._new:
            self.start, self._new = batch_idx, False

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._new = True
        acc = int(trainer.accumulate_grad_batches)
        self.rows.append((self.units, acc, self.start, optimizer.param_groups[0]["lr"]))
        self.units += acc * ROWS if self.start + acc <= PER_EPOCH else (PER_EPOCH - self.start) * ROWS


def _fit(epochs: int, *, tracked: bool = True, ckpt: str | None = None, save: str | None = None,
         coupling: str = "auto"):
    rows = _Rows()
    cbs = CBSCallback(controller=BatchSchedule(MARKS), unit="samples", lr_coupling=coupling) if tracked else None
    check = GradCheck(cbs) if tracked else None
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
    """Every window runs the schedule's accumulation at the units before it, unless Lightning's counter
    cannot take it there yet (the position in the epoch is not a multiple of it): then the previous one."""
    schedule = BatchSchedule(MARKS)
    delayed = 0
    for i, (before, acc, start, _) in enumerate(rows):
        want = int(schedule.batch_at(before) // ROWS)
        if acc != want:
            assert i > 0 and acc == rows[i - 1][1] and start % want != 0, (before, acc, start, want)
            delayed += 1
    return delayed


def test_the_schedule_in_lightning_windows_gradients_and_lr_per_token():
    const, _, _, _ = _fit(2, tracked=False)
    const_lr = [lr for _, _, _, lr in const]
    rows, cbs, check, _ = _fit(2)
    # 8 never runs: decided at 76 samples (position 6 of epoch 1), it waits for a position 8 divides, and
    # the schedule's 12 comes first (position 24)
    assert sorted({a for _, a, _, _ in rows}) == [2, 4, 6, 12]
    delayed = _check_rule(rows)
    assert delayed >= 3
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
    assert sorted({acc for _, acc, _, _ in rows}) == [2, 4, 6, 12]
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
