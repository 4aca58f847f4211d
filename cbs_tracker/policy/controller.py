"""Batch-size controller: turn the measured noise scale into power-of-two accumulation changes.

Pure policy, no torch: call :meth:`BatchSizeController.update` once per optimizer step
with the smoothed simple noise scale ``B_simple``; the :class:`Decision` gives the next
window's accumulation ``A0 * 2**e``. The controller composes small parts: the batch
level (:mod:`.level`), the growth rules (:mod:`.rules`), the feedback guard
(:mod:`.guard`), the budget plan (:mod:`.plan`) and the LR-decay conversion (:mod:`.conversion`).
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from cbs_tracker._warn import warn_user
from cbs_tracker.policy._state import StateReader
from cbs_tracker.policy.conversion import LRDecayConversion
from cbs_tracker.policy.efficiency import EfficiencyBudget
from cbs_tracker.policy.guard import FeedbackGuard
from cbs_tracker.policy.kappa import KappaSchedule, parse_kappa
from cbs_tracker.policy.level import BatchLevel
from cbs_tracker.policy.plan import BudgetPlan
from cbs_tracker.policy.plateau import PlateauHold
from cbs_tracker.policy.ranks import RankChange, convert_level_state
from cbs_tracker.policy.rules import GrowthRules

__all__ = ["BatchSizeController", "Decision"]

_log = logging.getLogger(__name__)

LRScaling = Literal["keep", "sqrt", "linear"]
_LR_SCALINGS = ("keep", "sqrt", "linear")
_TOL = 1e-9


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
            ``keep`` -> 1, ``sqrt`` -> ``sqrt(r)``, ``linear`` -> ``r``; with
            ``lr_scaling=None`` always 1 (the adapter applies the coupling it chose).
        reason: short text for logs.
        feedback_trap: the controller found that the noise scale follows the batch
            and stopped growing.
        planned_batch: budget-aware mode: the plan's batch at this step's tokens
            (``None`` without a budget).
        lr_conversions: doublings made so far in place of a halving of the scheduled
            learning rate (``convert_lr_decay=True``; 0 otherwise).
        warning: a message for the adapter to show once (a
            :class:`~cbs_tracker.policy.batch_schedule.BatchSchedule` that ran above the
            measured critical batch); ``None`` otherwise.
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
    lr_conversions: int = 0
    warning: str | None = None


@dataclass(frozen=True)
class _Now:
    """One step's inputs as the parts see them."""

    step: int
    tokens: float
    measured: bool
    low: float | None  # interval of the noise scale (None: none given)
    high: float | None
    scheduled_lr: float | None
    critical: float | None
    median: float | None
    planned_exp: int | None
    planned: float | None


