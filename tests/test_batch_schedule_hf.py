"""A ``BatchSchedule`` in the Hugging Face ``Trainer`` (``CBSTrainer(controller=schedule)``), 1 and 2 processes.

Truths: the schedule's marks with the ``Trainer``'s rule for where an accumulation may
change (it steps when ``(microbatch in epoch + 1) % A == 0``: a new ``A`` takes effect at
the first window boundary at or after the mark whose position in the epoch it divides),
the autograd mean of each window's microbatches, the constant-batch run's LR at the same
samples, and the uninterrupted run (a resume from a checkpoint mid-schedule).
"""

from __future__ import annotations

import math
import socket

import pytest
import torch

from cbs_tracker import BatchSchedule
from tests.hf_workers import Regression, ddp_worker, regression_data, training_args, window_checker
from tests.spawning import spawn
from tests.test_transformers import make

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning")]

ROWS, A0 = 2, 2
B0 = ROWS * A0
PER_EPOCH = 16  # microbatches of 32 samples
# accumulation 2 -> 4 -> 6 -> 8 over two epochs of 32 samples (where the Trainer's counter allows)
MARKS = ((0, 4), (8, 8), (20, 12), (40, 16))


def _check_rule(rows, marks, slot: int) -> int:
    """Each window is set to the schedule's accumulation at the units before it, or, where the Trainer's
    counter cannot take it yet (the position in the epoch is not a multiple of it), to the previous one;
    an epoch's last window may run short of its setting. ``rows``: the window checker's."""
    schedule, delayed, pos = BatchSchedule(marks), 0, 0
    for i, r in enumerate(rows):
        rec = r["record"]
        rec = rec if isinstance(rec, dict) else vars(rec)
        want = int(schedule.batch_at(rec["tokens_seen"] - rec["global_batch"]) // slot)
        if r["setting"] != want:
            assert i > 0 and r["setting"] == rows[i - 1]["setting"] and (pos % PER_EPOCH) % want, (i, want)
            delayed += 1
        assert r["microbatches"] == r["setting"] or (pos + r["microbatches"]) % PER_EPOCH == 0, i
        assert rec["global_batch"] == r["microbatches"] * slot
        pos += r["microbatches"]
    return delayed


def _run(tmp_path, name, controller, *, checker=False, coupling="auto", **kw):
    args = training_args(str(tmp_path / name), optim="adamw_torch", learning_rate=1e-2, lr_scheduler_type="linear",
                         warmup_steps=3, num_train_epochs=3, **kw)
    model = Regression(seed=0)
    ref: list = []
    callbacks = [window_checker(model, ref)] if checker else []
    trainer, rec = make(model, args, regression_data(32), unit="samples", controller=controller,
                        callbacks=callbacks, lr_coupling=coupling)
    ref.append(trainer)
    return trainer, rec, callbacks


def test_the_schedule_in_the_trainer_windows_gradients_lr_and_a_resume(tmp_path):
    const, c_rec, _ = _run(tmp_path, "const", None)
    const.train()
    lr_at = {r.tokens_seen - r.global_batch: r.lr for r in c_rec.rows}
    grow, rec, (check,) = _run(tmp_path, "grow", BatchSchedule(MARKS), checker=True, save_strategy="steps",
                               save_steps=1)
    grow.train()
    rows = rec.rows
    assert sorted({r["setting"] for r in check.rows}) == [2, 4, 6, 8]
    assert _check_rule(check.rows, MARKS, ROWS) >= 1  # 8, decided at 40 samples, waits for epoch 2
    for r in check.rows:  # the Trainer's gradient is the mean of the window's microbatches
        torch.testing.assert_close(r["got"], r["mean"], rtol=1e-5, atol=1e-6)
    for r, c in zip(rows, check.rows, strict=True):  # the constant run's LR at the same samples x sqrt(B / B0)
        before = r.tokens_seen - r.global_batch  # (the batch set: an epoch's short last window keeps the LR)
        assert r.lr == pytest.approx(lr_at[before // B0 * B0] * math.sqrt(c["setting"] / A0), rel=1e-12)
    assert rows[-1].tokens_seen == c_rec.rows[-1].tokens_seen == 96
    keep, k_rec, _ = _run(tmp_path, "keep", BatchSchedule(MARKS), coupling="keep")
    keep.train()
    assert [r.lr for r in k_rec.rows] == [lr_at[(r.tokens_seen - r.global_batch) // B0 * B0] for r in k_rec.rows]
    # resumed from a checkpoint mid-schedule (A = 6 in force, in epoch 0), the rest is the uninterrupted run
    at = next(r.step for r in rows if r.accumulation_steps == 6)
    part, part_rec, _ = _run(tmp_path, "part", BatchSchedule(MARKS))
    part.train(resume_from_checkpoint=str(tmp_path / "grow" / f"checkpoint-{at}"))
    assert part_rec.rows == rows[at:]
    for a, b in zip(part.model.parameters(), grow.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_schedule_on_two_gloo_processes_and_a_resume_there(tmp_path):
    # 64 samples: 32 per rank (16 microbatches), the global batch twice the single process's
    marks = tuple((2 * t, 2 * b) for t, b in MARKS)
    spawn(ddp_worker, args=(2, _free_port(), str(tmp_path), 64, marks, True),
                                nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    r0, r1 = ranks[0]["rows"], ranks[1]["rows"]
    assert ranks[0]["applied"] == ranks[1]["applied"] and len(ranks[0]["applied"]) >= 2
    assert _check_rule(r0, marks, 2 * ROWS) >= 1
    for a, b in zip(r0, r1):
        torch.testing.assert_close(a["params"], b["params"], rtol=0, atol=0)
        torch.testing.assert_close(a["got"], (a["mean"] + b["mean"]) / 2, rtol=1e-5, atol=1e-6)
        assert a["record"] == b["record"]
    assert sorted({r["setting"] for r in r0}) == [2, 4, 6, 8]
    # lr_coupling="keep": the LR is the constant run's linear decay (24 starting-batch steps of 8 samples)
    # at the same data, exactly
    for r in r0:
        rec = r["record"]
        position = int((rec["tokens_seen"] - rec["global_batch"]) // (2 * B0))
        assert rec["lr"] == pytest.approx(0.05 * (24 - position) / 24, rel=1e-12, abs=1e-15), position
    # resumed on both processes from a checkpoint mid-schedule (A = 6 in force): the rest of the run
    at = next(i + 1 for i, r in enumerate(r0) if r["setting"] == 6)
    ckpt = str(tmp_path / "run" / f"checkpoint-{at}")
    resumed = tmp_path / "resumed"
    spawn(ddp_worker, args=(2, _free_port(), str(resumed), 64, marks, False, ckpt),
                                nprocs=2, join=True)
    for r in range(2):
        tail = ranks[r]["rows"][at:]
        again = torch.load(resumed / f"rank{r}.pt", weights_only=False)["rows"]
        assert len(tail) >= 4 and {x["setting"] for x in tail} >= {6, 8}
        assert [x["record"] for x in again] == [x["record"] for x in tail]
        assert [x["setting"] for x in again] == [x["setting"] for x in tail]
        for x, y in zip(again, tail, strict=True):
            torch.testing.assert_close(x["params"], y["params"], rtol=0, atol=0)


@pytest.mark.parametrize("max_steps", [9, 11])
def test_max_steps_ends_at_the_same_samples_under_a_schedule(tmp_path, max_steps):
    # a budget of max_steps starting-batch steps: the last windows are cut to divisors of the schedule's
    # accumulation (aligned) so that the run ends at max_steps x B0 samples, as the constant run does
    trainer, rec, _ = _run(tmp_path, "cut", BatchSchedule(MARKS), max_steps=max_steps)
    trainer.train()
    assert rec.rows[-1].tokens_seen == max_steps * B0
    assert trainer.session.starting_batch_steps == max_steps
    assert max(r.accumulation_steps for r in rec.rows) >= 4
