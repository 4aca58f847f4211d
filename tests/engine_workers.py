"""Spawned workers of tests/test_misuse.py (module-level so ``torch.multiprocessing.spawn`` can import them)."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch import nn

from cbs_tracker import CBSTracker


def _controller(plan: dict[int, int]):
    from tests.lightning_workers import PlanController

    return PlanController(plan)


def loop_ignores_accumulation(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """DDP; the tracker grows to 8 after step 2 but the loop keeps running 2 microbatches a window."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tracker = CBSTracker(model, opt, accumulation_steps=2, unit="samples", controller=_controller({2: 8}),
                             lr_coupling="keep")
        g = torch.Generator().manual_seed(rank)
        error = None
        steps = 0
        for _ in range(4):
            for _ in range(2):  # the bug: a fixed count instead of tracker.accumulation_steps
                x = torch.randn(3, 4, generator=g)
                with tracker.microbatch(size=3):
                    (model(x).pow(2).mean() / 2).backward()
            try:
                tracker.step()
            except RuntimeError as err:
                error = str(err)
                break
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps += 1
        params = [p.detach().flatten().tolist() for p in model.parameters()]
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"error": error, "steps": steps, "params": params}, f)
    finally:
        dist.destroy_process_group()
