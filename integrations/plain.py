"""``CBSTracker``: the plain PyTorch loop (and DDP, and Lightning Fabric) adapter.

Usage::

    tracker = CBSTracker(model, optimizer, accumulation_steps=4, lr_scheduler=scheduler)
    while tracker.starting_batch_steps < total_steps:      # the same units as a constant run
        for _ in range(tracker.accumulation_steps):        # may change between windows
            x, y = next(batches)
            with tracker.microbatch(labels=y):             # DDP no_sync on all but the last
                loss = model(x, y) / tracker.accumulation_steps
                loss.backward()
        tracker.step()                                     # after unscale_, before clipping
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()                                   # advanced on its units-seen timing
        optimizer.zero_grad(set_to_none=True)

A Lightning Fabric loop passes what ``fabric.setup(model, optimizer)`` returned and calls
``fabric.backward(loss / tracker.accumulation_steps)`` inside ``tracker.microbatch`` (which
replaces ``fabric.no_backward_sync``); ``fabric.clip_gradients`` after :meth:`step` works as usual.

The loss normalisation it assumes and the rest are in docs/design.md.
"""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from cbs_tracker.core import distributed as cbs_dist
from cbs_tracker.core.loop import LoopTracker
from cbs_tracker.core.measure import loss_scale

__all__ = ["CBSTracker"]


class CBSTracker(LoopTracker):
    """Measures the gradient noise scale of a training loop and (with a controller) sets its accumulation.

    A ``DistributedDataParallel`` model is recognised: hooks go on ``model.module``,
    ``no_sync`` is applied on all but the last microbatch of each window, and a window
    that does not run :attr:`accumulation_steps` microbatches stops the run before the
    optimizer steps on gradients that were never all-reduced. Arguments: see
    :class:`~cbs_tracker.core.loop.LoopTracker`.

    A Lightning Fabric model (what ``fabric.setup`` returns) is recognised too, without
    importing Lightning: hooks go on the module given to ``fabric.setup``; under a DDP
    strategy ``no_sync`` is applied through the DDP module inside it (so the loop does not
    use ``fabric.no_backward_sync``); a Fabric-wrapped optimizer is unwrapped; and the
    precision plugin's ``GradScaler`` (``"16-mixed"``) is found by itself and left to
    unscale the gradients where Fabric does (``fabric.clip_gradients`` or
    ``optimizer.step()``; :meth:`clip_grad_norm_` unscales them first). Fabric's
    single-device and DDP strategies are supported.

    Raises:
        TypeError: an FSDP2 model (use ``FSDPTracker``), a Fabric model of another strategy
            (FSDP, DeepSpeed...), or a bad argument.
        ValueError: a bad argument value (the message names it), or a ``grad_scaler`` other
            than the Fabric precision plugin's.
    """

    def __init__(self, model: nn.Module, optimizer: Any | None = None, **kwargs: Any) -> None:
        name = type(self).__name__
        inner = model  # the module that gets the forward (DDP or the user's)
        self._fabric_module: nn.Module | None = None  # the module given to fabric.setup
        self._fabric_scaler = False  # the Fabric precision plugin's scaler: Fabric unscales
        if _is_fabric_module(model):
            inner, self._fabric_module = _fabric_inner(model, name)
            optimizer = _fabric_optimizer(optimizer, kwargs.get("lr_scheduler"))
            scaler = getattr(getattr(model._strategy, "precision", None), "scaler", None)
            given = kwargs.get("grad_scaler")
            if given is not None and given is not scaler:
                raise ValueError(
                    f"{name}(grad_scaler={type(given).__name__}): not the scaler of the Fabric model's precision "
                    f"plugin ({_precision_name(model)}), which scales the losses fabric.backward runs; leave "
                    "grad_scaler unset, the tracker finds the plugin's own"
                )
            kwargs["grad_scaler"] = scaler
            self._fabric_scaler = scaler is not None
        # imported iff the user may have called fully_shard
        fsdp = sys.modules.get("torch.distributed.fsdp")
        if fsdp is not None and isinstance(inner, fsdp.FSDPModule):
            raise TypeError(
                f"CBSTracker(model={type(inner).__name__}): an FSDP2 (fully_shard) model needs "
                "cbs_tracker.integrations.fsdp.FSDPTracker (the sharded parameters' hooks never fire)"
            )
        self._ddp = isinstance(inner, nn.parallel.DistributedDataParallel)
        self._ddp_module = inner if self._ddp else None
        # DDP with static_graph=True fails on no_sync() before one synced iteration.
        self._needs_synced_first_step = self._ddp and bool(getattr(inner, "static_graph", False))
        super().__init__(model, optimizer, **kwargs)
        self._sync_free = not self._ddp and type(self)._sync_context is CBSTracker._sync_context

    def _unwrap(self, model: nn.Module) -> nn.Module:
        if self._fabric_module is not None:
            return self._fabric_module
        return model.module if self._ddp else model

    def _averaging_ranks(self, grads_averaged_over_ranks: bool | None) -> int:
        if self._ddp and grads_averaged_over_ranks in (None, True):
            # DDP averages over its own process group
            return cbs_dist.group_size(getattr(self._ddp_module, "process_group", None))
        return super()._averaging_ranks(grads_averaged_over_ranks)

    def _skips_sync(self) -> bool:
        return self._ddp

    def _sync_context(self, last: bool) -> AbstractContextManager[Any]:
        if self._ddp and self._unsynced(last):
            return self._ddp_module.no_sync()  # type: ignore[union-attr]
        return nullcontext()

    def _unsynced(self, last: bool) -> bool:
        if not self._ddp:
            return super()._unsynced(last)
        sync_anyway = self._needs_synced_first_step and self.session.step == 0
        return not last and not sync_anyway

    # ------------------------------------------------------------------ Fabric's loss scale
    def _loss_scale(self) -> torch.Tensor | None:
        if not self._fabric_scaler:
            return super()._loss_scale()
        if not self.grad_scaler.is_enabled():
            return None
        # not unscaled here: fabric.clip_gradients unscales (a second unscale_ would raise)
        return loss_scale(self.grad_scaler)

    def _grads_still_scaled(self) -> bool:
        if not self._fabric_scaler or self.optimizer is None or not self.grad_scaler.is_enabled():
            return False
        states = self.grad_scaler._per_optimizer_states
        stage = states.get(id(_raw(self.optimizer)), {}).get("stage")
        return stage is None or getattr(stage, "name", "") == "READY"

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """See :meth:`~cbs_tracker.core.loop.LoopTracker.clip_grad_norm_`; with a Fabric
        ``GradScaler`` the gradients are unscaled first (as ``fabric.clip_gradients`` does)."""
        if self._fabric_scaler and self._grads_still_scaled():
            self.grad_scaler.unscale_(_raw(self.optimizer))
        return super().clip_grad_norm_(
            max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )


