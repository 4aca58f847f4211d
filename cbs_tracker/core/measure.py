"""One optimizer step's gradient norms on one scale, reduced over the data-parallel group.

The torch-facing half of the step engine: :func:`reduce_window` turns a
collector's per-microbatch norms and the synced ``.grad`` into host numbers
(:class:`~cbs_tracker.core.collector.StepStats`) with one ``all_reduce`` and one
host sync per optimizer step; :func:`unscale_and_get_scale` handles AMP.
"""

from __future__ import annotations

import math
import time
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

__all__ = ["LOSS_NORMALIZATIONS", "REPLICA_TOLERANCE", "SHARED_DATA_TOLERANCE", "WindowFaults", "loss_scale", "reduce_window", "unscale_and_get_scale"]


def unscale_and_get_scale(grad_scaler: Any, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Unscale ``optimizer``'s gradients unless the loop already did; return the loss scale (0-d tensor).

    The scale is the one the backward passes of this window used (``update()`` runs
    after the optimizer step), read without a host sync where torch allows.
    """
    states = getattr(grad_scaler, "_per_optimizer_states", {})
    stage = states.get(id(optimizer), {}).get("stage")
    if stage is None or getattr(stage, "name", "") == "READY":
        grad_scaler.unscale_(optimizer)
    return loss_scale(grad_scaler)


def loss_scale(grad_scaler: Any) -> torch.Tensor:
    """The scaler's current loss scale as a 0-d tensor, read without a host sync where torch allows."""
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
        replica_spread: how far the ranks' synced gradients disagree: the spread across
            ranks of ``|.grad|^2`` over its mean (0 when they agree, or when it was not
            checked: one rank, sharded gradients, an unmeasured or non-finite window).
        shared_data: every rank's microbatch norms summed to the same number (to
            :data:`SHARED_DATA_TOLERANCE`): ranks that see the same data (tensor- or
            pipeline-parallel ranks counted as data-parallel, a sampler that does not split).
        invalid_sizes: microbatch sizes that were negative or not finite.
        microbatches_run: microbatches run on all ranks, those without any
            loss-contributing unit included (``StepStats.num_microbatches`` leaves them out).
    """

    mismatched_ranks: int = 0
    invalid_sizes: int = 0
    microbatches_run: int = 0
    replica_spread: float = 0.0
    shared_data: bool = False

    @classmethod
    def _of(cls, **values: Any) -> WindowFaults:
        """``WindowFaults(**values)``, every field given, without the frozen dataclass's ``__setattr__``s."""
        faults = object.__new__(cls)
        faults.__dict__.update(values)
        return faults


#: The largest relative spread across the DP ranks of the synced gradient's squared norm that
#: still counts as replicas agreeing. A synced gradient is the same all-reduce result on every
#: rank (bitwise in practice); the float64 sums that carry the fingerprints round at about 1e-8.
REPLICA_TOLERANCE = 1e-5
#: Ranks whose per-microbatch norms sum to the same number within this relative spread ran the
#: same data: two different samples of data never agree this closely (a spread of the order of
#: the noise, 1e-2 and more), the same data on the same weights agrees bitwise.
SHARED_DATA_TOLERANCE = 1e-9


