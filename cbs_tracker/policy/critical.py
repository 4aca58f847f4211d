"""The critical batch from branch losses: the largest batch whose loss stays within ``epsilon``.

Pure math on the held-out losses of short training branches at batch multiples
``k * B`` (Merrill, Arora, Groeneveld, Hajishirzi 2025, "Critical Batch Size
Revisited"): walking up the batches, each one is compared with the best loss of
every smaller batch; the critical batch is the last batch before the first one whose
loss is more than ``epsilon`` worse. Replicate branches (the same batches over other
data orders) give each comparison a paired standard error, and a comparison whose
difference is within ``z`` standard errors of ``epsilon`` is reported as not resolved.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BranchLosses", "Comparison", "CriticalBatchInterval", "critical_batch_interval"]

#: one-sided 95% (a two-sided 90% interval): a comparison is resolved when its
#: difference lies this many standard errors away from epsilon
Z_90 = 1.6448536269514722


@dataclass(frozen=True)
class BranchLosses:
    """The final held-out losses of the replicate branches at one batch.

    Attributes:
        batch: the branch's global batch, in the run's unit.
        multiple: ``batch`` over the batch the run had at the branch point.
        lr_factor: the factor on the run's learning rate in this branch.
        losses: one final held-out loss per replicate (replicate ``r`` of every batch
            trained on the same samples).
        label: ``""`` for a branch, ``"control"`` for the LR control.
    """

    batch: float
    multiple: float
    lr_factor: float
    losses: tuple[float, ...]
    label: str = ""

    @property
    def mean(self) -> float:
        return sum(self.losses) / len(self.losses)

    @property
    def stderr(self) -> float | None:
        """Standard error of :attr:`mean` over replicates (``None`` with one replicate)."""
        n = len(self.losses)
        if n < 2:
            return None
        m = self.mean
        return math.sqrt(sum((x - m) ** 2 for x in self.losses) / (n - 1) / n)


@dataclass(frozen=True)
class Comparison:
    """One batch against the best loss of the batches below it.

    Attributes:
        batch: the batch judged.
        against: the batch (or the control, at the run's batch) with the best mean loss below it.
        difference: mean of the paired differences ``loss(batch) - loss(against)`` (nats).
        stderr: standard error of ``difference`` over replicates (``None`` with one).
        within: ``difference <= epsilon``.
        resolved: ``|difference - epsilon| >= z * stderr`` (``False`` without a standard error).
    """

    batch: float
    against: float
    difference: float
    stderr: float | None
    within: bool
    resolved: bool


@dataclass(frozen=True)
class CriticalBatchInterval:
    """The measured critical batch: at least :attr:`low`, below :attr:`high`.

    Attributes:
        low: the largest batch whose loss stayed within ``epsilon`` of every smaller one.
        high: the first batch that fell more than ``epsilon`` behind (``inf`` when none did:
            ``low`` is then only a lower bound).
        resolved: every comparison up to the deciding one was resolved by the replicates.
        comparisons: each batch above the smallest against the best below it.
        epsilon: the tolerance, in nats.
    """

    low: float
    high: float
    resolved: bool
    comparisons: tuple[Comparison, ...]
    epsilon: float

    @property
    def lower_bound_only(self) -> bool:
        return math.isinf(self.high)


def _paired(a: BranchLosses, b: BranchLosses) -> tuple[float, float | None]:
    if len(a.losses) == len(b.losses):
        diffs = [x - y for x, y in zip(a.losses, b.losses)]
        n = len(diffs)
        mean = sum(diffs) / n
        if n < 2:
            return mean, None
        return mean, math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1) / n)
    sa, sb = a.stderr, b.stderr
    se = None if sa is None or sb is None else math.sqrt(sa * sa + sb * sb)
    return a.mean - b.mean, se


def critical_batch_interval(branches: Sequence[BranchLosses], *, epsilon: float = 0.01,
                            control: BranchLosses | None = None, z: float = Z_90) -> CriticalBatchInterval:
    """The largest batch whose loss is within ``epsilon`` of the best loss at every smaller batch.

    Args:
        branches: one entry per batch (at least two, distinct batches).
        epsilon: tolerance in nats (``> 0``).
        control: a branch at the run's batch with the largest branch's LR factor; it joins
            the comparison pool for the batches above its own, so a larger batch does not
            pass for affordable only because its coupled learning rate is a better one.
        z: standard errors that separate a resolved comparison from ``epsilon``.

    Returns:
        The :class:`CriticalBatchInterval`.

    Raises:
        ValueError: fewer than two batches, a repeated batch, or ``epsilon <= 0``.
    """
    if not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"critical_batch_interval(epsilon={epsilon!r}): must be a finite number > 0 (nats)")
    ordered = sorted(branches, key=lambda b: b.batch)
    if len(ordered) < 2:
        raise ValueError(f"critical_batch_interval: {len(ordered)} batch(es) given; at least two are needed")
    batches = [b.batch for b in ordered]
    if len(set(batches)) != len(batches):
        raise ValueError(f"critical_batch_interval: batches {batches} repeat a batch")
    comparisons: list[Comparison] = []
    low, high, resolved = ordered[0].batch, math.inf, True
    for i in range(1, len(ordered)):
        pool = list(ordered[:i])
        if control is not None and control.batch < ordered[i].batch:
            pool.append(control)
        best = min(pool, key=lambda b: b.mean)
        diff, se = _paired(ordered[i], best)
        within = diff <= epsilon
        ok = se is not None and abs(diff - epsilon) >= z * se
        comparisons.append(Comparison(ordered[i].batch, best.batch, diff, se, within, ok))
        if math.isinf(high):
            resolved = resolved and ok
            if within:
                low = ordered[i].batch
            else:
                high = ordered[i].batch
    return CriticalBatchInterval(low, high, resolved, tuple(comparisons), float(epsilon))
