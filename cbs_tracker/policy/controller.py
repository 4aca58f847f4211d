"""Batch-size controller: turn the measured noise scale into power-of-two accumulation changes.

Pure policy, no torch: the tracker calls :meth:`BatchSizeController.update` once
per optimizer step with the smoothed simple noise scale ``B_simple`` (McCandlish
et al. 2018, "An Empirical Model of Large-Batch Training", App. A) and the
batch of that step; the controller answers with the accumulation steps of the
next window (a :class:`Decision`). DESIGN §4 describes the policy; the rules are:

* target ``critical_batch = clip(kappa * B_simple, min_batch, max_batch)``;
* only power-of-two multiples of the starting global batch: the accumulation
  steps are ``A0 * 2**e`` with ``A0`` the starting accumulation;
* robust to single spikes: the decision uses the **median** of the last
  ``window`` measurements, and it must hold for ``patience`` consecutive
  measurements;
* hysteresis: grow ``B -> 2B`` when the target is at least ``2B (1 + margin)``
  (so the batch stays at or below ``critical / (1 + margin)``); shrink (only with
  ``allow_shrink``) ``B -> B/2`` when the target is below ``B / (2 (1 + margin))``.
  Between the two the batch holds: a factor ``4 (1 + margin)^2`` of dead band;
* warm-up (no decision before ``warmup_steps`` steps **and** ``warmup_tokens``),
  cool-down (at least ``cooldown_tokens`` between a change taking effect and the
  next change), caps on the batch and on the accumulation steps;
* the feedback trap (DESIGN §4): close to the noise floor of the current batch
  the measured ``B_simple`` is driven by the batch itself (``|G|^2`` is the
  iterate's own fluctuation, which scales as ``1/B``), so a rule "double when
  ``B_simple >= 2B``" runs away. After every doubling the controller compares
  the median noise scale once the new batch has been measured for a cool-down
  with the median that triggered the doubling, discounting the growth trend it
  saw before the doubling. If the noise scale roughly doubled with the batch
  (by ``feedback_ratio`` = 1.4 or more beyond the trend), the growth was the
  batch's own doing: the controller stops growing from the noise scale (in
  budget-aware mode it also goes back to the plan's batch), says so in
  :attr:`Decision.reason` and warns once. Growth resumes only if, at a fixed
  batch, ``B_simple / B`` later rises by ``feedback_resume`` (1.5): a noise scale
  that follows the batch keeps that ratio, a critical batch that still rises does
  not, so a trap declared on the fast early rise costs a delay, not the run;
* the learning-rate coupling at a change: ``keep`` (default), ``sqrt`` (Adam) or
  ``linear`` (SGD); :func:`apply_lr_factor` applies it to an optimizer and its
  scheduler;
* budget-aware mode (``budget_tokens=...``): the batch is the larger of what the
  rules above reach (following the measured critical batch early, as OLMo's
  batch-size warm-up does, then holding) and the power-of-two plan of the
  functional-scaling-law optimum for the remaining budget
  (:func:`cbs_tracker.theory.schedule.plan_doubling`: "hold, then ramp late", DESIGN §6–7).
  No gradient statistic can time the late doublings (they act like a learning-rate
  decay whose timing depends on the budget); the plan does, from the budget, the
  starting batch, the largest batch and three priors (``plan_s``, ``plan_beta``,
  ``plan_floor_ratio``). The plan ramps up to the largest batch the caps allow
  (``max_batch``, else ``256 * A0`` accumulation): set ``max_batch`` to bound the
  last doublings.

When tracking helps and when it does not: where the measured noise scale
describes the landscape (signal-dominated runs; on a small GPT it rose early, then
sat at 2.2-2.9k tokens whatever the batch, 2.5-5x the best constant batch of a
sweep), following ``kappa * B_simple`` (default ``kappa = 0.5``) found a batch as good
as the sweep's best without a sweep. Where it follows the batch (near the noise floor; the NQM at every
batch), it carries no information on the batch to use: the guard stops the growth
one doubling after the start, and only the budget (the plan) can time a ramp.

Sizes are in the caller's unit (loss-contributing tokens for a language model,
samples elsewhere): ``global_batch``, ``tokens_seen``, ``noise_scale``,
``min_batch``, ``max_batch``, ``warmup_tokens`` and ``cooldown_tokens`` must all
use the same one. Defaults that are sizes are relative to the batch, so the same
defaults fit a 16-sample regression and a 4M-token pretraining batch.
"""

from __future__ import annotations

import bisect
import logging
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["BatchSizeController", "Decision"]

_log = logging.getLogger(__name__)

LRScaling = Literal["keep", "sqrt", "linear"]
_LR_SCALINGS = ("keep", "sqrt", "linear")

# Trap-check states (stored as plain ints in the state dict).
_TRAP_IDLE = 0  # no doubling waiting to be checked
_TRAP_ARMED = 1  # a doubling happened; compare once the new batch has been measured
_TRAP_TRIPPED = 2  # the noise scale followed the batch: growth stopped (until feedback_resume)


