"""Scenarios of the Accelerate adapter's tests, run in one process or on spawned gloo ranks.

Module-level functions so that ``torch.multiprocessing.spawn`` children can import them. The
parent test (``tests/test_accelerate.py``) runs :func:`scenario` in its own process (one
process) and spawns :func:`run_ranks` (two gloo processes, the Accelerator built after
``init_process_group`` with the environment ``PartialState`` reads); each returns or saves a
payload per scenario, which the tests compare with references computed without Accelerate.

The problem is the one of ``tests/dist_workers.py`` (a tanh MLP regression, float64, plain
SGD, microbatches of 3 to 5 samples). The data is a pure function of ``(m, rank)``, ``m`` the
process's microbatch counter (``tracker.microbatches_seen``), so a single-process reference
runs the same global windows: per window, every rank's microbatches, rank-major.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cbs_tracker import CBSTracker
from tests import dist_workers as dw
from tests.doubles import PlanController

LR = 0.05
START = 4  # microbatches per window at the start, over all processes (4 // world per process)
WINDOWS = 12
FIXED_ROWS = 3  # the LR scenario's microbatches (tokens align between runs)
# the LR scenario's forced growth: x2 the starting accumulation after step 1, x4 after step 4
GROWTH_PLAN = {1: 2, 4: 4}
CLIP = 100.0  # loose: clipping runs through accelerator.clip_grad_norm_ but changes nothing


class Net(nn.Module):
    """The MLP of ``tests.dist_workers``; notes whether autocast was on in its forward."""

    def __init__(self, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.net = dw.make_model(dtype)
        self.autocast_seen: set[str] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled("cpu"):
            self.autocast_seen.add(str(torch.get_autocast_dtype("cpu")))
        return self.net(x)


def data(
    m: int, rank: int, *, dtype: torch.dtype = torch.float64, rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Microbatch ``m`` of process ``rank`` (3 to 5 samples; ``rows`` keeps the first ones)."""
    x, y = dw.microbatch_data(m, rank, 0, dtype=dtype)
    return (x, y) if rows is None else (x[:rows], y[:rows])


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Half the mean squared error, in the labels' dtype (an autocast output is cast up first)."""
    return 0.5 * (out.squeeze(-1).to(y.dtype) - y).pow(2).mean()


def reset_accelerate() -> None:
    """Forget Accelerate's singletons (a new Accelerator may then take other settings); the process group stays."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def make_accelerator(world: int, **kw: Any) -> Any:
    """A CPU Accelerator starting at ``START // world`` microbatches per process (its singletons reset first)."""
    from accelerate import Accelerator

    reset_accelerate()
    kw.setdefault("gradient_accumulation_steps", START // world)
    return Accelerator(cpu=True, **kw)


def record_dict(rec: Any) -> dict[str, Any]:
    keys = (
        "step",
        "global_batch",
        "accumulation_steps",
        "next_accumulation_steps",
        "dp_degree",
        "noise_scale",
        "grad_sq_norm",
        "trace_cov",
        "critical_batch",
        "tokens_seen",
        "lr",
        "lr_coupling",
    )
    return {k: getattr(rec, k) for k in keys}


def flat_grad(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().double().reshape(-1).clone() for p in module.parameters()])


def flat_params(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().double().reshape(-1).clone() for p in module.parameters()])


def window_reference(
    module: nn.Module,
    start: int,
    per_rank: int,
    world: int,
    source: Any,
    *,
    autocast: torch.dtype | None = None,
) -> torch.Tensor:
    """The mean over every rank's microbatches of the window of each one's own gradient, by autograd (float64 sums).

    ``source(m, rank)``: microbatch ``m`` of ``rank``; ``autocast``: the forward's autocast dtype (``None``: off)."""
    grads = []
    for r in range(world):
        for j in range(per_rank):
            x, y = source(start + j, r)
            params = {
                n: p.detach().clone().requires_grad_(True) for n, p in module.named_parameters()
            }
            with torch.autocast(
                "cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None
            ):
                out = torch.func.functional_call(module, params, (x,))
            g = torch.autograd.grad(loss_of(out, y), list(params.values()))
            grads.append(torch.cat([t.double().reshape(-1) for t in g]))
    return torch.stack(grads).mean(0)


