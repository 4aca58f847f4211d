"""Learning-rate coupling of a batch change and the timing of the user's LR scheduler in tokens.

:class:`ScheduleTimer` keeps a step-sized torch scheduler on its token timing while
the batch grows and multiplies what it sets by the batch-size coupling;
:func:`resolve_coupling` picks the coupling from the optimizer; :func:`token_schedule`
writes a schedule directly in units seen. See docs/design.md ("Learning-rate schedules").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

from cbs_tracker._warn import warn_user

__all__ = [
    "ADAPTIVE_OPTIMIZERS",
    "COUPLINGS",
    "SGD_OPTIMIZERS",
    "ScheduleTimer",
    "apply_lr_factor",
    "coupling_factor",
    "resolve_coupling",
    "schedule_horizon",
    "token_schedule",
]

Coupling = Literal["keep", "sqrt", "linear"]
COUPLINGS = ("auto", "keep", "sqrt", "linear")

#: optimizers (class names) whose update is normalised by a second-moment estimate (or a sign): a
#: doubled batch is worth LR x sqrt(2) there, and LR x 2 for plain SGD (momentum or not, :data:`SGD_OPTIMIZERS`)
ADAPTIVE_OPTIMIZERS = {
    "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "SparseAdam", "Adafactor", "Adagrad",
    "RMSprop", "Adadelta", "Lion", "LAMB", "Lamb", "AdEMAMix", "Muon", "SOAP", "Shampoo",
}
SGD_OPTIMIZERS = {"SGD", "ASGD"}


def resolve_coupling(mode: str | None, optimizer: Any | None, *, owner: str = "cbs-tracker") -> Coupling:
    """The learning-rate coupling to use: ``mode`` itself, or for ``"auto"``/``None`` the optimizer's rule.

    ``sqrt`` for Adam-family (adaptive) optimizers, ``linear`` for SGD; an optimizer
    of another kind gets ``sqrt`` with a warning saying so. Without an optimizer: ``keep``.

    Raises:
        ValueError: ``mode`` is not one of ``"auto"``, ``"keep"``, ``"sqrt"``, ``"linear"``, ``None``.
    """
    if mode is not None and mode not in COUPLINGS:
        raise ValueError(f"{owner}(lr_coupling={mode!r}): expected one of {list(COUPLINGS)} or None")
    if mode not in (None, "auto"):
        return mode  # type: ignore[return-value]
    if optimizer is None:
        return "keep"
    name = type(optimizer).__name__
    for cls in type(optimizer).__mro__:
        if cls.__name__ in SGD_OPTIMIZERS:
            return "linear"
        if cls.__name__ in ADAPTIVE_OPTIMIZERS:
            return "sqrt"
    warn_user(
        f"{owner}: lr_coupling='auto' does not know the optimizer {name}; it uses 'sqrt' (the rule "
        "for adaptive optimizers: LR x sqrt(2) per doubling). Pass lr_coupling='linear' for an "
        "SGD-like optimizer or 'keep' to leave the LR alone.")
    return "sqrt"


def coupling_factor(coupling: str, batch_ratio: float) -> float:
    """The LR factor of a batch ``batch_ratio`` times the starting batch: 1, sqrt(ratio) or ratio."""
    if coupling == "keep":
        return 1.0
    if coupling == "sqrt":
        return math.sqrt(batch_ratio)
    if coupling == "linear":
        return float(batch_ratio)
    raise ValueError(f"coupling_factor(coupling={coupling!r}): expected 'keep', 'sqrt' or 'linear'")


def token_schedule(
    peak_lr: float,
    total: float,
    *,
    warmup: float = 0.0,
    decay: Literal["cosine", "linear", "wsd", "constant"] = "cosine",
    final_ratio: float = 0.1,
    decay_fraction: float = 0.2,
) -> Callable[[float], float]:
    """A learning-rate schedule written in units seen (tokens or samples), not in steps.

    ``lr(units)``: linear warm-up over ``warmup`` units, then ``cosine`` or ``linear``
    decay to ``final_ratio * peak_lr`` at ``total``; ``wsd`` (warmup-stable-decay) holds
    the peak and decays linearly over the last ``decay_fraction`` of ``total``;
    ``constant`` holds the peak. Beyond ``total`` it stays at the final value. Use it
    with a ``LambdaLR`` whose lambda reads the tracker's units seen, or set the LR
    yourself each step; a schedule in units needs no re-timing when the batch grows.

    Raises:
        ValueError: a non-positive ``peak_lr`` or ``total``, ``warmup`` outside ``[0, total)``,
            ``final_ratio`` outside ``[0, 1]``, ``decay_fraction`` outside ``(0, 1]``, unknown ``decay``.
    """
    if not (isinstance(peak_lr, (int, float)) and math.isfinite(peak_lr) and peak_lr > 0):
        raise ValueError(f"token_schedule(peak_lr={peak_lr!r}): must be a finite number > 0")
    if not (isinstance(total, (int, float)) and math.isfinite(total) and total > 0):
        raise ValueError(f"token_schedule(total={total!r}): must be a finite number > 0")
    if not (isinstance(warmup, (int, float)) and 0 <= warmup < total):
        raise ValueError(f"token_schedule(warmup={warmup!r}): must be in [0, total={total!r})")
    if not (isinstance(final_ratio, (int, float)) and 0 <= final_ratio <= 1):
        raise ValueError(f"token_schedule(final_ratio={final_ratio!r}): must be in [0, 1]")
    if not (isinstance(decay_fraction, (int, float)) and 0 < decay_fraction <= 1):
        raise ValueError(f"token_schedule(decay_fraction={decay_fraction!r}): must be in (0, 1]")
    if decay not in ("cosine", "linear", "wsd", "constant"):
        raise ValueError(f"token_schedule(decay={decay!r}): expected 'cosine', 'linear', 'wsd' or 'constant'")
    low = final_ratio * peak_lr

    def lr(units: float) -> float:
        if warmup > 0 and units < warmup:
            return peak_lr * (units + 1e-12) / warmup if units > 0 else peak_lr * 0.0
        if decay == "constant":
            return peak_lr
        if decay == "wsd":
            start = total * (1.0 - decay_fraction)
            if units <= start:
                return peak_lr
            frac = min(1.0, (units - start) / (total - start))
            return peak_lr - (peak_lr - low) * frac
        frac = min(1.0, max(0.0, (units - warmup) / (total - warmup)))
        if decay == "linear":
            return peak_lr - (peak_lr - low) * frac
        return low + 0.5 * (peak_lr - low) * (1.0 + math.cos(math.pi * frac))

    return lr


class ScheduleTimer:
    """Keeps a step-sized LR scheduler on its token timing and applies the batch-size coupling.

    Every batch the controller allows is ``B0 * 2**e``, so one optimizer step at the
    accumulation ``A0 * 2**e`` holds the units of ``2**e`` steps at the starting batch
    (a batch schedule's other multiples carry their part-steps, see the session).
    Each call of the scheduler's ``step()`` (by the user's loop, Lightning or the
    Hugging Face ``Trainer``, once per optimizer step as usual) advances it by the
    starting-batch steps owed since the last call (:meth:`owe`), so any torch
    scheduler (chained, sequential, OneCycle) keeps its timing in units. Before
    advancing, the param groups get back the scheduler's own values; after it, the
    learning rate is ``scheduled * coupling`` (optionally capped at the peak). The
    scheduler never sees the coupling, so recursive and closed-form schedulers stay
    exact and its ``state_dict`` is the plain schedule's.

    The scheduler's class is swapped for a subclass whose ``step`` does this (the
    instance ``__dict__`` and so its ``state_dict`` are untouched); :meth:`detach`
    restores it. A second ``step()`` call for the same optimizer step raises. With
    ``per_call=True`` (epoch-interval schedulers) each call advances the scheduler once.
    """

    def __init__(self, scheduler: Any, optimizer: Any, *, owner: str, cap_at_peak: bool = False,
                 per_call: bool = False, period: int = 1, coupling: float = 1.0) -> None:
        if isinstance(scheduler, type) or not callable(getattr(scheduler, "step", None)):
            raise TypeError(
                f"{owner}(lr_scheduler={scheduler!r}): expected a torch.optim.lr_scheduler instance "
                "(an object with step() and optimizer) or None"
            )
        if getattr(scheduler, "optimizer", None) is not optimizer:
            raise ValueError(
                f"{owner}(lr_scheduler={type(scheduler).__name__}): the scheduler drives a different "
                "optimizer than the one given to the tracker"
            )
        if _has_timer(scheduler):
            raise RuntimeError(
                f"{owner}(lr_scheduler={type(scheduler).__name__}): this scheduler is already timed by "
                "another tracker or callback; attach it to one only"
            )
        self.scheduler = scheduler
        self.optimizer = optimizer
        self.owner = owner
        self.cap_at_peak = bool(cap_at_peak)
        # the groups hold the scheduled value times the coupling now in force (a resumed run's)
        self.coupling = float(coupling)
        self.owed = 0
        self.due = 0  # optimizer steps not yet followed by the scheduler's step() (0 or 1)
        self.writes = 0
        self._plateau = type(scheduler).__name__ == "ReduceLROnPlateau"
        # one step per call, not re-timed: an epoch-interval scheduler (an epoch holds the same data
        # at any batch size), whenever the framework calls it
        self.per_call = bool(per_call)
        # starting-batch steps per scheduler step (Lightning's ``frequency``: the constant-batch run
        # steps its scheduler once every ``period`` optimizer steps); what a call leaves is carried
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"{owner}: scheduler period={period!r}: must be an integer >= 1")
        self.period = period
        self.carry = 0
        self._warned_horizon = False
        groups = optimizer.param_groups
        self.scheduled = [float(g["lr"]) / self.coupling for g in groups]
        self.peak = [float(g.get("max_lr", g.get("initial_lr", g["lr"]))) for g in groups]
        self._orig_class = type(scheduler)
        self.horizon = None if self._plateau or self.per_call else schedule_horizon(scheduler)
        timer = self

        def step(self_sched: Any, *args: Any, **kwargs: Any) -> None:
            timer._step(*args, **kwargs)

        scheduler.__class__ = type(self._orig_class.__name__, (self._orig_class,), {"step": step, "_cbs_timer": timer})

    # ------------------------------------------------------------------ driven by the session
    def owe(self, steps: int) -> None:
        """Starting-batch steps the schedule owes after an optimizer step that held that many."""
        self.owed += int(steps)
        self.due += 1  # a step that held less than a starting-batch step still calls the scheduler once

    def set_coupling(self, factor: float) -> None:
        """Apply a new coupling factor now: ``lr = scheduled * factor`` in every param group."""
        self.coupling = float(factor)
        self._write()

    def end_period_count(self) -> None:
        """Take the scheduler steps the owed starting-batch steps still hold, then drop the remainder.

        For a framework whose step count restarts with each epoch (Lightning's ``frequency`` counts
        ``batch_idx``): the constant-batch run takes ``floor(batches / lcm(A0, f))`` scheduler steps
        per epoch, so what an epoch leaves is not carried into the next.
        """
        n = (self.owed + self.carry) // self.period
        self.owed = self.carry = self.due = 0
        if n > 0 and not (self._plateau or self.per_call):
            self._advance(n)

    def _advance(self, n: int, *args: Any, **kwargs: Any) -> None:
        """Step the scheduler ``n`` times on its own values, then write them times the coupling."""
        groups = self.optimizer.param_groups
        for g, lr in zip(groups, self.scheduled):
            g["lr"] = _set(g["lr"], lr)
        for _ in range(n):
            self._orig_class.step(self.scheduler, *args, **kwargs)
        self.scheduled = [float(g["lr"]) for g in groups]
        self._write()

    def detach(self) -> None:
        """Give the scheduler its own class back (the learning rate stays as it is)."""
        if type(self.scheduler) is not self._orig_class and _has_timer(self.scheduler):
            self.scheduler.__class__ = self._orig_class

    # ------------------------------------------------------------------ the patched step
    def _step(self, *args: Any, **kwargs: Any) -> None:
        if self._plateau or self.per_call:
            # metric-driven or epoch-sized, not step-sized: one call, no re-timing
            self._advance(1, *args, **kwargs)
        else:
            if self.due <= 0:
                raise RuntimeError(
                    f"{self.owner}: lr_scheduler.step() was called twice for one optimizer step (or before "
                    "the tracker measured the step). The scheduler given to the tracker is advanced by "
                    "its own units-seen timing on each call: call lr_scheduler.step() once per optimizer "
                    "step, after optimizer.step(), and nowhere else."
                )
            n, self.carry = divmod(self.owed + self.carry, self.period)
            self.owed = self.due = 0
            if n > 0 and self.horizon is not None:
                n = self._past_horizon(n)
            self._advance(n, *args, **kwargs)

    def _past_horizon(self, n: int) -> int:
        """Warn once when an optimizer step runs after the schedule already reached its horizon (the loop
        went on past the data it was sized for); a OneCycleLR, which raises there, stays at its end."""
        position = int(getattr(self.scheduler, "last_epoch", 0))
        assert self.horizon is not None
        onecycle = self._orig_class.__name__ == "OneCycleLR"
        if position >= self.horizon and not self._warned_horizon:
            self._warned_horizon = True
            warn_user(
                f"{self.owner}: the LR scheduler ({self._orig_class.__name__}) reached the end it was sized for "
                f"({self.horizon} scheduler steps, the data of that many optimizer steps at the starting batch) and "
                "the loop runs on: every step from here trains on data the plan did not have, "
                + ("and OneCycleLR cannot step past its total_steps: its last LR is kept. " if onecycle else
                   "and the schedule goes on past its end (a cosine rises again). ")
                + "A loop that stops on its own count of optimizer steps (completed_steps >= max_train_steps) "
                "runs past the plan once the batch has grown; stop it on the data: `if tracker.done(max_train_steps): "
                "break` after each batch, or `while not tracker.done(max_train_steps):` around each window.")
        if onecycle:
            n = max(0, min(n, self.horizon - position))
        return n

    def _write(self) -> None:
        for i, g in enumerate(self.optimizer.param_groups):
            lr = self.scheduled[i] * self.coupling
            if self.cap_at_peak and self.coupling > 1.0:
                lr = min(lr, max(self.peak[i], self.scheduled[i]))
            g["lr"] = _set(g["lr"], lr)
        self.writes += 1  # the session tells its own writes from a loop's

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"scheduled_lrs": list(self.scheduled), "owed": self.owed, "carry": self.carry, "due": self.due}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduled = [float(v) for v in state["scheduled_lrs"]]
        self.owed = int(state["owed"])
        self.carry = int(state.get("carry", 0))
        self.due = int(state.get("due", 1 if self.owed > 0 else 0))


def schedule_horizon(scheduler: Any) -> int | None:
    """Scheduler steps a step-sized schedule was sized for, where it says so; ``None`` elsewhere.

    ``OneCycleLR.total_steps``, ``CosineAnnealingLR.T_max``, ``PolynomialLR.total_iters``, a
    ``LambdaLR`` of transformers' ``get_scheduler`` (its lambda's ``num_training_steps``, or the
    warm-up, stable and decay steps of ``warmup_stable_decay``) and a ``SequentialLR`` whose last
    scheduler has one (after its last milestone). Warm-up-only and constant schedules have none.
    """
    cls = getattr(type(scheduler), "_cbs_timer", None)
    kind = (type(scheduler).__mro__[1] if cls is not None else type(scheduler)).__name__
    try:
        if kind == "OneCycleLR":
            return int(scheduler.total_steps)
        if kind == "CosineAnnealingLR":
            return int(scheduler.T_max)
        if kind == "PolynomialLR":
            return int(scheduler.total_iters)
        if kind in ("LambdaLR", "MultiplicativeLR"):
            for fn in getattr(scheduler, "lr_lambdas", ()):
                keywords = getattr(fn, "keywords", None) or {}
                if isinstance(keywords.get("num_training_steps"), int):
                    return int(keywords["num_training_steps"])
                parts = [keywords.get(k) for k in ("num_warmup_steps", "num_stable_steps", "num_decay_steps")]
                if all(isinstance(v, int) for v in parts):
                    return int(sum(parts))  # type: ignore[arg-type]
            return None
        if kind == "SequentialLR":
            last = schedule_horizon(scheduler._schedulers[-1])
            return None if last is None else int(scheduler._milestones[-1]) + last
    except (AttributeError, TypeError, ValueError, IndexError):
        return None
    return None


def _has_timer(scheduler: Any) -> bool:
    return isinstance(type(scheduler).__dict__.get("_cbs_timer"), ScheduleTimer)


def _set(current: Any, value: float) -> Any:
    """A param group's new lr; a tensor lr (capturable optimizers) is written in place."""
    if hasattr(current, "fill_"):
        current.fill_(value)
        return current
    return value


