"""Workers for resuming a plain-loop / DDP / FSDP2 run on another number of data-parallel ranks.

The data is a pure function of ``(step, g)`` where ``g`` is the microbatch's index in the
*global* batch (rank-major: rank ``r``'s ``j``-th microbatch is ``g = r * A + j``), so a
step of ``K`` microbatches holds the same samples however they are split over ranks. The
truth is one process running all ``K`` microbatches of every step (``reference``): a run
checkpointed on 2 ranks and resumed on ``D'`` must give its global batch, its learning
rate and its decisions at every step, its noise scale and its weights (float64, to rounding).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cbs_tracker import CBSTracker
from tests.dist_workers import (
    FIXED_ROWS,
    LR,
    init_process_group,
    make_controller,
    make_estimator,
    make_model,
    make_schedule,
    make_scheduler,
    microbatch_data,
)

START_ACCUMULATION = 2  # per rank, on the 2 ranks the run starts with (K0 = 4 microbatches)
START_RANKS = 2


def record(rec: Any, tracker: CBSTracker) -> dict[str, Any]:
    return {
        "step": rec.step, "global_batch": rec.global_batch, "dp_degree": rec.dp_degree,
        "microbatches": rec.accumulation_steps * rec.dp_degree,
        "next_microbatches": rec.next_accumulation_steps * rec.dp_degree,
        "lr": rec.lr, "scheduled_lr": rec.scheduled_lr, "lr_coupling": rec.lr_coupling,
        "noise_scale": rec.noise_scale, "grad_sq_norm": rec.grad_sq_norm, "trace_cov": rec.trace_cov,
        "tokens_seen": rec.tokens_seen, "starting_batch_steps": tracker.starting_batch_steps,
    }


def build(model: nn.Module, accumulation: int, *, momentum: float = 0.0, tracker_type: type = CBSTracker,
          schedule: bool = False) -> tuple[CBSTracker, torch.optim.Optimizer, Any]:
    params = model.module.parameters() if isinstance(model, nn.parallel.DistributedDataParallel) else model.parameters()
    opt = torch.optim.SGD(params, lr=LR, momentum=momentum)
    scheduler = make_scheduler(opt)
    tracker = tracker_type(model, opt, accumulation_steps=accumulation, unit="samples", estimator=make_estimator(),
                           controller=make_schedule() if schedule else make_controller(), lr_scheduler=scheduler)
    return tracker, opt, scheduler


def train(model: nn.Module, tracker: CBSTracker, opt: Any, scheduler: Any, *, first_step: int, last_step: int,
          rank: int, rows: int | None = None) -> list[dict[str, Any]]:
    """Steps ``first_step .. last_step - 1``; this rank runs its slice of each global batch (``rows``: every
    microbatch cut to that many samples, for a batch schedule)."""
    out = []
    for step in range(first_step, last_step):
        acc = tracker.accumulation_steps
        for j in range(acc):
            x, y = microbatch_data(step, 0, rank * acc + j)
            x, y = x[:rows], y[:rows]
            with tracker.microbatch(size=len(y)):
                loss = 0.5 * (model(x).squeeze(-1) - y).pow(2).mean() / acc
                loss.backward()
        rec = tracker.step()
        opt.step()
        scheduler.step()
        opt.zero_grad(set_to_none=True)
        out.append(record(rec, tracker))
    return out


def params_of(model: nn.Module) -> list[list[float]]:
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1).tolist()
            for p in inner.parameters()]


def reference(steps: int, momentum: float = 0.0, schedule: bool = False) -> dict[str, Any]:
    """One process, every microbatch of each global batch: the run that never moved."""
    model = make_model()
    tracker, opt, scheduler = build(model, START_ACCUMULATION * START_RANKS, momentum=momentum, schedule=schedule)
    records = train(model, tracker, opt, scheduler, first_step=0, last_step=steps, rank=0,
                    rows=FIXED_ROWS if schedule else None)
    return {"records": records, "params": params_of(model), "state": tracker.state_dict()}


def worker(rank: int, world: int, init_file: str, out_dir: str, first_step: int, last_step: int,
           ckpt_in: str | None, ckpt_out: str | None, schedule: bool = False) -> None:
    """Run steps ``first_step .. last_step - 1`` on ``world`` ranks (from ``ckpt_in`` if given), save at the end."""
    if world > 1:
        init_process_group(rank, world, init_file)
    model: nn.Module = make_model()
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    inner = model.module if world > 1 else model
    # the same command line on every world size
    tracker, opt, scheduler = build(model, START_ACCUMULATION, schedule=schedule)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if ckpt_in is not None:
            ckpt = torch.load(ckpt_in, weights_only=False)
            inner.load_state_dict(ckpt["model"])
            tracker.load_state_dict(ckpt["tracker"])
            opt.load_state_dict(ckpt["optimizer"])  # after the tracker: its LR is the one saved
            scheduler.load_state_dict(ckpt["scheduler"])
        records = train(model, tracker, opt, scheduler, first_step=first_step, last_step=last_step, rank=rank,
                        rows=FIXED_ROWS if schedule else None)
    if ckpt_out is not None and rank == 0:
        torch.save({"model": inner.state_dict(), "optimizer": opt.state_dict(), "scheduler": scheduler.state_dict(),
                    "tracker": tracker.state_dict()}, ckpt_out)
    payload = {"records": records, "params": params_of(model), "state": tracker.state_dict(),
               "warnings": [str(w.message) for w in caught]}
    path = Path(out_dir) / f"rank{rank}.json"
    path.write_text(json.dumps(payload))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


FSDP_MOMENTUM = 0.9  # the optimizer has state to reshard


def fsdp_worker(rank: int, world: int, init_file: str, out_dir: str, first_step: int, last_step: int,
                ckpt_in: str | None, ckpt_out: str | None) -> None:
    """FSDP2 on ``world`` ranks (1 included): model and optimizer resharded by ``torch.distributed.checkpoint``."""
    import torch.distributed.checkpoint as dcp
    from cbs_tracker.integrations.fsdp import FSDPTracker
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from tests.dist_workers import _fsdp_model

    init_process_group(rank, world, init_file)
    model = _fsdp_model()
    tracker, opt, scheduler = build(model, START_ACCUMULATION, momentum=FSDP_MOMENTUM, tracker_type=FSDPTracker)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if ckpt_in is not None:
            model_sd, optim_sd = get_state_dict(model, opt)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=ckpt_in)
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            extra = torch.load(Path(ckpt_in) / "tracker.pt", weights_only=False)
            tracker.load_state_dict(extra["tracker"])
            scheduler.load_state_dict(extra["scheduler"])
        records = train(model, tracker, opt, scheduler, first_step=first_step, last_step=last_step, rank=rank)
    if ckpt_out is not None:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt_out)
        if rank == 0:
            torch.save({"tracker": tracker.state_dict(), "scheduler": scheduler.state_dict()},
                       Path(ckpt_out) / "tracker.pt")
    payload = {"records": records, "params": params_of(model), "state": tracker.state_dict(),
               "warnings": [str(w.message) for w in caught]}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(payload))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- the microbatch grown first
MB_ROWS = 2  # rows per loader batch
MB_MARKS = ((0, 8), (24, 16), (72, 32), (200, 64))  # samples: levels 2, 4, 8, 16 loader batches per rank of 2
MB_N = 2 * MB_ROWS * 96


def _mb_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def _mb_loader(world: int, rank: int, skip: int = 0) -> Any:
    import itertools

    from tests.test_microbatch_first import Indexed

    data = Indexed(MB_N)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(0)
    return itertools.islice(torch.utils.data.DataLoader(data, batch_size=MB_ROWS, sampler=sampler), skip, None)


def microbatch_first_run(rank: int, world: int, init_file: str, out_dir: str, steps: int, ckpt_in: str | None,
                         ckpt_out: str | None, accumulation: int) -> None:
    """``steps`` windows of ``tracker.windows(loader)`` with ``max_microbatch`` on ``world`` ranks."""
    from cbs_tracker import BatchSchedule

    if world > 1:
        init_process_group(rank, world, init_file)
    model: nn.Module = _mb_model()
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    inner = model.module if world > 1 else model
    opt = torch.optim.SGD(inner.parameters(), lr=LR)
    tracker = CBSTracker(model, opt, accumulation_steps=accumulation, unit="samples",
                         controller=BatchSchedule(MB_MARKS), max_microbatch=4 * MB_ROWS)
    consumed, skip = 0, 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if ckpt_in is not None:
            ckpt = torch.load(ckpt_in, weights_only=False)
            inner.load_state_dict(ckpt["model"])
            tracker.load_state_dict(ckpt["tracker"])
            opt.load_state_dict(ckpt["optimizer"])
            skip = tracker.resume_position(ckpt["batches_per_rank"])
        records = []
        for window in tracker.windows(_mb_loader(world, rank, skip)):
            for mb in window:
                with tracker.microbatch(size=len(mb["index"])):
                    loss = 0.5 * (model(mb["x"]).squeeze(-1) - mb["y"]).pow(2).mean()
                    (loss / tracker.accumulation_steps).backward()
            rec = tracker.step()
            opt.step()
            opt.zero_grad(set_to_none=True)
            consumed += rec.accumulation_steps
            records.append({"step": rec.step, "global_batch": rec.global_batch, "lr": rec.lr,
                            "loader_batches": rec.accumulation_steps * rec.dp_degree,
                            "microbatches": len(window) * rec.dp_degree, "micro_batch": rec.micro_batch,
                            "indices": [i for mb in window for i in mb["index"].tolist()]})
            if len(records) == steps:
                break
    if ckpt_out is not None and rank == 0:
        torch.save({"model": inner.state_dict(), "optimizer": opt.state_dict(), "tracker": tracker.state_dict(),
                    "batches_per_rank": consumed}, ckpt_out)
    payload = {"records": records, "params": params_of(model), "warnings": [str(w.message) for w in caught]}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(payload))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