class BucketCount:
    """A DDP communication hook that averages as the default does and counts the bucket syncs."""

    def __init__(self) -> None:
        self.n = 0

    def hook(self):  # noqa: ANN201 (DDP checks the hook's annotations by identity)
        def hook(group, bucket):  # noqa: ANN001, ANN202
            self.n += 1
            tensor = bucket.buffer()
            tensor.div_(dist.get_world_size(group))
            return (
                dw._ALL_REDUCE(tensor, group=group, async_op=True)
                .get_future()
                .then(lambda f: f.value()[0])
            )

        return hook


# ---------------------------------------------------------------------------- the Accelerate loop
def accelerate_loop(
    acc: Any,
    tracker: Any,
    model: nn.Module,
    optimizer: Any,
    scheduler: Any,
    *,
    rank: int,
    world: int,
    windows: int,
    dtype: torch.dtype = torch.float64,
    rows: int | None = None,
    check_grads: bool = True,
    buckets: BucketCount | None = None,
    clip: bool = True,
    batches: Any = None,
    source: Any = None,
) -> list[dict[str, Any]]:
    """``windows`` optimizer steps of the loop of ``run_clm_no_trainer.py``'s shape; one dict per window.

    Per microbatch it notes what Accelerate says (``sync_gradients``, ``gradient_accumulation_steps``, its
    counter), the DDP bucket syncs and the optimizer steps it ran; per window the record, ``.grad`` when the
    tracker measured it and the window's reference gradient (``check_grads``), and the LR the step used.
    ``batches``: an iterator of ``(x, y)`` to use instead of :func:`data` (a prepared DataLoader's), ``source``
    the function ``(m, rank) -> (x, y)`` that gives the same microbatches to the reference."""
    if source is None:
        source = lambda m, r: data(m, r, dtype=dtype, rows=rows)  # noqa: E731
    autocast = (
        {"bf16": torch.bfloat16, "fp16": torch.float16}.get(acc.mixed_precision)
        if acc.native_amp
        else None
    )
    module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    inner = optimizer.optimizer
    stepped = [0]
    handle = inner.register_step_post_hook(lambda *a: stepped.__setitem__(0, stepped[0] + 1))
    out = []
    try:
        for _ in range(windows):
            per_rank = tracker.accumulation_steps
            start = tracker.microbatches_seen
            row: dict[str, Any] = {"microbatches": [], "start": start}
            for _ in range(per_rank):
                if batches is None:
                    x, y = source(tracker.microbatches_seen, rank)
                else:
                    x, y = next(batches)
                b0, s0 = (buckets.n if buckets else 0), stepped[0]
                with tracker.accumulate(size=len(y)):
                    loss = loss_of(model(x), y)
                    acc.backward(loss)
                    info = {
                        "sync": bool(acc.sync_gradients),
                        "ga": int(acc.gradient_accumulation_steps),
                        "counter": int(acc.step),
                    }
                    if acc.sync_gradients:
                        row["grad"] = flat_grad(module)  # still times the fp16 loss scale, if any
                        row["scale"] = 1.0 if acc.scaler is None else float(acc.scaler.get_scale())
                        if check_grads:
                            row["ref"] = window_reference(
                                module, start, per_rank, world, source, autocast=autocast
                            )
                        row["record"] = record_dict(tracker.step())
                        row["lr"] = float(inner.param_groups[0]["lr"])
                        if clip:
                            acc.clip_grad_norm_(model.parameters(), CLIP)
                    optimizer.step()
                    if scheduler is not None:
                        scheduler.step()
                    optimizer.zero_grad()
                info.update(
                    buckets=(buckets.n if buckets else 0) - b0, optimizer_steps=stepped[0] - s0
                )
                row["microbatches"].append(info)
            out.append(row)
    finally:
        handle.remove()
    return out


def build(
    acc: Any,
    *,
    world: int,
    dtype: torch.dtype = torch.float64,
    lr: float = LR,
    scheduler: bool = False,
    controller: Any = "grow",
    count_buckets: bool = False,
    **tracker_kw: Any,
) -> dict[str, Any]:
    """A prepared model, optimizer (and LambdaLR scheduler) and the tracker on them."""
    from cbs_tracker.integrations.accelerate import AcceleratorTracker

    net = Net(dtype)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    sched = dw.make_scheduler(opt) if scheduler else None
    prepared = acc.prepare(net, opt, sched) if scheduler else (*acc.prepare(net, opt), None)
    model, optimizer, lr_scheduler = prepared
    buckets = None
    if count_buckets and world > 1:
        buckets = BucketCount()
        model.register_comm_hook(None, buckets.hook())
    if controller == "grow":
        controller = dw.make_controller()
    tracker = AcceleratorTracker(
        acc,
        model,
        optimizer,
        lr_scheduler=lr_scheduler,
        controller=controller,
        unit="samples",
        estimator=dw.make_estimator(),
        **tracker_kw,
    )
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": lr_scheduler,
        "tracker": tracker,
        "net": net,
        "buckets": buckets,
    }


