"""The feedback guard: notice when the measured noise scale follows the batch, and stop growing.

Near the noise floor of the current batch ``B_simple`` scales with ``B`` itself, so a
doubling makes its own reason for the next one. :class:`FeedbackGuard` compares the
median noise scale after a doubling with the one that triggered it, net of the trend
seen before; the trap is declared on two such doublings in a row (one can be a chance
low before it), and growth resumes once ``B_simple / B`` rises at a fixed batch.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from cbs_tracker._warn import warn_user
from cbs_tracker.policy._state import StateReader

__all__ = ["IDLE", "ARMED", "TRIPPED", "FeedbackGuard"]

_log = logging.getLogger("cbs_tracker.policy.controller")

IDLE = 0  # no doubling waiting to be checked
ARMED = 1  # a doubling happened; compare once the new batch has been measured
TRIPPED = 2  # the noise scale followed the batch: growth stopped (until resume)


class FeedbackGuard:
    """Trap detection after a doubling, and resumption at a fixed batch.

    Args:
        settings: the controller; read: ``feedback_guard``, ``feedback_ratio``, ``feedback_strikes``,
            ``feedback_resume``, ``budget_tokens`` (no resumption with a budget: the
            plan times the growth after a trap).

    The check of a doubling: ``growth = median_after / median_before`` against the
    trend ``exp(slope * span)`` measured over the window before the doubling; a doubling
    *follows the batch* when ``growth / trend >= feedback_ratio`` and the earlier level
    (carried by the trend) lies below the new measurement's interval (a change within the
    noise scale's own interval is no evidence). The trap is declared when
    ``feedback_strikes`` measured doublings in a row followed the batch: a noise scale
    that read low by chance before one doubling makes that doubling look like the trap,
    and one comparison must not stop growth for the rest of the run.
    """

    MAX_STRIKES = 8

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.state = IDLE
        self.ns_before = 0.0  # median noise scale that triggered the doubling
        self.tokens_before = 0.0  # tokens_seen at that decision
        self.slope = 0.0  # d log(noise scale) / d tokens before the doubling (>= 0)
        self.span = 0.0  # tokens over which that slope was measured
        self.ratio = 0.0  # median noise scale / batch when the trap was declared
        self.exponent = 0  # the batch exponent that ratio was measured at
        # Anchor for the pre-doubling trend: a median and its tokens, retaken whenever a
        # window of measurements is complete after a change (or after the start).
        self.anchor_ns = 0.0
        self.anchor_tokens = 0.0
        self.anchor_set = False
        self.warned = False
        self.strikes = 0  # measured doublings in a row that followed the batch

    @property
    def tripped(self) -> bool:
        return self.state == TRIPPED

    @property
    def armed(self) -> bool:
        return self.state == ARMED

    def new_level(self) -> None:
        """A change took effect: the trend is measured again from the next full window."""
        self.anchor_set = False

    def anchor(self, median: float, tokens: float) -> None:
        """Start of the trend at this batch (first full window after a change)."""
        if not self.anchor_set:
            self.anchor_set, self.anchor_ns, self.anchor_tokens = True, median, tokens

    def on_change(self, median: float | None, tokens: float, *, measured_doubling: bool) -> None:
        """The level changed; arm the check if the measurement asked for this doubling.

        Only such a doubling is checked: a plan change, a conversion or a shrink in
        between would confound the comparison.
        """
        if self.state == TRIPPED:
            return
        self.state = IDLE
        if measured_doubling and self.settings.feedback_guard and median is not None:
            slope, span = 0.0, 0.0
            # After a doubling that followed the batch, the rise seen since is no landscape
            # trend: in the trap it is that doubling's own echo, and crediting it would
            # explain the next doubling's rise away. The deciding doubling is judged flat.
            if self.strikes == 0 and self.anchor_set and tokens > self.anchor_tokens and self.anchor_ns > 0:
                span = tokens - self.anchor_tokens
                slope = max(0.0, math.log(median / self.anchor_ns) / span)
            self.state = ARMED
            self.ns_before, self.tokens_before = median, tokens
            self.slope, self.span = slope, span

    def check(self, median: float, low: float | None, tokens: float, step: int, batch: float,
              exponent: int) -> None:
        """Compare the settled noise scale with the one that triggered the doubling; trips or disarms."""
        growth = median / self.ns_before
        # The trend is extrapolated no further than the span it was measured on: an early
        # transient (an estimator filling up, an iterate settling on its noise floor) rises
        # fast and then flattens. A trend over-estimated from noise can still hide a trap
        # at this doubling; the next doubling's trend is then measured at a batch already
        # in the trap (flat noise scale), so the trap is caught there at the latest.
        trend = math.exp(self.slope * min(tokens - self.tokens_before, self.span))
        excess = growth / trend
        outside = low is None or low > self.ns_before * trend
        if excess < self.settings.feedback_ratio or not outside:
            self.state, self.strikes = IDLE, 0
            return
        self.strikes += 1
        # With a budget a trap silences nothing (the plan goes on timing the growth), so
        # one comparison decides there, as it costs the least doubling into the trap.
        needed = 1 if self.settings.budget_tokens is not None else self.settings.feedback_strikes
        if self.strikes < needed:
            self.state = IDLE
            _log.info("BatchSizeController step %d: after doubling the batch, the measured noise scale grew x%.2f "
                      "(x%.2f beyond its earlier trend), as in the feedback trap; the next measured doubling "
                      "decides", step, growth, excess)
            return
        self.state = TRIPPED
        self.ratio, self.exponent = median / batch, exponent
        bound = self.ns_before * trend
        self._report(step, growth, excess, median=median, low=low, bound=bound)

    def _report(self, step: int, growth: float, excess: float, *, median: float, low: float | None,
                bound: float) -> None:
        s = self.settings
        if s.budget_tokens is not None:
            after = "(the budget's plan times the growth from here)"
        elif s.feedback_resume is not None:
            after = f"(it resumes only if B_simple / B rises x{s.feedback_resume:g} at a fixed batch)"
        else:
            after = "for the rest of the run"
        msg = (
            f"BatchSizeController step {step}: after doubling the batch, the measured noise scale "
            f"grew x{growth:.2f} (x{excess:.2f} beyond its earlier trend: median {median:.4g}"
            + ("" if low is None else f" and 90% interval's lower end {low:.4g}")
            + f", above the {bound:.4g} the trend predicts): it follows the batch "
            "itself (the feedback trap), so it says nothing about the critical batch "
            f"here. Growth from the noise scale stopped {after}."
        )
        _log.info(msg)
        if not self.warned:
            self.warned = True
            warn_user(msg, RuntimeWarning)

    def revisit(self, median: float, low: float | None, batch: float, exponent: int, step: int) -> None:
        """After a trap: re-measure ``B_simple / B`` at a new level, or resume if it rose at this one.

        Resumes when ``median / B >= feedback_resume * ratio`` and the interval's lower
        end lies above the trap's ratio too (a rise within the estimate's own error is no
        evidence). Never with a budget (the plan is in charge after a trap).
        """
        s = self.settings
        if self.state != TRIPPED:
            return
        if self.exponent != exponent:
            # the plan moved the batch since the trap: measure the ratio again at this batch
            self.ratio, self.exponent = median / batch, exponent
        elif (
            s.feedback_resume is not None
            and s.budget_tokens is None
            and self.ratio > 0
            and median / batch >= s.feedback_resume * self.ratio
            and (low is None or low / batch > self.ratio)
        ):
            # At this batch the noise scale rose on its own: it describes the landscape again.
            self.state = IDLE
            _log.info(
                "BatchSizeController step %d: the noise scale rose x%.2f per unit of batch since the "
                "feedback trap, at a fixed batch; growth from the noise scale resumes",
                step, median / batch / self.ratio,
            )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "trap_state": self.state,
            "trap_ns_before": self.ns_before,
            "trap_tokens_before": self.tokens_before,
            "trap_slope": self.slope,
            "trap_span": self.span,
            "trap_ratio": self.ratio,
            "trap_exponent": self.exponent,
            "anchor_ns": self.anchor_ns,
            "anchor_tokens": self.anchor_tokens,
            "anchor_set": int(self.anchor_set),
            "warned_trap": int(self.warned),
            "trap_strikes": self.strikes,
        }

    @staticmethod
    def parse_state(read: StateReader) -> dict[str, Any]:
        """Validate this part's keys (all but ``trap_state`` optional); returns what :meth:`assign` takes."""
        parsed = {
            "state": read.integer("trap_state", minimum=IDLE, maximum=TRIPPED),
            "ns_before": read.number("trap_ns_before", minimum=0.0, default=0.0),
            "tokens_before": read.number("trap_tokens_before", minimum=-1.0, default=0.0),
            "slope": read.number("trap_slope", minimum=0.0, default=0.0),
            "span": read.number("trap_span", minimum=0.0, default=0.0),
            "ratio": read.number("trap_ratio", minimum=0.0, default=0.0),
            "exponent": read.integer("trap_exponent", minimum=-62, maximum=62, default=0),
            "anchor_ns": read.number("anchor_ns", minimum=0.0, default=0.0),
            "anchor_tokens": read.number("anchor_tokens", minimum=-1.0, default=0.0),
            "anchor_set": read.flag("anchor_set", default=0),
            "warned": read.flag("warned_trap", default=0),
            "strikes": read.integer("trap_strikes", minimum=0, maximum=FeedbackGuard.MAX_STRIKES, default=0),
        }
        if parsed["state"] == ARMED and parsed["ns_before"] <= 0:
            raise ValueError(
                f"{read.owner}: state['trap_ns_before']={parsed['ns_before']!r}: expected > 0 while a doubling "
                f"awaits its feedback check (state['trap_state']={ARMED})"
            )
        return parsed

    def assign(self, parsed: dict[str, Any]) -> None:
        for name, value in parsed.items():
            setattr(self, name, value)
