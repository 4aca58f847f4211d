"""One optimizer step's gradient norms on one scale, reduced over the data-parallel group.

The torch-facing half of the step engine: :func:`reduce_window` turns a
collector's per-microbatch norms and the synced ``.grad`` into host numbers
(:class:`~cbs_tracker.core.collector.StepStats`) with one ``all_reduce`` and one
host sync per optimizer step; :func:`unscale_and_get_scale` handles AMP.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cbs_tracker.core import distributed as cbs_dist
from cbs_tracker.core.collector import (
    GradStatsCollector,
    GradTransform,
    StepStats,
    local_grad_sq_norm,
)

__all__ = ["WindowFaults", "reduce_window", "unscale_and_get_scale"]


def unscale_and_get_scale(grad_scaler: Any, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Unscale ``optimizer``'s gradients unless the loop already did; return the loss scale (0-d tensor).

    The scale is the one the backward passes of this window used (``update()`` runs
    after the optimizer step), read without a host sync where torch allows.
    """
    states = getattr(grad_scaler, "_per_optimizer_states", {})
    stage = states.get(id(optimizer), {}).get("stage")
    if stage is None or getattr(stage, "name", "") == "READY":
        grad_scaler.unscale_(optimizer)
    get_async = getattr(grad_scaler, "_get_scale_async", None)
    scale = get_async() if get_async is not None else None
    if scale is None:
        scale = torch.tensor(float(grad_scaler.get_scale()))
    return scale


@dataclass(frozen=True)
class WindowFaults:
    """What the step's reduction found wrong, summed over the DP group (identical on every rank).

    Attributes:
        mismatched_ranks: ranks whose window ran a number of microbatches other than
            the one expected (0 when no expectation was given).
        invalid_sizes: microbatch sizes that were negative or not finite.
        microbatches_run: microbatches run on all ranks, those without any
            loss-contributing unit included (``StepStats.num_microbatches`` leaves them out).
    """

    mismatched_ranks: int = 0
    invalid_sizes: int = 0
    microbatches_run: int = 0


def reduce_window(
    collector: GradStatsCollector,
    big_params: Iterable[nn.Parameter],
    *,
    dp_group: Any | None,
    loss_divisor: float,
    avg_ranks: int,
    scale: torch.Tensor | None = None,
    transform: GradTransform | None = None,
    big_norm_is_sharded: bool = False,
    expected_microbatches: int | None = None,
) -> tuple[StepStats, WindowFaults]:
    """One optimizer step's norms on one scale, reduced over the DP group.

    The hooked microbatch gradients are ``h_k = S g_k / a`` (``S`` the AMP loss scale,
    ``a = loss_divisor`` the factor each microbatch loss was divided by) and the
    synced, unscaled ``.grad`` is ``sum_k g_k / (a R)`` over the ``K`` microbatches of
    all ranks (``R = avg_ranks`` when the sync averages). So
    ``|g_k|^2 = |h_k|^2 a^2 / S^2`` and ``|mean_k g_k|^2 = |.grad|^2 (R a / K)^2``, with
    ``K`` the microbatches really run (a short window is measured with its real size).
    One ``all_reduce`` of 10 float64 numbers and one host sync.

    Args:
        collector: the window's per-microbatch norms (not reset here).
        big_params: parameters whose ``.grad`` holds the synced, unscaled step gradient.
        dp_group: the data-parallel group (``None``: world, or no distribution).
        loss_divisor: ``a`` (1.0: not divided).
        avg_ranks: ``R``, ranks the gradient sync averages over (1: it sums, or one rank).
        scale: the AMP loss scale the hooked gradients carry (``None``: none).
        transform: the collector's gradient transform, applied to ``.grad`` as well.
        big_norm_is_sharded: every rank's ``.grad`` is a shard (sum the partial norms)
            rather than a replica (take rank 0's).
        expected_microbatches: microbatches this rank's window should have run; a rank
            that ran another non-zero number is counted in ``WindowFaults.mismatched_ranks``.

    Returns:
        The reduced :class:`~cbs_tracker.core.collector.StepStats` and :class:`WindowFaults`.
    """
    big = local_grad_sq_norm(big_params, transform)
    ref = big if big is not None else (collector.microbatch_sq_norms() or [torch.zeros(())])[0]
    device = cbs_dist.reduction_device(dp_group, ref.device)
    # what this rank knows on the host: [unmeasurable, mismatched, microbatches it ran]
    local_k = collector.num_microbatches
    flags = [
        float(collector.window_unmeasurable or (big is None and transform is not None)),
        float(expected_microbatches is not None and local_k not in (0, expected_microbatches)),
        float(local_k),
    ]
    if big is not None and not (big_norm_is_sharded or cbs_dist.group_rank(dp_group) == 0):
        big = None  # a replica: one rank reports the big norm
    factor = float(loss_divisor) ** 2  # h_k = S g_k / a, so |g_k|^2 = |h_k|^2 a^2 / S^2
    if device.type == "cpu" and ref.device.type == "cpu" and (scale is None or scale.device.type == "cpu"):
        host = collector.host_window_sums()
        if host is not None:
            return _reduce_on_host(host, big, flags, factor=factor, scale=scale, dp_group=dp_group,
                                   avg_ranks=avg_ranks, loss_divisor=loss_divisor)
    # On an accelerator every operator below is a launch: the vector is built in about a dozen.
    sums = collector.window_sums(device)  # [sum |h_k|^2, K, sum 1/b_k, sum b_k, invalid]
    small = sums[:1] * factor
    if scale is not None:
        small = small / scale.to(device=device, dtype=torch.float64).square()
    if big is None:
        big_val = torch.zeros(1, dtype=torch.float64, device=device)
    else:
        big_val = big.reshape(1).to(device=device, dtype=torch.float64)
    pair = torch.cat([small, big_val])
    nonfinite = (pair - pair).ne(0).any(0, keepdim=True)  # x - x is nan exactly for inf and nan
    pair = pair.masked_fill(nonfinite, 0.0)
    flag_vec = torch.tensor(flags, dtype=torch.float64, device=device)
    # [small, K, sum 1/b, units, big, nonfinite, unmeasurable, mismatched, invalid, ran]
    vec = torch.cat([pair[:1], sums[1:4], pair[1:], nonfinite.to(torch.float64), flag_vec[:2], sums[4:5], flag_vec[2:]])
    vec = cbs_dist.all_reduce_sum(vec, dp_group)
    return _step_stats(vec.tolist(), avg_ranks=avg_ranks, loss_divisor=loss_divisor)  # one host sync


