"""The one module that talks to ``torch.distributed``: the DP group and the per-step reduction.

Plain functions taking the process group as an argument. The tracker adds one
``all_reduce(SUM)`` of a short float64 vector per optimizer step; state that
combines by a plain sum (sums and counts) makes that reduction exact.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def resolve_dp_group(
    process_group: Any | None = None,
    device_mesh: Any | None = None,
    mesh_dim: str | tuple[str, ...] | None = None,
) -> Any | None:
    """The data-parallel process group (``None`` = the default world group, or no distribution).

    Only ranks that see different data belong to it: tensor, pipeline, context
    and expert parallel ranks share tokens and never multiply the batch.

    Args:
        process_group: an explicit DP group.
        device_mesh: a ``DeviceMesh``; with ``mesh_dim`` naming its DP dimension(s).
        mesh_dim: e.g. ``"dp"`` or ``("dp_replicate", "dp_shard")`` for HSDP.

    Raises:
        ValueError: both ``process_group`` and ``device_mesh`` given, or a mesh
            without ``mesh_dim`` (for a mesh of more than one dimension), or an unknown name.
    """
    if process_group is not None and device_mesh is not None:
        raise ValueError(
            "CBSTracker(process_group=..., device_mesh=...): give one of them, not both"
        )
    if device_mesh is None:
        if mesh_dim is not None:
            raise ValueError(f"CBSTracker(mesh_dim={mesh_dim!r}): needs device_mesh=")
        return process_group
    names = tuple(device_mesh.mesh_dim_names or ())
    if mesh_dim is None:
        if device_mesh.ndim == 1:
            return device_mesh.get_group()
        raise ValueError(
            f"CBSTracker(device_mesh=<{device_mesh.ndim}-D mesh {names}>, mesh_dim=None): name the "
            "data-parallel dimension(s), e.g. mesh_dim='dp' or mesh_dim=('dp_replicate', 'dp_shard')"
        )
    wanted = (mesh_dim,) if isinstance(mesh_dim, str) else tuple(mesh_dim)
    unknown = [d for d in wanted if d not in names]
    if unknown:
        raise ValueError(f"CBSTracker(mesh_dim={mesh_dim!r}): {unknown} not in the mesh's dimensions {names}")
    if len(wanted) == 1:
        return device_mesh.get_group(wanted[0])
    return device_mesh[wanted]._flatten().get_group()


def group_size(group: Any | None) -> int:
    """Ranks in ``group`` (1 without ``torch.distributed``)."""
    if not is_distributed():
        return 1
    return dist.get_world_size(group)


def group_rank(group: Any | None) -> int:
    """This rank's index in ``group`` (0 without ``torch.distributed``)."""
    if not is_distributed():
        return 0
    return dist.get_rank(group)


def all_reduce_sum(values: torch.Tensor, group: Any | None) -> torch.Tensor:
    """Sum ``values`` over ``group`` in place and return it (identity without distribution).

    Every rank must call this in every step, in the same order, whatever its
    own gradients look like: it is the tracker's only collective.
    """
    if is_distributed() and group_size(group) > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    return values


def mean_losses(values: list[Any], group: Any | None) -> list[float]:
    """Windows' losses (numbers, one-element tensors on one device, ``None`` for none given) as floats, each the
    mean over the ranks of ``group`` that gave one (``nan`` where none did): the tensors read in one transfer
    and, on several ranks, one ``all_reduce`` of each window's sum and count (every rank the same windows)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    read = iter(torch.stack(tensors).double().tolist() if tensors else ())
    local = [math.nan if v is None else next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]
    if not (is_distributed() and group_size(group) > 1):
        return local
    given = [math.isfinite(v) for v in local]
    t = torch.tensor([v if ok else 0.0 for v, ok in zip(local, given)] + [float(ok) for ok in given],
                     dtype=torch.float64, device=reduction_device(group, torch.device("cpu")))
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    sums, counts = t.tolist()[:len(local)], t.tolist()[len(local):]
    return [s / c if c else math.nan for s, c in zip(sums, counts)]


def all_reduce_min(value: int, group: Any | None, device: torch.device | None = None) -> int:
    """The smallest ``value`` over ``group`` (``max_microbatch="auto"``: one extra collective per step)."""
    if not (is_distributed() and group_size(group) > 1):
        return value
    t = torch.tensor([value], dtype=torch.int64, device=reduction_device(group, device or torch.device("cpu")))
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def reduction_device(group: Any | None, fallback: torch.device) -> torch.device:
    """Where the reduction vector must live: the backend's device (CUDA for NCCL, CPU for gloo)."""
    if not is_distributed():
        return fallback
    backend = dist.get_backend(group)
    if "nccl" in str(backend).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if str(backend).lower() == "gloo":
        return torch.device("cpu")
    return fallback


def global_rank() -> int:
    """Rank in the default process group; 0 when ``torch.distributed`` is not initialised."""
    return int(dist.get_rank()) if is_distributed() else 0
