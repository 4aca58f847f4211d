"""Resuming on another number of data-parallel ranks: the saved state converted, the global batch kept.

Everything the tracker saves is independent of the rank count (the units seen, the
schedule's position, the estimator, the controller's level and measurements) except
the split of the global batch into ``A`` microbatches on each of ``D`` ranks. On ``D'``
ranks the same global batch of ``K = A * D`` microbatches is ``A' = K / D'`` per rank.
When ``D'`` does not divide ``K`` (3 ranks from 2 at ``A = 2``), the nearest global
batch that can run is taken (``A' * D'`` closest to ``K``, the smaller on a tie, and at
least 2 microbatches so that the noise scale stays measurable); the learning-rate
coupling then follows the batch that really runs.

Per-rank quantities move by ``D / D'``: the starting accumulation ``A0`` (so the
starting *global* batch, the clock of a schedule sized in starting-batch steps, is kept;
it may become a fraction of a microbatch per rank, e.g. ``A0 = 1`` on 2 ranks is
``0.5`` on 4), the part-step carried towards the next starting-batch step, and the
controller's ladder ``A0 * 2**e``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["RankChange", "nearest_accumulation", "plain_number"]


def plain_number(value: float) -> int | float:
    """``value`` as an ``int`` when it is integral (the saved state stays plain ints where it can)."""
    value = float(value)
    return int(value) if value.is_integer() else value


def nearest_accumulation(global_microbatches: int, dp_degree: int) -> int:
    """Microbatches per rank on ``dp_degree`` ranks whose global count is nearest ``global_microbatches``.

    Ties go to the smaller batch; the result keeps ``A * dp_degree >= 2`` (one microbatch in
    all leaves nothing to compare) and ``A >= 1``.
    """
    k, d = int(global_microbatches), int(dp_degree)
    low = max(1, k // d)
    candidates = [a for a in (low, low + 1) if a * d >= 2] or [2]
    return min(candidates, key=lambda a: (abs(a * d - k), a))


@dataclass(frozen=True)
class RankChange:
    """A checkpoint of ``old_dp`` ranks at ``old_accumulation`` per rank resumed on ``new_dp`` ranks."""

    old_dp: int
    new_dp: int
    old_accumulation: int
    new_accumulation: int

    @classmethod
    def plan(cls, old_dp: int, new_dp: int, accumulation: int) -> RankChange:
        """The change that keeps ``accumulation * old_dp`` microbatches, or the nearest feasible batch."""
        return cls(old_dp, new_dp, accumulation, nearest_accumulation(accumulation * old_dp, new_dp))

    @property
    def old_microbatches(self) -> int:
        """Global microbatches per optimizer step before the change (``A * D``)."""
        return self.old_accumulation * self.old_dp

    @property
    def new_microbatches(self) -> int:
        """Global microbatches per optimizer step after the change (``A' * D'``)."""
        return self.new_accumulation * self.new_dp

    @property
    def exact(self) -> bool:
        """The global batch is kept exactly."""
        return self.old_microbatches == self.new_microbatches

    @property
    def per_rank(self) -> float:
        """``D / D'``: a per-rank count at the same global batch (the starting accumulation, a carry)."""
        return self.old_dp / self.new_dp

    @property
    def accumulation_ratio(self) -> float:
        """``A' / A``: the current window's accumulation (and the ladder ``A0 * 2**e`` of a controller)."""
        return self.new_accumulation / self.old_accumulation

    def accumulation(self, old: int) -> int | None:
        """Another per-rank accumulation of the same ladder (a pending change) on the new ranks, or ``None``
        when it is not a whole number of microbatches there."""
        value = old * self.accumulation_ratio
        if value < 1 or not math.isclose(value, round(value), rel_tol=0.0, abs_tol=1e-9):
            return None
        return int(round(value))

    def position(self, done_per_rank: int, multiple: int = 1) -> int:
        """The same place in an epoch on the new ranks: ``done_per_rank`` loader batches on each old rank.

        A sampler that deals the epoch's batches to the ranks in turn (``DistributedSampler``,
        accelerate's batch sharding) gives the old ranks the epoch's first ``D * m``; on ``D'``
        ranks that is ``D * m / D'`` each, rounded down to a multiple of ``multiple`` (a window's
        microbatches) where it is not one: the batches in between run again, none is skipped.
        """
        step = self.new_dp * int(multiple)
        return int(done_per_rank) * self.old_dp // step * int(multiple)

    def describe(self, micro_units: float | None, unit: str) -> str:
        """Both batches, for the warning of an uneven split."""
        def batch(k: int) -> str:
            return f"{k} microbatches" + ("" if micro_units is None else f" ({k * micro_units:,.0f} {unit})")
        return (
            f"the checkpoint's global batch of {batch(self.old_microbatches)}, {self.old_accumulation} per rank on "
            f"{self.old_dp} ranks, cannot be split evenly over {self.new_dp} ranks; the run goes on with the "
            f"nearest batch that can, {batch(self.new_microbatches)} ({self.new_accumulation} per rank)"
        )


def convert_level_state(state: dict[str, Any], change: RankChange, old_pending: int | None) -> dict[str, Any]:
    """A :class:`~cbs_tracker.policy.level.BatchLevel`'s keys (inside a controller's state) on the new ranks.

    The ladder ``A0 * 2**e`` is scaled by ``A' / A`` (so the current level is the accumulation
    that runs) and the per-rank accumulation counted so far by ``D / D'`` (so the units per
    accumulation step are those of ``D'`` ranks). A pending change that is not a whole number
    of microbatches on the new ranks is dropped (the level goes back to the one that runs).
    """
    out = dict(state)
    if not int(state.get("started", 0)):
        return out
    out["start_accumulation_steps"] = plain_number(float(state["start_accumulation_steps"]) * change.accumulation_ratio)
    out["accumulation_sum"] = plain_number(float(state["accumulation_sum"]) * change.per_rank)
    if int(state.get("pending", 0)) and old_pending is not None and change.accumulation(old_pending) is None:
        shift = round(math.log2(old_pending / change.old_accumulation))
        out["exponent"] = int(state["exponent"]) - shift
        out["pending"] = 0
    return out
