"""The power-of-two level of the batch: accumulation ``A0 * 2**e`` and what the caller has run.

:class:`BatchLevel` counts steps and units, holds the exponent ``e``, and knows when a
change decided earlier has taken effect (the caller reports the new accumulation).
"""

from __future__ import annotations

import math
from typing import Any

from cbs_tracker.policy._state import StateReader

__all__ = ["BatchLevel"]


class BatchLevel:
    """Where the batch stands on the ladder ``B0 * 2**e``.

    The nominal batch of level ``e`` is the mean units per accumulation step so far
    times ``A0 * 2**e``. A change is decided at one step and takes effect when the
    caller reports the new accumulation; cool-downs count from ``effective_tokens``.
    """

    KEYS = ("started", "start_accumulation_steps", "units_sum", "accumulation_sum", "exponent", "steps",
            "last_step", "last_tokens", "pending", "effective_tokens")

    def __init__(self) -> None:
        self.started = False
        self.a0 = 0  # starting accumulation steps
        self.units_sum = 0.0  # sum of global_batch over all calls
        self.accum_sum = 0  # sum of accumulation_steps over all calls
        self.exponent = 0  # accumulation = a0 * 2**exponent
        self.steps = 0  # calls seen
        self.last_step = -1
        self.last_tokens = -math.inf
        self.pending = False
        self.effective_tokens = -math.inf  # tokens_seen when the last change took effect

    def accum(self, exponent: int) -> int | float:
        """Accumulation steps of level ``exponent``.

        ``A0`` is a whole number unless the run was resumed on more data-parallel ranks than it
        started with (``A0 = 1`` on 2 ranks is ``0.5`` per rank on 4); a level whose accumulation
        is then not a whole number cannot run (:meth:`runnable`).
        """
        if isinstance(self.a0, int):
            return self.a0 << exponent if exponent >= 0 else self.a0 >> (-exponent)
        value = self.a0 * 2.0**exponent
        return int(value) if value.is_integer() else value

    def runnable(self, exponent: int) -> bool:
        """Level ``exponent`` is a whole number of microbatches per rank, at least one."""
        value = self.accum(exponent)
        return value >= 1 and float(value).is_integer()

    def unit_batch(self) -> float:
        """Mean units per accumulation step so far."""
        return self.units_sum / self.accum_sum

    def batch(self, exponent: int | None = None) -> float:
        """Nominal global batch of level ``exponent`` (default: the current one)."""
        return self.unit_batch() * self.accum(self.exponent if exponent is None else exponent)

    def observe(self, step: int, tokens: float, global_batch: float, accumulation_steps: int) -> bool:
        """Count one step; True when the change decided earlier took effect with it."""
        if not self.started:
            self.started, self.a0 = True, accumulation_steps
        self.steps += 1
        self.last_step = step
        self.last_tokens = tokens
        self.units_sum += float(global_batch)
        self.accum_sum += accumulation_steps
        if self.pending and accumulation_steps == self.accum(self.exponent):
            self.pending = False
            self.effective_tokens = tokens - float(global_batch)
            return True
        return False

    def move_to(self, exponent: int) -> None:
        """Decide level ``exponent``; it is pending until the caller runs it."""
        self.exponent = exponent
        self.pending = True

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "started": int(self.started),
            "start_accumulation_steps": self.a0,
            "units_sum": self.units_sum,
            "accumulation_sum": self.accum_sum,
            "exponent": self.exponent,
            "steps": self.steps,
            "last_step": self.last_step,
            "last_tokens": self.last_tokens if math.isfinite(self.last_tokens) else -1.0,
            "pending": int(self.pending),
            "effective_tokens": self.effective_tokens if math.isfinite(self.effective_tokens) else -1.0,
        }

    @staticmethod
    def parse_state(read: StateReader) -> dict[str, Any]:
        """Validate this part's keys; returns the values :meth:`assign` takes."""
        started = read.flag("started")
        # whole numbers, or fractions after a resume on more data-parallel ranks (see policy/ranks.py)
        a0 = _count(read, "start_accumulation_steps", positive=started)
        parsed = {
            "started": started,
            "a0": a0,
            "units_sum": read.number("units_sum", minimum=0.0),
            "accum_sum": _count(read, "accumulation_sum", positive=False),
            "exponent": read.integer("exponent", minimum=-(max(int(math.ceil(a0)), 1).bit_length() - 1),
                                     maximum=62),
            "steps": read.integer("steps", minimum=0),
            "last_step": read.integer("last_step", minimum=-1),
            "last_tokens": read.number("last_tokens", minimum=-1.0),
            "pending": read.flag("pending"),
            "effective_tokens": read.number("effective_tokens", minimum=-1.0),
        }
        if started and (parsed["accum_sum"] <= 0 or parsed["units_sum"] <= 0):
            raise ValueError(
                f"{read.owner}: state['accumulation_sum']={parsed['accum_sum']!r}, "
                f"state['units_sum']={parsed['units_sum']!r}: a started controller has seen at least "
                "one step (accumulation_sum > 0 and units_sum > 0)"
            )
        return parsed

    def assign(self, parsed: dict[str, Any]) -> None:
        for name in ("started", "a0", "units_sum", "accum_sum", "exponent", "steps", "last_step", "pending"):
            setattr(self, name, parsed[name])
        self.last_tokens = parsed["last_tokens"] if parsed["last_tokens"] >= 0 else -math.inf
        self.effective_tokens = parsed["effective_tokens"] if parsed["effective_tokens"] >= 0 else -math.inf


def _count(read: StateReader, key: str, *, positive: bool) -> int | float:
    """A count saved as an int, or as a float after a resume on another number of ranks."""
    value = read.state.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        read.integer(key, minimum=1 if positive else 0)  # raises, naming the key
    number = read.number(key, positive=positive, minimum=0.0)
    return int(number) if number.is_integer() else number
