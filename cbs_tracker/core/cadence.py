"""Which windows are measured: every ``n``-th one, with ``n`` fixed or chosen on the step clock.

Measuring a window costs ``K + 1`` norm passes and the hooks' work; on a small,
launch-bound model that is several percent of a step however cheap each pass is. With
``measure_every=n`` one window in ``n`` is measured; the others run without the tracker's
hooks on the parameters, take no norm and read no clock (they only count microbatches
and units). ``"auto"`` judges by the step clock, the wall time from one optimizer step's
reduction to the next (on an accelerator it follows the device, the reduction being a host
sync): it compares each measured window with the unmeasured window just before it, so that
the machine's drift cancels, and gets ``d``, what measuring adds to a step, including what
no host timer sees (the hooks' calls into Python, caches the norm passes evict, the
kernels). The tracker's own host work in the measured window, timed directly, bounds ``d``
from below (a machine whose step times jitter can hide a small ``d``). The unmeasured window
itself cannot be compared with an untracked step inside the run, so its cost ``u`` is
bounded by the tracker's own host work in it, timed directly in the window before each
measured one (the only unmeasured windows whose clock is read; the plain loop times its
``microbatch()`` entry and exit and its ``step()``, the other adapters only the step's
bookkeeping, a lower bound there). Over a cycle of ``n``
windows the tracker's share of the step time is ``d / n + u``; ``"auto"`` picks the smallest
``n`` that keeps it at or below ``target``, from the medians of the recent windows.
Until it has :data:`_CALIBRATION` pairs it alternates measured and unmeasured windows.
Every rank proposes its ``n`` in the step's reduction and all adopt the rounded-up mean,
and which windows are measured depends only on counters the ranks share, so the ranks
always agree on which window is measured.
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
#: measured windows paired with an unmeasured one before ``"auto"`` chooses (it alternates until then)
_CALIBRATION = 8
#: recent windows whose median is used
_MEMORY = 16


def check_measure_every(value: Any, target: Any, *, owner: str) -> None:
    """Raise a clear error for a bad ``measure_every`` or ``measure_target``.

    Called once, where an adapter is built (:class:`~cbs_tracker.core.engine.EngineSettings`);
    :class:`MeasureCadence` takes the values as checked there.
    """
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{owner}(measure_every={value!r}): must be an integer >= 1 or 'auto'")
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target < 1:
        raise ValueError(f"{owner}(measure_target={target!r}): must be a fraction of the step time in (0, 1)")


class MeasureCadence:
    """Decides, window by window, whether the tracker measures it.

    Args:
        measure_every: ``n >= 1`` (measure one window in ``n``) or ``"auto"``.
        target: with ``"auto"``, the largest share of the step time the tracker may take.

    Both as checked by :func:`check_measure_every`, where the adapter was built.
    """

    def __init__(self, measure_every: int | str = 1, target: float = 0.01) -> None:
        self.auto = measure_every == "auto"
        self.target = float(target)
        self.every = 1 if self.auto else int(measure_every)
        self._since = 0  # windows since the last measured one
        self._windows = 0
        self._paired = 0  # measured windows that followed an unmeasured one, after the warm-up
        self._last_measured = True
        self._ref: tuple[float, float | None] | None = None  # the last window: (seconds, own seconds), if timed
        self._pairs: deque[float] = deque(maxlen=_MEMORY)  # d: measured over the unmeasured window before, - 1
        self._direct: deque[float] = deque(maxlen=_MEMORY)  # the tracker's own host work in a measured window
        self._plain: deque[float] = deque(maxlen=_MEMORY)  # u: its own host work in an unmeasured window
        self._proposal: float | None = None
        #: ``d``: what measuring a window adds to its step, as a share of an unmeasured step
        self.overhead: float | None = None
        #: ``u``: the share of an unmeasured window that is the tracker's own work
        self.floor: float | None = None

    def _calibrating(self) -> bool:
        return self.auto and self._paired < _CALIBRATION

    def _measured_at(self, ahead: int) -> bool:
        """Whether the window ``ahead`` windows after the next one is measured, as things stand."""
        if self._windows + ahead == 0:
            return True  # the run's first window is always measured
        if self._calibrating():  # the warm-up measured, then unmeasured and measured windows in turn
            w = self._windows + ahead
            return w < _WARMUP or (w - _WARMUP) % 2 == 1
        return self._since + 1 + ahead >= self.every

    def measure_next(self) -> bool:
        """Whether the window about to start is measured (the same answer on every rank)."""
        return self._measured_at(0)

    def times_next(self) -> bool:
        """``"auto"``: whether the tracker's own work in the (unmeasured) window about to start is timed:
        it is the window before a measured one."""
        return self.auto and not self._measured_at(0) and self._measured_at(1)

    def clock_due(self) -> bool:
        """``"auto"``: whether the step clock is read when the window about to start ends: it, or one of
        the two after it, is measured (a measured window and its unmeasured predecessor need their
        start and end). With an integer cadence the clock is never read."""
        return self.auto and (self._measured_at(0) or self._measured_at(1) or self._measured_at(2))

    def window_done(self, measured: bool, seconds: float | None = None, own_seconds: float | None = None) -> None:
        """Count a finished window.

        Args:
            measured: whether it was measured.
            seconds: its length on the step clock (``None``: not read).
            own_seconds: the tracker's own host work in it, timed directly (``None``: not timed).
        """
        warm = self._windows >= _WARMUP
        self._windows += 1
        ref, self._ref = self._ref, None
        if self.auto and warm and measured and not self._last_measured:
            self._paired += 1
        self._since = 0 if measured else self._since + 1
        self._last_measured = measured
        if not self.auto or not warm or seconds is None or not (math.isfinite(seconds) and seconds > 0):
            return
        own = own_seconds if own_seconds is not None and math.isfinite(own_seconds) and own_seconds >= 0 else None
        if measured:
            if ref is not None:
                self._pairs.append(seconds / ref[0] - 1.0)
            if own is not None:
                base = ref[0] if ref is not None else max(seconds - own, 1e-12)
                self._direct.append(own / base)
        else:
            self._ref = (seconds, own)
            if own is not None:
                self._plain.append(own / seconds)
        self._proposal = None

    def unmeasured_done(self, mean_proposal: float) -> tuple[bool, bool]:
        """:meth:`window_done` of a window not measured whose clock was not read, then :meth:`agree`;
        returns :meth:`clock_due` and :meth:`times_next` for the window about to start (an integer
        cadence: its counters only)."""
        if self.auto:
            self.window_done(False)
            self.agree(mean_proposal)
            return self.clock_due(), self.times_next()
        self._windows += 1
        self._ref = None
        self._since += 1
        self._last_measured = False
        return False, False

    def proposal(self) -> float:
        """This rank's ``n`` for the windows ahead (``"auto"``: from its timings)."""
        if not self.auto or self._calibrating():
            return float(self.every)
        if self._proposal is None:
            pairs = statistics.median(self._pairs) if self._pairs else 0.0
            direct = statistics.median(self._direct) if self._direct else 0.0
            self.overhead = d = max(pairs, direct, 0.0)
            self.floor = u = statistics.median(self._plain) if self._plain else 0.0
            if u >= self.target:
                # the windows not measured alone cost the target: measure as rarely as allowed
                self._proposal = float(MAX_EVERY)
            else:
                self._proposal = float(min(MAX_EVERY, max(1, math.ceil(d / (self.target - u) - 1e-6))))
        return self._proposal

    def agree(self, mean_proposal: float) -> None:
        """Adopt the ranks' mean proposal, rounded up (identical on every rank)."""
        if self.auto and not self._calibrating() and math.isfinite(mean_proposal) and mean_proposal >= 1:
            self.every = int(min(MAX_EVERY, math.ceil(mean_proposal - 1e-9)))

    def state_dict(self) -> dict[str, Any]:
        return {"measure_every": "auto" if self.auto else self.every, "every_now": self.every,
                "since_measured": self._since}

    def load_state_dict(self, state: dict[str, Any], windows: int = 0) -> None:
        """Go on where the saved cadence was (``state`` checked by the session), ``windows`` windows into the run
        (the session's step count: one step a window). An integer cadence then measures the windows the
        uninterrupted run would have measured, the run's first only if none had passed; ``"auto"`` warms up
        and times afresh, its first window measured: the resumed process's clock is new. An integer cadence is
        the one this process was given, whatever the saved run's (its windows since the last measured one carry
        over); ``"auto"`` starts from the saved run's ``n``."""
        if self.auto:
            self.every = int(state.get("every_now", self.every))
        self._since = int(state.get("since_measured", 0))
        if not self.auto:
            self._windows = int(windows)