def _check_number(name: str, value: Any, *, allow_none: bool = False, integer: bool = False,
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


#: ``hold_on_plateau="auto"`` (the default): this threshold where the run counts tokens, no hold where it counts samples
AUTO_PLATEAU = 0.15
#: updates of a run that reads the loss after which, none given yet, the controller says so (as many as the slope
#: needs points)
NO_LOSS_UPDATES = 8
#: ``long_run_kappa``: the most ``kappa`` is multiplied by past ``plateau_tokens_per_parameter``
LONG_RUN_MOST = 3.0


def _check_plateau(hold_on_plateau: Any, plateau_at: Any, plateau_exit: Any) -> None:
    if isinstance(hold_on_plateau, str):
        if hold_on_plateau != "auto":
            raise ValueError(f"BatchSizeController(hold_on_plateau={hold_on_plateau!r}): expected a number > 0 (nats "
                             "per e-fold of tokens), 'auto' (0.15 where the units are tokens, off in samples) or None")
        hold_on_plateau = AUTO_PLATEAU
    else:
        _check_number("hold_on_plateau", hold_on_plateau, allow_none=True)
    _check_number("plateau_at", plateau_at)
    _check_number("plateau_exit", plateau_exit, allow_none=True)
    if plateau_at >= 1.0:
        raise ValueError(f"BatchSizeController(plateau_at={plateau_at!r}): must be in (0, 1) (the fraction of "
                         "the run where hold_on_plateau reads the loss's slope)")
    if plateau_exit is not None and (hold_on_plateau is None or plateau_exit < hold_on_plateau):
        raise ValueError(f"BatchSizeController(plateau_exit={plateau_exit!r}, hold_on_plateau={hold_on_plateau!r}): "
                         "plateau_exit needs hold_on_plateau and must be at least it (the slope a held run "
                         "grows again from)")


def _check_size_gate(plateau_tokens_per_parameter: Any, model_parameters: Any) -> None:
    gate = plateau_tokens_per_parameter
    if gate is not None and (isinstance(gate, bool) or not isinstance(gate, (int, float))):
        raise TypeError(f"BatchSizeController(plateau_tokens_per_parameter={gate!r}): expected a number (tokens per "
                        f"parameter of the model) or None, got {type(gate).__name__}")
    if gate is not None and not 0 < gate < math.inf:
        raise ValueError(f"BatchSizeController(plateau_tokens_per_parameter={gate!r}): must be finite and > 0, or "
                         "None to turn the size gate off")
    if model_parameters is not None:
        _check_count(model_parameters, "BatchSizeController(model_parameters=")


def _check_long_run(long_run_kappa: Any, plateau_tokens_per_parameter: Any) -> None:
    _check_number("long_run_kappa", long_run_kappa, allow_none=True)
    if long_run_kappa is not None and plateau_tokens_per_parameter is None:
        raise ValueError(f"BatchSizeController(long_run_kappa={long_run_kappa!r}, plateau_tokens_per_parameter=None): "
                         "long_run_kappa reads the run's tokens per parameter past plateau_tokens_per_parameter; "
                         "give it (20 by default)")


def _check_count(count: Any, call: str) -> int:
    """A model's parameter count (an integer >= 1, numpy's included) as an int; ``call`` names the argument."""
    if isinstance(count, bool) or not isinstance(count, numbers.Integral):
        raise TypeError(f"{call}{count!r}): expected an int (the model's parameter count; int(...) of a count held "
                        f"as a float), got {type(count).__name__}")
    if count < 1:
        raise ValueError(f"{call}{count!r}): must be >= 1")
    return int(count)


class BatchSizeController:
    """Grow (optionally shrink) the global batch by powers of two as the critical batch moves.

    Sizes are in the caller's unit (tokens or samples) and must all use the same one.
    Defaults that are sizes are relative to the starting batch.

    Args:
        kappa: the target batch is ``kappa * B_simple`` (``B_simple`` approximates the
            critical batch ``B_noise``, where a run needs about twice the minimal data;
            at a fixed budget the loss-optimal batch sits below it). Default 0.4, with
            ``convert_lr_decay`` up to ``convert_until=0.85``: chosen on small GPTs under cosine and
            warmup-stable-decay schedules; alone (``hold_on_plateau=None``) it ended well above the
            constant batch on GPTs whose loss sits on a plateau, which the default ``hold_on_plateau``
            holds (results.md). ``kappa=0.5`` without conversion is an earlier default.
            A :class:`~cbs_tracker.policy.kappa.KappaSchedule` (or a list of ``(tokens, kappa)``
            pairs) gives a *measured* ``kappa`` that moves with the units seen, as a branched
            calibration reports it
            (:meth:`cbs_tracker.calibrate.Calibration.kappa_schedule`).
        kappa_rise: a constant ``kappa`` rises linearly in units from ``kappa`` at the start
            to ``kappa_rise * kappa`` at the run's end (``total_tokens``, or the length an
            adapter gives: :meth:`set_run_length`), and stays there after it. Default 1 (fixed).
            ``2`` (0.4 to 0.8) saved more optimizer steps than a fixed 0.4 on four small GPTs
            under cosine and warmup-stable-decay but kept the final loss on fewer of them
            (results.md). At least 1. Without the run's length ``kappa`` stays where it started
            (said once). A measured ``KappaSchedule`` is used as given (a rise with it is said to
            be ignored); a constant set during the run (:meth:`set_kappa`) starts the rise anew.
        min_batch: lower clip of the critical batch and lowest batch a shrink may reach.
            ``None``: no lower bound.
        max_batch: upper clip of the critical batch and largest batch a doubling may
            reach. ``None``: only ``max_accumulation_steps`` bounds the growth.
        max_accumulation_steps: largest accumulation a doubling may reach. ``None``
            (default): ``256 * A0``.
        convert_lr_decay: turn each halving of ``scheduled_lr`` (passed to
            :meth:`update`) into a doubling of the batch, while the doubled batch stays
            at or below ``conversion_kappa * B_simple`` and the caps; beyond that the LR
            decays as scheduled, as it always does from ``convert_until`` of the run on.
            Default ``True``. Without a scheduled LR (``None``, as an adapter passes when it
            has no optimizer) or with one that never halves (a constant LR) it does nothing.
            A state saved without a scheduled-LR reference (``convert_lr_decay=False``, the
            earlier default) loads: its halvings count from the scheduled LR at resume, with a
            warning.
        budget_tokens: the planned total units of the run. ``None`` (default):
            budget-unaware. When set, the batch never falls below the power-of-two plan
            of :func:`cbs_tracker.theory.schedule.plan_doubling` (built at the first
            update from the starting batch and the largest batch the caps allow); after a
            feedback trap the controller returns to the plan's batch.
        efficiency_budget: with ``total_tokens``, growth spends a budget of token efficiency
            in place of the ``kappa`` threshold (:mod:`cbs_tracker.policy.efficiency`): a
            doubling ``B -> 2B`` is taken when ``2B <= B_simple`` and the LR-weighted share of
            the run's tokens lost to batches above the starting one (McCandlish's
            ``(B - B0) / (B_simple + B)``), spent so far plus projected for the rest of the run
            at ``2B``, stays at or below ``efficiency_budget`` (for ``patience`` measurements in
            a row). ``None`` (default): the ``kappa`` rule. In ``(0, 1]``.
        total_tokens: the run's length in units, for ``kappa_rise``, ``efficiency_budget`` and
            ``convert_until`` (``None``: unknown; ``kappa`` stays fixed, every halving converts).
            Left ``None``, an adapter sets it from the run's own length (:meth:`set_run_length`);
            given, it wins over the adapter's.
        hold_on_plateau: hold every change but a budget plan's (doublings, conversions of LR halvings and,
            with ``allow_shrink``, shrinks) until ``plateau_at`` of
            the run (``total_tokens``, or the length an adapter gives); there, read how fast the training loss
            falls, ``-dL / d ln T`` by least squares over the second half of the tokens seen (from twice the
            LR's warm-up on), and below ``hold_on_plateau`` nats per e-fold of tokens (a loss on its plateau)
            hold for the rest of the run; otherwise the rule is in force from then on. Default ``"auto"``:
            ``0.15`` where the units are tokens, and no hold where an adapter says they are samples (the threshold
            is a language model's loss per token, in nats; give a number to hold on a plateau of another loss). It
            kept the loss on 30 of 32 small-GPT settings and schedules where the ``kappa`` rule alone
            (``None``, the earlier default) kept it on 19, saving up to 15 points fewer of the steps where both
            kept it (results.md): a hypothesis read off eight of them, in nats, which a run long for its model
            falls slower than a quarter in; past ``plateau_tokens_per_parameter`` such a run is not held (see
            there). It needs each step's training loss (:meth:`observe_loss`; the adapters pass it where they
            see the loss); with none by the controller's 8th update it warns, and with none at the verdict the rule is in
            force from then on. Without the
            run's length nothing is held (said once). A budget plan (``budget_tokens``) is not held. A state
            saved without the hold resumes without it (said once).

        allow_shrink: allow halving when the target falls well below the batch. Default
            ``False``.
        observe_only: compute and report the critical batch, never change anything.
        lr_scaling: learning-rate factor of a change reported in
            :attr:`Decision.lr_factor`: ``"keep"``, ``"sqrt"`` (Adam rule) or ``"linear"``
            (SGD rule). ``None`` (default): the adapter chooses from the optimizer and
            applies the coupling itself; ``lr_factor`` is then 1.

    Tuning (the rules' finer settings; the defaults are what the results were measured with):

        margin: hysteresis. Grow ``B -> 2B`` when the target is ``>= 2B (1 + margin)``;
            shrink when it is ``< B / (2 (1 + margin))``. Default 0.1.
        patience: consecutive measurements for which the target must pass a threshold
            before a change. Default 16.
        window: the decision uses the median of the last ``window`` measurements.
            Default 32.
        warmup_steps: no change before this many optimizer steps. Default 100.
        warmup_tokens: no change before this many units were seen. ``None`` (default):
            100 starting global batches.
        cooldown_tokens: units that must pass, once a change has taken effect, before the
            next change (and before the feedback check of a doubling). ``None``
            (default): 100 global batches of the new size.
        conversion_kappa: the conversions' bound as a multiple of the measured noise
            scale (default 1: ``B_simple`` itself, above the ``kappa * B_simple`` that
            growth follows, so that a halving has room to convert).
        convert_until: a halving of the scheduled LR that comes after this fraction of the run's
            length (``total_tokens``, or the length an adapter gives) is not converted: the LR
            decays as scheduled. A doubling late in the run saves few steps (its remaining tokens at
            twice the batch) while the LR it keeps high is the run's final anneal: under
            warmup-stable-decay every halving falls there. Default 0.85 (1: every halving
            converts). In ``(0, 1]``; without the run's length every halving converts (said at
            the first halving).
        feedback_guard: detect the feedback trap (the noise scale follows the batch)
            and stop growing there. Default ``True``.
        feedback_ratio: a doubling follows the batch when, after it, the median noise
            scale grew by at least this factor beyond its earlier trend. Default 1.4.
        feedback_strikes: the trap is declared after this many measured doublings in a
            row followed the batch (default 2: one comparison can rest on a noise scale
            that read low by chance; a true trap costs one doubling more). With
            ``budget_tokens`` one comparison decides (the plan, not the trap, then
            times the growth, so a false trap silences nothing).
        feedback_resume: after a trap, growth resumes once ``B_simple / B`` has risen by
            this factor at a fixed batch. ``None``: stop for good. Default 1.5. Not used
            in budget-aware mode (the plan times the growth after a trap).
        plan_s: source exponent ``s`` of the plan. Default 0.5.
        plan_beta: capacity exponent ``beta`` of the plan (``> 1``). Default 2.0.
        plan_floor_ratio: a run held at the starting batch would level off at this
            fraction of its initial excess loss. Default 0.5.
        plateau_at: the fraction of the run where ``hold_on_plateau`` reads the loss's slope, in ``(0, 1)``.
            Default 0.25 (at 0.19 a run on a plateau was misread as off it; results.md).
        plateau_exit: with ``hold_on_plateau``, a run held at the verdict grows again from the first update
            where the slope reaches ``plateau_exit`` (at least ``hold_on_plateau``). ``None`` (default): a
            held run never grows.
        plateau_tokens_per_parameter: with ``hold_on_plateau``, a verdict that would hold does not where the
            run has seen at least this many units (tokens) per parameter of the model by then: a loss that falls
            slowly that far into training is a run long for its model, not a plateau. Default 20 (Chinchilla's
            compute-optimal ratio, chosen before any run; on three small GPTs trained on 200-380 tokens per
            parameter the option held and saved nothing, and with it grew and kept the loss, one of them held
            out; results.md). A hypothesis: on a 544-parameter bigram toy the growth it freed cost 0.008 nats
            (``benchmarks/gate_toy.py``). At the default ``plateau_at`` a run of fewer than 80 tokens per
            parameter in all reaches it only where its verdict waited past the quarter for a readable slope.
            ``None``: hold whatever the run's length. The count is ``model_parameters``, or what an adapter gives
            (:meth:`set_model_parameters`); unknown, a holding verdict holds and warns. Read only where the units
            are tokens (in samples the verdict says so). A verdict is read once: a state saved before this gate
            existed resumes with its verdict as it was.
        model_parameters: the model's parameter count (each shared parameter once, a sharded one whole, a frozen
            one too; buffers are not parameters), for
            ``plateau_tokens_per_parameter``. ``None`` (default): the adapter's (counted on the model it tracks);
            give it where that count is not the model's (a module that also holds an EMA copy or a frozen
            teacher; tensor parallelism by hand, without ``DTensor``, where each rank holds a part). Read only
            where the units are tokens.
        long_run_kappa: past ``plateau_tokens_per_parameter`` tokens per parameter of the model (a run long for
            its model), ``kappa`` is multiplied by ``(tokens per parameter / plateau_tokens_per_parameter) **
            long_run_kappa``, at most 3 x, and the hold on a plateau no longer holds before its verdict (a verdict
            there could not hold). ``None`` (default): off. ``0.5`` is judged on the frontier's GPTs trained for
            117-380 tokens per parameter (results.md); a hypothesis, not the default. Needs the
            model's parameter count (as the gate) and tokens; inert below the gate, in samples, or where the count
            is unknown.
    Raises:
        TypeError: an argument of the wrong type.
        ValueError: an argument out of range, or inconsistent bounds.
    """

    STATE_VERSION = 1

    def __init__(
        self,
        *,
        kappa: float | KappaSchedule | list[tuple[float, float]] = 0.4,
        kappa_rise: float = 1.0,
        min_batch: float | None = None,
        max_batch: float | None = None,
        max_accumulation_steps: int | None = None,
        convert_lr_decay: bool = True,
        budget_tokens: float | None = None,
        efficiency_budget: float | None = None,
        total_tokens: float | None = None,
        hold_on_plateau: float | str | None = "auto",
        allow_shrink: bool = False,
        observe_only: bool = False,
        lr_scaling: LRScaling | None = None,
        # tuning
        margin: float = 0.1,
        patience: int = 16,
        window: int = 32,
        warmup_steps: int = 100,
        warmup_tokens: float | None = None,
        cooldown_tokens: float | None = None,
        conversion_kappa: float = 1.0,
        convert_until: float = 0.85,
        feedback_guard: bool = True,
        feedback_ratio: float = 1.4,
        feedback_strikes: int = 2,
        feedback_resume: float | None = 1.5,
        plan_s: float = 0.5,
        plan_beta: float = 2.0,
        plan_floor_ratio: float = 0.5,
        plateau_at: float = 0.25,
        plateau_exit: float | None = None,
        plateau_tokens_per_parameter: float | None = 20.0,
        model_parameters: int | None = None,
        long_run_kappa: float | None = None,
    ) -> None:
        self._kappa_schedule, self._kappa_now = parse_kappa(kappa, "BatchSizeController")
        self._kappa_start = self._kappa_now  # a constant kappa at the run's start (before its rise)
        _check_number("kappa_rise", kappa_rise)
        if kappa_rise < 1:
            raise ValueError(f"BatchSizeController(kappa_rise={kappa_rise!r}): must be >= 1 (kappa rises from "
                             "kappa at the start to kappa_rise * kappa at the run's end; 1 keeps it fixed)")
        if kappa_rise != 1 and self._kappa_schedule is not None:
            warn_user(f"BatchSizeController(kappa_rise={kappa_rise!r}) is ignored: kappa is a measured "
                      "KappaSchedule, used as given.")
        _check_number("conversion_kappa", conversion_kappa)
        _check_number("convert_until", convert_until)
        if convert_until > 1.0:
            raise ValueError(f"BatchSizeController(convert_until={convert_until!r}): must be in (0, 1] (the fraction "
                             "of the run's length after which a halving of the scheduled LR is not converted)")
        _check_number("efficiency_budget", efficiency_budget, allow_none=True)
        _check_number("total_tokens", total_tokens, allow_none=True)
        if efficiency_budget is not None and allow_shrink:
            raise ValueError(f"BatchSizeController(efficiency_budget={efficiency_budget!r}, allow_shrink=True): the "
                             "efficiency budget only grows (its shrink would be kappa's and undo its doublings); "
                             "use one or the other")
        if efficiency_budget is not None and efficiency_budget > 1.0:
            raise ValueError(f"BatchSizeController(efficiency_budget={efficiency_budget!r}): must be in (0, 1] "
                             "(the share of the run's tokens growth may lose)")
        _check_number("min_batch", min_batch, allow_none=True)
        _check_number("max_batch", max_batch, allow_none=True)
        _check_number("margin", margin, allow_zero=True)
        _check_number("patience", patience, integer=True)
        _check_number("window", window, integer=True)
        _check_number("warmup_steps", warmup_steps, integer=True, allow_zero=True)
        _check_number("warmup_tokens", warmup_tokens, allow_none=True, allow_zero=True)
        _check_number("cooldown_tokens", cooldown_tokens, allow_none=True, allow_zero=True)
        _check_number("max_accumulation_steps", max_accumulation_steps, allow_none=True, integer=True)
        _check_number("feedback_ratio", feedback_ratio)
        _check_number("feedback_resume", feedback_resume, allow_none=True)
        _check_number("feedback_strikes", feedback_strikes, integer=True)
        if feedback_strikes > FeedbackGuard.MAX_STRIKES:
            raise ValueError(f"BatchSizeController(feedback_strikes={feedback_strikes!r}): must be an integer "
                             f"in [1, {FeedbackGuard.MAX_STRIKES}]")
        if feedback_resume is not None and feedback_resume <= 1.0:
            raise ValueError(
                f"BatchSizeController(feedback_resume={feedback_resume!r}): must be > 1 or None "
                "(the factor by which B_simple / B must rise before growth resumes)"
            )
        _check_number("budget_tokens", budget_tokens, allow_none=True)
        _check_plateau(hold_on_plateau, plateau_at, plateau_exit)
        _check_size_gate(plateau_tokens_per_parameter, model_parameters)
        _check_long_run(long_run_kappa, plateau_tokens_per_parameter)
        _check_number("plan_s", plan_s)
        _check_number("plan_beta", plan_beta)
        _check_number("plan_floor_ratio", plan_floor_ratio)
        if plan_beta <= 1.0:
            raise ValueError(
                f"BatchSizeController(plan_beta={plan_beta!r}): must be > 1 (the capacity exponent; "
                "the noise kernel must be summable)"
            )
        for name, flag in (("allow_shrink", allow_shrink), ("observe_only", observe_only),
                           ("feedback_guard", feedback_guard), ("convert_lr_decay", convert_lr_decay)):
            if not isinstance(flag, bool):
                raise TypeError(f"BatchSizeController({name}={flag!r}): expected a bool")
        if lr_scaling is not None and lr_scaling not in _LR_SCALINGS:
            raise ValueError(
                f"BatchSizeController(lr_scaling={lr_scaling!r}): expected one of {list(_LR_SCALINGS)} or None"
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
        self.lr_scaling: LRScaling | None = lr_scaling
        self.feedback_guard = feedback_guard
        self.feedback_ratio = float(feedback_ratio)
        self.feedback_resume = None if feedback_resume is None else float(feedback_resume)
        self.feedback_strikes = feedback_strikes
        self.budget_tokens = None if budget_tokens is None else float(budget_tokens)
        self.plan_s = float(plan_s)
        self.plan_beta = float(plan_beta)
        self.plan_floor_ratio = float(plan_floor_ratio)
        self.convert_lr_decay = convert_lr_decay
        self.conversion_kappa = float(conversion_kappa)
        self.convert_until = float(convert_until)
        self.efficiency_budget = None if efficiency_budget is None else float(efficiency_budget)
        self.total_tokens = None if total_tokens is None else float(total_tokens)
        self._applied_length: float | None = None  # set_run_length's value total_tokens took last
        self._level = BatchLevel()
        self._rules = GrowthRules(self)
        self._guard = FeedbackGuard(self)
        self._plan = BudgetPlan(self)
        self._conversion = LRDecayConversion()
        self._efficiency = EfficiencyBudget(self)
        #: the hold is the default's: read where the units are tokens, off where an adapter says they are samples
        self._plateau_auto = hold_on_plateau == "auto"
        hold_on_plateau = AUTO_PLATEAU if self._plateau_auto else hold_on_plateau
        if observe_only:  # nothing is grown, so nothing is held (and no loss is read)
            hold_on_plateau = None
        self._plateau = PlateauHold(None if hold_on_plateau is None else float(hold_on_plateau), float(plateau_at),
                                    None if plateau_exit is None else float(plateau_exit),
                                    None if plateau_tokens_per_parameter is None else float(plateau_tokens_per_parameter))
        self._plateau.parameters = None if model_parameters is None else int(model_parameters)
        self.long_run_kappa = None if long_run_kappa is None else float(long_run_kappa)
        self._plateau.ends_at_gate = long_run_kappa is not None  # a run long for its model is one from there on
        self._parameters_given = model_parameters is not None  # the user's count wins over an adapter's
        self.kappa_rise = float(kappa_rise)
        self._updates_without_loss = 0  # updates of a run that reads the loss with none given yet (not saved)
        self._said_once: set[str] = set()  # what was said once: options lacking the run's length, a resume without the hold
        self._resumed_without_lr_reference = False  # set by load_state_dict, cleared at the first scheduled LR

    # ------------------------------------------------------------------ kappa
    @property
    def kappa(self) -> float:
        """``kappa`` in force: the constant (on its rise, ``kappa_rise``), or the measured schedule's value, at the last update's units."""
        return self._kappa_now

    @kappa.setter
    def kappa(self, value: float | KappaSchedule | list[tuple[float, float]]) -> None:
        self.set_kappa(value)

    @property
    def kappa_schedule(self) -> KappaSchedule | None:
        """The measured ``kappa`` (``None`` while ``kappa`` is a constant)."""
        return self._kappa_schedule

    @property
    def kappa_start(self) -> float | None:
        """The constant ``kappa`` as given, before its rise (``kappa_rise``); ``None`` under a measured schedule."""
        return None if self._kappa_schedule is not None else self._kappa_start

    def set_kappa(self, kappa: float | KappaSchedule | list[tuple[float, float]]) -> None:
        """Replace ``kappa`` (a constant or a measured schedule); it takes effect at the next update.

        A constant given during a run replaces the start of the rise (``kappa_rise``): in force from now on is
        the new constant times the rise already made, ``kappa * (1 + (kappa_rise - 1) * min(1, t / T))``."""
        self._kappa_schedule, self._kappa_start = parse_kappa(kappa, "BatchSizeController")
        self._kappa_now = self._kappa_at(self._level.last_tokens)

    def _kappa_at(self, tokens: float) -> float:
        """``kappa`` at ``tokens``: the measured schedule's value, or the constant on its rise over the run's
        length (``kappa_rise``; where the length is unknown, the constant)."""
        if self._kappa_schedule is not None:
            return self._kappa_schedule.value_at(tokens) * self._long_run_factor(tokens)
        if self.kappa_rise == 1.0 or self.total_tokens is None:
            return self._kappa_start * self._long_run_factor(tokens)
        rise = 1.0 + (self.kappa_rise - 1.0) * min(1.0, max(0.0, tokens) / self.total_tokens)
        return self._kappa_start * rise * self._long_run_factor(tokens)

    def _say_long_run(self, tokens: float) -> None:
        """Logged once, where ``long_run_kappa`` first raises ``kappa``."""
        if "long run" in self._said_once or self._long_run_factor(tokens) <= 1.0:
            return
        self._said_once.add("long run")
        _log.info("BatchSizeController: %.4g units, %g tokens per parameter of the model (plateau_tokens_per_parameter): "
                  "a run long for its model; from here kappa x (tokens per parameter / %g) ** %g, at most %g x, and "
                  "the hold on a plateau no longer holds before its verdict", tokens,
                  self._plateau.tokens_per_parameter, self._plateau.tokens_per_parameter, self.long_run_kappa,
                  LONG_RUN_MOST)

    def _long_run_factor(self, tokens: float) -> float:
        """``long_run_kappa``'s factor at ``tokens``: ``(tokens per parameter / plateau_tokens_per_parameter) **
        long_run_kappa`` past the gate, at most :data:`LONG_RUN_MOST`; 1 before it, without the option, or where the
        tokens per parameter are not read."""
        past = self._plateau.past_gate(tokens) if self.long_run_kappa is not None else None
        if past is None or past <= 1.0:
            return 1.0
        return min(LONG_RUN_MOST, past ** self.long_run_kappa)

    def add_kappa_point(self, tokens: float, kappa: float) -> None:
        """Add one measured ``kappa`` (a calibration during the run): from ``tokens`` on, the
        controller follows the measured points instead of the constant."""
        if self._kappa_schedule is None:
            self._kappa_schedule = KappaSchedule([(tokens, kappa)])
        else:
            self._kappa_schedule.add(tokens, kappa)
        self._kappa_now = self._kappa_schedule.value_at(max(self._level.last_tokens, float(tokens)))

    # ------------------------------------------------------------ run length
    def set_run_length(self, units: float) -> None:
        """The run's length in units (all data-parallel ranks), as an adapter learns it: ``total_tokens``
        for ``kappa_rise``, ``efficiency_budget`` and ``convert_until``.

        Adapters call it (when the controller has it) with the length of the run they drive: a
        plain loop's ``tracker.done(steps=...)`` times the starting global batch, a Trainer's
        ``max_steps`` at the starting accumulation times it, OLMo-core's ``max_duration`` in tokens.
        It sets ``total_tokens`` only where the user left it ``None``: an explicit
        ``total_tokens=`` (or one assigned later) wins and is never replaced. A second, different
        value replaces the earlier one the adapter gave (a resumed run made longer). The value is
        saved with :meth:`state_dict` (``efficiency_run_length``) so that a resumed run decides
        as the uninterrupted one from its first step; the user's ``total_tokens`` is configuration
        and is not saved.

        Raises:
            TypeError: ``units`` is not a number.
            ValueError: ``units`` is not finite and > 0.
        """
        if isinstance(units, bool) or not isinstance(units, (int, float)):
            raise TypeError(f"BatchSizeController.set_run_length(units={units!r}): expected a number "
                            f"(the run's length in units, all ranks), got {type(units).__name__}")
        if not math.isfinite(units) or units <= 0:
            raise ValueError(f"BatchSizeController.set_run_length(units={units!r}): must be finite and > 0 "
                             "(the run's length in units, all ranks)")
        self._efficiency.run_length = float(units)
        self._apply_run_length()
        self._kappa_now = self._kappa_at(self._level.last_tokens)  # a length given mid-run moves kappa now

    def set_model_parameters(self, count: int, *, unit: str = "tokens") -> None:
        """The parameter count of the model the run trains (each shared parameter once, a sharded one whole), as
        an adapter counts it, and the run's unit: for ``plateau_tokens_per_parameter``, which reads tokens per
        parameter only where the units are tokens (in ``"samples"`` the verdict says it is not read, and ``count``
        is not used). A ``model_parameters=`` given to the controller wins and is kept. Configuration, not saved: a
        resumed run's adapter gives it again.

        Raises:
            TypeError: ``count`` is not an integer.
            ValueError: ``count`` is not >= 1, or ``unit`` is not ``"tokens"`` or ``"samples"``.
        """
        count = _check_count(count, "BatchSizeController.set_model_parameters(count=")
        if unit not in ("tokens", "samples"):
            raise ValueError(f"BatchSizeController.set_model_parameters(unit={unit!r}): must be 'tokens' or 'samples'")
        self._plateau.in_samples = unit == "samples"
        if self._plateau.in_samples and self._plateau_auto and self._plateau.active and self._plateau.held is None:
            self._plateau.below = None  # off: its threshold is a language model's loss per token, in nats
            self._plateau.slope.clear()
            _log.info("BatchSizeController: the run counts samples, so the default hold_on_plateau='auto' is off "
                      "(its 0.15 nats per e-fold of tokens was read off language models); pass hold_on_plateau=0.15 "
                      "to hold on a plateau of this loss")
        if self._plateau.in_samples and self._parameters_given and self._plateau.active \
                and self._plateau.tokens_per_parameter is not None:
            warn_user(f"BatchSizeController(model_parameters={self._plateau.parameters}): the run's units are "
                      "samples, so plateau_tokens_per_parameter is not read and the count is not used (count "
                      "tokens, or give plateau_tokens_per_parameter=None)")
        if not self._parameters_given:
            self._plateau.parameters = count

    @property
    def default_hold(self) -> bool:
        """The hold on a plateau is the default's (``hold_on_plateau="auto"``) and on: its threshold reads a
        language model's loss per token."""
        return self._plateau_auto and self._plateau.active

    @property
    def model_parameters(self) -> int | None:
        """The model's parameter count the plateau verdict reads (``None``: unknown)."""
        return self._plateau.parameters

    def _apply_run_length(self) -> None:
        """``total_tokens`` takes the adapter's run length unless the user gave one."""
        length = self._efficiency.run_length
        if length is None:
            return
        # total_tokens still holds the adapter's last value (the user gave none, or assigned none since)
        if self.total_tokens is None or (self._applied_length is not None and self.total_tokens == self._applied_length):
            self.total_tokens = self._applied_length = length

    # ------------------------------------------------------------------ state
    def _parts(self) -> tuple[Any, ...]:
        return (self._level, self._rules, self._guard, self._plan, self._conversion, self._efficiency, self._plateau)

    def state_dict(self) -> dict[str, Any]:
        """The controller's resumable state: fixed keys, plain numbers, a ``"version"``.

        Each part contributes its own keys. ``recent_noise_scales`` is the list of the
        last ``window`` measurements (the median needs them to resume exactly). The
        configuration is not saved: build the resumed controller with the same arguments.
        """
        state: dict[str, Any] = {"version": self.STATE_VERSION}
        for part in self._parts():
            state.update(part.state_dict())
        # a measured kappa is state (a calibration during the run added it), not configuration
        state["kappa_points"] = [] if self._kappa_schedule is None else self._kappa_schedule.state_dict()
        return state

    def convert_ranks(self, state: Mapping[str, Any], change: RankChange, *,
                      pending: int | None = None) -> dict[str, Any]:
        """:meth:`state_dict` output of a run on ``change.old_dp`` ranks, for a run on ``change.new_dp``.

        Only the level's per-rank counts move (see :mod:`cbs_tracker.policy.ranks`): the
        measurements, the guard, the plan and ``kappa`` are in units and stay. ``pending``: the
        accumulation per rank the old run had decided but not yet run (``None``: none).
        """
        return convert_level_state(dict(state), change, pending)

    # the level's and the rules' state and the guard's state flag (its other keys and those of
    # the plan and the conversion are optional: states written before them still load)
    _REQUIRED_KEYS = ("version", *BatchLevel.KEYS, *GrowthRules.KEYS, "trap_state")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output. Strict on required keys, tolerant of newer optional ones.

        Every value is checked (type, range, version) before any is assigned: a failed
        load leaves the controller as it was.

        Raises:
            TypeError: ``state`` is not a mapping, or a value has the wrong type.
            KeyError: a required key is missing.
            ValueError: an unknown version, or a value out of range.
        """
        owner = "BatchSizeController.load_state_dict"
        if not isinstance(state, Mapping):
            raise TypeError(f"{owner}: expected a mapping, got {type(state).__name__}")
        missing = [k for k in self._REQUIRED_KEYS if k not in state]
        if missing:
            raise KeyError(f"{owner}: missing required keys {missing}")
        read = StateReader(state, owner)
        version = read.integer("version")
        if version > self.STATE_VERSION:
            raise ValueError(
                f"{owner}: state version {version} is newer than this code's {self.STATE_VERSION}; upgrade cbs-tracker"
            )
        if version != self.STATE_VERSION:
            raise ValueError(f"{owner}: state['version']={version!r}: expected {self.STATE_VERSION}")
        parsed = [part.parse_state(read) for part in self._parts()]
        points = state.get("kappa_points")
        if points is not None and not isinstance(points, (list, tuple)):
            raise TypeError(f"{owner}: state['kappa_points']={points!r}: expected a list of [tokens, kappa] pairs")
        schedule = None
        if points:  # [] (or absent): kappa stays as configured
            try:
                schedule = KappaSchedule(points)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{owner}: state['kappa_points']={points!r}: {exc}") from None
        for part, values in zip(self._parts(), parsed, strict=True):
            part.assign(values)
        if schedule is not None:
            self._kappa_schedule = schedule
        self._apply_run_length()  # the adapter's run length the state carries (the user's total_tokens wins)
        self._keep_a_run_begun_without_the_hold(state)
        self._kappa_now = self._kappa_at(self._level.last_tokens)
        # a state with no scheduled-LR reference (saved with convert_lr_decay=False, the earlier
        # default, or without a scheduled LR): its halvings count from the scheduled LR at resume
        self._resumed_without_lr_reference = self._level.started and self._conversion.reference == 0.0

    def _keep_a_run_begun_without_the_hold(self, state: Mapping[str, Any]) -> None:
        """A run that began without ``hold_on_plateau`` (its state has no ``plateau_held``: saved with
        ``hold_on_plateau=None``, or before the hold was the default) goes on without it: a verdict read mid-run
        would hold growth the run has already taken. Said once."""
        if not self._plateau.active:  # a state with a verdict, loaded without the hold: no verdict here
            self._plateau.held = self._plateau.verdict_slope = self._plateau.verdict_tokens = None
            self._plateau.slope.clear()
            return
        if "plateau_held" in state or not self._level.started:
            return
        self._plateau.held = False
        self._plateau.slope.clear()
        if "begun without the hold" in self._said_once:
            return
        self._said_once.add("begun without the hold")
        said = (f"BatchSizeController(hold_on_plateau={'auto' if self._plateau_auto else self._plateau.below}): the "
                "state was saved without the hold (hold_on_plateau=None, in samples, or by cbs-tracker before it was "
                "the default), so the run goes on without it, as it began")
        if self._plateau_auto:
            _log.info("%s", said)
        else:
            warn_user(said + "; build the controller with hold_on_plateau=None to say so")

    # ------------------------------------------------------------ properties
    @property
    def accumulation_steps(self) -> int:
        """Accumulation steps of the current level (``A0 * 2**e``); 0 before the first update."""
        return self._level.accum(self._level.exponent) if self._level.started else 0

    @property
    def exponent(self) -> int:
        """The current power-of-two level ``e``: accumulation ``A0 * 2**e`` (0 before the first update)."""
        return self._level.exponent

    @property
    def start_batch(self) -> float | None:
        """Nominal starting global batch (mean units per accumulation step times ``A0``)."""
        return self._level.unit_batch() * self._level.a0 if self._level.started else None

    @property
    def feedback_trap(self) -> bool:
        """True once the controller found that the noise scale follows the batch."""
        return self._guard.tripped

    @property
    def lr_conversions(self) -> int:
        """Doublings made so far in place of a halving of the scheduled learning rate."""
        return self._conversion.conversions

    def build_plan(self) -> Any:
        """The budget's :class:`~cbs_tracker.theory.schedule.DoublingPlan` (``None`` without a budget or before the first update).

        ``plan_doubling(budget_tokens, start batch, largest allowed batch, plan_s,
        plan_beta, floor_ratio=plan_floor_ratio)``, cached. Needs numpy.
        """
        return self._plan.build(self._plan_top_level) if self._level.started else None

    def _plan_top_level(self) -> int:
        """Largest exponent the caps allow (the plan's ``b_max`` rung)."""
        level, cap, top = self._level, self._rules.max_accumulation(self._level), 0
        while level.accum(top + 1) <= cap and (
            self.max_batch is None or self._plan.batch_at(top + 1) <= self.max_batch * (1 + _TOL)
        ):
            top += 1
        return top

    def _lr_factor(self, ratio: float) -> float:
        if self.lr_scaling == "sqrt":
            return math.sqrt(ratio)
        if self.lr_scaling == "linear":
            return ratio
        return 1.0

    # ---------------------------------------------------------------- update
    def update(
        self,
        *,
        step: int,
        tokens_seen: float,
        global_batch: float,
        accumulation_steps: int,
        noise_scale: float | None,
        scheduled_lr: float | None = None,
        noise_scale_low: float | None = None,
        noise_scale_high: float | None = None,
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
            scheduled_lr: the learning rate the user's schedule sets for the coming
                step, before any batch-size coupling (used by ``convert_lr_decay``).
            noise_scale_low: lower end of the estimator's 90% interval of
                ``noise_scale``; growth then needs ``kappa * noise_scale_low`` past the
                threshold too (``None``: the median rule alone; ``<= 0``: no evidence).
            noise_scale_high: upper end of that interval (a shrink needs it below the
                shrink threshold).

        Returns:
            The :class:`Decision` for the next window.

        Raises:
            TypeError / ValueError: an argument of the wrong type or out of range.
            RuntimeError: ``step`` did not increase or ``tokens_seen`` decreased.
        """
        self._check_update_args(step, tokens_seen, global_batch, accumulation_steps, noise_scale,
                                scheduled_lr, noise_scale_low, noise_scale_high)
        if not self._level.started:
            self._check_start(global_batch, accumulation_steps)
            self._plan.anchor = float(global_batch)
        self._read_plateau(float(tokens_seen), scheduled_lr)
        self._kappa_now = self._kappa_at(float(tokens_seen))
        self._say_long_run(float(tokens_seen))
        if self._level.observe(step, float(tokens_seen), global_batch, accumulation_steps):
            self._rules.reset()  # the change decided earlier is in force from this step on
            self._guard.new_level()
        now = self._measure(step, float(tokens_seen), noise_scale, noise_scale_low, noise_scale_high,
                            scheduled_lr)
        if self._efficiency.active:
            # the step against its own starting-batch equivalent (its units at the starting accumulation), so
            # a step at the starting level whose units vary (padding, masked labels) never counts as larger
            start = float(global_batch) * self._level.a0 / accumulation_steps
            self._efficiency.observe(now.tokens, float(global_batch), start, now.median, scheduled_lr)
        elif self.efficiency_budget is not None:
            self._warn_no_run_length(now, "efficiency_budget")
        if self.total_tokens is None and self._kappa_schedule is None and self.kappa_rise != 1.0:
            self._warn_no_run_length(now, "kappa_rise")
        for rule in (self._wait_or_follow_plan, self._check_last_doubling, self._convert_lr_halving):
            decision = rule(now)
            if decision is not None:
                return decision
        return self._apply_rules(now)

    def observe_loss(self, tokens: float, loss: float) -> None:
        """One optimizer step's mean training loss (the adapters give the mean over the data-parallel ranks), at
        ``tokens`` (all ranks' units so far, the step's included), given before the step's :meth:`update`, for
        ``hold_on_plateau``. Ignored without
        it and once its verdict is final; a loss that is not finite (an overflowed step) is skipped.

        Raises:
            ValueError: ``tokens`` is not finite and > 0.
        """
        if not self._plateau.collecting:
            return
        if isinstance(tokens, bool) or not isinstance(tokens, (int, float)) or not 0 < tokens < math.inf:
            raise ValueError(f"BatchSizeController.observe_loss(tokens={tokens!r}): must be finite and > 0")
        loss = float(loss)
        if math.isfinite(loss):
            self._plateau.slope.add(float(tokens), loss)

    @property
    def plateau(self) -> PlateauHold:
        """``hold_on_plateau``'s state: ``held`` (``None`` before the verdict), ``verdict_slope``,
        ``verdict_tokens``, ``exit_tokens``, ``gated`` (the tokens per parameter at a verdict the size gate
        kept from holding, else ``None``) and the fit (``slope``)."""
        return self._plateau

    def _read_plateau(self, tokens: float, scheduled_lr: float | None) -> None:
        """``hold_on_plateau``'s verdict (and exit) at this update; the LR's warm-up it fits from."""
        plateau = self._plateau
        if not plateau.active:
            return
        plateau.slope.observe_lr(tokens, scheduled_lr)
        if self.total_tokens is None and plateau.held is None and "hold_on_plateau" not in self._said_once \
                and self._level.started and self._rules.waiting(self._level, tokens) != "warm-up":
            self._said_once.add("hold_on_plateau")
            warn_user(f"BatchSizeController(hold_on_plateau={plateau.below:g}) has no run length "
                      "(total_tokens=None and no adapter gave one): nothing is held. Pass total_tokens= (units "
                      "of the whole run), or stop the loop with tracker.done(...), which gives the length.")
        self._warn_no_loss_early(plateau)
        said = plateau.decide(tokens, self.total_tokens)
        if said is not None and plateau.unread and "no loss" in self._said_once:
            plateau.warn = False  # said at the run's start already: the verdict's own note goes to the log
        if said is not None and plateau.held is True and plateau.verdict_tokens == tokens and self._plateau_auto:
            # the default, not asked for, stops growth for good: said where a user sees it
            said += ("; the default holds growth for the rest of the run (hold_on_plateau=None grows on the noise "
                     "scale alone)")
            plateau.warn = True
        if said is not None and plateau.warn:
            warn_user(f"BatchSizeController: {said}.")
        elif said is not None:
            _log.info("BatchSizeController: %s", said)

    def _warn_no_loss_early(self, plateau: PlateauHold) -> None:
        """Said once, :data:`NO_LOSS_UPDATES` updates into a run that reads the loss and has been given none: the
        verdict a quarter in would read nothing, and the run is young enough to mend."""
        if not plateau.collecting or plateau.held is not None or plateau.slope.seen or self.total_tokens is None:
            return
        self._updates_without_loss += 1
        if self._updates_without_loss < NO_LOSS_UPDATES or "no loss" in self._said_once:
            return
        self._said_once.add("no loss")
        auto = "'auto'" if self._plateau_auto else f"{plateau.below:g}"
        warn_user(f"BatchSizeController(hold_on_plateau={auto}): no training loss reached the controller in its first "
                  f"{NO_LOSS_UPDATES} updates; without one its verdict at {plateau.at:g} of the run reads nothing and "
                  "lets the growth rule decide. In a plain, Fabric or Accelerate loop call tracker.observe_loss(loss) "
                  "after each microbatch's backward, with the loss as the model returned it (not divided by the "
                  "accumulation); Lightning, the Hugging Face Trainer and OLMo-core pass it where their step returns "
                  "a loss; hold_on_plateau=None turns the hold off")

    def _measure(self, step: int, tokens: float, noise_scale: float | None, low: float | None,
                 high: float | None, scheduled_lr: float | None) -> _Now:
        measured = noise_scale is not None and math.isfinite(noise_scale) and noise_scale > 0
        if not measured or low is None or math.isnan(low):
            low = None
        if not measured or high is None or math.isnan(high):
            high = None
        if measured and not self._level.pending:
            self._rules.add(float(noise_scale))  # type: ignore[arg-type]
        median = self._rules.median()
        if self._rules.full and median is not None:
            self._guard.anchor(median, tokens)
        planned_exp = self._plan.exponent_at(tokens, self._plan_top_level)
        if self.convert_lr_decay:
            self._warn_resumed_without_lr_reference(scheduled_lr)
            self._conversion.observe(scheduled_lr)
        return _Now(
            step=step, tokens=tokens, measured=measured,
            low=None if low is None else max(0.0, float(low)), high=None if high is None else float(high),
            scheduled_lr=scheduled_lr,
            critical=self._rules.clip(self.kappa * float(noise_scale)) if measured else None,  # type: ignore[arg-type]
            median=median, planned_exp=planned_exp,
            planned=None if planned_exp is None else self._plan.batch_at(planned_exp),
        )

    def _warn_resumed_without_lr_reference(self, scheduled_lr: float | None) -> None:
        if not self._resumed_without_lr_reference or scheduled_lr is None or scheduled_lr <= 0:
            return
        self._resumed_without_lr_reference = False
        warn_user(
            "BatchSizeController(convert_lr_decay=True) resumed a state that holds no scheduled learning rate "
            "(saved with convert_lr_decay=False, as the defaults were before kappa=0.4 with conversion, or "
            f"by a run that passed none): halvings of the scheduled LR now count from {scheduled_lr:.4g}, its "
            "value at resume. The configuration is not saved; to resume a run of the earlier defaults as it "
            "ran, build the controller with kappa=0.5, convert_lr_decay=False, hold_on_plateau=None.")

    def _hold(self, now: _Now, reason: str) -> Decision:
        level = self._level
        return Decision(
            step=now.step, accumulation_steps=level.accum(level.exponent), global_batch=level.batch(),
            changed=False, critical_batch=now.critical, decision_noise_scale=now.median, lr_factor=1.0,
            reason=reason, feedback_trap=self.feedback_trap, planned_batch=now.planned,
            lr_conversions=self._conversion.conversions,
        )

    def _change_to(self, exponent: int, now: _Now, reason: str, *, measured_doubling: bool = False) -> Decision:
        level = self._level
        if not level.runnable(exponent):  # a ladder scaled by a resume on more ranks: A0 * 2**e may be 1/2
            return self._hold(now, f"{reason}: not run, {level.accum(exponent):g} microbatches per rank is not a "
                                   "whole number on these data-parallel ranks")
        old_batch = level.batch()
        level.move_to(exponent)
        self._rules.grow_count = self._rules.shrink_count = 0
        self._guard.on_change(now.median, level.last_tokens, measured_doubling=measured_doubling)
        _log.info("BatchSizeController step %d: %s", now.step, reason)
        return Decision(
            step=now.step, accumulation_steps=level.accum(exponent), global_batch=level.batch(), changed=True,
            critical_batch=now.critical, decision_noise_scale=now.median,
            lr_factor=self._lr_factor(level.batch() / old_batch), reason=reason,
            feedback_trap=self.feedback_trap, planned_batch=now.planned,
            lr_conversions=self._conversion.conversions,
        )

    def _wait_or_follow_plan(self, now: _Now) -> Decision | None:
        """Observe-only, a pending change, the budget's plan ahead of the level, or nothing measured yet."""
        if self.observe_only:
            return self._hold(now, "observe-only")
        if self._level.pending:
            return self._hold(now, f"pending: waiting for accumulation_steps={self.accumulation_steps} to take effect")
        if now.planned_exp is not None and now.planned_exp > self._level.exponent:
            return self._change_to(
                now.planned_exp, now,
                f"plan: {now.planned:.4g} at {now.tokens:.4g} of {self.budget_tokens:.4g} budget units",
            )
        if now.median is None:
            return self._hold(now, "no measurement yet")
        return None

    def _check_last_doubling(self, now: _Now) -> Decision | None:
        """The feedback check of the last measured doubling, once its cool-down has passed."""
        level, guard = self._level, self._guard
        if not (guard.armed and self._rules.full and not self._rules.in_cooldown(level, now.tokens)):
            return None
        guard.check(now.median, now.low, now.tokens, now.step, level.batch(), level.exponent)  # type: ignore[arg-type]
        if guard.tripped and now.planned_exp is not None:
            back = max(now.planned_exp, level.exponent - 1)
            if back < level.exponent:
                return self._change_to(
                    back, now, "feedback trap: the noise scale follows the batch; back to the budget's plan"
                )
        return None

    def _convert_lr_halving(self, now: _Now) -> Decision | None:
        """Double the batch in place of a halving of the scheduled LR, while the measured critical batch allows.

        A halving waits while no judgement is possible (warm-up, a window still filling,
        a doubling awaiting its feedback check); then it is consumed exactly once.
        """
        conversion, level, rules = self._conversion, self._level, self._rules
        if not (self.convert_lr_decay and conversion.halved(now.scheduled_lr)):
            return None
        waiting = rules.waiting(level, now.tokens)
        if (waiting is not None and waiting != "cool-down") or self._guard.armed:
            return None
        if self.total_tokens is None and self.convert_until < 1.0:
            self._warn_no_run_length(now, "convert_until")  # said at the first halving: only then it matters
        doubled = level.batch(level.exponent + 1)
        why_not = rules.why_not_grow(level)
        late = self.total_tokens is not None and now.tokens > self.convert_until * self.total_tokens
        if why_not is None and late:
            why_not = (f"past convert_until={self.convert_until:g} of the run: {now.tokens:.4g} of "
                       f"{self.total_tokens:.4g} units")
        if why_not is None and self._guard.tripped:
            why_not = "feedback trap: the noise scale does not measure the critical batch"
        if why_not is None and self._plateau.holds(now.tokens, self.total_tokens):
            why_not = "hold_on_plateau: growth held"
        if why_not is None and not rules.supports(doubled, now.low, kappa=self.conversion_kappa):
            why_not = f"the doubled batch {doubled:.4g} is above " + self._evidence(
                "conversion_kappa", self.conversion_kappa, now)
        conversion.consume(converted=why_not is None)
        if why_not is not None:
            _log.info("BatchSizeController step %d: scheduled LR halved; not converted (%s), it decays as "
                      "scheduled", now.step, why_not)
            return None
        return self._change_to(
            level.exponent + 1, now,
            f"convert: scheduled LR {now.scheduled_lr:.4g} halved; batch {level.batch():.4g} -> {doubled:.4g} "
            f"instead (conversion {conversion.conversions})",
        )

    def _evidence(self, name: str, kappa: float, now: _Now) -> str:
        """The bounds a growth check compared with the batch: ``kappa`` x the interval's lower end and x the
        median of the window (both must reach the batch; clipped to ``min_batch``/``max_batch``)."""
        rules = self._rules
        at_median = rules.clip(kappa * now.median)  # type: ignore[operator]
        if now.low is None:
            return f"{name} x the median noise scale = {at_median:.4g}"
        at_low = rules.clip(kappa * now.low)
        return (f"{name} x the noise scale = {at_low:.4g} at its 90% interval's lower end, {at_median:.4g} at "
                "the median (both must reach it)")

    def _apply_rules(self, now: _Now) -> Decision:
        """Growth and shrink from the measured critical batch, with warm-up, cool-down, caps and the guard."""
        level, rules, guard = self._level, self._rules, self._guard
        batch = level.batch()
        grow_at, shrink_at = rules.thresholds(batch)
        held = self._plateau.holds(now.tokens, self.total_tokens)
        if now.measured:  # patience counts measurements; a step without one changes nothing
            rules.count(batch, now.low, now.high, grow=False if held else self._efficiency_allows(now, 2 * batch))
        waiting = rules.waiting(level, now.tokens)
        if waiting is not None:
            return self._hold(now, waiting)
        if held:
            return self._hold(now, "hold_on_plateau: growth held " + (
                "until the verdict" if self._plateau.held is None else "(the loss is on its plateau)"))
        guard.revisit(now.median, now.low, batch, level.exponent, now.step)  # type: ignore[arg-type]
        target = rules.clip(self.kappa * now.median)  # type: ignore[operator]
        if rules.wants_grow:
            if guard.tripped:
                return self._hold(now, "feedback trap: the noise scale follows the batch; growth stopped")
            why_not = rules.why_not_grow(level)
            if why_not is not None:
                return self._hold(now, why_not)
            if self._efficiency.active:
                low = now.median if now.low is None else min(now.median, now.low)  # type: ignore[type-var]
                spent = self._efficiency.projected(now.tokens, 2 * batch, level.batch(0), low,  # type: ignore[arg-type]
                                                   now.scheduled_lr)
                why = (f"efficiency budget: {spent:.4g} units lost by the end at {2 * batch:.4g} "
                       f"<= {self.efficiency_budget:g} x {self.total_tokens:.4g}, and {2 * batch:.4g} <= the "
                       f"median noise scale {now.median:.4g}")
            else:
                why = f"critical batch {target:.4g} >= {grow_at:.4g}" + (
                    "" if now.low is None else
                    f" (kappa x the interval's lower end {rules.clip(self.kappa * now.low):.4g} too)")
            return self._change_to(
                level.exponent + 1, now,
                f"grow {batch:.4g} -> {2 * batch:.4g}: {why} for {self.patience} measurements",
                measured_doubling=True,
            )
        if rules.wants_shrink and rules.why_not_shrink(level) is None and (
            now.planned_exp is None or now.planned_exp < level.exponent
        ):
            return self._change_to(
                level.exponent - 1, now,
                f"shrink {batch:.4g} -> {batch / 2:.4g}: critical batch {target:.4g} < {shrink_at:.4g} "
                f"for {self.patience} measurements",
            )
        if self.kappa * now.median >= grow_at:  # type: ignore[operator]
            why_not = rules.why_not_grow(level)  # would grow but for a cap: say which
            if why_not is not None:
                return self._hold(now, why_not)
        return self._hold(now, "hold")

    def _efficiency_allows(self, now: _Now, doubled: float) -> bool | None:
        """The efficiency budget's growth test (``None`` while the rule is inactive: the ``kappa`` rule)."""
        if not self._efficiency.active:
            return None
        if now.median is None:
            return False
        # the projection at the interval's lower end (a noise scale that read high by chance commits the rest
        # of the run); the ceiling at the median
        low = now.median if now.low is None else min(now.median, now.low)
        return doubled <= self._rules.clip(now.median) and self._efficiency.allows(
            now.tokens, doubled, self._level.batch(0), low, now.scheduled_lr)

    def _warn_no_run_length(self, now: _Now, option: str) -> None:
        """An option that needs the run's length, without it (``efficiency_budget``: the ``kappa`` rule decides;
        ``kappa_rise``: ``kappa`` stays at its start; ``convert_until``: every halving converts); said once per
        option, past warm-up."""
        if option in self._said_once or self._rules.waiting(self._level, now.tokens) == "warm-up":
            return
        self._said_once.add(option)
        if option == "efficiency_budget":
            given, effect, or_else = f"efficiency_budget={self.efficiency_budget:g}", "the kappa rule decides growth", ""
        elif option == "convert_until":
            given, effect = f"convert_until={self.convert_until:g}", "every halving of the scheduled LR converts"
            or_else = ", or set convert_until=1"
        else:
            given = f"kappa_rise={self.kappa_rise:g}"
            effect = (f"kappa stays at {self._kappa_start:g} instead of rising to "
                      f"{self._kappa_start * self.kappa_rise:g} by the run's end")
            or_else = ", or set kappa_rise=1 to keep kappa fixed"
        warn_user(
            f"BatchSizeController({given}) has no run length (total_tokens=None and no adapter gave one): {effect}. "
            f"Pass total_tokens= (units of the whole run), or stop the loop with tracker.done(...), which gives the "
            f"length{or_else}.")

    # ------------------------------------------------------------- arguments
    def _check_start(self, global_batch: float, accumulation_steps: int) -> None:
        cap = self.max_accumulation_steps if self.max_accumulation_steps is not None else 256 * accumulation_steps
        if accumulation_steps > cap:
            raise ValueError(
                f"BatchSizeController: starting accumulation_steps={accumulation_steps} exceeds "
                f"max_accumulation_steps={cap}"
            )
        if self.max_batch is not None and global_batch > self.max_batch * (1 + _TOL):
            raise ValueError(
                f"BatchSizeController: starting global_batch={global_batch:g} exceeds max_batch={self.max_batch:g}"
            )
        if self.budget_tokens is not None and self.budget_tokens < global_batch:
            raise ValueError(
                f"BatchSizeController(budget_tokens={self.budget_tokens:g}): smaller than the "
                f"starting global_batch={global_batch:g}"
            )

    def _check_update_args(self, step: Any, tokens_seen: Any, global_batch: Any, accumulation_steps: Any,
                           noise_scale: Any, scheduled_lr: Any, low: Any, high: Any) -> None:
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"BatchSizeController.update(step={step!r}): expected an int")
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int):
            raise TypeError(
                f"BatchSizeController.update(accumulation_steps={accumulation_steps!r}): expected an int"
            )
        for name, value in (("tokens_seen", tokens_seen), ("global_batch", global_batch)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"BatchSizeController.update({name}={value!r}): expected a number")
        for name, value in (("noise_scale", noise_scale), ("scheduled_lr", scheduled_lr),
                            ("noise_scale_low", low), ("noise_scale_high", high)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise TypeError(f"BatchSizeController.update({name}={value!r}): expected a number or None")
        if accumulation_steps < 1:
            raise ValueError(f"BatchSizeController.update(accumulation_steps={accumulation_steps}): must be >= 1")
        if not math.isfinite(global_batch) or global_batch <= 0:
            raise ValueError(f"BatchSizeController.update(global_batch={global_batch!r}): must be finite and > 0")
        if not math.isfinite(tokens_seen) or tokens_seen < 0:
            raise ValueError(f"BatchSizeController.update(tokens_seen={tokens_seen!r}): must be finite and >= 0")
        if scheduled_lr is not None and (not math.isfinite(scheduled_lr) or scheduled_lr < 0):
            raise ValueError(
                f"BatchSizeController.update(scheduled_lr={scheduled_lr!r}): must be finite and >= 0, or None"
            )
        if step <= self._level.last_step:
            raise RuntimeError(
                f"BatchSizeController.update(step={step}): steps must increase (last was {self._level.last_step})"
            )
        if tokens_seen < self._level.last_tokens:
            raise RuntimeError(
                f"BatchSizeController.update(tokens_seen={tokens_seen!r}): tokens_seen went back "
                f"(last was {self._level.last_tokens!r})"
            )


def adapter_controller(owner: str, controller: Any, observe_only: bool) -> Any:
    """The controller an adapter's ``controller=`` and ``observe_only=`` arguments ask for.

    ``"auto"`` builds ``BatchSizeController(observe_only=observe_only)``; ``None`` measures only;
    anything else must be an instance with ``update``, ``state_dict`` and ``load_state_dict`` (a
    ``BatchSizeController``, a ``BatchSchedule`` or one of the user's own), built with
    ``observe_only=True`` when ``observe_only`` is asked for. ``owner`` names the adapter in errors.

    Raises:
        TypeError: ``observe_only`` not a bool; a class instead of an instance; an object without
            those three methods.
        ValueError: a string other than ``"auto"``; ``observe_only=True`` with a controller that
            would change the batch.
    """
    expected = "expected 'auto', None, a BatchSizeController or a BatchSchedule"
    if not isinstance(observe_only, bool):
        raise TypeError(f"{owner}(observe_only={observe_only!r}): expected True or False")
    if isinstance(controller, type):
        raise TypeError(
            f"{owner}(controller={controller.__name__}): pass an instance, e.g. "
            f"controller={controller.__name__}(), not the class"
        )
    if isinstance(controller, str):
        if controller != "auto":
            raise ValueError(f"{owner}(controller={controller!r}): {expected}")
        return BatchSizeController(observe_only=observe_only)
    if controller is None:
        return None
    if not all(callable(getattr(controller, m, None)) for m in ("update", "state_dict", "load_state_dict")):
        raise TypeError(
            f"{owner}(controller={type(controller).__name__}): {expected} (an object with update(...), "
            "state_dict() and load_state_dict())"
        )
    if observe_only and not getattr(controller, "observe_only", False):
        raise ValueError(
            f"{owner}(controller=<{type(controller).__name__}>, observe_only=True): pass "
            f"{type(controller).__name__}(observe_only=True) (or controller=None) instead"
        )
    return controller
