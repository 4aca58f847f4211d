"""Spawned workers for the collector's DDP and FSDP2 tests (gloo ranks on CPU).

Each rank feeds its own microbatches to a small GPT (embedding tied to the head)
wrapped in DDP or FSDP2, with two sets of hooks on the same parameters: the
bucketed :class:`~cbs_tracker.core.collector.GradStatsCollector` and
:class:`PerParameterReference`, which takes each gradient's norm inside its hook
(the per-parameter computation the collector replaces). Every rank writes both
lists of per-microbatch squared norms to one JSON file per scenario.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cbs_tracker.core.collector import GradStatsCollector, GradTransform, adam_preconditioner
from cbs_tracker.demo.gpt import GPT, GPTConfig

STEPS = 3
LOSS_SCALE = 1024.0  # an AMP-like constant loss scale: the hooked gradients carry it


class PerParameterReference:
    """One norm per gradient, taken inside its hook, summed in squares per microbatch."""

    def __init__(self, transform: GradTransform | None = None) -> None:
        self.transform = transform
        self.recording = False
        self.partials: list[torch.Tensor] = []
        self.sq: list[float] = []
        self.hooked: set[int] = set()

    def hook(self, param: nn.Parameter) -> None:
        if param.requires_grad and id(param) not in self.hooked:
            self.hooked.add(id(param))
            param.register_hook(lambda g, p=param: self._on_grad(p, g))

    def _on_grad(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        if not self.recording:
            return
        g = grad if self.transform is None else self.transform(param, grad)
        if g is not None:
            self.partials.append(torch.linalg.vector_norm(g.double()).square())

    def begin(self) -> None:
        self.recording = True
        self.partials = []

    def end(self) -> None:
        self.recording = False
        self.sq.append(float(sum(self.partials)))


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, context_length=8, n_layer=2, d_model=16, n_head=2))


def batch(step: int, rank: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + 100 * rank + index)
    n = 2 + (rank + index) % 2
    x = torch.randint(0, 32, (n, 8), generator=gen)
    y = torch.randint(0, 32, (n, 8), generator=gen)
    return x, y


def _ddp_scenario(name: str, rank: int) -> dict[str, Any]:
    model = tiny_gpt()
    ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=name == "ddp_bucket_view")
    adam = name == "ddp_adam"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2) if adam else torch.optim.SGD(model.parameters(), lr=0.1)
    transform = adam_preconditioner(opt) if adam else None
    collector = GradStatsCollector(model.parameters(), transform=transform)
    ref = PerParameterReference(transform)
    for p in model.parameters():
        ref.hook(p)
    # accumulation 1: every microbatch synchronises and starts with .grad None
    accumulation = 1 if name == "ddp_sync_every" else 2
    unmeasurable = []
    norms: list[float] = []
    for step in range(STEPS):
        for j in range(accumulation):
            x, y = batch(step, rank, j)
            ctx = ddp.no_sync() if j < accumulation - 1 else _Null()
            collector.begin_microbatch()
            ref.begin()
            with ctx:
                _, loss = ddp(x, y)
                (loss * LOSS_SCALE / accumulation).backward()
            collector.end_microbatch(torch.tensor(x.numel()))
            ref.end()
        unmeasurable.append(collector.window_unmeasurable)
        norms += [float(t) for t in collector.microbatch_sq_norms()]
        collector.reset_window()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"collector": norms, "reference": ref.sq,
            "unmeasurable": unmeasurable}


def _fsdp_scenario(name: str, rank: int) -> dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    model = tiny_gpt()
    kwargs: dict[str, Any] = {}
    if name == "fsdp_bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    collector = GradStatsCollector([], register=False)
    ref = PerParameterReference()
    sharded = {id(p) for p in model.parameters()}

    def hook_unsharded(module: nn.Module, args: Any) -> None:
        for p in module.parameters():
            if p.requires_grad and id(p) not in sharded:  # FSDP's unsharded parameters
                collector.hook(p)
                ref.hook(p)

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.register_forward_pre_hook(hook_unsharded)
    accumulation = 2
    norms: list[float] = []
    for step in range(STEPS):
        for j in range(accumulation):
            if name != "fsdp_every":
                model.set_requires_gradient_sync(j == accumulation - 1)
            x, y = batch(step, rank, j)
            collector.begin_microbatch()
            ref.begin()
            _, loss = model(x, y)
            (loss * LOSS_SCALE / accumulation).backward()
            collector.end_microbatch(float(x.numel()))
            ref.end()
        norms += [float(t) for t in collector.microbatch_sq_norms()]
        collector.reset_window()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"collector": norms, "reference": ref.sq,
            "unmeasurable": [], "hooks": collector.num_hooks}


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def run(rank: int, world: int, init_file: str, out_dir: str, names: list[str]) -> None:
    """Spawn target: every scenario in ``names``, one JSON file per scenario and rank."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        for name in names:
            out = _fsdp_scenario(name, rank) if name.startswith("fsdp") else _ddp_scenario(name, rank)
            (Path(out_dir) / f"{name}.rank{rank}.json").write_text(json.dumps(out))
        dist.barrier()  # both ranks done before the group goes away (gloo aborts otherwise)
    finally:
        dist.destroy_process_group()