# Scheduler attributes that hold learning rates (scaled by apply_lr_factor) and the
# param-group keys that do. torch's LRScheduler copies each group's "lr" into
# "initial_lr" at construction and keeps them as `base_lrs`; closed-form schedules
# (LambdaLR, and every scheduler when SequentialLR switches) compute lr = base_lr * f(t),
# recursive ones (CosineAnnealingLR, LinearLR, StepLR, ...) multiply the current group
# lr, and CosineAnnealingLR adds `eta_min`; CyclicLR keeps `max_lrs`, OneCycleLR keeps
# per-group "max_lr"/"min_lr", ReduceLROnPlateau `min_lrs`.
_SCHEDULER_LIST_ATTRS = ("base_lrs", "max_lrs", "min_lrs", "_last_lr")
_SCHEDULER_SCALAR_ATTRS = ("eta_min",)
_GROUP_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")


def _scaled(value: Any, factor: float, done: set[int] | None = None) -> Any:
    """``value * factor``; a tensor in a param group is scaled in place (once per object)."""
    if done is not None and hasattr(value, "mul_"):
        # capturable optimizers keep the lr tensor's identity; a tensor shared by two keys
        # must be scaled once
        if id(value) not in done:
            done.add(id(value))
            value.mul_(factor)
        return value
    return value * factor


