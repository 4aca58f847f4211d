"""A growth rule that spends a budget of token efficiency: grow while the run's projected loss of data fits.

McCandlish et al. (2018) model a batch ``B`` against the noise scale ``B_noise``: reaching a given
loss takes ``E_min (1 + B / B_noise)`` tokens. Relative to the starting batch ``B0``, a step at ``B``
wastes the share ``w(B) = (B - B0) / (B_noise + B)`` of its tokens (``1 - (1 + B0/Bn) / (1 + B/Bn)``).
A token is worth as much progress as the learning rate it is trained at, so :class:`EfficiencyBudget`
counts the waste weighted by the scheduled LR over its peak::

    W = sum over steps of  tokens * w(B) * lr / lr_peak

and allows a doubling ``B -> 2B`` at ``t`` tokens of a run of ``T`` when the waste so far plus the
waste of running at ``2B`` for the rest of the run, at today's LR and the lower end of today's noise scale
(its 90% interval), fits the budget::

    W + (T - t) * w(2B) * lr / lr_peak  <=  budget * T

The projection shrinks with the tokens left, so on a noise scale that plateaus a doubling comes at a
point that moves smoothly with ``budget`` (a threshold ``kappa * B_simple >= 2B`` on a plateau grows
either at once or never). A doubling never goes past the median ``B_simple`` itself. Pure: no torch.
"""

from __future__ import annotations

import math
from typing import Any

from cbs_tracker.policy._state import StateReader

__all__ = ["EfficiencyBudget", "waste_share"]


def waste_share(batch: float, start: float, noise_scale: float) -> float:
    """``(batch - start) / (noise_scale + batch)``: the share of a step's tokens lost against ``start``."""
    if batch <= start:
        return 0.0
    return (batch - start) / (noise_scale + batch)


class EfficiencyBudget:
    """The waste spent so far and whether a doubling fits what is left.

    Args:
        settings: the controller; read: ``efficiency_budget`` (the share of the run's tokens that may be
            lost, LR-weighted) and ``total_tokens`` (the run's length in units; the rule is inactive
            while either is ``None``).

    :attr:`run_length` is the run's length as an adapter gave it
    (:meth:`~cbs_tracker.policy.controller.BatchSizeController.set_run_length`); it is state, saved so that
    a resumed run has it before the adapter gives it again.
    """

    KEYS = ("efficiency_spent", "efficiency_lr_peak", "efficiency_last_tokens", "efficiency_run_length")

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.spent = 0.0  # LR-weighted units lost so far
        self.lr_peak = 0.0  # highest scheduled LR seen (0: none yet)
        self.last_tokens: float | None = None  # units seen at the last observation (None: none yet)
        self.run_length: float | None = None  # the run's length in units as an adapter gave it (None: none)

    @property
    def active(self) -> bool:
        s = self.settings
        return s.efficiency_budget is not None and s.total_tokens is not None

    def lr_weight(self, scheduled_lr: float | None) -> float:
        """The scheduled LR over its peak so far (1 without a scheduled LR, 0 at an LR of 0)."""
        if scheduled_lr is None or not math.isfinite(scheduled_lr):
            return 1.0
        if scheduled_lr <= 0:
            return 0.0
        self.lr_peak = max(self.lr_peak, float(scheduled_lr))
        return float(scheduled_lr) / self.lr_peak

    def observe(self, tokens: float, batch: float, start: float, noise_scale: float | None,
                scheduled_lr: float | None) -> None:
        """Count the waste of the step that ended at ``tokens`` (trained at ``batch``)."""
        weight = self.lr_weight(scheduled_lr)
        # the first observation (of a run, or of a resumed state saved before this rule) counts nothing
        step_tokens = 0.0 if self.last_tokens is None else max(0.0, tokens - self.last_tokens)
        self.last_tokens = tokens if self.last_tokens is None else max(self.last_tokens, tokens)
        if noise_scale is not None and noise_scale > 0:
            self.spent += step_tokens * waste_share(batch, start, noise_scale) * weight

    def projected(self, tokens: float, batch: float, start: float, noise_scale: float,
                  scheduled_lr: float | None) -> float:
        """The waste at the run's end if it ran at ``batch`` from ``tokens`` on, at today's noise scale and LR."""
        left = max(0.0, float(self.settings.total_tokens) - tokens)
        weight = 1.0 if self.lr_peak <= 0 or scheduled_lr is None else min(1.0, max(0.0, scheduled_lr) / self.lr_peak)
        return self.spent + left * waste_share(batch, start, noise_scale) * weight

    def allows(self, tokens: float, batch: float, start: float, noise_scale: float,
               scheduled_lr: float | None) -> bool:
        """The projected waste of ``batch`` (at ``noise_scale``) fits the budget."""
        s = self.settings
        return self.projected(tokens, batch, start, noise_scale, scheduled_lr) <= (
            s.efficiency_budget * s.total_tokens)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"efficiency_spent": self.spent, "efficiency_lr_peak": self.lr_peak,
                "efficiency_last_tokens": -1.0 if self.last_tokens is None else self.last_tokens,
                "efficiency_run_length": 0.0 if self.run_length is None else self.run_length}

    @staticmethod
    def parse_state(read: StateReader) -> dict[str, Any]:
        # optional keys: a state saved before this rule existed loads with nothing spent
        return {"spent": read.number("efficiency_spent", minimum=0.0, default=0.0),
                "lr_peak": read.number("efficiency_lr_peak", minimum=0.0, default=0.0),
                "last_tokens": read.number("efficiency_last_tokens", minimum=-1.0, default=-1.0),
                "run_length": read.number("efficiency_run_length", minimum=0.0, default=0.0)}

    def assign(self, parsed: dict[str, Any]) -> None:
        self.spent, self.lr_peak = parsed["spent"], parsed["lr_peak"]
        self.last_tokens = None if parsed["last_tokens"] < 0 else parsed["last_tokens"]
        self.run_length = parsed["run_length"] or None
