"""Growth and shrink rules: median of a window, patience, hysteresis, warm-up, cool-down, caps.

:class:`GrowthRules` keeps the last ``window`` measurements and counts for how many
consecutive measurements the evidence passed a threshold. It reads its settings from the controller, so a
setting changed on the controller applies from the next step.
"""

from __future__ import annotations

from typing import Any

from cbs_tracker.policy._state import StateReader
from cbs_tracker.policy.level import BatchLevel

__all__ = ["GrowthRules", "median"]

_TOL = 1e-9  # relative slack when comparing batches with bounds


def median(values: list[float]) -> float:
    """Median of a non-empty list (mean of the two middle values for an even length)."""
    ordered = sorted(values)
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


class GrowthRules:
    """When the measured critical batch asks for ``B -> 2B`` or ``B -> B/2``.

    Grow when ``kappa * median >= 2B (1 + margin)`` for ``patience`` consecutive
    measurements, shrink (if allowed) when ``kappa * median < B / (2 (1 + margin))``;
    ``median`` is over the last ``window`` estimates. Where the estimator gives an
    interval, each of those measurements must also hold at the interval's far end
    (``kappa * low`` for growth, ``kappa * high`` for a shrink): a decision on evidence.

    Args:
        settings: the controller; read: ``kappa``, ``margin``, ``patience``, ``window``,
            ``warmup_steps``, ``warmup_tokens``, ``cooldown_tokens``, ``min_batch``,
            ``max_batch``, ``max_accumulation_steps``, ``allow_shrink``.
    """

    KEYS = ("recent_noise_scales", "grow_count", "shrink_count")

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.recent: list[float] = []  # last `window` estimates
        self.grow_count = 0
        self.shrink_count = 0

    # ----------------------------------------------------------- measurements
    def reset(self) -> None:
        """Forget the window and the counts (the batch changed: older values describe another batch)."""
        self.recent.clear()
        self.grow_count = self.shrink_count = 0

    def add(self, noise_scale: float) -> None:
        """Append one measurement; the window keeps the last ``window``."""
        self.recent.append(noise_scale)
        if len(self.recent) > self.settings.window:
            del self.recent[0]

    @property
    def full(self) -> bool:
        return len(self.recent) >= self.settings.window

    def median(self) -> float | None:
        """Median of the window's estimates (``None`` while empty)."""
        return median(self.recent) if self.recent else None

    def clip(self, value: float) -> float:
        """``clip(value, min_batch, max_batch)``."""
        s = self.settings
        if s.min_batch is not None:
            value = max(value, s.min_batch)
        if s.max_batch is not None:
            value = min(value, s.max_batch)
        return value

    def supports(self, batch: float, low: float | None, kappa: float | None = None) -> bool:
        """The evidence puts the critical batch at or above ``batch``: ``clip(kappa * x) >= batch``
        for ``x`` the window's median and, when given, the interval's lower end ``low``
        (``kappa`` defaults to the controller's)."""
        kappa = self.settings.kappa if kappa is None else kappa
        med = self.median()
        return med is not None and self.clip(kappa * med) >= batch and (
            low is None or self.clip(kappa * low) >= batch)

    # ------------------------------------------------------------- thresholds
    def thresholds(self, batch: float) -> tuple[float, float]:
        """``(grow_at, shrink_at)`` for the critical batch at this batch."""
        s = self.settings
        grow_at = 2.0 * batch * (1.0 + s.margin)
        shrink_at = batch / (2.0 * (1.0 + s.margin))
        # A target clipped at a bound cannot pass a margin beyond that bound: a doubling
        # that stays within max_batch happens when the target sits at max_batch (and a
        # halving that stays within min_batch when the target sits at min_batch).
        if s.max_batch is not None and 2.0 * batch <= s.max_batch * (1 + _TOL):
            grow_at = min(grow_at, s.max_batch)
        if s.min_batch is not None and 0.5 * batch >= s.min_batch * (1 - _TOL):
            shrink_at = max(shrink_at, s.min_batch * (1 + _TOL))
        return grow_at, shrink_at

    def count(self, batch: float, low: float | None, high: float | None, *, grow: bool | None = None) -> None:
        """One measurement more (``low``/``high``: its interval, if any): extend or reset the patience counts.

        ``grow``: another rule's verdict on a doubling (the efficiency budget); ``None``: the ``kappa`` rule's.
        """
        grow_at, shrink_at = self.thresholds(batch)
        kappa, med = self.settings.kappa, self.median()
        if grow is None:
            grow = self.supports(grow_at, low)
        shrink = med is not None and self.clip(kappa * med) < shrink_at and (
            high is None or self.clip(kappa * high) < shrink_at)
        self.grow_count = self.grow_count + 1 if grow else 0
        self.shrink_count = self.shrink_count + 1 if shrink else 0

    @property
    def wants_grow(self) -> bool:
        return self.grow_count >= self.settings.patience

    @property
    def wants_shrink(self) -> bool:
        return self.shrink_count >= self.settings.patience

    # ----------------------------------------------------------------- timing
    def in_cooldown(self, level: BatchLevel, tokens: float) -> bool:
        """Fewer than ``cooldown_tokens`` (default 100 current batches) since the last change took effect."""
        cooldown = self.settings.cooldown_tokens
        if cooldown is None:
            cooldown = 100.0 * level.batch()
        return tokens - level.effective_tokens < cooldown

    def waiting(self, level: BatchLevel, tokens: float) -> str | None:
        """Why no rule may act yet (warm-up, a window still filling, cool-down), or ``None``."""
        s = self.settings
        warmup_tokens = s.warmup_tokens if s.warmup_tokens is not None else 100.0 * level.a0 * level.unit_batch()
        if level.steps < s.warmup_steps or tokens < warmup_tokens:
            return "warm-up"
        if not self.full:
            return f"filling the median window ({len(self.recent)}/{s.window})"
        if self.in_cooldown(level, tokens):
            return "cool-down"
        return None

    # ------------------------------------------------------------------- caps
    def max_accumulation(self, level: BatchLevel) -> int:
        """``max_accumulation_steps``, or ``256 * A0`` when unset."""
        cap = self.settings.max_accumulation_steps
        return cap if cap is not None else 256 * level.a0

    def why_not_grow(self, level: BatchLevel) -> str | None:
        """``None`` if a doubling is allowed, else why not."""
        s = self.settings
        if level.accum(level.exponent + 1) > self.max_accumulation(level):
            return f"at max_accumulation_steps={self.max_accumulation(level)}"
        if s.max_batch is not None and level.batch(level.exponent + 1) > s.max_batch * (1 + _TOL):
            return f"at max_batch={s.max_batch:g}"
        return None

    def why_not_shrink(self, level: BatchLevel) -> str | None:
        """``None`` if a halving is allowed, else why not."""
        s = self.settings
        if not s.allow_shrink:
            return "shrinking disabled"
        acc = level.accum(level.exponent)
        if acc % 2 or acc < 2:
            return "accumulation_steps cannot be halved"
        if s.min_batch is not None and level.batch(level.exponent - 1) < s.min_batch * (1 - _TOL):
            return f"at min_batch={s.min_batch:g}"
        return None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "recent_noise_scales": list(self.recent),
            "grow_count": self.grow_count,
            "shrink_count": self.shrink_count,
        }

    def parse_state(self, read: StateReader) -> dict[str, Any]:
        """Validate this part's keys; returns the values :meth:`assign` takes."""
        return {
            # a resumed controller with a smaller window keeps the newest values
            "recent": read.positive_list("recent_noise_scales")[-self.settings.window:],
            "grow_count": read.integer("grow_count", minimum=0),
            "shrink_count": read.integer("shrink_count", minimum=0),
        }

    def assign(self, parsed: dict[str, Any]) -> None:
        self.recent = list(parsed["recent"])
        self.grow_count, self.shrink_count = parsed["grow_count"], parsed["shrink_count"]