def apply_lr_factor(optimizer: Any, factor: float, scheduler: Any | None = None) -> None:
    """Multiply the learning rate by ``factor`` now and in everything a scheduler will set later.

    The composition rule: the factor multiplies what the scheduler sets, i.e. after
    ``apply_lr_factor(opt, f, sched)`` at step ``k``, the learning rate at every later
    step is ``f`` times the one the same scheduler would have set without it. This
    scales each param group's ``"lr"`` (and ``"initial_lr"``, ``"max_lr"``,
    ``"min_lr"`` where present), and on the scheduler (recursively through
    ``SequentialLR`` / ``ChainedScheduler``): ``base_lrs``, ``max_lrs``, ``min_lrs``,
    ``eta_min`` and the last reported lr. Recursive schedulers (which multiply the
    current lr) carry the factor through the group's lr, closed-form ones through
    ``base_lrs``, and ``eta_min`` keeps the affine cosine form exact. Tested with
    ``LambdaLR``, ``CosineAnnealingLR`` (``eta_min > 0``), ``StepLR``,
    ``SequentialLR(LinearLR, CosineAnnealingLR)`` and ``OneCycleLR``.

    Without ``scheduler`` only the optimizer is changed: enough when no scheduler is
    used, or for a scheduler built later (it reads ``"initial_lr"``), but a scheduler
    that already exists would undo the factor wherever it uses its ``base_lrs``.

    Args:
        optimizer: anything with ``param_groups`` (a list of dicts with ``"lr"``).
        factor: positive finite multiplier (``Decision.lr_factor``).
        scheduler: the LR scheduler driving ``optimizer``, if any.

    Raises:
        TypeError: ``optimizer`` has no ``param_groups``, or ``factor`` is not a number.
        ValueError: ``factor`` is not positive and finite.
    """
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise TypeError(f"apply_lr_factor(factor={factor!r}): expected a number")
    if not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"apply_lr_factor(factor={factor!r}): must be finite and > 0")
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:
        raise TypeError(
            f"apply_lr_factor(optimizer={type(optimizer).__name__}): expected an object with param_groups"
        )
    if factor == 1:
        return
    done: set[int] = set()
    for group in groups:
        for key in _GROUP_KEYS:
            if key in group:
                group[key] = _scaled(group[key], factor, done)
    if scheduler is not None:
        _scale_scheduler(scheduler, factor, seen=set())


def _scale_scheduler(scheduler: Any, factor: float, seen: set[int]) -> None:
    if id(scheduler) in seen:
        return
    seen.add(id(scheduler))
    for attr in _SCHEDULER_LIST_ATTRS:
        values = getattr(scheduler, attr, None)
        if isinstance(values, list):
            setattr(scheduler, attr, [_scaled(v, factor) for v in values])
    for attr in _SCHEDULER_SCALAR_ATTRS:
        value = getattr(scheduler, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            setattr(scheduler, attr, value * factor)
    for child in getattr(scheduler, "_schedulers", None) or ():
        _scale_scheduler(child, factor, seen)
