"""Learning-rate coupling of a batch change and the handling of the user's LR scheduler."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["apply_lr_factor"]


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