def _reduce_on_host(
    sums: list[float],
    big: torch.Tensor | None,
    flags: list[float],
    *,
    factor: float,
    scale: torch.Tensor | None,
    dp_group: Any | None,
    avg_ranks: int,
    loss_divisor: float,
) -> tuple[StepStats, WindowFaults]:
    """:func:`reduce_window`'s vector with every number on the host (CPU training, gloo): floats, not tensors."""
    small_sum = sums[0] * factor
    if scale is not None:
        s2 = float(scale) ** 2  # a loss scale that decayed to 0 makes the step non-finite, as on a device
        small_sum = small_sum / s2 if s2 > 0 else math.nan
    big_val = 0.0 if big is None else big.item()
    finite = math.isfinite(small_sum) and math.isfinite(big_val)
    unmeasurable, mismatched, ran = flags
    values = [
        small_sum if finite else 0.0, sums[1], sums[2], sums[3], big_val if finite else 0.0,
        0.0 if finite else 1.0, unmeasurable, mismatched, sums[4], ran,
    ]
    if cbs_dist.is_distributed() and cbs_dist.group_size(dp_group) > 1:
        values = cbs_dist.all_reduce_sum(torch.tensor(values, dtype=torch.float64), dp_group).tolist()
    return _step_stats(values, avg_ranks=avg_ranks, loss_divisor=loss_divisor)


def _step_stats(values: list[float], *, avg_ranks: int, loss_divisor: float) -> tuple[StepStats, WindowFaults]:
    """The reduced vector ``[small, K, sum 1/b, units, big, nonfinite, unmeasurable, mismatched, invalid, ran]``."""
    small_total, count, inv_sum, units, big_total, nonfinite, unmeas, mism, bad, ran = values
    k = int(round(count))
    big_sq = big_total * (avg_ranks * float(loss_divisor) / max(k, 1)) ** 2
    stats = StepStats(
        small_sq_norm=small_total / max(k, 1),
        big_sq_norm=big_sq,
        num_microbatches=k,
        small_batch=(k / inv_sum) if inv_sum > 0 else 0.0,
        units=units,
        finite=nonfinite == 0 and unmeas == 0 and math.isfinite(big_sq),
        synced_sq_norm=big_total if nonfinite == 0 else math.nan,
    )
    return stats, WindowFaults(
        mismatched_ranks=int(round(mism)), invalid_sizes=int(round(bad)), microbatches_run=int(round(ran))
    )
