"""The Hugging Face ``Trainer``: a ``CBSTrainer`` checkpoint of two gloo processes resumed on one.

Truth: a single-process run that never moved, with twice the accumulation. accelerate
shards the Trainer's batches over the processes in turn (rank ``p`` runs the epoch's
batches ``p, p + D, ...``), so each of its windows holds the microbatches of one
two-process step, and a position of ``m`` batches per process on two processes is ``2m``
here: the resumed run's every step (record, LR, samples, weights, the schedule's
decisions) is the reference's. The same command line (``gradient_accumulation_steps=1``,
a global batch of 2 microbatches on two processes, 2 per process here) is accepted; a
changed one is refused with the reason.
"""

from __future__ import annotations

import collections
import math
import re
import socket

import pytest
import torch

from tests.hf_workers import resize_worker, resized_run
from tests.spawning import spawn

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning")]

N = 64  # samples; microbatches of 2: 32 per epoch in all, 16 per process on two
# global batches in samples: 4 (1 microbatch per process on two), 8 from 16 samples, 12 from 40, 16 from 80
MARKS = ((0, 4), (16, 8), (40, 12), (80, 16))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _same_step(a: dict, b: dict) -> None:
    ra, rb = a["record"], b["record"]
    for key, value in rb.items():
        if isinstance(value, float) and key not in ("tokens_seen", "global_batch", "lr", "scheduled_lr",
                                                    "lr_coupling", "micro_batch"):
            # the estimates: two processes' gradients were averaged by DDP, summed here in one
            assert ra[key] == pytest.approx(value, rel=1e-4, abs=1e-9), key
        else:
            assert ra[key] == value, key
    assert a["setting"] == b["setting"] and a["microbatches"] == b["microbatches"]
    torch.testing.assert_close(a["first_x"], b["first_x"], rtol=0, atol=0)  # the same samples
    torch.testing.assert_close(a["params"], b["params"], rtol=1e-5, atol=1e-6)