# ---------------------------------------------------------------------------- Lightning Fabric
def _is_fabric_module(model: Any) -> bool:
    """``lightning.fabric``'s ``_FabricModule``, by duck typing (Lightning is never imported here)."""
    return all(
        isinstance(getattr(model, attr, None), nn.Module)
        for attr in ("_forward_module", "_original_module")
    ) and hasattr(model, "_strategy")


def _fabric_inner(model: nn.Module, name: str) -> tuple[nn.Module, nn.Module]:
    """The module Fabric's forward runs (the DDP wrapper, or the user's module) and the user's module."""
    forward, original = model._forward_module, model._original_module
    # fabric.setup re-applies torch.compile outside the strategy's wrapper
    forward = getattr(forward, "_orig_mod", forward)
    if isinstance(forward, nn.parallel.DistributedDataParallel):
        if forward.module is not original:
            raise TypeError(
                f"{name}(model=_FabricModule): its DistributedDataParallel wraps a {type(forward.module).__name__}, "
                f"not the module given to fabric.setup ({type(original).__name__})"
            )
        return forward, original
    if forward is not original:
        raise TypeError(
            f"{name}(model=_FabricModule around {type(forward).__name__}, strategy "
            f"{type(model._strategy).__name__}): the plain tracker supports Fabric's single-device and DDP "
            "strategies ('auto' on one device, 'ddp'); under FSDP or DeepSpeed the per-microbatch gradients "
            "are sharded or accumulated by the engine"
        )
    return original, original


def _fabric_optimizer(optimizer: Any, lr_scheduler: Any) -> Any:
    """The optimizer inside a ``_FabricOptimizer`` (Fabric's scaler keys its state by it), unless the
    scheduler was built on the Fabric-wrapped one (whose ``param_groups`` and ``state`` are the same)."""
    inner = getattr(optimizer, "_optimizer", None)
    if not isinstance(inner, torch.optim.Optimizer):
        return optimizer
    if lr_scheduler is not None and getattr(lr_scheduler, "optimizer", None) is optimizer:
        return optimizer
    return inner


def _raw(optimizer: Any) -> Any:
    inner = getattr(optimizer, "_optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _precision_name(model: nn.Module) -> str:
    precision = getattr(model._strategy, "precision", None)
    return str(getattr(precision, "precision", type(precision).__name__))