@dataclass(frozen=True)
class Decision:
    """What the controller decided after one optimizer step.

    Attributes:
        step: the ``step`` this decision answers.
        accumulation_steps: microbatches per rank for the **next** window,
            ``A0 * 2**e``.
        global_batch: the nominal global batch of the next window, in the caller's
            unit (mean units per accumulation step so far times ``accumulation_steps``).
        changed: ``accumulation_steps`` differs from the controller's previous level.
        critical_batch: ``clip(kappa * noise_scale, min_batch, max_batch)`` of this
            step's measurement (``None`` without a measurement).
        decision_noise_scale: the median of the last ``window`` measurements, the
            value the decision used (``None`` before the first measurement).
        lr_factor: multiplicative learning-rate factor to apply now because of this
            change (1.0 when unchanged). For a batch ratio ``r = new / old``:
            ``keep`` -> 1, ``sqrt`` -> ``sqrt(r)``, ``linear`` -> ``r``.
        reason: short text for logs.
        feedback_trap: the controller found that the noise scale follows the batch
            and stopped growing (stays ``True`` from then on).
        planned_batch: budget-aware mode: the plan's batch at this step's tokens
            (``None`` without a budget).
    """

    step: int
    accumulation_steps: int
    global_batch: float
    changed: bool
    critical_batch: float | None
    decision_noise_scale: float | None
    lr_factor: float
    reason: str
    feedback_trap: bool = False
    planned_batch: float | None = None


