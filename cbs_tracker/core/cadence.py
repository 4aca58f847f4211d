"""Which windows are measured: every ``n``-th one, with ``n`` fixed or chosen from the measured cost.

Measuring a window costs ``K + 1`` norm passes and the hooks' work; on a small,
launch-bound model that is several percent of a step however cheap each pass is. With
``measure_every=n`` one window in ``n`` is measured (the others run with hooks that return
at once and no norm pass); ``"auto"`` times the windows, measured and not, per unit of
data and picks the smallest ``n`` whose overhead ``(t_measured / t_plain - 1) / n`` stays at
or below ``target``. Every rank proposes its ``n`` in the step's reduction and all adopt the
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
#: windows of each kind timed before ``"auto"`` chooses (it alternates until then)
_CALIBRATION = 8
#: recent windows of each kind whose median time is compared
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
        self._times: dict[bool, deque[float]] = {True: deque(maxlen=_MEMORY), False: deque(maxlen=_MEMORY)}
        self.overhead: float | None = None  # measured window's extra time per unit, as a fraction

    @property
    def calibrating(self) -> bool:
        return self.auto and min(len(self._times[True]), len(self._times[False])) < _CALIBRATION

    def measure_next(self) -> bool:
        """Whether the window about to start is measured (the same answer on every rank)."""
        if self._windows == 0:
            return True  # the run's first window is always measured
        if self.calibrating and self._windows >= _WARMUP:
            return self._windows % 2 == 0  # alternate while the two kinds are timed
        return self._since + 1 >= self.every

    def window_done(self, measured: bool, seconds_per_unit: float | None) -> None:
        """Count a finished window; time it (``None``: no timing, e.g. the first window)."""
        self._windows += 1
        self._since = 0 if measured else self._since + 1
        if self.auto and seconds_per_unit is not None and self._windows > _WARMUP:
            if math.isfinite(seconds_per_unit) and seconds_per_unit > 0:
                self._times[measured].append(seconds_per_unit)

    def proposal(self) -> float:
        """This rank's ``n`` for the windows ahead (``"auto"``: from its timings)."""
        if not self.auto or self.calibrating:
            return float(self.every)
        plain = statistics.median(self._times[False])
        extra = statistics.median(self._times[True]) / plain - 1.0
        self.overhead = max(extra, 0.0)
        return float(min(MAX_EVERY, max(1, math.ceil(self.overhead / self.target - 1e-6))))

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