#: How each microbatch's loss was normalised (what its hooked gradient carries, besides the
#: constant ``loss_divisor``): ``"mean"``, its own mean over its units; ``"window"``, its
#: summed unit losses over the units of this rank's window; ``"group"``, its summed unit
#: losses over the units of the window on all ranks, times the ranks the sync averages over
#: (so the synced gradient is the mean over every unit of the step).
LOSS_NORMALIZATIONS = ("mean", "window", "group")


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
    normalization: str = "mean",
    units_divisor: torch.Tensor | float | None = None,
    big_is_scaled: bool = False,
    measured: bool = True,
    proposed_every: float = 1.0,
) -> tuple[StepStats, WindowFaults]:
    """One optimizer step's norms on one scale, reduced over the DP group.

    Each hooked microbatch gradient is ``h_k = S c_k g_k``: ``g_k`` the mean gradient of its
    own ``b_k`` units, ``S`` the AMP loss scale and ``c_k`` the weight the loss
    normalisation gave it: ``1/a`` for a mean loss divided by ``a = loss_divisor``, and
    ``b_k/(D a)`` for a summed unit loss divided by ``D`` (the window's units). So
    ``|g_k|^2 = |h_k|^2 / (S c_k)^2`` whatever the normalisation. The synced, unscaled
    ``.grad`` is ``sum_k c_k g_k / R`` over the microbatches of all ranks (``R =
    avg_ranks`` when the sync averages): the step's mean gradient is ``.grad R / C`` with
    ``C = sum_k c_k``, whose noise is that of ``B_big = C^2 / sum_k (c_k^2 / b_k)`` units
    (``K B_small`` for equal weights; the window's units for unit-normalised losses;
    ``R`` times the harmonic mean of the ranks' units when each rank divides by its own).
    ``K`` is the microbatches really run (a short window is measured with its real size).
    One ``all_reduce`` of 18 float64 numbers; on an accelerator the norms, the sizes given as
    tensors and the loss scale reach the host in one copy (a ``stack`` per kind of number), the
    sums are host arithmetic, and on several ranks the vector goes back to the device for the
    ``all_reduce`` and is read once more (two host syncs, a handful of launches).

    Replicated gradients (not ``big_norm_is_sharded``) are checked in the same reduction:
    every rank adds its own ``|.grad|^2`` and its square, so the spread across ranks follows
    from the two sums (:attr:`WindowFaults.replica_spread`); ranks whose synced gradients
    differ (a microbatch that skipped the all-reduce) show there before the optimizer steps.
    Likewise each rank's own sum of microbatch norms: ranks that agree on it exactly ran the
    same data (:attr:`WindowFaults.shared_data`).

    Args:
        collector: the window's per-microbatch norms (not reset here).
        big_params: parameters whose ``.grad`` holds the synced step gradient.
        dp_group: the data-parallel group (``None``: world, or no distribution).
        loss_divisor: ``a``, a constant every microbatch loss was divided by (1.0: none).
        avg_ranks: ``R``, ranks the gradient sync averages over (1: it sums, or one rank).
        scale: the AMP loss scale the hooked gradients carry (``None``: none).
        transform: the collector's gradient transform, applied to ``.grad`` as well.
        big_norm_is_sharded: every rank's ``.grad`` is a shard (sum the partial norms)
            rather than a replica (take rank 0's).
        expected_microbatches: microbatches this rank's window should have run; a rank
            that ran another non-zero number is counted in ``WindowFaults.mismatched_ranks``.
        normalization: one of :data:`LOSS_NORMALIZATIONS`.
        units_divisor: with ``normalization="window"``, the ``D`` this rank divided by when
            it differs from the sum of the sizes given to the collector (a number or a 0-d
            tensor, left on its device; the Trainer's ``num_items_in_batch`` over its rank
            factor).
        big_is_scaled: ``.grad`` still carries the loss scale ``S`` (not unscaled yet).
        measured: ``False`` for a window the measuring cadence lets pass (the collector
            took no norm): no norm pass over ``.grad``, only the counts are reduced.
        proposed_every: this rank's proposal for the measuring cadence (averaged over ranks).

    Returns:
        The reduced :class:`~cbs_tracker.core.collector.StepStats` and :class:`WindowFaults`.

    Raises:
        ValueError: an unknown ``normalization``.
    """
    if normalization not in LOSS_NORMALIZATIONS:
        raise ValueError(f"reduce_window(normalization={normalization!r}): must be one of {LOSS_NORMALIZATIONS}")
    if not measured:
        return _reduce_counts(
            collector, dp_group=dp_group, loss_divisor=loss_divisor, avg_ranks=avg_ranks,
            big_norm_is_sharded=big_norm_is_sharded, expected_microbatches=expected_microbatches,
            normalization=normalization, units_divisor=units_divisor, proposed_every=proposed_every,
        )
    t0 = time.perf_counter() if collector.timed else None
    big = local_grad_sq_norm(big_params, transform) if measured else None
    ref = big if big is not None else (collector.microbatch_sq_norms() or [torch.zeros(())])[0]
    device = cbs_dist.reduction_device(dp_group, ref.device)
    # what this rank knows on the host: [unmeasurable, mismatched, microbatches it ran]
    local_k = collector.num_microbatches
    flags = [
        float(measured and (collector.window_unmeasurable or (big is None and transform is not None))),
        float(expected_microbatches is not None and local_k not in (0, expected_microbatches)),
        float(local_k),
        float(measured),
        float(proposed_every),
    ]
    # a replica: every rank reports its own norm (their mean is the big norm, their spread the check)
    a = float(loss_divisor)
    group = normalization == "group"
    on_host = (
        device.type == "cpu" and ref.device.type == "cpu"
        and (not isinstance(scale, torch.Tensor) or scale.device.type == "cpu")
        and (not isinstance(units_divisor, torch.Tensor) or units_divisor.device.type == "cpu")
    )
    host = collector.host_window_sums() if on_host else None
    if host is not None:
        big_f = None if big is None else big.item()
        scale_f = None if scale is None else float(scale)
        div_f = None if units_divisor is None else float(units_divisor)
    else:
        # an accelerator: every number the step needs reaches the host in one copy, then host arithmetic
        extra = [t for t in (big, scale, units_divisor) if isinstance(t, torch.Tensor)]
        host, read = collector.pulled_window_sums(extra)
        it = iter(read)
        big_f = None if big is None else next(it)
        scale_f = None if scale is None else (next(it) if isinstance(scale, torch.Tensor) else float(scale))
        div_f = None if units_divisor is None else (
            next(it) if isinstance(units_divisor, torch.Tensor) else float(units_divisor))
    s1, k, inv_b, units, invalid, s2 = host
    if normalization == "mean":
        small, c, q = s1 * a * a, k / a, inv_b / (a * a)
    else:
        d = 1.0 if group else (units if div_f is None else div_f)
        d = d if units > 0 else 1.0  # nothing ran: every sum is 0 anyway
        small, c, q = s2 * (d * a) ** 2, units / (d * a), units / (d * a) ** 2
    if scale_f is not None:
        s_sq = scale_f ** 2  # a loss scale that decayed to 0 makes the step non-finite
        small = small / s_sq if s_sq > 0 else math.nan
        if big_f is not None and big_is_scaled:
            big_val = big_f / s_sq if s_sq > 0 else math.nan
        else:
            big_val = 0.0 if big_f is None else big_f
    else:
        big_val = 0.0 if big_f is None else big_f
    finite = math.isfinite(small) and math.isfinite(big_val) and math.isfinite(c) and math.isfinite(q)
    unmeasurable, mismatched, ran, was_measured, proposal = flags
    values = [
        small if finite else 0.0, k, inv_b, units, big_val if finite else 0.0,
        0.0 if finite else 1.0, unmeasurable, mismatched, invalid, ran,
        c if finite else 0.0, q if finite else 0.0, was_measured, proposal,
        *((small * small, c * c, q * q, big_val * big_val) if finite else (0.0, 0.0, 0.0, 0.0)),
    ]
    ranks = cbs_dist.group_size(dp_group)
    if ranks > 1:
        vec = torch.tensor(values, dtype=torch.float64)
        values = cbs_dist.all_reduce_sum(vec if device.type == "cpu" else vec.to(device), dp_group).tolist()
    return _step_stats(values, avg_ranks=avg_ranks, group=group, ranks=ranks,
                       replicas=not big_norm_is_sharded, own_seconds=_own_seconds(collector, measured, t0))


