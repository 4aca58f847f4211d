"""Lightning Fabric loops (LitGPT's ``pretrain.py`` shape) with ``CBSTracker``, and the plain loops they must equal.

Module-level functions only, so ``torch.multiprocessing.spawn`` children can import
them. ``tests/test_fabric.py`` runs the one-process scenarios in its own process and
spawns :func:`run_scenarios` on two gloo ranks; every rank writes one JSON file per
scenario.

Two ranks. Fabric's own launcher starts processes by re-running the script (not a
pytest test), so the parent spawns the ranks as the other distributed tests do and
each builds its ``Fabric(accelerator="cpu", devices=2, strategy="ddp")`` inside:
``LOCAL_RANK`` set (Fabric then launches nothing, its cluster environment "creates
processes externally") and the process group already initialised with a file init
method and a 60 s timeout (Fabric's ``launch()`` finds it initialised and keeps it).

The problem is :mod:`tests.dist_workers`' (a tanh MLP in float64, microbatches of 3 to
5 samples that are pure functions of ``(step, dp_rank, index)``, plain SGD, its
fast-growing controller); with ``precision="32-true"`` Fabric leaves a float64 model
and its inputs as they are. The loop is LitGPT's: ``fabric.backward(loss / A)``,
``fabric.clip_gradients``, ``optimizer.step()``, ``optimizer.zero_grad()``, with
``tracker.microbatch`` in place of ``fabric.no_backward_sync``.
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cbs_tracker import CBSTracker
from tests import dist_workers as dw

CLIP = 1.0  # fabric.clip_gradients' max_norm: the run's step norms straddle it (some steps clip)
START_ACCUMULATION = 2  # per rank
FP16_INIT_SCALE = 2.0**8  # well below fp16 overflow for this problem, so no step is skipped
SAVE_AT = 5  # the resumed scenarios checkpoint after this many steps


# ---------------------------------------------------------------------------- the loop
class Counter:
    """Counts the forwards and samples of the user's module, independently of the tracker."""

    def __init__(self, module: nn.Module) -> None:
        self.calls = self.samples = 0
        module.register_forward_pre_hook(self._count)

    def _count(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self.calls += 1
        self.samples += int(args[0].shape[0])


def litgpt_loop(
    model: nn.Module,
    optimizer: Any,
    tracker: CBSTracker,
    *,
    steps: int,
    dp_rank: int | None,
    dp_size: int,
    fabric: Any = None,
    first_step: int = 0,
    dtype: torch.dtype = torch.float64,
    autocast: torch.dtype | None = None,
    scaler: Any = None,
    module: nn.Module | None = None,
    log: dw.CollectiveLog | None = None,
    user_no_sync: bool = False,
    clip_with_tracker: bool = False,
    norm_type: float = 2.0,
    out: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """LitGPT's training loop with the tracker setting the windows; the plain loop when ``fabric`` is None.

    ``dp_rank=None`` runs every rank's microbatches in one process (rank-major, as
    :func:`tests.dist_workers.train` does), with ``tracker.accumulation_steps`` =
    ``dp_size`` times a rank's. Plain loop: ``loss.backward()`` (``autocast``: the forward
    under ``torch.autocast("cpu", autocast)``; ``scaler``: a ``GradScaler`` the plain
    tracker unscales), ``torch.nn.utils.clip_grad_norm_``. ``user_no_sync``: the loop also
    wraps each microbatch in ``fabric.no_backward_sync(model, enabled=True)``, a count
    that disagrees with the tracker's on the last microbatch. ``clip_with_tracker``: clip with
    ``tracker.clip_grad_norm_`` instead of ``fabric.clip_gradients`` (both with ``norm_type``). Collects, per step, the
    record, the weights the window ran at, the step gradient after ``tracker.step()`` (before
    clipping), the forwards and samples the module saw, and the communication (``log``).
    """
    out = {"records": [], "grads": [], "fed": [], "communication": [], "before": []} if out is None else out
    counter = Counter(module if module is not None else model)
    for step in range(first_step, first_step + steps):
        counter.calls = counter.samples = 0
        out["before"].append(params_of(module if module is not None else model))
        acc = tracker.accumulation_steps
        if dp_rank is None:
            items = [(r, j) for r in range(dp_size) for j in range(acc // dp_size)]
        else:
            items = [(dp_rank, j) for j in range(acc)]
        for r, j in items:
            x, y = dw.microbatch_data(step, r, j, dtype=dtype)
            with tracker.microbatch(size=len(y)):
                if fabric is not None:
                    sync = fabric.no_backward_sync(model, enabled=True) if user_no_sync else _null()
                    with sync:
                        pred = model(x).squeeze(-1)
                        loss = 0.5 * (pred.to(y.dtype) - y).pow(2).mean()
                        fabric.backward(loss / tracker.accumulation_steps)
                else:
                    with _autocast(autocast):
                        pred = model(x).squeeze(-1)
                    loss = 0.5 * (pred.to(y.dtype) - y).pow(2).mean() / tracker.accumulation_steps
                    (scaler.scale(loss) if scaler is not None else loss).backward()
        record = tracker.step()
        params = list((module if module is not None else model).parameters())
        out["grads"].append(torch.cat([p.grad.reshape(-1) for p in params]).double().tolist())
        if fabric is not None:
            if clip_with_tracker:
                tracker.clip_grad_norm_(CLIP, norm_type=norm_type)
            else:
                fabric.clip_gradients(model, optimizer, max_norm=CLIP, norm_type=norm_type)
            optimizer.step()
        else:
            torch.nn.utils.clip_grad_norm_(params, CLIP)
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out["records"].append(dw.record_dict(record))
        out["fed"].append({"forwards": counter.calls, "samples": counter.samples})
        if log is not None:
            log.end_step()
            out["communication"] = log.steps
    out["params"] = params_of(module if module is not None else model)
    return out


def _null() -> Any:
    from contextlib import nullcontext

    return nullcontext()


def _autocast(dtype: torch.dtype | None) -> Any:
    return _null() if dtype is None else torch.autocast("cpu", dtype=dtype)


def params_of(module: nn.Module) -> list[list[float]]:
    return [p.detach().double().reshape(-1).tolist() for p in module.parameters()]


# ---------------------------------------------------------------------------- building the runs
def make_fabric(devices: int, precision: str = "32-true", *, fp16: bool = False, buckets: bool = False) -> Any:
    """A launched CPU ``Fabric``: one device, or ``devices`` DDP ranks (the process group already up).

    ``fp16``: the ``"16-mixed"`` plugin built by hand (``Fabric(precision="16-mixed")`` falls back to
    bf16 on a CPU), its ``GradScaler`` starting at :data:`FP16_INIT_SCALE`. ``buckets``: DDP buckets of
    ~100 bytes, so the MLP's 65 float64 parameters take several and "once per bucket" is seen.
    """
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.precision import MixedPrecision
    from lightning.fabric.strategies import DDPStrategy

    kwargs: dict[str, Any] = {"accelerator": "cpu", "devices": devices}
    if devices > 1:
        kwargs["strategy"] = DDPStrategy(process_group_backend="gloo", **({"bucket_cap_mb": 1e-4} if buckets else {}))
    if fp16:
        scaler = torch.amp.GradScaler("cpu", init_scale=FP16_INIT_SCALE)
        kwargs["plugins"] = [MixedPrecision("16-mixed", device="cpu", scaler=scaler)]
    else:
        kwargs["precision"] = precision
    fabric = Fabric(**kwargs)
    fabric.launch()
    return fabric


def tracker_for(model: nn.Module, optimizer: Any, accumulation: int) -> CBSTracker:
    return CBSTracker(
        model, optimizer, accumulation_steps=accumulation, unit="samples",
        estimator=dw.make_estimator(), controller=dw.make_controller(),
    )


def fabric_setup(
    *, devices: int, dp_rank: int | None, dp_size: int, precision: str = "32-true", fp16: bool = False,
    buckets: bool = False,
) -> tuple[Any, nn.Module, nn.Module, Any, CBSTracker, torch.dtype]:
    """Fabric, the user's module, ``fabric.setup``'s model and optimizer, the tracker, the data dtype."""
    fabric = make_fabric(devices, precision, fp16=fp16, buckets=buckets)
    dtype = torch.float64 if precision == "32-true" and not fp16 else torch.float32
    module = dw.make_model(dtype)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=dw.LR))
    per_rank = START_ACCUMULATION * (dp_size if dp_rank is None else 1)
    return fabric, module, model, optimizer, tracker_for(model, optimizer, per_rank), dtype


def fabric_run(
    *, steps: int, dp_rank: int | None, dp_size: int, devices: int, precision: str = "32-true",
    fp16: bool = False, buckets: bool = False, log: dw.CollectiveLog | None = None,
    save_to: str | None = None, resume_from: str | None = None, clip_with_tracker: bool = False,
    norm_type: float = 2.0,
) -> dict[str, Any]:
    """The Fabric loop: float64 in ``"32-true"``, float32 under ``"bf16-mixed"`` and ``fp16``.

    ``save_to``: stop after :data:`SAVE_AT` steps, ``fabric.save`` model, optimizer, tracker and
    the step. ``resume_from``: fresh objects, ``fabric.load`` that checkpoint into them, run the
    rest to ``steps``.
    """
    fabric, module, model, optimizer, tracker, dtype = fabric_setup(
        devices=devices, dp_rank=dp_rank, dp_size=dp_size, precision=precision, fp16=fp16, buckets=buckets
    )
    if log is not None:
        model._forward_module.register_comm_hook(dist.group.WORLD, log.ddp_hook())
        log.install()
    first = 0
    if resume_from is not None:
        remainder = fabric.load(resume_from, {"model": model, "optimizer": optimizer, "tracker": tracker})
        first = int(remainder["step"])
    n = SAVE_AT if save_to is not None else steps - first
    try:
        out = litgpt_loop(model, optimizer, tracker, steps=n, dp_rank=dp_rank, dp_size=dp_size, fabric=fabric,
                          first_step=first, dtype=dtype, module=module, log=log,
                          clip_with_tracker=clip_with_tracker, norm_type=norm_type)
    finally:
        if log is not None:
            log.uninstall()
    if save_to is not None:
        fabric.save(save_to, {"model": model, "optimizer": optimizer, "tracker": tracker, "step": SAVE_AT})
    out["fabric_scaler"] = tracker.grad_scaler is not None
    out["unsynced_first"] = tracker._unsynced(last=False)
    return out


def user_no_sync_run(*, dp_rank: int | None, dp_size: int, devices: int) -> dict[str, Any]:
    """One window whose loop also enters ``fabric.no_backward_sync(model, enabled=True)`` on every
    microbatch (its own count says the window goes on): the error, the parameters before and after."""
    fabric, module, model, optimizer, tracker, dtype = fabric_setup(devices=devices, dp_rank=dp_rank, dp_size=dp_size)
    before = params_of(module)
    error = None
    try:
        litgpt_loop(model, optimizer, tracker, steps=1, dp_rank=dp_rank, dp_size=dp_size, fabric=fabric,
                    dtype=dtype, module=module, user_no_sync=True)
    except RuntimeError as err:
        error = str(err)
    return {"error": error, "params_before": before, "params_after": params_of(module)}


def plain_run(
    *, steps: int, dp_rank: int | None, dp_size: int, distributed: bool, dtype: torch.dtype = torch.float64,
    autocast: torch.dtype | None = None, fp16: bool = False,
) -> dict[str, Any]:
    """The same loop with the plain ``CBSTracker`` (DDP when ``distributed``), ``loss.backward()``."""
    module = dw.make_model(dtype)
    model: nn.Module = nn.parallel.DistributedDataParallel(module) if distributed else module
    optimizer = torch.optim.SGD(module.parameters(), lr=dw.LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=FP16_INIT_SCALE) if fp16 else None
    per_rank = START_ACCUMULATION * (dp_size if dp_rank is None else 1)
    tracker = CBSTracker(
        model, optimizer, accumulation_steps=per_rank, unit="samples", grad_scaler=scaler,
        estimator=dw.make_estimator(), controller=dw.make_controller(),
    )
    return litgpt_loop(model, optimizer, tracker, steps=steps, dp_rank=dp_rank, dp_size=dp_size, dtype=dtype,
                       autocast=torch.float16 if fp16 else autocast, scaler=scaler, module=module)


# ---------------------------------------------------------------------------- two ranks
def scenario(name: str, rank: int, world: int, out_dir: str, steps: int) -> dict[str, Any]:
    """One named two-rank scenario on this rank."""
    common = {"steps": steps, "dp_rank": rank, "dp_size": world}
    ckpt = str(Path(out_dir) / "fabric_resume.ckpt")
    if name == "fabric_ddp":
        return fabric_run(devices=world, buckets=True, log=dw.CollectiveLog(), **common)
    if name == "plain_ddp":
        return plain_run(distributed=True, **common)
    if name == "fabric_resume":
        first = fabric_run(devices=world, save_to=ckpt, **common)
        rest = fabric_run(devices=world, resume_from=ckpt, **common)
        return {"records": first["records"] + rest["records"], "params": rest["params"]}
    if name == "fabric_bf16":
        return fabric_run(devices=world, precision="bf16-mixed", **common)
    if name == "plain_bf16":
        return plain_run(distributed=True, dtype=torch.float32, autocast=torch.bfloat16, **common)
    if name == "fabric_fp16":
        return fabric_run(devices=world, fp16=True, **common)
    if name == "plain_fp16":
        return plain_run(distributed=True, dtype=torch.float32, fp16=True, **common)
    if name == "fabric_user_no_sync":
        return user_no_sync_run(devices=world, dp_rank=rank, dp_size=world)
    raise ValueError(f"unknown scenario {name!r}")


def run_scenarios(rank: int, world: int, init_file: str, out_dir: str, names: list[str], steps: int) -> None:
    """Spawn target: each scenario in ``names`` in order (an error is saved, not raised), then a clean shutdown."""
    os.environ.update({"LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": str(world)})
    dw.init_process_group(rank, world, init_file)
    try:
        for name in names:
            try:
                payload = scenario(name, rank, world, out_dir, steps)
            except Exception:  # the parent test reports it; the other scenarios still run
                payload = {"failed": traceback.format_exc()}
            path = Path(out_dir) / f"{name}.rank{rank}.json"
            path.write_text(json.dumps(payload))
            dist.barrier()
    finally:
        dist.destroy_process_group()
