"""The budget-aware plan: the power-of-two doubling plan of a run whose total units are known.

:class:`BudgetPlan` builds :func:`cbs_tracker.theory.schedule.plan_doubling` once, from
the starting batch, the largest batch the caps allow and three priors, and says which
level the plan asks for at a given number of units seen.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from typing import Any

from cbs_tracker.policy._state import StateReader

__all__ = ["BudgetPlan"]


class BudgetPlan:
    """The plan's level at each point of the budget (inactive without ``budget_tokens``).

    Args:
        settings: the controller; read: ``budget_tokens``, ``plan_s``, ``plan_beta``,
            ``plan_floor_ratio``, ``max_batch``.
    """

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.anchor = 0.0  # starting batch the plan is built from
        self._plan: Any = None  # the DoublingPlan, rebuilt from the anchor on demand

    @property
    def active(self) -> bool:
        return self.settings.budget_tokens is not None

    def batch_at(self, exponent: int) -> float:
        """The plan's batch of level ``exponent``."""
        return self.anchor * 2.0**exponent

    def build(self, max_level: Callable[[], int]) -> Any:
        """The cached :class:`~cbs_tracker.theory.schedule.DoublingPlan` (``None`` without a budget or an anchor).

        ``max_level()``: the largest exponent the caps allow (the plan's ``b_max`` rung),
        asked once, when the plan is built.
        """
        s = self.settings
        if s.budget_tokens is None or self.anchor <= 0:
            return None
        if self._plan is None:
            from cbs_tracker.theory.schedule import plan_doubling

            self._plan = plan_doubling(s.budget_tokens, self.anchor, self.batch_at(max_level()),
                                       s.plan_s, s.plan_beta, floor_ratio=s.plan_floor_ratio)
        return self._plan

    def exponent_at(self, tokens: float, max_level: Callable[[], int]) -> int | None:
        """The plan's level at ``tokens`` units seen (``None`` without a budget)."""
        plan = self.build(max_level)
        if plan is None:
            return None
        # same rule as DoublingPlan.batch_at_tokens, without numpy on every step
        batch = float(plan.batches[bisect.bisect_right(plan.switch_tokens, tokens)])
        return max(0, int(round(math.log2(batch / self.anchor))))

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"plan_anchor_batch": self.anchor}

    @staticmethod
    def parse_state(read: StateReader) -> dict[str, Any]:
        return {"anchor": read.number("plan_anchor_batch", minimum=0.0, default=0.0)}

    def assign(self, parsed: dict[str, Any]) -> None:
        self.anchor = parsed["anchor"]
        self._plan = None