# ---------------------------------------------------------------------------- references without Accelerate
def plain_reference(
    *,
    world: int,
    windows: int,
    dtype: torch.dtype = torch.float64,
    lr: float = LR,
    autocast: torch.dtype | None = None,
    controller: Any = "grow",
    rows: int | None = None,
    source: Any = None,
) -> dict[str, Any]:
    """The plain CBSTracker loop in one process on the same global windows: every rank's microbatches, rank-major.

    ``autocast``: the forward's autocast dtype (``None``: off; no GradScaler)."""
    if source is None:
        source = lambda m, r: data(m, r, dtype=dtype, rows=rows)  # noqa: E731
    net = Net(dtype)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    tracker = CBSTracker(
        net,
        opt,
        accumulation_steps=START,
        unit="samples",
        controller=dw.make_controller() if controller == "grow" else controller,
        estimator=dw.make_estimator(),
    )
    records, pos = [], 0
    for _ in range(windows):
        acc = tracker.accumulation_steps
        per_rank = acc // world
        for r in range(world):
            for j in range(per_rank):
                x, y = source(pos + j, r)
                with tracker.microbatch(size=len(y)):
                    with torch.autocast(
                        "cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None
                    ):
                        out = net(x)
                    (loss_of(out, y) / acc).backward()
        pos += per_rank
        records.append(record_dict(tracker.step()))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"records": records, "params": flat_params(net)}


def constant_accelerate_run(
    acc: Any, *, rank: int, steps: int, rows: int
) -> list[dict[str, float]]:
    """A plain Accelerate loop at the starting batch (no tracker): the LR each optimizer step used, by units seen."""
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    model, optimizer, scheduler = acc.prepare(net, opt, dw.make_scheduler(opt))
    inner = optimizer.optimizer
    out, m = [], 0
    units = START * rows
    while len(out) < steps:
        x, y = data(m, rank, rows=rows)
        m += 1
        with acc.accumulate(model):
            acc.backward(loss_of(model(x), y))
            if acc.sync_gradients:
                out.append(
                    {"units_before": len(out) * units, "lr": float(inner.param_groups[0]["lr"])}
                )
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return out


