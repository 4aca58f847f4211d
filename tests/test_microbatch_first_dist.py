"""Microbatch-first growth on two gloo ranks (DDP and FSDP2), against a single-process float64 reference.

Each rank reads its ``DistributedSampler`` shard through ``tracker.windows``; the
reference recomputes every window's gradient from the samples the ranks report
(the mean over ranks of the mean over each rank's microbatches of their own means),
the per-step estimate from those microbatch gradients, and the SGD trajectory.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cbs_tracker import CBSTracker
from cbs_tracker.core.estimator import estimate_from_norms
from tests.doubles import PlanController
from tests.spawning import spawn
from tests.test_microbatch_first import ROWS, Indexed

WORLD = 2
PLAN = {3: 4, 6: 8, 9: 16}  # loader batches per rank and window, decided at these steps
LEVELS = [2] * 3 + [4] * 3 + [8] * 3 + [16] * 2
N = WORLD * ROWS * (sum(LEVELS) + 3)  # and a last window cut short: 3 loader batches per rank
LR = 0.05


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 0.5 * (model(x).squeeze(-1) - y).pow(2).mean()


def _full(t: torch.Tensor) -> list[float]:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().flatten().tolist()


def _worker(rank: int, kind: str, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                           timeout=timedelta(seconds=60))
    try:
        data = Indexed(N)
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=WORLD, rank=rank, shuffle=True, seed=0)
        sampler.set_epoch(0)
        loader = torch.utils.data.DataLoader(data, batch_size=ROWS, sampler=sampler, num_workers=1)
        common = dict(accumulation_steps=2, unit="samples", controller=PlanController(PLAN), max_microbatch=4 * ROWS)
        if kind == "ddp":
            model = nn.parallel.DistributedDataParallel(_model())
            optimizer = torch.optim.SGD(model.parameters(), lr=LR)
            tracker = CBSTracker(model, optimizer, **common)
        else:
            from cbs_tracker.integrations.fsdp import FSDPTracker
            from torch.distributed.fsdp import fully_shard

            model = _model()
            fully_shard(model[0])
            fully_shard(model[2])
            fully_shard(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=LR)
            tracker = FSDPTracker(model, optimizer, **common)
        windows = []
        for window in tracker.windows(loader):
            for mb in window:
                with tracker.microbatch(size=len(mb["index"])):
                    (_loss(model, mb["x"], mb["y"]) / tracker.accumulation_steps).backward()
            r = tracker.step()
            windows.append(dict(indices=[mb["index"].tolist() for mb in window],
                                grad=[_full(p.grad) for p in model.parameters()],
                                trace_cov=r.step_trace_cov, grad_sq=r.step_grad_sq_norm,
                                accumulation=r.accumulation_steps, micro_batch=r.micro_batch,
                                lr=optimizer.param_groups[0]["lr"]))  # the LR carries the batch coupling
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        windows[-1]["weights"] = [_full(p) for p in model.parameters()]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(windows))
        dist.barrier()  # both ranks done before the group goes away (gloo aborts otherwise)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=["ddp", "fsdp2"])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[list[dict]]:
    tmp = tmp_path_factory.mktemp(f"mbfirst_{request.param}")
    spawn(_worker, args=(request.param, str(tmp / "pg"), str(tmp)), nprocs=WORLD, join=True)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_each_sample_once_per_epoch_in_the_same_layout_on_every_rank(ranks):
    used = [i for windows in ranks for w in windows for mb in w["indices"] for i in mb]
    assert sorted(used) == list(range(N))  # the sampler's shards, each sample once over both ranks
    layouts = [[(len(w["indices"]), len(w["indices"][0])) for w in windows] for windows in ranks]
    assert layouts[0] == layouts[1]
    # levels 2, 4, 8, 16 loader batches of 2 rows per rank, microbatches of at most 8 rows: with two ranks one
    # microbatch per rank is enough (K = 2 over the group)
    assert layouts[0] == [(1, 4)] * 3 + [(1, 8)] * 3 + [(2, 8)] * 3 + [(4, 8)] * 2 + [(1, 6)]
    assert [w["accumulation"] for w in ranks[0]][:-1] == LEVELS


def test_window_gradients_estimates_and_weights_equal_the_single_process_reference(ranks):
    data = Indexed(N)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step, windows in enumerate(zip(*ranks, strict=True)):
        micro = []  # every microbatch's own mean gradient, rank by rank
        for w in windows:
            for idx in w["indices"]:
                model.zero_grad(set_to_none=True)
                _loss(model, data.x[idx], data.y[idx]).backward()
                micro.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        g = torch.stack(micro)
        step_grad = g.mean(0)  # equal microbatches on equal ranks: the mean of the rank means
        for w in windows:  # the synced gradient every rank stepped on
            torch.testing.assert_close(torch.tensor([v for p in w["grad"] for v in p], dtype=torch.float64),
                                       step_grad, rtol=1e-10, atol=1e-12)
        b = float(len(windows[0]["indices"][0]))
        want = estimate_from_norms(float(g.pow(2).sum(1).mean()), float(step_grad.pow(2).sum()), b, len(micro) * b)
        assert windows[0]["grad_sq"] == pytest.approx(want.grad_sq_norm, rel=1e-8), step
        assert windows[0]["trace_cov"] == pytest.approx(want.trace_cov, rel=1e-8), step
        assert windows[0]["micro_batch"] == b
        offset = 0
        optimizer.param_groups[0]["lr"] = windows[0]["lr"]
        with torch.no_grad():
            for p in model.parameters():
                p.grad = step_grad[offset : offset + p.numel()].view_as(p).clone()
                offset += p.numel()
        optimizer.step()
    final = [torch.tensor(p, dtype=torch.float64) for p in ranks[0][-1]["weights"]]
    for got, want in zip(final, model.parameters(), strict=True):
        torch.testing.assert_close(got.flatten(), want.detach().flatten(), rtol=1e-10, atol=1e-12)


def _auto_worker(rank: int, init_file: str, out_dir: str) -> None:
    """``max_microbatch="auto"`` with a device whose free memory differs by rank (a fake probe)."""
    import cbs_tracker.core.loop as loop
    from tests.test_microbatch_first import _FakeMemory

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                           timeout=timedelta(seconds=60))
    try:
        # 0.85 * 1500 - base for activations at 40 bytes per row: rank 0 (base 100) fits 29 rows (16 as a power
        # of two of the loader's 2), rank 1 (base 700) 14 rows (8)
        memory = _FakeMemory(base=100 if rank == 0 else 700, per_row=40, total=1500)
        loop._cuda_memory_probe = lambda model, owner: memory
        data = Indexed(N)
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=WORLD, rank=rank, shuffle=False)
        loader = torch.utils.data.DataLoader(data, batch_size=ROWS, sampler=sampler)
        model = nn.parallel.DistributedDataParallel(_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        tracker = CBSTracker(model, optimizer, accumulation_steps=2, unit="samples",
                             controller=PlanController(PLAN), max_microbatch="auto")
        layouts = []
        for window in tracker.windows(loader):
            for mb in window:
                with tracker.microbatch(size=len(mb["index"])):
                    memory.rows = max(memory.rows, len(mb["index"]))
                    (_loss(model, mb["x"], mb["y"]) / tracker.accumulation_steps).backward()
            layouts.append((len(window), len(window[0]["index"])))
            tracker.step()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        out = dict(layouts=layouts, weights=[_full(p) for p in model.parameters()])
        Path(out_dir, f"auto{rank}.json").write_text(json.dumps(out))
        dist.barrier()  # both ranks done before the group goes away (gloo aborts otherwise)
    finally:
        dist.destroy_process_group()


def test_auto_takes_the_smallest_fit_of_all_ranks(tmp_path):
    spawn(_auto_worker, args=(str(tmp_path / "pg"), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [json.loads((tmp_path / f"auto{r}.json").read_text()) for r in range(WORLD)]
    assert ranks[0]["layouts"] == ranks[1]["layouts"], ranks[0]["layouts"]
    assert ranks[0]["weights"] == ranks[1]["weights"]  # the replicas stay identical
    # rank 1 fits 8 rows (4 loader batches), rank 0 would take 16 rows: both run the level-16 windows as 4
    # microbatches of 8 rows (the first window, before any measurement, at the loader's batch)
    assert ranks[0]["layouts"] == [[2, 2]] + [[1, 4]] * 2 + [[1, 8]] * 3 + [[2, 8]] * 3 + [[4, 8]] * 2 + [[1, 6]]
