"""No growth while the training loss sits on a plateau: the run's own loss curve, read once a quarter in.

On the small GPTs of the frontier, every rule that grew the batch while the loss fell slowly (less than about
0.15 nats per e-fold of tokens, a plateau) ended above the constant batch, whatever its noise scale said; where
the loss fell faster, growth kept it. :class:`LossSlope` fits the loss against the log of the tokens,
``-dL / d ln T``, by least squares over the second half of the tokens seen (from twice the LR's warm-up on);
:class:`PlateauHold` holds growth until ``at`` of the run, reads the slope there once, and holds for good
below ``below`` (unless the slope later reaches ``exit``); otherwise the controller's rule is in force. A loss
that falls slowly after many tokens per parameter of the model is a run long for its model, not a plateau: with
``tokens_per_parameter`` and the model's size known, a verdict that would hold past that many tokens per parameter
does not hold. On
several data-parallel ranks each point is the mean over the ranks (the session reduces it), so every rank fits the
same points and decides alike.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from cbs_tracker.policy._state import StateReader

__all__ = ["LossSlope", "PlateauHold"]

#: the fewest points a slope is read from
MIN_POINTS = 8


class LossSlope:
    """``-dL / d ln T`` of the step losses given (:meth:`add`), by least squares over those at
    ``T >= max(T_now / 2, 2 w)``, ``w`` the tokens where the scheduled LR last rose (its warm-up; 0 without a
    scheduled LR). No slope before ``2.5 w`` nor from fewer than :data:`MIN_POINTS` points."""

    def __init__(self) -> None:
        self.points: deque[tuple[float, float]] = deque()  # (tokens, loss), oldest first
        self.sums = [0.0] * 5  # n, sum x, sum y, sum x^2, sum x y over the points (x = ln tokens)
        self.warmup = 0.0  # the tokens where the scheduled LR last rose
        self._lr = -math.inf  # the last scheduled LR seen
        self.seen = 0  # losses given since the start (the ones the fit dropped included)

    def observe_lr(self, tokens: float, scheduled_lr: float | None) -> None:
        """The scheduled LR at an update: while it rises, its warm-up runs to ``tokens``."""
        if scheduled_lr is None:
            return
        if scheduled_lr > self._lr:
            self.warmup = float(tokens)
        self._lr = float(scheduled_lr)

    def _change(self, tokens: float, loss: float, sign: float) -> None:
        x = math.log(tokens)
        for k, v in enumerate((1.0, x, loss, x * x, x * loss)):
            self.sums[k] += sign * v

    def add(self, tokens: float, loss: float) -> None:
        """One step's loss at ``tokens`` (all ranks' units so far); the points before the fit's start leave."""
        self.seen += 1
        self.points.append((tokens, loss))
        self._change(tokens, loss, 1.0)
        start = max(tokens / 2, 2 * self.warmup)
        while self.points and self.points[0][0] < start:
            self._change(*self.points.popleft(), -1.0)

    def clear(self) -> None:
        """Forget the points (the slope is no longer needed)."""
        self.points.clear()
        self.sums = [0.0] * 5

    def slope(self, tokens: float) -> float | None:
        """The slope at ``tokens``, or ``None`` where it is not read."""
        n, sx, sy, sxx, sxy = self.sums
        spread = sxx - sx * sx / n if n else 0.0
        if tokens < 2.5 * self.warmup or n < MIN_POINTS or spread <= 0:
            return None
        return -(sxy - sx * sy / n) / spread

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"loss_points": [list(p) for p in self.points], "loss_sums": list(self.sums),
                "loss_warmup": self.warmup, "loss_last_lr": None if self._lr == -math.inf else self._lr,
                "losses_seen": self.seen}

    @staticmethod
    def parse_state(read: StateReader) -> dict[str, Any]:
        points = read.state.get("loss_points", [])
        sums = read.state.get("loss_sums", [0.0] * 5)
        ok = isinstance(points, (list, tuple)) and all(
            isinstance(p, (list, tuple)) and len(p) == 2 and all(_finite(v) for v in p) and p[0] > 0 for p in points)
        if not ok:
            raise TypeError(f"{read.owner}: state['loss_points']={points!r}: expected a list of [tokens > 0, loss] "
                            "pairs of finite numbers")
        if not (isinstance(sums, (list, tuple)) and len(sums) == 5 and all(_finite(v) for v in sums)):
            raise TypeError(f"{read.owner}: state['loss_sums']={sums!r}: expected 5 finite numbers")
        last = read.state.get("loss_last_lr")
        if last is not None and not _finite(last):
            raise TypeError(f"{read.owner}: state['loss_last_lr']={last!r}: expected a finite number or None")
        return {"points": [(float(t), float(y)) for t, y in points], "sums": [float(v) for v in sums],
                "warmup": read.number("loss_warmup", minimum=0.0, default=0.0),
                "lr": -math.inf if last is None else float(last),
                "seen": read.integer("losses_seen", minimum=0, default=0)}

    def assign(self, parsed: dict[str, Any]) -> None:
        self.points, self.sums = deque(parsed["points"]), parsed["sums"]
        self.warmup, self._lr, self.seen = parsed["warmup"], parsed["lr"], parsed["seen"]


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class PlateauHold:
    """Growth held until ``at`` of the run; there, one verdict from the loss's slope: below ``below`` the run
    holds (until the slope reaches ``exit``, if given), otherwise the controller's rule is in force from then on.
    Where the slope cannot be read yet at ``at`` (a warm-up longer than ``at / 2.5`` of the run, or fewer than
    :data:`MIN_POINTS` losses) the verdict waits for it, held, until :attr:`give_up` of the run (then the rule is in
    force); with no loss at all it does nothing. With
    ``tokens_per_parameter``, a verdict that would hold does not where the run has seen at least that many units per
    parameter of the model (:attr:`parameters`, given by the controller; unknown, the verdict holds and says so).
    """

    def __init__(self, below: float | None, at: float, exit: float | None,
                 tokens_per_parameter: float | None = None) -> None:
        self.below, self.at, self.exit = below, at, exit
        self.tokens_per_parameter = tokens_per_parameter
        self.parameters: int | None = None  # the model's parameter count (configuration, not saved)
        self.in_samples = False  # the run counts samples: there are no tokens per parameter to read (not saved)
        self.gated: float | None = None  # the tokens per parameter at a verdict that would have held and did not
        self.slope = LossSlope()
        self.waiting_said = False  # the verdict is due and waits for a readable slope (said once)
        self.held: bool | None = None  # None: no verdict yet
        self.verdict_slope: float | None = None  # the slope read at the verdict
        self.verdict_tokens: float | None = None
        self.exit_tokens: float | None = None  # where a held run left its plateau
        self.unread = False  # the verdict came and no loss had been given
        self.ends_at_gate = False  # long_run_kappa: no hold before the verdict past tokens_per_parameter (config)
        self.warn = False  # what decide() said last is a warning

    @property
    def give_up(self) -> float:
        """The fraction of the run where a verdict still waiting for a readable slope gives way to the rule: twice
        ``at`` (half the run at the default quarter), at most halfway from ``at`` to the end."""
        return min(2 * self.at, (1 + self.at) / 2)

    @property
    def active(self) -> bool:
        return self.below is not None

    def holds(self, tokens: float, total: float | None) -> bool:
        """Growth is held at ``tokens``: before the verdict (due or not) and after one that held; without the run's
        length (``total``) nothing is held."""
        if not self.active or self.held is False:
            return False
        if self.held is None and self.ends_at_gate and (self.past_gate(tokens) or 0.0) >= 1.0:
            return False  # a verdict from here could not hold: the run is long for its model
        return self.held is True or total is not None  # held, or before a verdict (due or not)

    def past_gate(self, tokens: float) -> float | None:
        """The run's tokens per parameter over ``tokens_per_parameter`` at ``tokens``; ``None`` where they are not
        read (no gate, the count unknown, or the units samples)."""
        if self.tokens_per_parameter is None or self.parameters is None or self.in_samples:
            return None
        return tokens / (self.tokens_per_parameter * self.parameters)

    def decide(self, tokens: float, total: float | None) -> str | None:
        """The verdict at the first update past ``at`` of the run where the slope can be read, and a held
        run's exit; returns what happened, to be said (``None``: nothing; :attr:`unread`, or a verdict that
        waits, :attr:`warn` set: a warning)."""
        self.warn = False
        if not self.active or total is None or self.held is False or tokens < self.at * total:
            return None
        if self.held is None:
            return self._verdict(tokens, total)
        if self.exit is None:
            return None
        slope = self.slope.slope(tokens)
        if slope is None or slope < self.exit:
            return None
        self.held, self.exit_tokens = False, tokens
        self.slope.clear()
        return f"plateau left at {tokens:.4g} units: slope {slope:.3f} >= exit {self.exit:g}; growth resumes"

    def _verdict(self, tokens: float, total: float) -> str | None:
        if not self.slope.seen:  # no loss was given: nothing to read
            self.held, self.unread, self.warn, self.verdict_tokens = False, True, True, tokens
            return (f"no training loss reached the controller (observe_loss) by {tokens:.4g} units, "
                    f"{self.at:g} of the run: hold_on_plateau={self.below:g} read nothing and the growth "
                    "rule is in force. In a plain, Fabric or Accelerate loop call tracker.observe_loss(loss) after each "
                    "microbatch's backward, with the loss as the model returned it (Lightning, the Hugging Face "
                    "Trainer and OLMo-core pass it); hold_on_plateau=None turns the hold off")
        slope = self.slope.slope(tokens)
        if slope is None and tokens >= self.give_up * total:  # waited long enough: the rule decides from here
            self.held, self.warn, self.verdict_tokens = False, True, tokens
            self.slope.clear()
            return (f"hold_on_plateau={self.below:g}: the loss's slope could still not be read at {tokens:.4g} units, "
                    f"{self.give_up:g} of the run (it is read from 2.5 x the LR's warm-up, "
                    f"{2.5 * self.slope.warmup:.4g} units, and from {MIN_POINTS} losses): the growth rule is in force "
                    "from here")
        if slope is None:  # the warm-up ran late into the run, or too few losses: wait for a slope
            if self.waiting_said:
                return None
            self.waiting_said = self.warn = True
            return (f"hold_on_plateau={self.below:g}: at {tokens:.4g} units, {self.at:g} of the run, the loss's "
                    f"slope cannot be read yet (it is read from 2.5 x the LR's warm-up, {2.5 * self.slope.warmup:.4g} "
                    f"units, and from {MIN_POINTS} losses; {len(self.slope.points)} in its window): growth stays "
                    f"held until it can be, or until {self.give_up:g} of the run")
        self.verdict_tokens, self.verdict_slope = tokens, slope
        self.held = slope < self.below  # type: ignore[operator]
        said = (f"plateau verdict at {tokens:.4g} units ({tokens / total:.2g} of the run): slope {slope:.3f} nats per "
                "e-fold of tokens; " + (f"below {self.below:g}" + self._gate(tokens) if self.held else
                                        f"at least {self.below:g}, the growth rule is in force"))
        if not (self.held and self.exit is not None):
            self.slope.clear()  # the verdict is final: no more points are needed
        return said

    def _gate(self, tokens: float) -> str:
        """A verdict below the threshold read against the run's tokens per parameter: past ``tokens_per_parameter``
        it does not hold; returns the rest of the verdict's sentence."""
        bound = self.tokens_per_parameter
        if bound is None:
            return ", growth held"
        if self.in_samples:
            return f", growth held (the units are samples: plateau_tokens_per_parameter={bound:g} is not read)"
        if self.parameters is None:
            self.warn = True
            return (f", growth held; plateau_tokens_per_parameter={bound:g} could not tell a plateau from a run long "
                    "for its model: the model's parameter count is unknown (the adapters give it where the units are "
                    "tokens; with tokens, pass model_parameters=; otherwise plateau_tokens_per_parameter=None holds "
                    "without it)")
        per_parameter = tokens / self.parameters
        if per_parameter < bound:
            return f", growth held ({per_parameter:.3g} tokens per parameter, below plateau_tokens_per_parameter={bound:g})"
        self.held, self.gated = False, per_parameter
        return (f" (a plateau by its slope), not held: the run has seen {per_parameter:.3g} tokens per parameter, at "
                f"least plateau_tokens_per_parameter={bound:g}, a run long for its model, so the growth rule is in "
                "force")

    @property
    def collecting(self) -> bool:
        """Losses are still needed (before the verdict, or held with an ``exit``)."""
        return self.active and (self.held is None or (self.held and self.exit is not None))

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        if not self.active:
            return {}  # a controller without the option saves the keys it always saved
        return {**self.slope.state_dict(), "plateau_held": self.held, "plateau_verdict_slope": self.verdict_slope,
                "plateau_verdict_tokens": self.verdict_tokens, "plateau_exit_tokens": self.exit_tokens,
                "plateau_gated": self.gated}

    @staticmethod
    def parse_state(read: StateReader) -> dict[str, Any]:
        held = read.state.get("plateau_held")
        if held is not None and not isinstance(held, bool):
            raise TypeError(f"{read.owner}: state['plateau_held']={held!r}: expected True, False or None")
        parsed = {"slope": LossSlope.parse_state(read), "held": held}
        for key in ("verdict_slope", "verdict_tokens", "exit_tokens", "gated"):
            value = read.state.get("plateau_" + key)
            if value is not None and not _finite(value):
                raise TypeError(f"{read.owner}: state['plateau_{key}']={value!r}: expected a finite number or None")
            parsed[key] = None if value is None else float(value)
        if parsed["gated"] is not None and (parsed["gated"] <= 0 or held is not False):
            raise ValueError(f"{read.owner}: state['plateau_gated']={parsed['gated']!r} with state['plateau_held']="
                             f"{held!r}: a verdict the size gate overturned has tokens per parameter > 0 and does "
                             "not hold (plateau_held False)")
        return parsed

    def assign(self, parsed: dict[str, Any]) -> None:
        self.slope.assign(parsed["slope"])
        self.held, self.verdict_slope = parsed["held"], parsed["verdict_slope"]
        self.verdict_tokens, self.exit_tokens = parsed["verdict_tokens"], parsed["exit_tokens"]
        self.gated = parsed["gated"]
