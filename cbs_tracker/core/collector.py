"""Per-microbatch and per-step squared gradient norms from parameter hooks (torch, no collectives).

``param.register_hook`` fires once per backward with that microbatch's **local**
gradient, before it is added into ``.grad`` and before DDP's all-reduce (also
on the synchronising microbatch). The hook reduces each parameter's gradient
to one float32 norm (float64 for float64 gradients) on the gradient's device; the norms of one microbatch are
combined by one ``stack().square().sum()`` when the microbatch ends. Nothing
is copied to the host here: the per-step numbers stay on the device until the
tracker reduces them across ranks and reads them once per optimizer step.

Shapes and scales: every tensor this module returns is a 0-d float32 tensor
(float64 when gradients are float64) on the gradient device, still carrying whatever factor the loss had (``1/A``
division, AMP loss scale); the tracker removes those factors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

# (param, local gradient) -> gradient to measure (e.g. Adam-preconditioned), or None to skip
GradTransform = Callable[[nn.Parameter, torch.Tensor], "torch.Tensor | None"]


@dataclass(frozen=True)
class StepStats:
    """One optimizer step's norms after the DP reduction, on one scale, as host numbers.

    Attributes:
        small_sq_norm: mean over the step's microbatches (all ranks) of ``|g_k|^2``,
            ``g_k`` the microbatch's mean-loss gradient (loss and AMP scale removed).
        big_sq_norm: ``|mean_k g_k|^2``, the squared norm of the step's mean gradient.
        num_microbatches: ``K``, microbatches in the step over all DP ranks.
        small_batch: harmonic mean of the microbatch sizes (``B_small``), in the unit.
        units: plain sum of the microbatch sizes (the step's global batch), in the unit.
        finite: every rank's gradients were finite.
    """

    small_sq_norm: float
    big_sq_norm: float
    num_microbatches: int
    small_batch: float
    units: float
    finite: bool

    @property
    def big_batch(self) -> float:
        """``B_big = K * B_small``."""
        return self.num_microbatches * self.small_batch


def adam_preconditioner(optimizer: torch.optim.Optimizer) -> GradTransform:
    """Gradients divided by Adam's ``sqrt(v_hat) + eps`` (Kingma & Ba 2015).

    ``v_hat = exp_avg_sq / (1 - beta2^step)`` is read from the optimizer's state as
    it stands before this step's update (the preconditioner this step's update
    will almost use). Works for ``torch.optim.Adam``/``AdamW`` and any optimizer
    keeping ``exp_avg_sq`` and ``step`` per parameter and ``betas``/``eps`` per group.
    A parameter without state yet (before the first step) returns ``None``.

    Raises:
        ValueError: if a param group has no ``betas``/``eps`` (not an Adam-like optimizer).
    """
    group_of: dict[int, dict] = {}
    for group in optimizer.param_groups:
        if "betas" not in group or "eps" not in group:
            raise ValueError(
                f"CBSTracker(preconditioner='adam'): optimizer {type(optimizer).__name__} has a param "
                "group without 'betas'/'eps'; use an Adam-like optimizer or preconditioner=None"
            )
        for p in group["params"]:
            group_of[id(p)] = group

    def transform(param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor | None:
        state = optimizer.state.get(param)
        group = group_of.get(id(param))
        if not state or group is None or "exp_avg_sq" not in state:
            return None
        step = float(state["step"])
        bias2 = 1.0 - group["betas"][1] ** step
        exp_avg_sq = state["exp_avg_sq"]
        if hasattr(exp_avg_sq, "to_local"):  # FSDP2: state is sharded like the parameter
            exp_avg_sq = exp_avg_sq.to_local()
        denom = (exp_avg_sq.float() / bias2).sqrt_().add_(group["eps"])
        return grad.float() / denom

    return transform


class GradStatsCollector:
    """Sums the squared norms of per-microbatch local gradients, batched, without host syncs.

    Args:
        params: parameters whose gradients are measured (the ones a hook sees:
            ``ddp.module.parameters()``, or FSDP2's unsharded parameters).
        transform: optional map applied to each gradient before its norm (e.g.
            :func:`adam_preconditioner`); a ``None`` result marks the microbatch as
            unmeasurable (e.g. no optimizer state yet).
        register: register hooks on ``params`` now (FSDP2 adapters register later).
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        *,
        transform: GradTransform | None = None,
        register: bool = True,
    ) -> None:
        self.transform = transform
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._hooked: set[int] = set()
        self._recording = False
        self._partials: list[torch.Tensor] = []
        self._skipped = False
        self._micro_sq: list[torch.Tensor] = []
        # sizes given as numbers stay on the host until the step (no copy per microbatch)
        self._micro_size: list[torch.Tensor | float] = []
        self.window_unmeasurable = False
        if register:
            for p in params:
                self.hook(p)

    # ------------------------------------------------------------------ hooks
    def hook(self, param: nn.Parameter) -> None:
        """Register the norm hook on ``param`` once (repeated calls are no-ops)."""
        if not param.requires_grad or id(param) in self._hooked:
            return
        self._hooked.add(id(param))
        self._handles.append(param.register_hook(self._make_hook(param)))

    def _make_hook(self, param: nn.Parameter) -> Callable[[torch.Tensor], None]:
        def fn(grad: torch.Tensor) -> None:
            if not self._recording:
                return
            g = grad if self.transform is None else self.transform(param, grad)
            if g is None:
                self._skipped = True
                return
            self._partials.append(torch.linalg.vector_norm(g, dtype=_norm_dtype(g.dtype)))

        return fn

    def remove(self) -> None:
        """Remove every hook (the model is left as it was)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._hooked.clear()

    @property
    def num_hooks(self) -> int:
        return len(self._handles)

    # ------------------------------------------------------------------ window
    def begin_microbatch(self) -> None:
        """Start recording the hooks of one microbatch's backward."""
        if self._recording:
            raise RuntimeError("GradStatsCollector.begin_microbatch: the previous microbatch was not ended")
        self._recording = True
        self._partials = []
        self._skipped = False

    def end_microbatch(self, size: torch.Tensor | float) -> None:
        """Close the microbatch; ``size`` is its loss-contributing units (tokens or samples)."""
        self._recording = False
        if self._skipped:
            self.window_unmeasurable = True
        if self._partials:
            sq = torch.stack(self._partials).square().sum()
        else:
            # No hook fired (no backward in this microbatch, or no trainable params).
            sq = torch.zeros((), dtype=torch.float32)
        self._partials = []
        self._micro_sq.append(sq)
        self._micro_size.append(size if isinstance(size, torch.Tensor) else float(size))

    @property
    def num_microbatches(self) -> int:
        """Microbatches ended in the current window on this rank."""
        return len(self._micro_sq)

    def microbatch_sq_norms(self) -> list[torch.Tensor]:
        """The window's per-microbatch squared norms (0-d tensors, loss scale still in)."""
        return list(self._micro_sq)

    def window_sums(self, device: torch.device) -> torch.Tensor:
        """``[sum_k |h_k|^2, K, sum_k 1/b_k, sum_k b_k]`` of this rank's window, float64 on ``device``.

        ``h_k`` are the hooked gradients as the backward produced them (loss
        division and AMP scale still in).
        """
        if not self._micro_sq:
            return torch.zeros(4, dtype=torch.float64, device=device)
        sq = torch.stack([t.to(device) for t in self._micro_sq]).double()
        host = [float(v) for v in self._micro_size if not isinstance(v, torch.Tensor)]
        on_device = [v.to(device).double() for v in self._micro_size if isinstance(v, torch.Tensor)]
        parts = on_device + ([torch.tensor(host, dtype=torch.float64, device=device)] if host else [])
        size = torch.cat([t.reshape(-1) for t in parts])
        inv = torch.where(size > 0, 1.0 / size.clamp_min(1e-30), torch.zeros_like(size))
        count = torch.tensor(float(len(self._micro_sq)), dtype=torch.float64, device=device)
        return torch.stack([sq.sum(), count, inv.sum(), size.sum()])

    def reset_window(self) -> None:
        self._micro_sq = []
        self._micro_size = []
        self.window_unmeasurable = False


