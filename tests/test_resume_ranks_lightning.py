"""Lightning: a checkpoint of two ``ddp_spawn`` ranks resumed with ``Trainer(devices=1)``.

Truth: a single-process fit that never moved, with twice the accumulation and the
two ranks' data order (rank 0's batch 0, rank 1's batch 0, rank 0's batch 1, ...), so
that each of its windows holds the microbatches of one two-rank step.

- From a checkpoint at an epoch's end everything is comparable: each step's global
  batch, units seen, LR, Lightning's position in the epoch, the samples it ran, the
  controller's doublings (where and to what) and the noise scale.
- From a checkpoint in the middle of an epoch Lightning restarts a DataLoader that is
  not resumable at the epoch's first batch (at any number of ranks), so the rest of that
  epoch runs other samples than the reference: the global batch, LR and position of
  every step, a schedule's decisions (by units seen) and the next epoch's samples are
  compared; the samples run twice and not at all in the interrupted epoch are counted
  from what really ran and checked against the warning's counts.
"""

from __future__ import annotations

import collections
import json
import re
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from cbs_tracker import BatchSchedule, CBSCallback
from tests.lightning_workers import (
    InterleavedBatches,
    LambdaRegression,
    RankSlice,
    Regression,
    SampleLog,
    regression_data,
)
from tests.test_lightning import (
    fast_estimator,
    pytestmark,  # noqa: F401  (Lightning's own warnings filtered alike)
    small_controller,
)

N, ROWS, A0 = 256, 4, 2  # an epoch of 256 samples in loader batches of 4; 2 per window and rank


class InterleavedOrder(torch.utils.data.Sampler[int]):
    """The samples of :class:`InterleavedBatches` one by one (so the loader has a ``batch_size``)."""

    def __init__(self, n: int, batch_size: int, ranks: int) -> None:
        self.order = [i for batch in InterleavedBatches(n, batch_size, ranks) for i in batch]

    def __iter__(self):
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)


def _trainer(devices: int, epochs: int, callbacks: list, accumulation: int, **kw) -> pl.Trainer:
    return pl.Trainer(**kw,
        accelerator="cpu", devices=devices, strategy="ddp_spawn" if devices > 1 else "auto", logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), enable_progress_bar=False,
        enable_model_summary=False, max_epochs=epochs, accumulate_grad_batches=accumulation,
        use_distributed_sampler=False, callbacks=callbacks,
    )