def _reduce_counts(
    collector: GradStatsCollector,
    *,
    dp_group: Any | None,
    loss_divisor: float,
    avg_ranks: int,
    big_norm_is_sharded: bool,
    expected_microbatches: int | None,
    normalization: str,
    units_divisor: torch.Tensor | float | None,
    proposed_every: float,
) -> tuple[StepStats, WindowFaults]:
    """:func:`reduce_window` of a window the cadence does not measure: its counts only, on the host.

    No norm, no clock; the sizes given as tensors are read in one copy. The vector is the one
    :func:`reduce_window` reduces (the norms' entries 0, ``measured`` 0), so on several ranks it
    goes through the same ``all_reduce``: the ranks still check the window's size and agree on
    the cadence. (:func:`count_sizes` is its one-rank short cut.)
    """
    divisor_t = units_divisor if isinstance(units_divisor, torch.Tensor) else None
    sizes, read = collector.host_sizes(() if divisor_t is None else (divisor_t.reshape(()),))
    k, inv_b, units, invalid = _size_sums(sizes)
    group = normalization == "group"
    window_divisor = units if units_divisor is None else (read[0] if read else float(units_divisor))
    c, q = _count_moments(normalization, k, inv_b, units, float(loss_divisor), window_divisor)
    finite = math.isfinite(c) and math.isfinite(q)
    local_k = len(sizes)
    mismatched = float(expected_microbatches is not None and local_k not in (0, expected_microbatches))
    ranks = cbs_dist.group_size(dp_group)
    values = [
        0.0, k, inv_b, units, 0.0, 0.0 if finite else 1.0, 0.0, mismatched, invalid, float(local_k),
        c if finite else 0.0, q if finite else 0.0, 0.0, float(proposed_every),
        0.0, (c * c) if finite else 0.0, (q * q) if finite else 0.0, 0.0,
    ]
    if ranks > 1:
        device = cbs_dist.reduction_device(dp_group, torch.device("cpu"))
        vec = torch.tensor(values, dtype=torch.float64).to(device)
        values = cbs_dist.all_reduce_sum(vec, dp_group).tolist()
    return _step_stats(values, avg_ranks=avg_ranks, group=group, ranks=ranks, replicas=not big_norm_is_sharded)


