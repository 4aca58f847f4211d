"""FSDP2 adapter: ``FSDPTracker`` measures the noise scale of a ``fully_shard`` model.

The plain-loop API of :class:`~cbs_tracker.core.loop.LoopTracker`, unchanged: build it on
the root ``FSDPModule`` and its optimizer, wrap each microbatch in ``tracker.microbatch()``
(gradient sync on the last one only, ``gradient_sync="last"``) and call ``tracker.step()``
before clipping. It hooks FSDP's unsharded parameters and reads the big norm from the
local shards of ``.grad``; the FSDP2 facts it relies on are in docs/design.md.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

import torch
from torch import nn

from cbs_tracker.core import distributed as cbs_dist
from cbs_tracker.core.loop import LoopTracker, refuse_pipeline

__all__ = ["FSDPTracker", "GradientSync"]

GradientSync = Literal["last", "every"]


def _fsdp_module_type() -> type:
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def _dtensor_type() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


class FSDPTracker(LoopTracker):
    """:class:`~cbs_tracker.core.loop.LoopTracker` for a model wrapped with FSDP2's ``fully_shard``.

    Args:
        model: the root module, itself an ``FSDPModule`` (``fully_shard(model)`` was
            called on it, after its sub-modules).
        optimizer: the optimizer over the sharded parameters (may be ``None``).
        gradient_sync: ``"last"`` (default): the tracker disables FSDP's gradient
            sync on all but the last microbatch of each window; ``"every"``: the
            tracker leaves it alone (FSDP reduces every microbatch, or whatever the
            loop sets).
        **kwargs: every keyword of :class:`~cbs_tracker.core.loop.LoopTracker`
            (``accumulation_steps``, ``unit``, ``controller``, ``process_group`` or
            ``device_mesh`` + ``mesh_dim``, ``grad_scaler``, ``estimator``, ...).

    Raises:
        TypeError: ``model`` is not an ``FSDPModule``.
        ValueError: an unknown ``gradient_sync``, ``preconditioner="adam"``, parameters
            FSDP does not manage, or a mesh layout the DP group does not match.
    """

    big_norm_is_sharded = True
    oom_recoverable = False

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        gradient_sync: GradientSync = "last",
        **kwargs: Any,
    ) -> None:
        refuse_pipeline(model, "FSDPTracker")
        fsdp_module = _fsdp_module_type()
        dtensor = _dtensor_type()
        if not isinstance(model, fsdp_module):
            raise TypeError(
                f"FSDPTracker(model={type(model).__name__}): expected the root module after "
                "fully_shard(model) (an FSDPModule); use CBSTracker for plain or DDP models"
            )
        if gradient_sync not in ("last", "every"):
            raise ValueError(f"FSDPTracker(gradient_sync={gradient_sync!r}): must be 'last' or 'every'")
        if kwargs.get("preconditioner") is not None:
            raise ValueError(
                f"FSDPTracker(preconditioner={kwargs['preconditioner']!r}): not supported with FSDP2 "
                "(the per-microbatch gradients are unsharded, Adam's second moments are sharded); "
                "use preconditioner=None"
            )
        sharded = [p for p in model.parameters() if p.requires_grad]
        unmanaged = [n for n, p in model.named_parameters() if p.requires_grad and not isinstance(p, dtensor)]
        if unmanaged:
            raise ValueError(
                f"FSDPTracker(model=...): parameters {unmanaged[:5]} are not managed by FSDP "
                "(ignored_params?); their gradients are not synced, so the step's gradient is not "
                "measurable. Shard them or set requires_grad=False"
            )
        meshes = {id(p.device_mesh): p.device_mesh for p in sharded}
        if (
            kwargs.get("process_group") is None
            and kwargs.get("device_mesh") is None
            and kwargs.get("mesh_dim") is None
            and len(meshes) == 1
        ):
            (mesh,) = meshes.values()
            if mesh.ndim != 1:
                raise ValueError(
                    f"FSDPTracker(device_mesh=None): the parameters are sharded on a {mesh.ndim}-D mesh "
                    f"{tuple(mesh.mesh_dim_names or ())}; name its data-parallel dimension(s), e.g. "
                    "device_mesh=mesh, mesh_dim=('dp_replicate', 'dp_shard') for HSDP"
                )
            kwargs["process_group"] = mesh.get_group(0)
        self.gradient_sync: GradientSync = gradient_sync
        self._sharded_ids = {id(p) for p in sharded}
        self._fsdp_modules = [m for m in model.modules() if isinstance(m, fsdp_module)]
        self._pre_hook_handles: list[torch.utils.hooks.RemovableHandle] = []
        super().__init__(model, optimizer, **kwargs)
        try:
            layouts: dict[tuple[int, tuple[Any, ...]], bool] = {}
            for p in sharded:  # usually one mesh and one placement for all parameters
                key = (id(p.device_mesh), tuple(p.placements))
                if key not in layouts:
                    layouts[key] = _reports_big_norm(p.device_mesh, key[1], self.dp_group, self.dp_degree)
            self._big_report_params = [p for p in sharded if layouts[(id(p.device_mesh), tuple(p.placements))]]
        except ValueError:
            self.remove_hooks()  # leave the model as it was
            raise

    # ------------------------------------------------------------------ adapter points
    def _register_hooks(self) -> None:
        # The objects the norm hooks go on exist only after FSDP's first all-gather: a
        # forward-pre-hook (after FSDP's own, which all-gathers) hooks the unsharded ones.
        if not self._sharded_ids:
            raise ValueError(
                f"FSDPTracker(model={type(self.model).__name__}): the model has no parameter with "
                "requires_grad=True, so there is no gradient to measure"
            )
        for module in self._fsdp_modules:
            self._pre_hook_handles.append(module.register_forward_pre_hook(self._hook_unsharded))

    def _refresh_params(self) -> None:
        # The trainable set is fixed at construction under FSDP2 (see docs/design.md).
        pass

    def _hook_unsharded(self, module: nn.Module, args: Any) -> None:
        if not self.engine.measure:  # a window not measured needs no hook (the next measured forward hooks them)
            return
        for p in module.parameters():
            if p.requires_grad and id(p) not in self._sharded_ids:
                self.collector.hook(p)  # once per object

    def _big_params(self) -> list[nn.Parameter]:
        # HSDP: replicas hold the same shard; only replica 0 reports it (the others add 0).
        return self._big_report_params

    def _skips_sync(self) -> bool:
        return self.gradient_sync == "last"

    def _unsynced(self, last: bool) -> bool:
        # the hooks sit on the unsharded parameters; .grad holds the reduce-scattered shard
        return False

    def _sync_context(self, last: bool) -> AbstractContextManager[Any]:
        if self.gradient_sync == "last":
            self.model.set_requires_gradient_sync(last)
        return nullcontext()

    def remove_hooks(self) -> None:
        """Detach from the model: the norm hooks and the forward-pre-hooks."""
        for h in self._pre_hook_handles:
            h.remove()
        self._pre_hook_handles.clear()
        super().remove_hooks()


def _group_ranks(group: Any | None) -> set[int]:
    import torch.distributed as dist

    return set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _reports_big_norm(mesh: Any, placements: tuple[Any, ...], dp_group: Any | None, dp_degree: int) -> bool:
    """Check the sharded parameter's mesh against the DP group; say whether this rank reports its shard.

    Each mesh dimension must either lie inside the DP group (data parallel: FSDP's
    shard dimension, or HSDP's replicate dimension) or meet it only in this rank
    (its ranks see the same data and hold their own copy of the DP group's result).
    The data-parallel dimensions must cover the DP group. This rank reports its
    local ``|grad|^2`` unless it is a non-zero coordinate of a data-parallel
    dimension along which the parameter is replicated (HSDP).

    Raises:
        ValueError: the layout does not match the DP group.
    """
    from torch.distributed.tensor import Replicate, Shard

    if not cbs_dist.is_distributed():
        return True
    me = cbs_dist.group_rank(None)
    dp_ranks = _group_ranks(dp_group)
    names = tuple(mesh.mesh_dim_names or (f"dim{i}" for i in range(mesh.ndim)))
    covered = 1
    reports = True
    for dim in range(mesh.ndim):
        ranks = _group_ranks(mesh.get_group(dim))
        placement = placements[dim]
        if ranks <= dp_ranks:
            covered *= len(ranks)
            if isinstance(placement, Replicate) and mesh.get_local_rank(dim) != 0:
                reports = False
        elif ranks & dp_ranks == {me}:
            if isinstance(placement, Shard):
                raise ValueError(
                    f"FSDPTracker: parameters are sharded ({placement!r}) along mesh dimension "
                    f"{names[dim]!r}, which is not data-parallel; tensor-parallel sharding is not "
                    "supported (each rank's hooks would see only its shard)"
                )
        else:
            raise ValueError(
                f"FSDPTracker: mesh dimension {names[dim]!r} (ranks {sorted(ranks)}) partly overlaps the "
                f"data-parallel group (ranks {sorted(dp_ranks)}); pass device_mesh= and mesh_dim= naming "
                "the data-parallel dimension(s) of the mesh FSDP shards on"
            )
    if covered != dp_degree:
        raise ValueError(
            f"FSDPTracker: the data-parallel group has {dp_degree} ranks but FSDP's mesh "
            f"{names} covers {covered} of them; the gradient sync would not span the DP group. "
            "Pass the DP group FSDP shards and replicates over (device_mesh= and mesh_dim=)"
        )
    return reports
