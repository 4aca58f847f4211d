"""``CBSTracker``: the plain PyTorch loop (and DDP) adapter.

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

The loss normalisation it assumes and the rest are in docs/design.md.
"""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from torch import nn

from cbs_tracker.core import distributed as cbs_dist
from cbs_tracker.core.loop import LoopTracker

__all__ = ["CBSTracker"]


class CBSTracker(LoopTracker):
    """Measures the gradient noise scale of a training loop and (with a controller) sets its accumulation.

    A ``DistributedDataParallel`` model is recognised: hooks go on ``model.module``,
    ``no_sync`` is applied on all but the last microbatch of each window, and a window
    that does not run :attr:`accumulation_steps` microbatches stops the run before the
    optimizer steps on gradients that were never all-reduced. Arguments: see
    :class:`~cbs_tracker.core.loop.LoopTracker`.

    Raises:
        TypeError: an FSDP2 model (use ``FSDPTracker``), or a bad argument.
        ValueError: a bad argument value (the message names it).
    """

    def __init__(self, model: nn.Module, optimizer: Any | None = None, **kwargs: Any) -> None:
        fsdp = sys.modules.get("torch.distributed.fsdp")  # imported iff the user may have called fully_shard
        if fsdp is not None and isinstance(model, fsdp.FSDPModule):
            raise TypeError(
                f"CBSTracker(model={type(model).__name__}): an FSDP2 (fully_shard) model needs "
                "cbs_tracker.integrations.fsdp.FSDPTracker (the sharded parameters' hooks never fire)"
            )
        self._ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        # DDP with static_graph=True fails on no_sync() before one synced iteration.
        self._needs_synced_first_step = self._ddp and bool(getattr(model, "static_graph", False))
        super().__init__(model, optimizer, **kwargs)

    def _unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if self._ddp else model

    def _averaging_ranks(self, grads_averaged_over_ranks: bool | None) -> int:
        if self._ddp and grads_averaged_over_ranks in (None, True):
            # DDP averages over its own process group
            return cbs_dist.group_size(getattr(self.model, "process_group", None))
        return super()._averaging_ranks(grads_averaged_over_ranks)

    def _skips_sync(self) -> bool:
        return self._ddp

    def _sync_context(self, last: bool) -> AbstractContextManager[Any]:
        return self.model.no_sync() if self._ddp and self._unsynced(last) else nullcontext()

    def _unsynced(self, last: bool) -> bool:
        if not self._ddp:
            return super()._unsynced(last)
        sync_anyway = self._needs_synced_first_step and self.session.step == 0
        return not last and not sync_anyway
