"""A measured ``kappa``: the ratio of the critical batch to the noise scale, as it moves with tokens.

The controller's target is ``kappa * B_simple``. A branched calibration
(:func:`cbs_tracker.calibrate.measure_critical_batch`) measures ``kappa`` at points of a
run; :class:`KappaSchedule` holds them and answers ``kappa`` at any token count:
interpolated linearly in ``log(tokens)`` between points (linearly in tokens from a point at
0 tokens), the first point's value before it and the latest one's after the last (so points added during a run take effect from
then on). Pure: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["KappaSchedule", "parse_kappa"]


def _check_point(owner: str, tokens: Any, kappa: Any) -> tuple[float, float]:
    for name, value in (("tokens", tokens), ("kappa", kappa)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{owner}: {name}={value!r}: expected a number")
    if not math.isfinite(tokens) or tokens < 0:
        raise ValueError(f"{owner}: tokens={tokens!r}: must be finite and >= 0")
    if not math.isfinite(kappa) or kappa <= 0:
        raise ValueError(f"{owner}: kappa={kappa!r}: must be finite and > 0")
    return float(tokens), float(kappa)


class KappaSchedule:
    """``kappa`` as a function of the units seen, from measured points.

    Args:
        points: ``(tokens, kappa)`` pairs, at least one; tokens strictly increasing after
            sorting (two points at the same tokens are refused), every ``kappa > 0``.

    Raises:
        TypeError: ``points`` is not a sequence of pairs of numbers.
        ValueError: no points, a duplicate token count, or a value out of range.
    """

    def __init__(self, points: Iterable[Sequence[float]]) -> None:
        owner = "KappaSchedule(points=...)"
        try:
            pairs = [tuple(p) for p in points]
        except TypeError as exc:
            raise TypeError(f"{owner}: expected (tokens, kappa) pairs, got {points!r}") from exc
        if not pairs:
            raise ValueError(f"{owner}: at least one (tokens, kappa) point is needed")
        checked = []
        for pair in pairs:
            if len(pair) != 2:
                raise TypeError(f"{owner}: {pair!r} is not a (tokens, kappa) pair")
            checked.append(_check_point(owner, *pair))
        checked.sort()
        for (t0, _), (t1, _) in zip(checked, checked[1:]):
            if t0 == t1:
                raise ValueError(f"{owner}: two points at tokens={t0:g}; give one kappa per token count")
        self._points: list[tuple[float, float]] = checked

    @property
    def points(self) -> list[tuple[float, float]]:
        """The points, sorted by tokens (a copy)."""
        return list(self._points)

    def add(self, tokens: float, kappa: float) -> None:
        """Add a measured point (a calibration during the run); one at the same tokens is replaced."""
        t, k = _check_point("KappaSchedule.add", tokens, kappa)
        self._points = sorted([p for p in self._points if p[0] != t] + [(t, k)])

    def value_at(self, tokens: float) -> float:
        """``kappa`` at ``tokens``: linear in ``log(tokens)`` between points, constant outside them."""
        pts = self._points
        if tokens <= pts[0][0]:
            return pts[0][1]
        if tokens >= pts[-1][0]:
            return pts[-1][1]
        for (t0, k0), (t1, k1) in zip(pts, pts[1:]):
            if t0 <= tokens <= t1:
                if t0 <= 0:  # log(0) is -inf: a segment from 0 tokens is linear in tokens
                    frac = tokens / t1
                else:
                    frac = (math.log(tokens) - math.log(t0)) / (math.log(t1) - math.log(t0))
                return k0 + frac * (k1 - k0)
        return pts[-1][1]  # not reached

    def state_dict(self) -> list[list[float]]:
        """The points as plain lists (for a checkpoint)."""
        return [[t, k] for t, k in self._points]

    def __repr__(self) -> str:
        inner = ", ".join(f"({t:g}, {k:.3g})" for t, k in self._points)
        return f"KappaSchedule([{inner}])"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KappaSchedule) and other._points == self._points

    __hash__ = None  # type: ignore[assignment]  (mutable through add)


def parse_kappa(kappa: Any, owner: str) -> tuple[KappaSchedule | None, float]:
    """``kappa`` as given to a controller or a schedule: ``(schedule, constant)``.

    A number gives ``(None, kappa)``; a :class:`KappaSchedule` (copied, so that points added
    later do not reach the caller's) or a list of ``(tokens, kappa)`` pairs gives
    ``(schedule, its first value)``.

    Raises:
        TypeError / ValueError: naming ``owner(kappa=...)``.
    """
    if isinstance(kappa, KappaSchedule):
        schedule = KappaSchedule(kappa.points)
        return schedule, schedule.value_at(0.0)
    if isinstance(kappa, (list, tuple)):
        try:
            schedule = KappaSchedule(kappa)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{owner}(kappa={kappa!r}): {exc}") from None
        return schedule, schedule.value_at(0.0)
    if isinstance(kappa, bool) or not isinstance(kappa, (int, float)):
        raise TypeError(f"{owner}(kappa={kappa!r}): expected a number, a KappaSchedule or a list of (tokens, kappa) "
                        "pairs")
    if not math.isfinite(kappa) or kappa <= 0:
        raise ValueError(f"{owner}(kappa={kappa!r}): must be finite and > 0")
    return None, float(kappa)