def local_grad_sq_norm(
    params: Iterable[nn.Parameter], transform: GradTransform | None = None
) -> torch.Tensor | None:
    """This rank's ``sum_p |p.grad|^2`` as a 0-d float32/64 tensor (``None`` if no grads).

    A ``DTensor`` gradient (FSDP2) contributes its local shard, so summing the
    result over the shard group gives the global squared norm. With a
    ``transform`` the transformed gradients are measured; a ``None`` from it
    returns ``None`` (unmeasurable step).
    """
    grads: list[torch.Tensor] = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        if hasattr(g, "to_local"):
            g = g.to_local()
        if transform is not None:
            g = transform(p, g)
            if g is None:
                return None
        grads.append(g)
    if not grads:
        return None
    by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault((g.device, _norm_dtype(g.dtype)), []).append(g)
    total: torch.Tensor | None = None
    for (_, norm_dtype), dev_grads in by_device.items():
        # one fused pass per device and dtype; float32 so fp16 gradients cannot overflow
        norms = torch._foreach_norm(dev_grads, 2, dtype=norm_dtype)
        part = torch.stack(norms).square().sum()
        total = part if total is None else total + part.to(total.device)
    return total


def _norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half/bf16/float32 gradients (no overflow), float64 for float64 (no narrowing)."""
    return torch.promote_types(dtype, torch.float32)