# "random": accelerate's sampler draws each epoch's order from the arguments and the epoch number alone, the
# same permutation at any number of processes, then dealt to them batch by batch
@pytest.mark.parametrize("sampling", ["sequential", "random"])
def test_cbs_trainer_two_processes_resumed_on_one_equal_the_run_that_never_moved(tmp_path, sampling):
    reference = resized_run(str(tmp_path / "reference"), N, MARKS, 2, train_sampling_strategy=sampling)
    spawn(resize_worker, args=(2, _free_port(), str(tmp_path / "two"), N, MARKS, 1, True, None, sampling), nprocs=2,
          join=True)
    two = torch.load(tmp_path / "two" / "rank0.pt", weights_only=False)
    assert [r["record"]["global_batch"] for r in two["rows"]] == [
        r["record"]["global_batch"] for r in reference["rows"]]
    # a checkpoint in the middle of epoch 0, at 2 microbatches per process, before the schedule's 3
    at = [i + 1 for i, r in enumerate(two["rows"]) if r["setting"] == 2][1]
    before = two["rows"][at - 1]["record"]
    assert 0 < before["tokens_seen"] < N and before["dp_degree"] == 2
    resumed = resized_run(str(tmp_path / "resumed"), N, MARKS, 1, save=True, train_sampling_strategy=sampling,
                          resume=str(tmp_path / "two" / "run" / f"checkpoint-{at}"))
    tail = reference["rows"][at:]
    assert len(resumed["rows"]) == len(tail) >= 8
    assert {r["setting"] for r in tail} >= {4, 6, 8}
    for a, b in zip(resumed["rows"], tail, strict=True):
        _same_step(a, b)
    assert resumed["applied"] == [c for c in reference["applied"] if c[0] > at]
    # the linear decay over 3 epochs of steps of the starting global batch (4 samples), as the reference's
    # (sized from gradient_accumulation_steps=1 on 32 microbatches here it would be twice as long), x B / B0
    # (SGD), B the batch set (an epoch's short last window keeps the LR)
    total = 3 * N // 4
    assert resumed["max_steps"] == reference["max_steps"] == total
    for r in resumed["rows"]:
        rec = r["record"]
        position = int((rec["tokens_seen"] - rec["global_batch"]) // 4)
        coupled = 0.05 * (total - position) / total * r["setting"] / 2
        assert rec["lr"] == pytest.approx(coupled, rel=1e-12, abs=1e-15), position
    # one microbatch per process on two is two here: the noise scale is measured, nothing warns of one
    assert not [w for w in resumed["warnings"] if "single microbatch" in w]
    assert math.isfinite(resumed["rows"][-1]["record"]["noise_scale"])

    # a checkpoint of the moved run (its session starts at 2 per process) resumed on one process again with
    # the same command line: the rest of the moved run
    later = at + 4
    again = resized_run(str(tmp_path / "again"), N, MARKS, 1, train_sampling_strategy=sampling,
                        resume=str(tmp_path / "resumed" / "run" / f"checkpoint-{later}"))
    assert [r["record"] for r in again["rows"]] == [r["record"] for r in resumed["rows"][later - at:]]

    # gradient_accumulation_steps changed on the command line: refused, naming the conversion
    with pytest.raises(ValueError, match=r"started at gradient_accumulation_steps=1 \(on 2 processes; here on 1"):
        resized_run(str(tmp_path / "changed"), N, MARKS, 2, resume=str(tmp_path / "two" / "run" / f"checkpoint-{at}"))


def test_cbs_trainer_two_processes_resumed_on_three_count_the_batches_run_again(tmp_path):
    # 48 samples: 24 microbatches, 12 per process on two, 8 on three; 2 per process and window (no controller):
    # a global batch of 4 microbatches, which three processes run as 3 (the session warns of it)
    n = 48
    spawn(resize_worker, args=(2, _free_port(), str(tmp_path / "two"), n, None, 2, True), nprocs=2, join=True)
    two = [torch.load(tmp_path / "two" / f"rank{r}.pt", weights_only=False) for r in range(2)]
    ckpt = str(tmp_path / "two" / "run" / "checkpoint-2")  # 4 microbatches per process run: 8 of the epoch
    spawn(resize_worker, args=(3, _free_port(), str(tmp_path / "three"), n, None, 2, False, ckpt), nprocs=3,
          join=True)
    three = [torch.load(tmp_path / "three" / f"rank{r}.pt", weights_only=False) for r in range(3)]
    assert {r["record"]["accumulation_steps"] for log in three for r in log["rows"]} == {1}
    # the LR follows the batch that runs: x 3/4 (SGD: linear) of the schedule's, from the first step on
    for r in three[0]["rows"]:
        rec = r["record"]
        assert rec["global_batch"] == 3 * 2  # one microbatch of 2 samples on each of three processes
        assert rec["lr"] == pytest.approx(rec["scheduled_lr"] * 3 / 4, rel=1e-12), rec["step"]

    def names(rows):
        return [tuple(x.tolist()) for r in rows for x in r["xs"]]

    before = [s for log in two for s in names(log["rows"][:2])]
    after = [s for log in three for s in names([r for r in log["rows"] if r["epoch"] == 0])]
    count = collections.Counter(before + after)
    assert len(count) == n  # no sample of the epoch skipped
    again = sum(c - 1 for c in count.values())
    assert again > 0
    (message,) = [w for w in three[0]["warnings"] if "run a second time" in w]
    got = re.search(r"(\d+) batches \((\d+) samples, 2 per batch\) run a second time", message)
    assert got is not None, message
    assert [int(x) for x in got.groups()] == [again // 2, again]
    # the rest of the interrupted epoch runs to its end (the Trainer fetches a window of at least one
    # microbatch per step of its count, the batch that runs being below the starting one), and the next
    # epoch is whole: every sample once
    position = len(before) // 2 // 3  # the global microbatches run before, over three processes, rounded down
    assert sum(r["microbatches"] for r in three[0]["rows"] if r["epoch"] == 0) == n // 2 // 3 - position
    seen = collections.Counter(s for log in three for s in names([r for r in log["rows"] if r["epoch"] == 1]))
    assert len(seen) == n and set(seen.values()) == {1}