def _size_sums(sizes: list[float]) -> tuple[float, float, float, float]:
    """``(K, sum 1/b, units, invalid)`` of a window's microbatch sizes (an empty microbatch counts in none)."""
    k = inv_b = units = invalid = 0.0
    for b in sizes:
        if not (b >= 0.0 and b < math.inf):  # negative, nan or infinite
            invalid += 1.0
        elif b > 0.0:
            k += 1.0
            inv_b += 1.0 / b
            units += b
    return k, inv_b, units, invalid


def _count_moments(normalization: str, k: float, inv_b: float, units: float, a: float,
                   window_divisor: float) -> tuple[float, float]:
    """``(C, Q)`` of a window from its counts alone: the sums of the loss weights and their squares
    (``window_divisor``: the units a ``"window"`` loss is divided by; ``"group"`` is scaled later)."""
    if normalization == "mean":
        return k / a, inv_b / (a * a)
    d = (1.0 if normalization == "group" else window_divisor) if units > 0 else 1.0
    return units / (d * a), units / (d * a) ** 2


def count_sizes(
    sizes: list[float], *, loss_divisor: float, avg_ranks: int, expected_microbatches: int, normalization: str,
    proposed_every: float,
) -> tuple[StepStats, WindowFaults | None]:
    """:func:`_reduce_counts` on one rank, without a units divisor, of the window's sizes as the collector
    reads them (``host_sizes``): the same stats and faults, read off the sizes directly (what
    :func:`_step_stats` makes of the one rank's vector), for the window of a cadence that is not measured
    (``tests/test_counted_step.py`` holds it equal to the general path). A function of its arguments
    alone: a run of counted windows of equal sizes reuses the stats of the first. The faults are ``None``
    when there are none (the window ran ``expected_microbatches``, every size valid)."""
    k, inv_b, units, invalid = _size_sums(sizes)
    c, q = _count_moments(normalization, k, inv_b, units, float(loss_divisor), units)
    finite = math.isfinite(c) and math.isfinite(q)
    if not finite:
        c = q = 0.0
    elif normalization == "group" and units > 0:  # as _step_stats scales them (c * c / q the same, bit for bit)
        d = units / avg_ranks
        c, q = c / d, q / (d * d)
    local_k = len(sizes)
    stats = StepStats._of(
        small_sq_norm=0.0, big_sq_norm=0.0, num_microbatches=int(round(k)),
        small_batch=(k / inv_b) if inv_b > 0 else 0.0, big_batch=(c * c / q) if q > 0 else 0.0, units=units,
        finite=finite, synced_sq_norm=math.nan, measured=False, proposed_every=float(proposed_every), own_seconds=0.0,
    )
    if local_k == expected_microbatches and not invalid:
        return stats, None  # the usual window: nothing wrong, it ran the microbatches set
    faults = WindowFaults._of(
        mismatched_ranks=int(local_k not in (0, expected_microbatches)), invalid_sizes=int(invalid),
        microbatches_run=local_k, replica_spread=0.0, shared_data=False,
    )
    return stats, faults


