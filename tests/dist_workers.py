"""Workers for the spawned distributed tests, and the single-process references they are compared with.

Module-level functions only, so ``torch.multiprocessing.spawn`` children can
import them. The parent test (``tests/test_distributed.py``) spawns
:func:`run_scenarios`; every rank writes one JSON file per scenario; the parent
runs :func:`reference_run` (no ``torch.distributed``) on the same concatenated
data and compares.

The problem: a small tanh MLP regression, microbatches of unequal size (the
harmonic mean matters), data that is a pure function of ``(step, dp_rank,
index)``, plain SGD so that the weights move and the runs must stay in step.
Float64 everywhere except the mixed-precision scenario.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cbs_tracker import BatchSchedule, CBSTracker, NoiseScaleEstimator
from cbs_tracker.policy.controller import BatchSizeController

_ALL_REDUCE = dist.all_reduce  # the comm hook's own all-reduce, invisible to CollectiveLog

D_IN = 6
HIDDEN = 8
LR = 0.05
START_ACCUMULATION = 2  # per DP rank
HSDP_CLIP = 1.2  # mesh_hsdp clips through the tracker (its step norms run 0.3-1.6)
ONE_MICROBATCH_CLIP = 2.0  # ddp_one_microbatch clips through the tracker (its step norms run 1.3-6.2)
# the *_schedule scenarios: microbatches of FIXED_ROWS samples; per rank of two, A = 2, 3, 4, 6
FIXED_ROWS = 3
SCHEDULE_MARKS = ((0, 12), (30, 18), (60, 24), (100, 36))


def make_schedule() -> BatchSchedule:
    return BatchSchedule(SCHEDULE_MARKS)


def make_scheduler(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1.0 + 0.1 * e))


# ---------------------------------------------------------------------------- the problem
def make_model(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1)).to(dtype)


def microbatch_data(
    step: int, dp_rank: int, index: int, *, dtype: torch.dtype = torch.float64, nan_at: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Microbatch ``index`` of DP rank ``dp_rank`` in optimizer step ``step`` (3 to 5 samples)."""
    gen = torch.Generator().manual_seed(100_003 * step + 1_009 * dp_rank + index + 7)
    n = 3 + (step + 2 * dp_rank + index) % 3
    x = torch.randn(n, D_IN, generator=gen, dtype=torch.float64)
    w = torch.linspace(-1.0, 1.0, D_IN, dtype=torch.float64)
    y = torch.tanh(x @ w) + 3.0 * torch.randn(n, generator=gen, dtype=torch.float64)
    if nan_at is not None and (step, dp_rank) == nan_at and index == 0:
        y[0] = float("nan")
    return x.to(dtype), y.to(dtype)


def make_controller() -> BatchSizeController:
    # Short warm-up and no cool-down so that a dozen steps see decisions (kappa=3 so that
    # they are doublings; the default kappa is tested in test_controller).
    return BatchSizeController(
        kappa=3.0, warmup_steps=3, warmup_tokens=0, cooldown_tokens=0, patience=2, window=3, feedback_guard=False,
        hold_on_plateau=None,  # doublings from the first steps (the hold is tested in test_plateau*)
    )


def make_estimator() -> NoiseScaleEstimator:
    from tests.estimators import NoIntervalEstimator

    return NoIntervalEstimator(min_steps=2)


def record_dict(rec: Any) -> dict[str, Any]:
    keys = (
        "step", "global_batch", "accumulation_steps", "next_accumulation_steps", "dp_degree",
        "noise_scale", "grad_sq_norm", "trace_cov", "critical_batch", "dropped", "lr", "measured",
    )
    return {k: getattr(rec, k) for k in keys}


