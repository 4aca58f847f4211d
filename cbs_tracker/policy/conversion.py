"""LR decay turned into batch growth: each halving of the scheduled learning rate is a chance to double.

:class:`LRDecayConversion` follows the learning rate the user's schedule sets (before
any batch-size coupling) and reports each time it has halved since the reference;
the controller decides whether that halving becomes a doubling of the batch.
"""

from __future__ import annotations

from typing import Any

from cbs_tracker.policy._state import StateReader

__all__ = ["LRDecayConversion"]


class LRDecayConversion:
    """Halvings of the scheduled learning rate, counted once each.

    The reference is the highest scheduled LR seen since the start; each halving
    (``lr <= reference / 2``) is consumed exactly once, converted into a doubling or
    not, and the reference then halves, so the halvings sit at ``peak * 2**-k``. A
    schedule that rises again (a warm restart) lifts the reference with it.
    """

    def __init__(self) -> None:
        self.reference = 0.0  # 0: no scheduled LR seen yet
        self.conversions = 0  # halvings turned into a doubling
        self.halvings = 0  # halvings consumed (converted or not)

    def observe(self, scheduled_lr: float | None) -> None:
        """Track the reference (the highest scheduled LR since the last halving)."""
        if scheduled_lr is not None and scheduled_lr > self.reference:
            self.reference = float(scheduled_lr)

    def halved(self, scheduled_lr: float | None) -> bool:
        """The scheduled LR is at or below half the reference (a halving waits to be consumed)."""
        return scheduled_lr is not None and self.reference > 0 and scheduled_lr <= 0.5 * self.reference * (1 + 1e-9)

    def consume(self, *, converted: bool) -> None:
        """Count one halving; the next one is measured from half the reference."""
        self.reference *= 0.5
        self.halvings += 1
        self.conversions += int(converted)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"lr_reference": self.reference, "lr_conversions": self.conversions, "lr_halvings": self.halvings}

    @staticmethod
    def parse_state(read: StateReader) -> dict[str, Any]:
        parsed = {
            "reference": read.number("lr_reference", minimum=0.0, default=0.0),
            "conversions": read.integer("lr_conversions", minimum=0, default=0),
            "halvings": read.integer("lr_halvings", minimum=0, default=0),
        }
        if parsed["conversions"] > parsed["halvings"]:
            raise ValueError(
                f"{read.owner}: state['lr_conversions']={parsed['conversions']!r}: expected at most "
                f"state['lr_halvings']={parsed['halvings']!r} (each halving converts at most once)"
            )
        return parsed

    def assign(self, parsed: dict[str, Any]) -> None:
        self.reference, self.conversions, self.halvings = parsed["reference"], parsed["conversions"], parsed["halvings"]