def _own_seconds(collector: GradStatsCollector, measured: bool, started: float | None) -> float:
    """Host seconds this rank spent measuring the window: its hooks and norms, and this reduction
    (0 when the collector is not timed)."""
    if started is None:
        return 0.0
    return (collector.own_seconds if measured else 0.0) + (time.perf_counter() - started)


def _step_stats(values: list[float], *, avg_ranks: int, group: bool, ranks: int, replicas: bool = True,
                own_seconds: float = 0.0) -> tuple[StepStats, WindowFaults]:
    """The reduced vector ``[small, K, sum 1/b, units, big, nonfinite, unmeasurable, mismatched, invalid, ran, C, Q,
    measured, proposal, small^2, C^2, Q^2, big^2]`` (``ranks``: the ranks summed; ``C^2`` and ``Q^2``
    are carried only because squaring the four numbers as one block is a single operator).

    With ``group`` the per-rank sums were taken with ``D = 1``: the divisor is known only now,
    the group's units over the averaging ranks. With ``replicas`` every rank reported its
    own synced norm: the big norm is their mean, and ``ranks sum(f^2) - (sum f)^2 = sum over
    pairs (f_i - f_j)^2`` measures how far they disagree.
    """
    (small_total, count, inv_sum, units, big_total, nonfinite, unmeas, mism, bad, ran, c, q, meas, prop,
     small_sq_total, _, _, big_sq_total) = values
    measured = meas > ranks - 0.5  # every rank measured this window
    shared = (
        ranks > 1 and measured and nonfinite == 0 and small_total > 0
        and math.sqrt(max(ranks * small_sq_total - small_total * small_total, 0.0)) / small_total
        < SHARED_DATA_TOLERANCE
    )
    spread = 0.0
    if replicas and ranks > 1:
        if measured and nonfinite == 0 and big_total > 0:
            spread = math.sqrt(max(ranks * big_sq_total - big_total * big_total, 0.0)) / big_total
        big_total = big_total / ranks
    if group and units > 0:
        d = units / avg_ranks
        small_total, c, q = small_total * d * d, c / d, q / (d * d)
    k = int(round(count))
    big_sq = big_total * (avg_ranks / c) ** 2 if c > 0 else 0.0
    stats = StepStats._of(
        small_sq_norm=small_total / max(k, 1),
        big_sq_norm=big_sq,
        num_microbatches=k,
        small_batch=(k / inv_sum) if inv_sum > 0 else 0.0,
        big_batch=(c * c / q) if q > 0 else 0.0,
        units=units,
        finite=nonfinite == 0 and unmeas == 0 and math.isfinite(big_sq),
        synced_sq_norm=big_total if nonfinite == 0 and measured else math.nan,
        measured=measured,
        proposed_every=prop / max(ranks, 1),
        own_seconds=own_seconds,
    )
    return stats, WindowFaults._of(
        mismatched_ranks=int(round(mism)), invalid_sizes=int(round(bad)), microbatches_run=int(round(ran)),
        replica_spread=spread, shared_data=shared,
    )