def train(
    model: nn.Module,
    tracker: CBSTracker,
    optimizer: torch.optim.Optimizer,
    *,
    steps: int,
    dp_rank: int | None,
    dp_size: int,
    dtype: torch.dtype = torch.float64,
    nan_at: tuple[int, int] | None = None,
    available: Any = None,
    manual_sync_group: Any = None,
    log: CollectiveLog | None = None,
    clip: float | None = None,
    clip_norms: list[float] | None = None,
    scheduler: Any = None,
    fixed_rows: int | None = None,
    first_step: int = 0,
) -> list[dict[str, Any]]:
    """The loop shared by the distributed ranks and the single-process reference.

    ``dp_rank=None`` is the reference: one process runs the microbatches of every DP
    rank (rank-major), with ``accumulation_steps`` = ``dp_size`` times a rank's.
    ``available(step, dp_rank, index)`` says whether that microbatch exists (data
    that runs out). ``manual_sync_group``: an unwrapped replicated model whose loop
    averages the gradients itself. ``log``: counts communication, one entry per step.
    ``clip``: clip the step's gradient to this norm, through ``tracker.clip_grad_norm_`` on
    the ranks and ``torch.nn.utils.clip_grad_norm_`` in the reference (norms into ``clip_norms``).
    ``scheduler``: stepped after each optimizer step. ``fixed_rows``: every microbatch keeps
    only its first rows (data of fixed size, for the batch schedules). ``first_step``: the data
    index of the first step (a resumed run continues the data where it stopped).
    """
    records = []
    for step in range(first_step, first_step + steps):
        acc = tracker.accumulation_steps
        if dp_rank is None:
            per_rank = acc // dp_size
            items = [(r, j) for r in range(dp_size) for j in range(per_rank)]
        else:
            items = [(dp_rank, j) for j in range(acc)]
        for r, j in items:
            if available is not None and not available(step, r, j):
                continue
            x, y = microbatch_data(step, r, j, dtype=dtype, nan_at=nan_at)
            if fixed_rows is not None:
                x, y = x[:fixed_rows], y[:fixed_rows]
            with tracker.microbatch(size=len(y)):
                out = model(x).squeeze(-1)
                loss = 0.5 * (out - y).pow(2).mean() / acc
                loss.backward()
        if manual_sync_group is not None:
            size = dist.get_world_size(manual_sync_group)
            for p in model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=manual_sync_group)
                p.grad /= size
        rec = tracker.step()
        if clip is not None:
            if dp_rank is None:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            else:
                norm = tracker.clip_grad_norm_(clip)
            assert clip_norms is not None
            clip_norms.append(float(norm))
        if not rec.dropped:
            optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        records.append(record_dict(rec))
        if log is not None:
            log.end_step()
    return records


