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
        dist.barrier()  # both ranks done before the group goes away (gloo aborts otherwise)
    finally:
        dist.destroy_process_group()


def fsdp_schedule(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """FSDP2 on 2 ranks: a cosine scheduler handed to FSDPTracker while a plan grows the batch."""
    from cbs_tracker.integrations.fsdp import FSDPTracker
    from torch.distributed.fsdp import fully_shard

    from tests.dist_workers import make_model

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = make_model(torch.float64)
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=48, eta_min=0.01)
        tracker = FSDPTracker(model, opt, accumulation_steps=2, unit="samples",
                              controller=_controller({2: 4, 3: 8, 4: 16}), lr_scheduler=sched)
        g = torch.Generator().manual_seed(rank)
        rows = []
        while tracker.starting_batch_steps + tracker.accumulation_steps // 2 <= 48:
            acc = tracker.accumulation_steps
            for _ in range(acc):
                x = torch.randn(3, 6, generator=g, dtype=torch.float64)  # D_IN of make_model
                with tracker.microbatch(size=3):
                    (model(x).pow(2).mean() / acc).backward()
            position = tracker.starting_batch_steps
            tracker.step()
            rows.append([position, acc, float(opt.param_groups[0]["lr"])])
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        with open(os.path.join(out_dir, f"fsdp{rank}.json"), "w") as f:
            json.dump({"rows": rows, "last_epoch": sched.last_epoch, "position": tracker.starting_batch_steps}, f)
        dist.barrier()  # both ranks done before the group goes away (gloo aborts otherwise)
    finally:
        dist.destroy_process_group()