def _fit(out, make_cbs, make_module, *, devices: int, epochs: int, accumulation: int, checkpoint=None,
         ckpt_path: str | None = None, n: int = N, **kw) -> tuple[dict, list]:
    """A fit writing ``out/rank{r}.json`` (a :class:`SampleLog`); returns rank 0's log and the warnings.

    Several devices: rank ``r`` of ``R`` runs samples ``r, r + R, ...``; one: the two ranks' batches in turn."""
    out.mkdir(parents=True, exist_ok=True)
    data = regression_data(n)
    cbs = make_cbs()
    callbacks = [cbs, SampleLog(cbs, data, str(out))] + ([checkpoint] if checkpoint is not None else [])
    sampler = RankSlice(n, devices) if devices > 1 else InterleavedOrder(n, ROWS, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(devices, epochs, callbacks, accumulation, **kw).fit(
            make_module(), torch.utils.data.DataLoader(data, batch_size=ROWS, sampler=sampler), ckpt_path=ckpt_path)
    log = json.loads((out / "rank0.json").read_text())
    return log, [str(w.message) for w in caught] + log["warnings"]  # (the log's: those from the fit's setup on)


def _steps(log: dict) -> list[tuple]:
    """Per step what does not depend on the data a step ran: its global batch and units, LR, position."""
    return [(r["record"]["step"], r["record"]["global_batch"], r["record"]["tokens_seen"], r["lr"], r["epoch"],
             r["batch_idx"], r["lightning_accumulation"]) for r in log["rows"]]


def test_lightning_two_ranks_resumed_on_one_from_an_epoch_end_equal_the_run_that_never_moved(tmp_path):
    def make_cbs():
        # a controller that keeps doubling; one doubling before the checkpoint, one after
        return CBSCallback(controller=small_controller(kappa=4.0, feedback_guard=False), estimator=fast_estimator())

    reference, _ = _fit(tmp_path / "reference", make_cbs, lambda: Regression(lr=0.05), devices=1, epochs=3,
                        accumulation=2 * A0)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), filename="{epoch}", every_n_epochs=1, save_top_k=-1,
                           save_on_train_epoch_end=True)
    first, _ = _fit(tmp_path / "first", make_cbs, lambda: Regression(lr=0.05), devices=2, epochs=1,
                    accumulation=A0, checkpoint=ckpt)
    state = torch.load(tmp_path / "ckpt" / "epoch=0.ckpt", weights_only=False)["callbacks"]["CBSCallback"]
    assert state["dp_degree"] == 2 and state["accumulation_steps"] == 2 * A0  # grown on two ranks
    # the same command line (accumulate_grad_batches=2) on one device
    resumed, _ = _fit(tmp_path / "resumed", make_cbs, lambda: Regression(lr=0.05), devices=1, epochs=3,
                      accumulation=A0, ckpt_path=str(tmp_path / "ckpt" / "epoch=0.ckpt"))

    done = len(first["rows"])
    assert first["world_size"] == 2 and [r["record"]["global_batch"] for r in first["rows"]] == [
        r["record"]["global_batch"] for r in reference["rows"][:done]]
    tail = reference["rows"][done:]
    assert len(resumed["rows"]) == len(tail) >= 10
    assert _steps(resumed) == _steps({"rows": tail})
    assert [r["samples"] for r in resumed["rows"]] == [r["samples"] for r in tail]
    assert {r["record"]["dp_degree"] for r in resumed["rows"]} == {1}
    # the controller's decisions: a doubling after the resume, at the same step and batch, to the same value
    later = [c for c in reference["applied"] if c[0] > done]
    assert later and resumed["applied"] == later
    assert any(c[0] <= done for c in reference["applied"])  # and one before, carried in the checkpoint
    measured = 0
    for a, b in zip(resumed["rows"], tail, strict=True):
        na, nb = a["record"]["noise_scale"], b["record"]["noise_scale"]
        assert (na is None) == (nb is None)
        if nb is not None:
            # two ranks' gradients were averaged by DDP, the reference summed them in one process
            assert na == pytest.approx(nb, rel=1e-4)
            measured += 1
    assert measured >= 10
    assert resumed["global_step"] == reference["global_step"]


# a global batch of 16 samples (2 per rank on 2 ranks), 32 from 64 samples, 64 from 384 (in epoch 1)
MARKS = ((0, 16), (64, 32), (384, 64))