def reference_run(
    *, steps: int, dp_size: int, nan_at: tuple[int, int] | None = None, available: Any = None,
    start_accumulation: int = START_ACCUMULATION, clip: float | None = None, schedule: bool = False,
    measure_every: int = 1,
) -> dict[str, Any]:
    """One process, no ``torch.distributed``: the microbatches of all DP ranks in one window.

    ``schedule``: the ``*_schedule`` scenarios' run (a ``BatchSchedule``, an LR scheduler, fixed sizes)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = make_scheduler(opt) if schedule else None
    tracker = CBSTracker(
        model, opt, accumulation_steps=start_accumulation * dp_size, unit="samples",
        estimator=make_estimator(), controller=make_schedule() if schedule else make_controller(),
        lr_scheduler=scheduler, measure_every=measure_every,
    )
    clip_norms: list[float] = []
    records = train(
        model, tracker, opt, steps=steps, dp_rank=None, dp_size=dp_size, nan_at=nan_at, available=available,
        clip=clip, clip_norms=clip_norms, scheduler=scheduler, fixed_rows=FIXED_ROWS if schedule else None,
    )
    return {"records": records, "params": [p.detach().reshape(-1).tolist() for p in model.parameters()],
            "clip_norms": clip_norms}


def bf16_reference(*, steps: int, dp_size: int) -> list[dict[str, float]]:
    """Slow reference for FSDP2 with bf16 parameters and fp32 reduction, at frozen weights.

    Materialises each microbatch's gradient with a bf16 copy of the float32 model
    (what FSDP's unsharded parameters are), takes ``small = mean_k |g_k|^2`` and
    ``big = |mean_k g_k|^2`` in float64 and feeds the estimator directly.
    """
    model32 = make_model(torch.float32)
    est = make_estimator()
    out = []
    for step in range(steps):
        grads, sizes = [], []
        for r in range(dp_size):
            for j in range(START_ACCUMULATION):
                m = make_model(torch.float32).to(torch.bfloat16)
                m.load_state_dict({k: v.to(torch.bfloat16) for k, v in model32.state_dict().items()})
                x, y = microbatch_data(step, r, j, dtype=torch.float32)
                o = m(x.to(torch.bfloat16)).squeeze(-1)
                (0.5 * (o - y).pow(2).mean()).backward()
                grads.append(torch.cat([p.grad.double().reshape(-1) for p in m.parameters()]))
                sizes.append(float(len(y)))
        g = torch.stack(grads)
        k = len(sizes)
        b_small = k / sum(1.0 / s for s in sizes)
        small = float(g.pow(2).sum(1).mean())
        big = float(g.mean(0).pow(2).sum())
        est.update(small, big, b_small, k * b_small, sum(sizes))
        out.append({"noise_scale": est.noise_scale, "grad_sq_norm": est.grad_sq_norm, "trace_cov": est.trace_cov})
    return out


# ---------------------------------------------------------------------------- counting communication
class CollectiveLog:
    """Every ``torch.distributed`` collective called from Python, and every DDP bucket sync, per optimizer step.

    DDP's gradient all-reduce runs in its C++ reducer, invisible to Python, unless a
    communication hook replaces it: :meth:`ddp_hook` does the default's work (average
    over the group) and records the bucket's index each time the reducer hands a
    bucket over, i.e. each gradient sync. The hook calls the all-reduce saved at import,
    so the wrapped ``torch.distributed`` functions count only the others (the tracker's).
    """

    PREFIXES = ("all_", "reduce", "broadcast", "gather", "scatter", "barrier", "monitored_barrier",
                "send", "recv", "isend", "irecv")

    def __init__(self) -> None:
        self.steps: list[dict[str, list]] = []
        self._calls: list[list[Any]] = []
        self._buckets: list[int] = []
        self._originals: list[tuple[str, Any]] = []

    def install(self) -> None:
        for name in dir(dist):
            fn = getattr(dist, name)
            if name.startswith(self.PREFIXES) and callable(fn) and not isinstance(fn, type):
                self._originals.append((name, fn))
                setattr(dist, name, self._wrap(name, fn))

    def uninstall(self) -> None:
        for name, fn in self._originals:
            setattr(dist, name, fn)
        self._originals.clear()

    def _wrap(self, name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            self._calls.append([name, tensors[0].numel() if tensors else 0,
                                str(tensors[0].dtype) if tensors else "", str(kwargs.get("op", args[1:2]))])
            return fn(*args, **kwargs)

        return wrapper

    def ddp_hook(self) -> Any:
        """The hook for ``register_comm_hook(group, hook)`` (unannotated: DDP checks annotations by identity)."""

        def hook(group, bucket):  # noqa: ANN001, ANN202
            self._buckets.append(bucket.index())
            tensor = bucket.buffer()
            tensor.div_(dist.get_world_size(group))
            fut = _ALL_REDUCE(tensor, group=group, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])

        return hook

    def end_step(self) -> None:
        self.steps.append({"collectives": self._calls, "bucket_syncs": self._buckets})
        self._calls, self._buckets = [], []


# ---------------------------------------------------------------------------- ranks
def init_process_group(rank: int, world: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )


def _save(out_dir: str, name: str, rank: int, payload: dict[str, Any]) -> None:
    path = Path(out_dir) / f"{name}.rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def _full_params(model: nn.Module) -> list[list[float]]:
    out = []
    for p in model.parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(t.detach().double().reshape(-1).tolist())
    return out


def _fsdp_model(mesh: Any = None, dtype: torch.dtype = torch.float64, mp_policy: Any = None) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw: dict[str, Any] = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    model = make_model(dtype)
    fully_shard(model[0], **kw)
    fully_shard(model[2], **kw)
    fully_shard(model, **kw)
    return model


def scenario(name: str, rank: int, world: int, out_dir: str, steps: int) -> None:
    """Run one named scenario on this rank and save its records."""
    from cbs_tracker.integrations.fsdp import FSDPTracker

    from cbs_tracker.core.engine import model_parameter_count

    common = {"unit": "samples", "estimator": make_estimator(), "controller": make_controller()}
    acc = START_ACCUMULATION
    payload: dict[str, Any] = {}
    if name in ("ddp", "ddp_static_bucket_view", "ddp_nonfinite", "ddp_one_microbatch", "ddp_device_path",
                "ddp_cadence"):
        kw = {"gradient_as_bucket_view": True, "static_graph": True} if name == "ddp_static_bucket_view" else {}
        if name == "ddp_one_microbatch":
            acc = 1  # the first microbatch is also the last: its backward syncs, .grad is not local
        # buckets of ~100 bytes: the 65 float64 parameters need several, so "once per bucket" is seen
        model = nn.parallel.DistributedDataParallel(make_model(), bucket_cap_mb=1e-4, **kw)
        log = CollectiveLog()
        model.register_comm_hook(dist.group.WORLD, log.ddp_hook())
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        every = {"measure_every": 3} if name == "ddp_cadence" else {}  # unmeasured windows: hooks off, counts only
        tracker = CBSTracker(model, opt, accumulation_steps=acc, **common, **every)
        nan_at = (3, 1) if name == "ddp_nonfinite" else None
        clip = ONE_MICROBATCH_CLIP if name == "ddp_one_microbatch" else None
        payload["clip_norms"] = []
        log.install()
        try:
            payload["records"] = train(model, tracker, opt, steps=steps, dp_rank=rank, dp_size=world, nan_at=nan_at,
                                       log=log, clip=clip, clip_norms=payload["clip_norms"])
        finally:
            log.uninstall()
        payload["params"] = _full_params(model.module)
        payload["communication"] = log.steps
    elif name in ("fsdp_last", "fsdp_every", "fsdp_nonfinite"):
        model = _fsdp_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        sync = "every" if name == "fsdp_every" else "last"
        tracker = FSDPTracker(model, opt, accumulation_steps=acc, gradient_sync=sync, **common)
        nan_at = (3, 1) if name == "fsdp_nonfinite" else None
        payload["records"] = train(model, tracker, opt, steps=steps, dp_rank=rank, dp_size=world, nan_at=nan_at)
        payload["params"] = _full_params(model)
        payload["hooks"] = tracker.collector.num_hooks
        payload["local_numel"] = sum(int(p.to_local().numel()) for p in model.parameters())
        payload["model_parameters"] = model_parameter_count(model)
        if name == "fsdp_last":  # a tracker in tokens gives its controller the whole model's count
            from cbs_tracker.policy.controller import BatchSizeController

            tracker.remove_hooks()
            in_tokens = BatchSizeController(hold_on_plateau=0.15)
            FSDPTracker(model, opt, accumulation_steps=acc, unit="tokens", controller=in_tokens).remove_hooks()
            payload["controller_parameters"] = [in_tokens.model_parameters, in_tokens.plateau.in_samples]
    elif name in ("ddp_schedule", "fsdp_schedule"):
        if name == "ddp_schedule":
            model = nn.parallel.DistributedDataParallel(make_model())
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            scheduler = make_scheduler(opt)
            tracker = CBSTracker(model, opt, accumulation_steps=acc, unit="samples", estimator=make_estimator(),
                                 controller=make_schedule(), lr_scheduler=scheduler)
        else:
            model = _fsdp_model()
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            scheduler = make_scheduler(opt)
            tracker = FSDPTracker(model, opt, accumulation_steps=acc, unit="samples", estimator=make_estimator(),
                                  controller=make_schedule(), lr_scheduler=scheduler)
        payload["records"] = train(model, tracker, opt, steps=steps, dp_rank=rank, dp_size=world,
                                   scheduler=scheduler, fixed_rows=FIXED_ROWS)
        payload["params"] = _full_params(model.module if name == "ddp_schedule" else model)
        if name == "ddp_schedule":  # a resume mid-schedule: half the run, a checkpoint, new objects, the rest
            payload["resumed"] = _resumed_schedule_run(rank, world, steps)
    elif name == "fsdp_bf16":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = _fsdp_model(dtype=torch.float32, mp_policy=policy)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # frozen: the reference is at fixed weights
        tracker = FSDPTracker(model, opt, accumulation_steps=acc, unit="samples", estimator=make_estimator())
        payload["records"] = train(
            model, tracker, opt, steps=steps, dp_rank=rank, dp_size=world, dtype=torch.float32
        )
    elif name == "manual_ranout":
        # Replicated model, the loop averages the gradients itself. Rank 1's data runs
        # short at step 4 (one of two microbatches) and is gone from step 5 on; at the
        # last step no rank has data and every rank must raise together.
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        tracker = CBSTracker(model, opt, accumulation_steps=acc, grads_averaged_over_ranks=True, **common)
        # several ranks without DDP: a sync inside the backward cannot be ruled out, so .grad is never read
        payload["reads_first_from_grad"] = tracker._unsynced(last=False)
        payload["records"] = train(
            model, tracker, opt, steps=steps, dp_rank=rank, dp_size=world,
            available=ranout_available, manual_sync_group=dist.group.WORLD,
        )
        payload["params"] = _full_params(model)
        try:
            tracker.step()
        except RuntimeError as err:
            payload["all_empty_error"] = str(err)
    else:
        raise ValueError(f"unknown scenario {name!r}")
    _save(out_dir, name, rank, payload)


def _resumed_schedule_run(rank: int, world: int, steps: int) -> list[dict[str, Any]]:
    """The ``ddp_schedule`` run stopped after half its steps, checkpointed, rebuilt and resumed: its records."""

    def build(state: dict[str, Any] | None = None) -> tuple[Any, Any, Any, Any]:
        model = nn.parallel.DistributedDataParallel(make_model())
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        scheduler = make_scheduler(opt)
        if state is not None:
            model.module.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            scheduler.load_state_dict(state["sched"])
        tracker = CBSTracker(model, opt, accumulation_steps=START_ACCUMULATION, unit="samples",
                             estimator=make_estimator(), controller=make_schedule(), lr_scheduler=scheduler)
        if state is not None:
            tracker.load_state_dict(state["tracker"])
        return model, opt, scheduler, tracker

    model, opt, scheduler, tracker = build()
    half = steps // 2
    first = train(model, tracker, opt, steps=half, dp_rank=rank, dp_size=world, scheduler=scheduler,
                  fixed_rows=FIXED_ROWS)
    state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": scheduler.state_dict(),
             "tracker": tracker.state_dict()}
    model, opt, scheduler, tracker = build(state)
    # the resumed half continues the data where the first stopped
    rest = train(model, tracker, opt, steps=steps - half, dp_rank=rank, dp_size=world, scheduler=scheduler,
                 fixed_rows=FIXED_ROWS, first_step=half)
    return first + rest


def ranout_available(step: int, dp_rank: int, index: int) -> bool:
    """Rank 1 has one microbatch at step 4 and none from step 5 on (rank 0 has all)."""
    if dp_rank != 1:
        return True
    if step == 4:
        return index == 0
    return step < 4


def run_scenarios(rank: int, world: int, init_file: str, out_dir: str, names: list[str], steps: int) -> None:
    """Spawn target: every scenario in ``names`` in order, then a clean shutdown."""
    init_process_group(rank, world, init_file)
    try:
        for name in names:
            if name.startswith("mesh_") or name == "errors_4":
                mesh_scenario(name, rank, world, out_dir, steps)
            elif name == "errors_2":
                error_scenario(rank, out_dir)
            elif name == "ddp_device_path":
                # what an accelerator runs: the window's sums stay tensors until the one all_reduce
                from cbs_tracker.core.collector import GradStatsCollector

                host = GradStatsCollector.host_window_sums
                GradStatsCollector.host_window_sums = lambda self: None  # type: ignore[method-assign]
                try:
                    scenario(name, rank, world, out_dir, steps)
                finally:
                    GradStatsCollector.host_window_sums = host  # type: ignore[method-assign]
            else:
                scenario(name, rank, world, out_dir, steps)
            dist.barrier()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------- 4 ranks: meshes
def mesh_scenario(name: str, rank: int, world: int, out_dir: str, steps: int) -> None:
    """2-D meshes on 4 ranks: ``dp x tp`` (tp ranks feed identical data) and HSDP."""
    from cbs_tracker.integrations.fsdp import FSDPTracker
    from torch.distributed.device_mesh import init_device_mesh

    common = {"unit": "samples", "estimator": make_estimator(), "controller": make_controller()}
    acc = START_ACCUMULATION
    payload: dict[str, Any] = {}
    if name in ("mesh_ddp_dp_tp", "mesh_fsdp_dp_tp"):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp_rank = mesh.get_local_rank("dp")  # the two tp ranks of a dp group share it
        if name == "mesh_ddp_dp_tp":
            model = nn.parallel.DistributedDataParallel(make_model(), process_group=mesh.get_group("dp"))
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            tracker = CBSTracker(model, opt, accumulation_steps=acc, device_mesh=mesh, mesh_dim="dp", **common)
            params_of = model.module
        else:
            model = _fsdp_model(mesh=mesh["dp"])
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            tracker = FSDPTracker(model, opt, accumulation_steps=acc, **common)  # DP group from the 1-D mesh
            params_of = model
        payload["records"] = train(model, tracker, opt, steps=steps, dp_rank=dp_rank, dp_size=2)
        payload["params"] = _full_params(params_of)
    elif name == "mesh_hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        model = _fsdp_model(mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        tracker = FSDPTracker(
            model, opt, accumulation_steps=acc, device_mesh=mesh, mesh_dim=("dp_replicate", "dp_shard"), **common
        )
        dp_rank = dist.get_rank(tracker.dp_group)
        payload["clip_norms"] = []  # clipped through the tracker: every replica must clip alike
        payload["records"] = train(model, tracker, opt, steps=steps, dp_rank=dp_rank, dp_size=4, clip=HSDP_CLIP,
                                   clip_norms=payload["clip_norms"])
        payload["params"] = _full_params(model)
        payload["reports_big_norm"] = bool(tracker._big_params())
    elif name == "errors_4":
        payload["errors"] = mesh_errors()
    else:
        raise ValueError(f"unknown scenario {name!r}")
    _save(out_dir, name, rank, payload)


def _error_of(fn: Any) -> str:
    try:
        fn()
    except (TypeError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def mesh_errors() -> dict[str, str]:
    """Layouts the FSDP adapter must refuse (messages pinned by the parent test)."""
    from cbs_tracker.integrations.fsdp import FSDPTracker
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    dp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    fsdp_dp = _fsdp_model(mesh=dp_tp["dp"])
    # the world as DP group, but FSDP only spans the dp dimension
    out["covers"] = _error_of(lambda: FSDPTracker(fsdp_dp, process_group=dist.group.WORLD))
    # HSDP-like 2-D mesh without naming the DP dimensions
    fsdp_2d = _fsdp_model(mesh=dp_tp)
    out["2d_unnamed"] = _error_of(lambda: FSDPTracker(fsdp_2d))
    # parameters sharded along "tp", which is not data parallel
    out["tp_sharded"] = _error_of(lambda: FSDPTracker(fsdp_2d, device_mesh=dp_tp, mesh_dim="dp"))
    # FSDP over all 4 ranks but the DP group is one mesh column
    fsdp_world = _fsdp_model(mesh=init_device_mesh("cpu", (4,)))
    before = sum(len(m._forward_pre_hooks) for m in fsdp_world.modules())
    out["overlap"] = _error_of(lambda: FSDPTracker(fsdp_world, device_mesh=dp_tp, mesh_dim="dp"))
    # a refused model keeps no hooks of ours (FSDP's own pre-forward hooks stay)
    out["hooks_added_by_refusal"] = str(sum(len(m._forward_pre_hooks) for m in fsdp_world.modules()) - before)
    return out


def error_scenario(rank: int, out_dir: str) -> None:
    """Configuration errors that need an FSDP2 model (2 ranks)."""
    from cbs_tracker.integrations.fsdp import FSDPTracker
    from torch.distributed.fsdp import fully_shard

    model = _fsdp_model()
    errors = {
        "cbs_tracker_on_fsdp": _error_of(lambda: CBSTracker(model)),
        "gradient_sync": _error_of(lambda: FSDPTracker(model, gradient_sync="first")),
        "adam": _error_of(
            lambda: FSDPTracker(model, torch.optim.Adam(model.parameters()), preconditioner="adam")
        ),
    }
    partial = make_model()
    fully_shard(partial, ignored_params={partial[2].bias})
    errors["unmanaged"] = _error_of(lambda: FSDPTracker(partial))
    _save(out_dir, "errors_2", rank, {"errors": errors})

