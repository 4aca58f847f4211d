"""A plain training loop whose noise scale rises as it trains, for end-to-end and resume tests.

Module-level functions so that spawned ranks and subprocesses can import them
(``python -m tests.plain_workers ...``).

The problem: linear regression ``y = w*.x + eps`` trained by SGD from far away.
``B_simple = (d(|delta|^2 + sigma^2) + |delta|^2) / |delta|^2`` grows as ``|delta|``
shrinks, so the controller has a reason to grow the batch.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
from torch import nn

from cbs_tracker import BatchSizeController, CBSTracker

D, SIGMA, MICRO = 8, 1.0, 4


def make_controller() -> BatchSizeController:
    # kappa=1 so that a few hundred steps see several doublings (the default is tested in test_controller)
    return BatchSizeController(
        kappa=1.0, warmup_steps=20, warmup_tokens=0, cooldown_tokens=64, patience=4, window=8, max_batch=256,
        hold_on_plateau=None,  # doublings from the first steps (the hold is tested in test_plateau*)
    )


def make_model() -> nn.Linear:
    torch.manual_seed(0)
    model = nn.Linear(D, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(_w_star()[None] + 2.0)
    return model


def _w_star() -> torch.Tensor:
    return torch.linspace(-1, 1, D)


def microbatch(step: int, index: int, rank: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of microbatch ``index`` of optimizer step ``step`` on ``rank``: pure in its arguments."""
    g = torch.Generator().manual_seed(((seed * 100_003 + step) * 1009 + index) * 17 + rank)
    x = torch.randn(MICRO, D, generator=g)
    y = x @ _w_star() + SIGMA * torch.randn(MICRO, generator=g)
    return x, y


class CountingLinear(nn.Module):
    """Counts forward calls, independently of the tracker."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.calls = 0
        self.samples = 0

    def forward(self, x):
        self.calls += 1
        self.samples += x.shape[0]
        return self.inner(x)


def run_window(model: nn.Module, tracker: CBSTracker, step: int, rank: int) -> None:
    """One window: ``tracker.accumulation_steps`` microbatches of step ``step``, each loss over the window."""
    for i in range(tracker.accumulation_steps):
        x, y = microbatch(step, i, rank)
        with tracker.microbatch(size=x.shape[0]):
            loss = 0.5 * (model(x).squeeze(-1) - y).pow(2).mean()
            (loss / tracker.accumulation_steps).backward()


def train(
    steps: int,
    *,
    rank: int = 0,
    world: int = 1,
    ckpt_in: str | None = None,
    ckpt_out: str | None = None,
    save_at: int | None = None,
) -> list[dict]:
    """Run ``steps`` optimizer steps (continuing from ``ckpt_in``); return one dict per step."""
    counting = CountingLinear(make_model())
    model: nn.Module = counting
    if world > 1:
        model = nn.parallel.DistributedDataParallel(counting)
    optimizer = torch.optim.SGD(counting.parameters(), lr=0.05)
    # decisions on the median rule: these tests are mechanics
    from tests.estimators import NoIntervalEstimator

    tracker = CBSTracker(model, optimizer, accumulation_steps=2, unit="samples", controller=make_controller(),
                         estimator=NoIntervalEstimator(horizon_steps=100))  # the earlier fixed memory
    start = 0
    if ckpt_in is not None:
        state = torch.load(ckpt_in, weights_only=False)
        counting.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        tracker.load_state_dict(state["tracker"])
        start = state["step"]
    log = []
    for step in range(start, steps):
        counting.calls = counting.samples = 0
        run_window(model, tracker, step, rank)
        record = tracker.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log.append(
            {
                "step": record.step,
                "accumulation_steps": record.accumulation_steps,
                "next_accumulation_steps": record.next_accumulation_steps,
                "forward_calls": counting.calls,
                "samples_fed": counting.samples,
                "global_batch": record.global_batch,
                "noise_scale": record.noise_scale,
                "tokens_seen": record.tokens_seen,
            }
        )
        if save_at is not None and step + 1 == save_at and ckpt_out is not None:
            torch.save(
                {"model": counting.state_dict(), "optimizer": optimizer.state_dict(),
                 "tracker": tracker.state_dict(), "step": step + 1},
                ckpt_out,
            )
    return log


def run_to_budget(controller: BatchSizeController | None, budget: dict, *, rank: int = 0, world: int = 1,
                  state: dict | None = None, save_at: int | None = None) -> dict:
    """The loop that stops on ``tracker.done(**budget)`` (checked before each window, as the README's
    loops do); from ``state`` (a dict this returns) when given, and returning one at ``save_at`` optimizer
    steps. Returns the units seen, each step's accumulation, the controller's ``total_tokens`` at the end."""
    model: nn.Module = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    tracker = CBSTracker(model, optimizer, accumulation_steps=2, unit="samples", controller=controller)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        tracker.load_state_dict(state["tracker"])
    accumulations = []
    while not tracker.done(**budget):
        run_window(model, tracker, tracker.steps, rank)
        record = tracker.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        accumulations.append(record.accumulation_steps)
        if save_at is not None and tracker.steps == save_at:
            return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "tracker": tracker.state_dict(), "accumulations": accumulations}
    return {"units": tracker.tokens_seen, "accumulations": accumulations,
            "total_tokens": getattr(controller, "total_tokens", None)}


def run_length_worker(rank: int, world: int, init_file: str, out_dir: str, budget: dict, grow: bool) -> None:
    """:func:`run_to_budget` on ``world`` gloo ranks (``grow``: with ``BatchSizeController(efficiency_budget=0.08)``,
    else at the constant batch); rank 0 writes ``out.json``."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        controller = BatchSizeController(efficiency_budget=0.08) if grow else None
        out = run_to_budget(controller, budget, rank=rank, world=world)
        if rank == 0:
            with open(os.path.join(out_dir, "out.json"), "w") as f:
                json.dump(out, f)
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def ddp_worker(rank: int, world: int, init_file: str, out_dir: str, steps: int) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        log = train(steps, rank=rank, world=world)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(log, f)
        torch.distributed.barrier()  # both ranks done before the group goes away (gloo aborts otherwise)
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    # python -m tests.plain_workers STEPS OUT.json [CKPT_IN]
    n, out = int(sys.argv[1]), sys.argv[2]
    ckpt = sys.argv[3] if len(sys.argv) > 3 else None
    torch.set_num_threads(1)
    with open(out, "w") as f:
        json.dump(train(n, ckpt_in=ckpt), f)
