"""Spawned ranks of the replica check: a nanoGPT-style loop that toggles DDP's sync flag itself.

Kept in a module of its own so that ``torch.multiprocessing.spawn`` children can import
the worker by name.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from cbs_tracker import BatchSchedule, CBSTracker
from tests.dist_workers import init_process_group

ROWS = 4  # samples per microbatch and rank
USER_ACCUMULATION = 2  # the loop's own count, as nanoGPT's gradient_accumulation_steps


def _batch(step: int, index: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * index + rank)
    x = torch.randn(ROWS, 6, generator=g)
    return x, x.sum(1, keepdim=True) + 0.3 * torch.randn(ROWS, 1, generator=g)


def toggle_worker(rank: int, world: int, init_file: str, out_dir: str, toggle: bool, same_data: bool = False) -> None:
    """Train with a schedule that doubles the accumulation at step 3; ``toggle``: the loop sets
    ``require_backward_grad_sync`` from its own accumulation count (as nanoGPT does);
    ``same_data``: every rank reads rank 0's microbatches."""
    init_process_group(rank, world, init_file)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(6, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    b0 = USER_ACCUMULATION * ROWS * world
    schedule = BatchSchedule([(0, b0), (3 * b0, 2 * b0)])
    tracker = CBSTracker(model, opt, accumulation_steps=USER_ACCUMULATION, unit="samples", controller=schedule)
    out: dict[str, Any] = {"steps": 0, "error": None, "accumulation": []}
    for step in range(6):
        a = tracker.accumulation_steps
        for micro in range(a):
            if toggle:
                model.require_backward_grad_sync = micro == USER_ACCUMULATION - 1
            x, y = _batch(step, micro, 0 if same_data else rank)
            with tracker.microbatch(size=ROWS):
                (0.5 * (model(x) - y).pow(2).mean() / a).backward()
        try:
            tracker.step()
        except RuntimeError as exc:
            out["error"] = str(exc)
            break
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["steps"] += 1
        out["accumulation"].append(a)
    out["params"] = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.save(out, os.path.join(out_dir, f"toggle{int(toggle)}.rank{rank}.pt"))
    torch.distributed.barrier()
    # Leave without tearing gloo down: after a window whose last microbatch skipped DDP's sync, the
    # teardown at exit aborted now and then ("terminate called without an active exception").
    os._exit(0)
