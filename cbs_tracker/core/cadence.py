"""Which windows are measured: every ``n``-th one, with ``n`` fixed or chosen from the measured cost.

Measuring a window costs ``K + 1`` norm passes and the hooks' work; on a small,
launch-bound model that is several percent of a step however cheap each pass is. With
``measure_every=n`` one window in ``n`` is measured (the others run with hooks that return
at once and no norm pass); ``"auto"`` times the tracker's own work in each window (hooks,
norm passes, the reduction, its bookkeeping; host time, which on an accelerator includes
the kernel launches but not the kernels) against the window's wall time, and picks the
smallest ``n`` whose mean share ``(m + (n - 1) u) / n`` stays at or below ``target``, ``m``
and ``u`` the median shares of measured and unmeasured windows.
Timing the tracker's own work directly, rather than comparing measured with unmeasured
windows, keeps the choice stable on a machine whose step times wander by several
percent. Every rank proposes its ``n`` in the step's reduction and all adopt the
rounded-up mean, so the ranks always agree on which window is measured.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

__all__ = ["MeasureCadence", "check_measure_every"]

#: the most windows ``"auto"`` lets pass between two measured ones
MAX_EVERY = 64
#: windows at the start not timed (first calls allocate, compile and warm caches)
_WARMUP = 3
#: measured windows timed before ``"auto"`` chooses (every window is measured until then)
_CALIBRATION = 8
#: recent measured windows whose median share is used
_MEMORY = 16


def check_measure_every(value: Any, target: Any, *, owner: str) -> None:
    """Raise a clear error for a bad ``measure_every`` or ``measure_target``."""
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{owner}(measure_every={value!r}): must be an integer >= 1 or 'auto'")
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target < 1:
        raise ValueError(f"{owner}(measure_target={target!r}): must be a fraction of the step time in (0, 1)")


class MeasureCadence:
    """Decides, window by window, whether the tracker measures it.

    Args:
        measure_every: ``n >= 1`` (measure one window in ``n``) or ``"auto"``.
        target: with ``"auto"``, the largest share of the step time the measurement may take.
    """

    def __init__(self, measure_every: int | str = 1, target: float = 0.01, *, owner: str = "CBSTracker") -> None:
        check_measure_every(measure_every, target, owner=owner)
        self.auto = measure_every == "auto"
        self.target = float(target)
        self.every = 1 if self.auto else int(measure_every)
        self._since = 0  # windows since the last measured one
        self._windows = 0
        self._shares: deque[float] = deque(maxlen=_MEMORY)  # measured windows
        self._plain: deque[float] = deque(maxlen=_MEMORY)  # windows not measured
        #: the median share of a measured window's time that was the tracker's own work
        self.overhead: float | None = None
        #: the same for the windows not measured (counts, bookkeeping)
        self.floor: float | None = None

    def measure_next(self) -> bool:
        """Whether the window about to start is measured (the same answer on every rank)."""
        if self._windows == 0:
            return True  # the run's first window is always measured
        return self._since + 1 >= self.every

    def window_done(self, measured: bool, own_share: float | None) -> None:
        """Count a finished window; ``own_share``: the tracker's share of a measured window's time."""
        self._windows += 1
        self._since = 0 if measured else self._since + 1
        if self.auto and own_share is not None and self._windows > _WARMUP:
            if math.isfinite(own_share) and own_share >= 0:
                (self._shares if measured else self._plain).append(own_share)

    def proposal(self) -> float:
        """This rank's ``n`` for the windows ahead (``"auto"``: from its timings)."""
        if not self.auto or len(self._shares) < _CALIBRATION:
            return float(self.every)
        self.overhead = m = statistics.median(self._shares)
        self.floor = u = statistics.median(self._plain) if self._plain else 0.0
        if m <= self.target:
            return 1.0
        if u >= self.target:
            return float(MAX_EVERY)  # the windows not measured alone cost the target: measure as rarely as allowed
        return float(min(MAX_EVERY, max(1, math.ceil((m - u) / (self.target - u) - 1e-6))))

    def agree(self, mean_proposal: float) -> None:
        """Adopt the ranks' mean proposal, rounded up (identical on every rank)."""
        if self.auto and math.isfinite(mean_proposal) and mean_proposal >= 1:
            self.every = int(min(MAX_EVERY, math.ceil(mean_proposal - 1e-9)))

    def state_dict(self) -> dict[str, Any]:
        return {"measure_every": "auto" if self.auto else self.every, "every_now": self.every,
                "since_measured": self._since}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.every = int(state.get("every_now", self.every))
        self._since = int(state.get("since_measured", 0))