def test_lightning_two_ranks_resumed_on_one_in_the_middle_of_an_epoch(tmp_path):
    def make_cbs():
        return CBSCallback(controller=BatchSchedule(MARKS), unit="samples")

    def make_module():
        return LambdaRegression(lr=0.05, optimizer="adam")  # a step scheduler, retimed; the LR coupled by sqrt

    reference, _ = _fit(tmp_path / "reference", make_cbs, make_module, devices=1, epochs=2, accumulation=2 * A0)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), filename="{step}", every_n_train_steps=7, save_top_k=-1)
    first, _ = _fit(tmp_path / "first", make_cbs, make_module, devices=2, epochs=1, accumulation=A0, checkpoint=ckpt)
    resumed, caught = _fit(tmp_path / "resumed", make_cbs, make_module, devices=1, epochs=2, accumulation=A0,
                           ckpt_path=str(tmp_path / "ckpt" / "step=7.ckpt"))

    # the checkpoint: 7 steps (4 of 16 samples, 3 of 32) into epoch 0, 20 loader batches per rank
    assert [r["record"]["global_batch"] for r in first["rows"][:7]] == [16] * 4 + [32] * 3
    tail = reference["rows"][7:]
    assert _steps(resumed) == _steps({"rows": tail})
    assert {r["lightning_accumulation"] for r in resumed["rows"]} == {8, 16}  # the schedule's doubling, after
    assert resumed["applied"] == [c for c in reference["applied"] if c[0] > 7]
    assert resumed["global_step"] == reference["global_step"]
    # the next epoch runs the reference's samples, in its order
    assert [r["samples"] for r in resumed["rows"] if r["epoch"] == 1] == [
        r["samples"] for r in tail if r["epoch"] == 1]
    # the interrupted epoch: what ran before the checkpoint (both ranks) and after it
    other = json.loads((tmp_path / "first" / "rank1.json").read_text())
    before = [i for log in (first, other) for r in log["rows"][:7] for i in r["samples"]]
    after = [i for e, i in resumed["samples"] if e == 0]
    assert len(before) + len(after) == N  # as many samples as an epoch holds
    count = collections.Counter(before + after)
    repeated = sum(1 for c in count.values() if c == 2)
    skipped = N - len(count)
    assert repeated > 0 and skipped > 0
    assert after == list(InterleavedOrder(N, ROWS, 2))[:N - len(before)]  # the epoch's first samples
    (message,) = [m for m in caught if "Lightning restarts it" in m]
    # Trainer(max_steps=...): the data of that many steps of the starting batch (16 samples), the same steps
    budget = N * 2 // 16 - 4  # four starting batches short of two epochs: inside the schedule's last batch
    cut, _ = _fit(tmp_path / "cut", make_cbs, make_module, devices=1, epochs=2, accumulation=2 * A0, max_steps=budget)
    cut_resumed, _ = _fit(tmp_path / "cut_resumed", make_cbs, make_module, devices=1, epochs=2, accumulation=A0,
                          max_steps=budget, ckpt_path=str(tmp_path / "ckpt" / "step=7.ckpt"))
    assert cut["rows"][-1]["record"]["tokens_seen"] == budget * 16 and cut["global_step"] < budget
    assert _steps(cut_resumed) == _steps({"rows": cut["rows"][7:]})
    got = re.search(r"(\d+) batches run a second time and (\d+) are not run in this epoch \((\d+) and (\d+) samples\)",
                    message)
    assert got is not None, message
    assert [int(x) for x in got.groups()] == [repeated // ROWS, skipped // ROWS, repeated, skipped]


def test_lightning_two_ranks_resumed_on_three_in_the_middle_of_an_epoch_count_what_runs_again(tmp_path):
    # 192 samples: 48 loader batches, 24 per rank on two, 16 on three; 2 per rank and window (no controller),
    # a global batch of 4 loader batches that three ranks run as 3
    n = 192
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), filename="{step}", every_n_train_steps=5, save_top_k=-1)
    first, _ = _fit(tmp_path / "first", lambda: CBSCallback(controller=None), Regression, devices=2, epochs=1,
                    accumulation=A0, checkpoint=ckpt, n=n)
    _fit(tmp_path / "three", lambda: CBSCallback(controller=None), Regression, devices=3, epochs=1,
         accumulation=A0, n=n, ckpt_path=str(tmp_path / "ckpt" / "step=5.ckpt"))
    logs = [json.loads((tmp_path / "three" / f"rank{r}.json").read_text()) for r in range(3)]
    other = json.loads((tmp_path / "first" / "rank1.json").read_text())
    before = [i for log in (first, other) for r in log["rows"][:5] for i in r["samples"]]
    after = [i for log in logs for _, i in log["samples"]]
    # Lightning's counter: the 20 global batches run, over three ranks in windows of 1, rounded down
    position = len(before) // ROWS // 3
    assert [r["batch_idx"] for r in logs[0]["rows"]] == list(range(position, n // ROWS // 3))
    assert {r["record"]["global_batch"] for log in logs for r in log["rows"]} == {3 * ROWS}
    count = collections.Counter(before + after)
    repeated, skipped = sum(c - 1 for c in count.values()), n - len(count)
    assert repeated > 0 and skipped > 0
    warned = [m for m in logs[0]["warnings"] if "Lightning restarts it" in m]
    assert len(warned) == 1, logs[0]["warnings"]
    got = re.search(r"(\d+) batches run a second time and (\d+) are not run in this epoch \((\d+) and (\d+) samples\)",
                    warned[0])
    assert got is not None, warned[0]
    assert [int(x) for x in got.groups()] == [repeated // ROWS, skipped // ROWS, repeated, skipped]
    assert f"so the counter goes on at {position * 3}, {len(before) // ROWS - position * 3} batches more" in warned[0]