def _check_positive(name: str, value: Any, *, allow_none: bool = False, integer: bool = False,
                    allow_zero: bool = False) -> None:
    if value is None:
        if allow_none:
            return
        raise TypeError(f"BatchSizeController({name}=None): expected a number")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"BatchSizeController({name}={value!r}): expected {'an int' if integer else 'a number'}, "
            f"got {type(value).__name__}"
        )
    if integer and not isinstance(value, int):
        raise TypeError(f"BatchSizeController({name}={value!r}): expected an int, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        allowed = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"BatchSizeController({name}={value!r}): must be finite and {allowed}")


class BatchSizeController:
    """Grow (optionally shrink) the global batch by powers of two as the critical batch moves.

    Args:
        kappa: the target batch is ``kappa * B_simple`` (DESIGN §2: ``B_crit ~ B_noise``,
            which ``B_simple`` approximates for a near-isotropic Hessian). Default 0.5.
            ``B_noise`` is where a run needs about twice the minimal data for a given loss
            (McCandlish et al. 2018: ``E = E_min (1 + B / B_noise)``); at a fixed token
            budget the loss-optimal batch sits below it. On the small GPT of
            ``examples/gpt_proof.py`` ``B_simple`` sat at 2.2-2.9k tokens while constants of
            512-1k ended lowest: ``kappa=1`` settled at 2k and ended 0.024/0.038 nats above
            the best constant (two seeds), ``kappa=0.5`` ended below every constant. The
            value was chosen from that sweep (one model, two seeds); the NQM results do not
            change with it. ``kappa=1`` trades more tokens for fewer steps.
        min_batch: lower clip of the critical batch and lowest batch a shrink may reach,
            in the caller's unit. ``None``: no lower bound (a shrink still keeps
            ``accumulation_steps >= 1``). A starting batch below it grows towards it.
        max_batch: upper clip of the critical batch and largest batch a doubling may
            reach. ``None``: only ``max_accumulation_steps`` bounds the growth.
        margin: hysteresis. Grow ``B -> 2B`` when the target is ``>= 2B (1 + margin)``;
            shrink ``B -> B/2`` when it is ``< B / (2 (1 + margin))``. Default 0.1
            (the batch ends at most ``1/1.1`` of the measured critical batch).
        patience: consecutive measurements for which the (median) target must pass a
            threshold before a change. Default 16.
        window: the decision uses the median of the last ``window`` measurements, so a
            spike in fewer than half of them moves nothing. Default 32.
        warmup_steps: no change before this many optimizer steps. Default 100.
        warmup_tokens: no change before this many units were seen. ``None`` (default):
            100 starting global batches.
        cooldown_tokens: units that must pass, once a change has taken effect, before the
            next change (and before the feedback check of a doubling). ``None``
            (default): 100 global batches of the new size.
        max_accumulation_steps: largest accumulation a doubling may reach. ``None``
            (default): ``256 * A0`` (eight doublings of the starting accumulation).
        allow_shrink: allow halving when the target falls well below the batch. Default
            ``False`` (grow only, as every published ramp does).
        observe_only: compute and report the critical batch, never change anything.
        lr_scaling: learning-rate coupling at a change (see :attr:`Decision.lr_factor`).
            ``"keep"`` (default: Apertus kept its LR when doubling), ``"sqrt"`` (Adam rule,
            OLMo-core) or ``"linear"`` (SGD rule).
        feedback_guard: detect the feedback trap (DESIGN §4) and stop growing there.
            Default ``True``.
        feedback_resume: after a trap, growth resumes once the median noise scale per unit
            of batch (``B_simple / B``) has risen by this factor over its value when the trap
            was declared, with no change in between: a noise scale that follows the batch
            keeps that ratio fixed, a landscape whose critical batch still rises does not.
            So a trap declared on the fast early rise of the critical batch costs a delay,
            not the rest of the run. ``None``: stop for good. Default 1.5. Not used in
            budget-aware mode, where the plan times the growth after a trap (resuming
            there made the batch go up and back down around each plan step on the NQM).
        feedback_ratio: after a doubling, the trap is declared when the median noise scale
            grew by at least this factor more than the trend seen before the doubling
            would explain. A noise scale that follows the batch doubles (2.0), one that
            describes the landscape stays (1.0). Default 1.4 (about sqrt(2), the geometric
            midpoint; the first check after a doubling sees a smoothed estimate that has
            not fully refreshed, so a trap reads below 2).
        budget_tokens: the planned total units of the run (tokens for a language model).
            ``None`` (default): budget-unaware. When set, the batch never falls below
            the plan of :func:`cbs_tracker.theory.schedule.plan_doubling` computed once, at the
            first update, with ``b_min`` = the starting batch and ``b_max`` = the largest
            batch the caps allow; a plan change takes effect at once (no patience, no
            cool-down, not subject to the feedback check). Growth from the measured
            critical batch works as without a budget. After a feedback trap the
            controller returns to the plan's batch (the doubling that revealed the trap
            was not the landscape's doing, and the plan times the growth from there).
        plan_s: source exponent ``s`` of the plan (default 0.5: the hard regime of language
            models; the seed's NQM measures 0.49).
        plan_beta: capacity exponent ``beta`` of the plan (default 2.0; NQM: 1.96).
        plan_floor_ratio: the plan's one free scale: a run held at the starting batch
            would level off at this fraction of its initial excess loss (default 0.5:
            the starting batch is well below the critical batch, where the gradient noise
            sets half the loss; :meth:`cbs_tracker.theory.schedule.ScalingLaw.from_noise_floor`).

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: an argument out of range, or inconsistent bounds.
    """

    STATE_VERSION = 1

    def __init__(
        self,
        *,
        kappa: float = 0.5,
        min_batch: float | None = None,
        max_batch: float | None = None,
        margin: float = 0.1,
        patience: int = 16,
        window: int = 32,
        warmup_steps: int = 100,
        warmup_tokens: float | None = None,
        cooldown_tokens: float | None = None,
        max_accumulation_steps: int | None = None,
        allow_shrink: bool = False,
        observe_only: bool = False,
        lr_scaling: LRScaling = "keep",
        feedback_guard: bool = True,
        feedback_ratio: float = 1.4,
        feedback_resume: float | None = 1.5,
        budget_tokens: float | None = None,
        plan_s: float = 0.5,
        plan_beta: float = 2.0,
        plan_floor_ratio: float = 0.5,
    ) -> None:
        _check_positive("kappa", kappa)
        _check_positive("min_batch", min_batch, allow_none=True)
        _check_positive("max_batch", max_batch, allow_none=True)
        _check_positive("margin", margin, allow_zero=True)
        _check_positive("patience", patience, integer=True)
        _check_positive("window", window, integer=True)
        _check_positive("warmup_steps", warmup_steps, integer=True, allow_zero=True)
        _check_positive("warmup_tokens", warmup_tokens, allow_none=True, allow_zero=True)
        _check_positive("cooldown_tokens", cooldown_tokens, allow_none=True, allow_zero=True)
        _check_positive("max_accumulation_steps", max_accumulation_steps, allow_none=True, integer=True)
        _check_positive("feedback_ratio", feedback_ratio)
        _check_positive("feedback_resume", feedback_resume, allow_none=True)
        if feedback_resume is not None and feedback_resume <= 1.0:
            raise ValueError(
                f"BatchSizeController(feedback_resume={feedback_resume!r}): must be > 1 or None "
                "(the factor by which B_simple / B must rise before growth resumes)"
            )
        _check_positive("budget_tokens", budget_tokens, allow_none=True)
        _check_positive("plan_s", plan_s)
        _check_positive("plan_beta", plan_beta)
        _check_positive("plan_floor_ratio", plan_floor_ratio)
        if plan_beta <= 1.0:
            raise ValueError(
                f"BatchSizeController(plan_beta={plan_beta!r}): must be > 1 (the capacity exponent; "
                "the noise kernel must be summable)"
            )
        for name, flag in (("allow_shrink", allow_shrink), ("observe_only", observe_only),
                           ("feedback_guard", feedback_guard)):
            if not isinstance(flag, bool):
                raise TypeError(f"BatchSizeController({name}={flag!r}): expected a bool")
        if lr_scaling not in _LR_SCALINGS:
            raise ValueError(
                f"BatchSizeController(lr_scaling={lr_scaling!r}): expected one of {list(_LR_SCALINGS)}"
            )
        if min_batch is not None and max_batch is not None and min_batch > max_batch:
            raise ValueError(
                f"BatchSizeController(min_batch={min_batch!r}, max_batch={max_batch!r}): "
                "min_batch must be <= max_batch"
            )
        if feedback_ratio <= 1.0:
            raise ValueError(
                f"BatchSizeController(feedback_ratio={feedback_ratio!r}): must be > 1 "
                "(1 means the noise scale did not follow the batch at all)"
            )
        self.kappa = float(kappa)
        self.min_batch = None if min_batch is None else float(min_batch)
        self.max_batch = None if max_batch is None else float(max_batch)
        self.margin = float(margin)
        self.patience = patience
        self.window = window
        self.warmup_steps = warmup_steps
        self.warmup_tokens = None if warmup_tokens is None else float(warmup_tokens)
        self.cooldown_tokens = None if cooldown_tokens is None else float(cooldown_tokens)
        self.max_accumulation_steps = max_accumulation_steps
        self.allow_shrink = allow_shrink
        self.observe_only = observe_only
        self.lr_scaling: LRScaling = lr_scaling
        self.feedback_guard = feedback_guard
        self.feedback_ratio = float(feedback_ratio)
        self.feedback_resume = None if feedback_resume is None else float(feedback_resume)
        self.budget_tokens = None if budget_tokens is None else float(budget_tokens)
        self.plan_s = float(plan_s)
        self.plan_beta = float(plan_beta)
        self.plan_floor_ratio = float(plan_floor_ratio)
        self._plan: Any = None  # the DoublingPlan, rebuilt from _plan_anchor on demand
        self._reset_state()

    # ------------------------------------------------------------------ state
    def _reset_state(self) -> None:
        self._started = False
        self._a0 = 0  # starting accumulation steps
        self._units_sum = 0.0  # sum of global_batch over all calls
        self._accum_sum = 0  # sum of accumulation_steps over all calls
        self._exponent = 0  # current level: accumulation = a0 * 2**exponent
        self._steps = 0  # calls seen
        self._last_step = -1
        self._last_tokens = -math.inf
        self._recent: list[float] = []  # last `window` measurements (noise scale, unit)
        self._grow_count = 0
        self._shrink_count = 0
        # A change is decided at one step and takes effect when the caller reports the
        # new accumulation; cool-down and the feedback check count from then on.
        self._pending = False
        self._effective_tokens = -math.inf  # tokens_seen when the last change took effect
        self._trap_state = _TRAP_IDLE
        self._trap_ns_before = 0.0  # median noise scale that triggered the doubling
        self._trap_tokens_before = 0.0  # tokens_seen at that decision
        self._trap_slope = 0.0  # d log(noise scale) / d tokens before the doubling (>= 0)
        self._trap_span = 0.0  # tokens over which that slope was measured
        self._trap_ratio = 0.0  # median noise scale / batch when the trap was declared
        self._trap_exponent = 0  # the batch exponent that ratio was measured at
        # Anchor for the pre-doubling trend: a median and its tokens, retaken whenever a
        # window of measurements is complete after a change (or after the start).
        self._anchor_ns = 0.0
        self._anchor_tokens = 0.0
        self._anchor_set = False
        self._warned_trap = False
        self._plan_anchor = 0.0  # starting batch the plan was built from (budget mode)
        self._plan = None

    def state_dict(self) -> dict[str, Any]:
        """The controller's resumable state: fixed keys, plain numbers, a version.

        ``recent_noise_scales`` is the list of the last ``window`` measurements (the
        median needs them to resume exactly). The configuration is not saved: build the
        resumed controller with the same arguments.
        """
        return {
            "version": self.STATE_VERSION,
            "started": int(self._started),
            "start_accumulation_steps": self._a0,
            "units_sum": self._units_sum,
            "accumulation_sum": self._accum_sum,
            "exponent": self._exponent,
            "steps": self._steps,
            "last_step": self._last_step,
            "last_tokens": self._last_tokens if math.isfinite(self._last_tokens) else -1.0,
            "recent_noise_scales": list(self._recent),
            "grow_count": self._grow_count,
            "shrink_count": self._shrink_count,
            "pending": int(self._pending),
            "effective_tokens": self._effective_tokens if math.isfinite(self._effective_tokens) else -1.0,
            "trap_state": self._trap_state,
            "trap_ns_before": self._trap_ns_before,
            "trap_tokens_before": self._trap_tokens_before,
            "trap_slope": self._trap_slope,
            "trap_span": self._trap_span,
            "trap_ratio": self._trap_ratio,
            "trap_exponent": self._trap_exponent,
            "anchor_ns": self._anchor_ns,
            "anchor_tokens": self._anchor_tokens,
            "anchor_set": int(self._anchor_set),
            "warned_trap": int(self._warned_trap),
            "plan_anchor_batch": self._plan_anchor,
        }

    _REQUIRED_KEYS = (
        "version", "started", "start_accumulation_steps", "units_sum", "accumulation_sum",
        "exponent", "steps", "last_step", "last_tokens", "recent_noise_scales",
        "grow_count", "shrink_count", "pending", "effective_tokens", "trap_state",
    )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output. Strict on required keys, tolerant of newer optional ones.

        Raises:
            TypeError: ``state`` is not a mapping.
            KeyError: a required key is missing.
            ValueError: the version is newer than this code understands.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"BatchSizeController.load_state_dict: expected a mapping, got {type(state).__name__}")
        missing = [k for k in self._REQUIRED_KEYS if k not in state]
        if missing:
            raise KeyError(f"BatchSizeController.load_state_dict: missing required keys {missing}")
        version = int(state["version"])
        if version > self.STATE_VERSION:
            raise ValueError(
                f"BatchSizeController.load_state_dict: state version {version} is newer than "
                f"this code's {self.STATE_VERSION}; upgrade cbs-tracker"
            )
        self._reset_state()
        self._started = bool(state["started"])
        self._a0 = int(state["start_accumulation_steps"])
        self._units_sum = float(state["units_sum"])
        self._accum_sum = int(state["accumulation_sum"])
        self._exponent = int(state["exponent"])
        self._steps = int(state["steps"])
        self._last_step = int(state["last_step"])
        last_tokens = float(state["last_tokens"])
        self._last_tokens = last_tokens if last_tokens >= 0 else -math.inf
        self._recent = [float(x) for x in state["recent_noise_scales"]][-self.window:]
        self._grow_count = int(state["grow_count"])
        self._shrink_count = int(state["shrink_count"])
        self._pending = bool(state["pending"])
        eff = float(state["effective_tokens"])
        self._effective_tokens = eff if eff >= 0 else -math.inf
        self._trap_state = int(state["trap_state"])
        # optional (all present since version 1, read with defaults for robustness)
        self._trap_ns_before = float(state.get("trap_ns_before", 0.0))
        self._trap_tokens_before = float(state.get("trap_tokens_before", 0.0))
        self._trap_slope = float(state.get("trap_slope", 0.0))
        self._trap_span = float(state.get("trap_span", 0.0))
        self._trap_ratio = float(state.get("trap_ratio", 0.0))
        self._trap_exponent = int(state.get("trap_exponent", 0))
        self._anchor_ns = float(state.get("anchor_ns", 0.0))
        self._anchor_tokens = float(state.get("anchor_tokens", 0.0))
        self._anchor_set = bool(state.get("anchor_set", 0))
        self._warned_trap = bool(state.get("warned_trap", 0))
        self._plan_anchor = float(state.get("plan_anchor_batch", 0.0))

    # ------------------------------------------------------------ properties
    @property
    def accumulation_steps(self) -> int:
        """Accumulation steps of the current level (``A0 * 2**e``); 0 before the first update."""
        if not self._started:
            return 0
        return self._accum(self._exponent)

    @property
    def start_batch(self) -> float | None:
        """Nominal starting global batch (mean units per accumulation step times ``A0``)."""
        if not self._started:
            return None
        return self._unit_batch() * self._a0

    @property
    def feedback_trap(self) -> bool:
        """True once the controller found that the noise scale follows the batch."""
        return self._trap_state == _TRAP_TRIPPED

    def _accum(self, exponent: int) -> int:
        if exponent >= 0:
            return self._a0 << exponent
        return self._a0 >> (-exponent)

    def _unit_batch(self) -> float:
        return self._units_sum / self._accum_sum

    def _batch(self, exponent: int) -> float:
        return self._unit_batch() * self._accum(exponent)

    def _max_accum(self) -> int:
        if self.max_accumulation_steps is not None:
            return self.max_accumulation_steps
        return 256 * self._a0

    def _clip(self, value: float) -> float:
        if self.min_batch is not None:
            value = max(value, self.min_batch)
        if self.max_batch is not None:
            value = min(value, self.max_batch)
        return value

    def _lr_factor(self, ratio: float) -> float:
        if self.lr_scaling == "sqrt":
            return math.sqrt(ratio)
        if self.lr_scaling == "linear":
            return ratio
        return 1.0

    def _can_grow(self) -> str | None:
        """None if a doubling is allowed, else why not."""
        if self._accum(self._exponent + 1) > self._max_accum():
            return f"at max_accumulation_steps={self._max_accum()}"
        if self.max_batch is not None and self._batch(self._exponent + 1) > self.max_batch * (1 + 1e-9):
            return f"at max_batch={self.max_batch:g}"
        return None

    def _can_shrink(self) -> str | None:
        if not self.allow_shrink:
            return "shrinking disabled"
        acc = self._accum(self._exponent)
        if acc % 2 or acc < 2:
            return "accumulation_steps cannot be halved"
        if self.min_batch is not None and self._batch(self._exponent - 1) < self.min_batch * (1 - 1e-9):
            return f"at min_batch={self.min_batch:g}"
        return None

    # ---------------------------------------------------------------- update
    def update(
        self,
        *,
        step: int,
        tokens_seen: float,
        global_batch: float,
        accumulation_steps: int,
        noise_scale: float | None,
    ) -> Decision:
        """Take one optimizer step's measurement and decide the next window's accumulation.

        Args:
            step: optimizer steps completed, this one included; strictly increasing.
            tokens_seen: units consumed since the start, this step included; non-decreasing.
            global_batch: units in this optimizer step (all DP ranks, the whole window).
            accumulation_steps: microbatches per rank in this step's window.
            noise_scale: the estimator's smoothed ``B_simple`` in the same unit, or
                ``None`` when not measurable yet. Non-finite or non-positive values count
                as no measurement.

        Returns:
            The :class:`Decision` for the next window.

        Raises:
            TypeError / ValueError: an argument of the wrong type or out of range.
            RuntimeError: ``step`` did not increase or ``tokens_seen`` decreased.
        """
        self._check_update_args(step, tokens_seen, global_batch, accumulation_steps, noise_scale)
        if not self._started:
            self._started = True
            self._a0 = accumulation_steps
            if accumulation_steps > self._max_accum():
                raise ValueError(
                    f"BatchSizeController: starting accumulation_steps={accumulation_steps} exceeds "
                    f"max_accumulation_steps={self._max_accum()}"
                )
            if self.max_batch is not None and global_batch > self.max_batch * (1 + 1e-9):
                raise ValueError(
                    f"BatchSizeController: starting global_batch={global_batch:g} exceeds "
                    f"max_batch={self.max_batch:g}"
                )
            if self.budget_tokens is not None and self.budget_tokens < global_batch:
                raise ValueError(
                    f"BatchSizeController(budget_tokens={self.budget_tokens:g}): smaller than the "
                    f"starting global_batch={global_batch:g}"
                )
            self._plan_anchor = float(global_batch)
        self._steps += 1
        self._last_step = step
        self._last_tokens = float(tokens_seen)
        self._units_sum += float(global_batch)
        self._accum_sum += accumulation_steps

        current = self._accum(self._exponent)
        if self._pending and accumulation_steps == current:
            # the change decided earlier is in force from this step on
            self._pending = False
            self._effective_tokens = float(tokens_seen) - float(global_batch)
            self._recent.clear()
            self._grow_count = self._shrink_count = 0
            self._anchor_set = False

        measured = noise_scale is not None and math.isfinite(noise_scale) and noise_scale > 0
        critical = self._clip(self.kappa * float(noise_scale)) if measured else None
        if measured and not self._pending:
            self._recent.append(float(noise_scale))
            if len(self._recent) > self.window:
                del self._recent[0]
        median = _median(self._recent) if self._recent else None
        full = len(self._recent) >= self.window

        if full and not self._anchor_set and median is not None:
            self._anchor_set, self._anchor_ns, self._anchor_tokens = True, median, float(tokens_seen)

        planned_exp = self._planned_exponent(float(tokens_seen))
        planned = None if planned_exp is None else self._batch_at_anchor(planned_exp)

        def hold(reason: str) -> Decision:
            return Decision(
                step=step, accumulation_steps=current, global_batch=self._batch(self._exponent),
                changed=False, critical_batch=critical, decision_noise_scale=median,
                lr_factor=1.0, reason=reason, feedback_trap=self.feedback_trap, planned_batch=planned,
            )

        if self.observe_only:
            return hold("observe-only")
        if self._pending:
            return hold(f"pending: waiting for accumulation_steps={current} to take effect")
        if planned_exp is not None and planned_exp > self._exponent:
            # the budget's plan is ahead of the measured level: follow it now
            return self._change_to(
                planned_exp, step, critical, median, planned,
                f"plan: {planned:.4g} at {tokens_seen:.4g} of {self.budget_tokens:.4g} budget units",
            )
        if median is None:
            return hold("no measurement yet")

        batch = self._batch(self._exponent)
        target = self._clip(self.kappa * median)
        cooldown = self.cooldown_tokens if self.cooldown_tokens is not None else 100.0 * batch
        in_cooldown = tokens_seen - self._effective_tokens < cooldown

        # Feedback check of the last doubling, once its cool-down has passed.
        if self._trap_state == _TRAP_ARMED and not in_cooldown and full:
            self._check_trap(median, float(tokens_seen), step)
            if self._trap_state == _TRAP_TRIPPED and planned_exp is not None:
                back = max(planned_exp, self._exponent - 1)
                if back < self._exponent:
                    return self._change_to(
                        back, step, critical, median, planned,
                        "feedback trap: the noise scale follows the batch; back to the budget's plan",
                    )

        grow_at = 2.0 * batch * (1.0 + self.margin)
        shrink_at = batch / (2.0 * (1.0 + self.margin))
        # A target clipped at a bound cannot pass a margin beyond that bound: a doubling
        # that stays within max_batch happens when the target sits at max_batch (and a
        # halving that stays within min_batch when the target sits at min_batch).
        if self.max_batch is not None and 2.0 * batch <= self.max_batch * (1 + 1e-9):
            grow_at = min(grow_at, self.max_batch)
        if self.min_batch is not None and 0.5 * batch >= self.min_batch * (1 - 1e-9):
            shrink_at = max(shrink_at, self.min_batch * (1 + 1e-9))
        if measured:  # patience counts measurements; a step without one changes nothing
            self._grow_count = self._grow_count + 1 if target >= grow_at else 0
            self._shrink_count = self._shrink_count + 1 if target < shrink_at else 0

        warmup_tokens = self.warmup_tokens if self.warmup_tokens is not None else 100.0 * self._a0 * self._unit_batch()
        if self._steps < self.warmup_steps or tokens_seen < warmup_tokens:
            return hold("warm-up")
        if not full:
            return hold(f"filling the median window ({len(self._recent)}/{self.window})")
        if in_cooldown:
            return hold("cool-down")

        if self._trap_state == _TRAP_TRIPPED and self._trap_exponent != self._exponent:
            # the plan moved the batch since the trap: measure the ratio again at this batch
            self._trap_ratio, self._trap_exponent = median / batch, self._exponent
        elif (
            self._trap_state == _TRAP_TRIPPED
            and self.feedback_resume is not None
            and self.budget_tokens is None  # with a budget, the plan is in charge after a trap
            and self._trap_ratio > 0
            and median / batch >= self.feedback_resume * self._trap_ratio
        ):
            # At this batch the noise scale rose on its own: it describes the landscape again.
            self._trap_state = _TRAP_IDLE
            _log.info(
                "BatchSizeController step %d: the noise scale rose x%.2f per unit of batch since the "
                "feedback trap, at a fixed batch; growth from the noise scale resumes",
                step, median / batch / self._trap_ratio,
            )
        if self._grow_count >= self.patience:
            if self._trap_state == _TRAP_TRIPPED:
                return hold("feedback trap: the noise scale follows the batch; growth stopped")
            why_not = self._can_grow()
            if why_not is not None:
                return hold(why_not)
            return self._change_to(
                self._exponent + 1, step, critical, median, planned,
                f"grow {batch:.4g} -> {2 * batch:.4g}: critical batch {target:.4g} >= {grow_at:.4g} "
                f"for {self.patience} measurements",
                arm_trap=True,
            )
        if self._shrink_count >= self.patience:
            why_not = self._can_shrink()
            if why_not is None and (planned_exp is None or planned_exp < self._exponent):
                return self._change_to(
                    self._exponent - 1, step, critical, median, planned,
                    f"shrink {batch:.4g} -> {batch / 2:.4g}: critical batch {target:.4g} < {shrink_at:.4g} "
                    f"for {self.patience} measurements",
                )
        if self.kappa * median >= grow_at:  # would grow but for a cap: say which
            why_not = self._can_grow()
            if why_not is not None:
                return hold(why_not)
        return hold("hold")

    def _change_to(self, exponent: int, step: int, critical: float | None, median: float | None,
                   planned: float | None, reason: str, *, arm_trap: bool = False) -> Decision:
        old_batch = self._batch(self._exponent)
        self._exponent = exponent
        new_acc = self._accum(self._exponent)
        new_batch = self._batch(self._exponent)
        self._pending = True
        self._grow_count = self._shrink_count = 0
        if self._trap_state != _TRAP_TRIPPED:
            # only a doubling the measurement asked for is checked; a plan change or a
            # shrink in between would confound the comparison
            self._trap_state = _TRAP_IDLE
            if arm_trap and self.feedback_guard and median is not None:
                slope, span = 0.0, 0.0
                if self._anchor_set and self._last_tokens > self._anchor_tokens and self._anchor_ns > 0:
                    span = self._last_tokens - self._anchor_tokens
                    slope = max(0.0, math.log(median / self._anchor_ns) / span)
                self._trap_state = _TRAP_ARMED
                self._trap_ns_before, self._trap_tokens_before = median, self._last_tokens
                self._trap_slope, self._trap_span = slope, span
        _log.info("BatchSizeController step %d: %s", step, reason)
        return Decision(
            step=step, accumulation_steps=new_acc, global_batch=new_batch, changed=True,
            critical_batch=critical, decision_noise_scale=median,
            lr_factor=self._lr_factor(new_batch / old_batch), reason=reason,
            feedback_trap=self.feedback_trap, planned_batch=planned,
        )

    # ------------------------------------------------------------ budget plan
    def _batch_at_anchor(self, exponent: int) -> float:
        return self._plan_anchor * 2.0**exponent

    def _plan_top_exponent(self) -> int:
        """Largest exponent the caps allow (the plan's ``b_max`` rung)."""
        top = 0
        while self._accum(top + 1) <= self._max_accum() and (
            self.max_batch is None or self._plan_anchor * 2.0 ** (top + 1) <= self.max_batch * (1 + 1e-9)
        ):
            top += 1
        return top

    def build_plan(self) -> Any:
        """The budget's :class:`~cbs_tracker.theory.schedule.DoublingPlan` (``None`` without a budget or before the first update).

        ``plan_doubling(budget_tokens, start batch, largest allowed batch, plan_s,
        plan_beta, floor_ratio=plan_floor_ratio)``, cached. Needs numpy.
        """
        if self.budget_tokens is None or not self._started:
            return None
        if self._plan is None:
            from cbs_tracker.theory.schedule import plan_doubling

            top = self._plan_top_exponent()
            self._plan = plan_doubling(
                self.budget_tokens, self._plan_anchor, self._batch_at_anchor(top),
                self.plan_s, self.plan_beta, floor_ratio=self.plan_floor_ratio,
            )
        return self._plan

    def _planned_exponent(self, tokens: float) -> int | None:
        plan = self.build_plan()
        if plan is None:
            return None
        # same rule as DoublingPlan.batch_at_tokens, without numpy on every step
        batch = float(plan.batches[bisect.bisect_right(plan.switch_tokens, tokens)])
        return max(0, int(round(math.log2(batch / self._plan_anchor))))

    def _check_trap(self, median: float, tokens: float, step: int) -> None:
        growth = median / self._trap_ns_before
        # The trend is extrapolated no further than the span it was measured on: an early
        # transient (an estimator filling up, an iterate settling on its noise floor) rises
        # fast and then flattens. A trend over-estimated from noise can still hide a trap
        # at this doubling; the next doubling's trend is then measured at a batch already
        # in the trap (flat noise scale), so the trap is caught there at the latest.
        span = min(tokens - self._trap_tokens_before, self._trap_span)
        trend = math.exp(self._trap_slope * span)
        excess = growth / trend
        if excess >= self.feedback_ratio:
            self._trap_state = _TRAP_TRIPPED
            self._trap_ratio, self._trap_exponent = median / self._batch(self._exponent), self._exponent
            if self.budget_tokens is not None:
                after = "(the budget's plan times the growth from here)"
            elif self.feedback_resume is not None:
                after = f"(it resumes only if B_simple / B rises x{self.feedback_resume:g} at a fixed batch)"
            else:
                after = "for the rest of the run"
            msg = (
                f"BatchSizeController step {step}: after doubling the batch, the measured noise scale "
                f"grew x{growth:.2f} (x{excess:.2f} beyond its earlier trend): it follows the batch "
                "itself (the feedback trap, DESIGN §4), so it says nothing about the critical batch "
                f"here. Growth from the noise scale stopped {after}."
            )
            _log.info(msg)
            if not self._warned_trap:
                self._warned_trap = True
                warnings.warn(msg, RuntimeWarning, stacklevel=3)
        else:
            self._trap_state = _TRAP_IDLE

    def _check_update_args(self, step: Any, tokens_seen: Any, global_batch: Any,
                           accumulation_steps: Any, noise_scale: Any) -> None:
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"BatchSizeController.update(step={step!r}): expected an int")
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int):
            raise TypeError(
                f"BatchSizeController.update(accumulation_steps={accumulation_steps!r}): expected an int"
            )
        for name, value in (("tokens_seen", tokens_seen), ("global_batch", global_batch)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"BatchSizeController.update({name}={value!r}): expected a number")
        if noise_scale is not None and (isinstance(noise_scale, bool) or not isinstance(noise_scale, (int, float))):
            raise TypeError(f"BatchSizeController.update(noise_scale={noise_scale!r}): expected a number or None")
        if accumulation_steps < 1:
            raise ValueError(f"BatchSizeController.update(accumulation_steps={accumulation_steps}): must be >= 1")
        if not math.isfinite(global_batch) or global_batch <= 0:
            raise ValueError(f"BatchSizeController.update(global_batch={global_batch!r}): must be finite and > 0")
        if not math.isfinite(tokens_seen) or tokens_seen < 0:
            raise ValueError(f"BatchSizeController.update(tokens_seen={tokens_seen!r}): must be finite and >= 0")
        if step <= self._last_step:
            raise RuntimeError(
                f"BatchSizeController.update(step={step}): steps must increase (last was {self._last_step})"
            )
        if tokens_seen < self._last_tokens:
            raise RuntimeError(
                f"BatchSizeController.update(tokens_seen={tokens_seen!r}): tokens_seen went back "
                f"(last was {self._last_tokens!r})"
            )


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])