# ---------------------------------------------------------------------------- scenarios
def scenario(name: str, rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Run scenario ``name`` on this process (``world`` processes in all); return its payload."""
    if name == "grow":
        acc = make_accelerator(world)
        parts = build(acc, world=world, count_buckets=True)
        rows = accelerate_loop(
            acc,
            parts["tracker"],
            parts["model"],
            parts["optimizer"],
            None,
            rank=rank,
            world=world,
            windows=WINDOWS,
            buckets=parts["buckets"],
        )
        return {
            "rows": rows,
            "params": flat_params(parts["net"]),
            "distributed_type": str(acc.distributed_type),
            "ddp": isinstance(parts["model"], nn.parallel.DistributedDataParallel),
        }
    if name == "bf16":
        acc = make_accelerator(world, mixed_precision="bf16")
        # frozen weights (lr=0): the reference's bf16 forward sees the same weights bit for bit
        parts = build(acc, world=world, dtype=torch.float32, lr=0.0, count_buckets=True)
        rows = accelerate_loop(
            acc,
            parts["tracker"],
            parts["model"],
            parts["optimizer"],
            None,
            rank=rank,
            world=world,
            windows=WINDOWS,
            dtype=torch.float32,
            buckets=parts["buckets"],
        )
        return {
            "rows": rows,
            "params": flat_params(parts["net"]),
            "autocast": sorted(parts["net"].autocast_seen),
        }
    if name == "lr":
        runs: dict[str, Any] = {}
        for coupling in ("keep", "linear"):
            acc = make_accelerator(world)
            plan = PlanController({k: v * (START // world) for k, v in GROWTH_PLAN.items()})
            parts = build(acc, world=world, scheduler=True, controller=plan, lr_coupling=coupling)
            runs[coupling] = accelerate_loop(
                acc,
                parts["tracker"],
                parts["model"],
                parts["optimizer"],
                parts["scheduler"],
                rank=rank,
                world=world,
                windows=8,
                rows=FIXED_ROWS,
                check_grads=False,
            )
            runs[coupling + "_starting_batch_steps"] = parts["tracker"].starting_batch_steps
        acc = make_accelerator(world)
        runs["constant"] = constant_accelerate_run(
            acc, rank=rank, steps=runs["keep_starting_batch_steps"] + 1, rows=FIXED_ROWS
        )
        return runs
    if name == "resume":
        return resume_scenario(rank, world, tmp)
    if name == "loader":
        return loader_scenario(rank, world)
    if name == "fp16":
        # Accelerate's fp16 path as on a GPU: a GradScaler (on the CPU, which Accelerate leaves without one) and
        # autocast; frozen weights so that the reference without a scaler runs the same forwards
        acc = make_accelerator(world, mixed_precision="fp16")
        acc.scaler, acc.native_amp = torch.amp.GradScaler("cpu", init_scale=2.0**12), True
        parts = build(acc, world=world, dtype=torch.float32, lr=0.0)
        rows = accelerate_loop(
            acc,
            parts["tracker"],
            parts["model"],
            parts["optimizer"],
            None,
            rank=rank,
            world=world,
            windows=WINDOWS,
            dtype=torch.float32,
        )
        return {"rows": rows, "autocast": sorted(parts["net"].autocast_seen)}
    raise ValueError(f"unknown scenario {name!r}")


LOADER_BATCHES = 10  # a prepared DataLoader of 10 batches: windows of 4 cross its end


def loader_source(m: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``m`` of the cycled loader of :func:`loader_scenario` (3 samples each)."""
    return data(m % LOADER_BATCHES, rank, rows=FIXED_ROWS)


def loader_scenario(rank: int, world: int) -> dict[str, Any]:
    """The batches of a prepared DataLoader, cycled over epochs: windows cross the loader's end."""
    acc = make_accelerator(world)
    parts = build(acc, world=world)
    xs, ys = zip(*(loader_source(m, rank) for m in range(LOADER_BATCHES)))
    dataset = torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys))
    loader = acc.prepare(torch.utils.data.DataLoader(dataset, batch_size=FIXED_ROWS, shuffle=False))

    def cycle() -> Any:
        while True:
            yield from loader

    rows = accelerate_loop(
        acc,
        parts["tracker"],
        parts["model"],
        parts["optimizer"],
        None,
        rank=rank,
        world=world,
        windows=WINDOWS,
        batches=cycle(),
        source=loader_source,
    )
    return {"rows": rows, "params": flat_params(parts["net"])}


def resume_scenario(rank: int, world: int, tmp: str, *, checkpoint: bool = True) -> dict[str, Any]:
    """The same run uninterrupted, and stopped halfway, saved by ``accelerator.save_state``, rebuilt and resumed."""

    def run(
        windows: int, *, load: str | None = None, save: str | None = None
    ) -> tuple[list, torch.Tensor]:
        acc = make_accelerator(world)
        parts = build(acc, world=world, scheduler=True, checkpoint=checkpoint)
        if load is not None:
            acc.load_state(load)
        rows = accelerate_loop(
            acc,
            parts["tracker"],
            parts["model"],
            parts["optimizer"],
            parts["scheduler"],
            rank=rank,
            world=world,
            windows=windows,
            check_grads=False,
        )
        if save is not None:
            acc.save_state(save)
        return rows, flat_params(parts["net"])

    full, full_params = run(WINDOWS)
    half = WINDOWS // 2
    path = str(Path(tmp) / f"ckpt_{int(checkpoint)}")
    first, _ = run(half, save=path)
    rest, params = run(WINDOWS - half, load=path)
    strip = lambda rows: [r["record"] for r in rows]  # noqa: E731
    return {
        "full": strip(full),
        "resumed": strip(first) + strip(rest),
        "full_params": full_params,
        "resumed_params": params,
    }


def run_scenario(name: str, rank: int, world: int, tmp: str) -> dict[str, Any]:
    """:func:`scenario` with its warnings; an error is returned as ``{"error": traceback}`` (the test fails on it)."""
    import traceback

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            payload = scenario(name, rank, world, tmp)
    except Exception:
        return {"error": traceback.format_exc()}
    payload["warnings"] = [str(w.message) for w in caught]
    return payload


def run_ranks(rank: int, world: int, init_file: str, out_dir: str, names: list[str]) -> None:
    """Spawn target: the environment Accelerate's ``PartialState`` reads, a gloo group, then every scenario."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        for name in names:
            torch.save(
                run_scenario(name, rank, world, out_dir), Path(out_dir) / f"{name}.rank{rank}.pt"
            )
            dist.barrier()
    finally:
        reset_accelerate()
        dist.destroy_process_group()
