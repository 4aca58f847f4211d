"""The ``cbs/`` tag names and the scalars of a :class:`~cbs_tracker.core.record.StepRecord`.

The only place where tag names are spelled: the TensorBoard logger, the Lightning
callback (through any Lightning logger) and ``cbs-tracker plot`` all use these
functions. ``docs/design.md`` (Logging) explains the two x-axes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cbs_tracker.core.record import StepRecord

__all__ = ["TAGS", "TagSpec", "record_scalars", "schedule_scalars", "schedule_step", "seen_tag"]

_UNITS = ("tokens", "samples")


@dataclass(frozen=True)
class TagSpec:
    """One row of the tag table.

    Attributes:
        tag: tag name; ``{unit}`` stands for the record's unit.
        field: the ``StepRecord`` attribute written under it.
        meaning: one line for the tag table of ``docs/design.md``.
    """

    tag: str
    field: str
    meaning: str


# The tag table: the only place where tag names are spelled. docs/design.md
# (Logging) repeats it for readers; tests/test_tb.py checks that they agree.
TAGS: tuple[TagSpec, ...] = (
    TagSpec("cbs/noise_scale", "noise_scale", "B_simple = tr(Sigma) / abs(G)^2, smoothed, in {unit}"),
    TagSpec("cbs/noise_scale_low", "noise_scale_low", "lower end of the 90% confidence interval of cbs/noise_scale"),
    TagSpec("cbs/noise_scale_high", "noise_scale_high", "upper end of the 90% confidence interval of cbs/noise_scale"),
    TagSpec("cbs/critical_batch", "critical_batch", "controller target kappa * B_simple, clipped, in {unit}"),
    TagSpec("cbs/kappa", "kappa", "kappa in force: the constant or the measured critical batch / B_simple"),
    TagSpec("cbs/grad_sq_norm", "grad_sq_norm", "smoothed estimate of abs(G)^2"),
    TagSpec("cbs/trace_cov", "trace_cov", "smoothed estimate of tr(Sigma) (per-example covariance trace)"),
    TagSpec("cbs/step_grad_sq_norm", "step_grad_sq_norm", "this step's own unbiased abs(G)^2 estimate (noisy, may be < 0)"),
    TagSpec("cbs/step_trace_cov", "step_trace_cov", "this step's own unbiased tr(Sigma) estimate (noisy, may be < 0)"),
    TagSpec("cbs/global_batch_{unit}", "global_batch", "{unit} in this optimizer step, all DP ranks and microbatches"),
    TagSpec("cbs/micro_batch_{unit}", "micro_batch", "mean {unit} of one microbatch on one rank"),
    TagSpec("cbs/accumulation_steps", "accumulation_steps", "microbatches per rank in this step's window"),
    TagSpec("cbs/dp_degree", "dp_degree", "data-parallel ranks (ranks that see different data)"),
    TagSpec("cbs/{unit}_seen", "tokens_seen", "{unit} consumed by all DP ranks, this step included"),
    TagSpec("cbs/lr", "lr", "learning rate of the first param group after this step"),
    TagSpec("cbs/scheduled_lr", "scheduled_lr", "learning rate the schedule sets, before the batch-size coupling"),
    TagSpec("cbs/lr_coupling", "lr_coupling", "factor the batch-size coupling multiplies the schedule by"),
    TagSpec("cbs/lr_conversions", "lr_conversions", "doublings made in place of a halving of the scheduled LR"),
    TagSpec("cbs/dropped", "dropped", "1 if the step's gradients were not finite (not measured), else 0"),
    TagSpec("cbs/measured", "measured", "1 if this window's norms were measured, 0 if the measuring cadence let it pass"),
    TagSpec("cbs_{unit}/noise_scale", "noise_scale", "as cbs/noise_scale, x = {unit} seen"),
    TagSpec("cbs_{unit}/critical_batch", "critical_batch", "as cbs/critical_batch, x = {unit} seen"),
    TagSpec("cbs_{unit}/global_batch_{unit}", "global_batch", "as cbs/global_batch_{unit}, x = {unit} seen"),
    TagSpec("cbs_{unit}/accumulation_steps", "accumulation_steps", "as cbs/accumulation_steps, x = {unit} seen"),
)


def _unit_of(record: StepRecord) -> str:
    if not isinstance(record, StepRecord):
        raise TypeError(f"expected a cbs_tracker.core.record.StepRecord, got {type(record).__name__}")
    if record.unit not in _UNITS:
        raise ValueError(f"StepRecord(unit={record.unit!r}) is not supported; expected one of {_UNITS}")
    return record.unit


def _scalars(record: StepRecord, prefix: str) -> dict[str, float]:
    unit = _unit_of(record)
    out: dict[str, float] = {}
    for spec in TAGS:
        tag = spec.tag.format(unit=unit)
        if not tag.startswith(prefix.format(unit=unit)):
            continue
        value = getattr(record, spec.field)
        if value is None:
            continue
        out[tag] = float(value)
    return out


def record_scalars(record: StepRecord) -> dict[str, float]:
    """The ``cbs/`` scalars of one step, to be written at x = ``record.step``.

    Args:
        record: the tracker's report of one optimizer step.

    Returns:
        A new dict ``{tag: value}`` with the ``cbs/`` rows of ``TAGS`` whose
        record field is not ``None`` (``dropped`` is written as 1.0 or 0.0).

    Raises:
        TypeError: ``record`` is not a ``StepRecord``.
        ValueError: ``record.unit`` is neither ``"tokens"`` nor ``"samples"``.
    """
    return _scalars(record, "cbs/")


def schedule_scalars(record: StepRecord) -> dict[str, float]:
    """The ``cbs_{unit}/`` scalars of one step, to be written at x = ``schedule_step(record)``.

    Args:
        record: the tracker's report of one optimizer step.

    Returns:
        A new dict ``{tag: value}`` with the ``cbs_{unit}/`` rows of ``TAGS``
        (noise scale, critical batch, global batch, accumulation steps) whose
        record field is not ``None``.

    Raises:
        TypeError: ``record`` is not a ``StepRecord``.
        ValueError: ``record.unit`` is neither ``"tokens"`` nor ``"samples"``.
    """
    return _scalars(record, "cbs_{unit}/")


def schedule_step(record: StepRecord) -> int:
    """TensorBoard step of the ``cbs_{unit}/`` tags: ``round(record.tokens_seen)``.

    Raises:
        TypeError: ``record`` is not a ``StepRecord``.
        ValueError: ``tokens_seen`` is negative or not finite.
    """
    _unit_of(record)
    seen = record.tokens_seen
    if not math.isfinite(seen) or seen < 0:
        raise ValueError(f"StepRecord(tokens_seen={seen!r}) must be a finite number >= 0")
    return int(round(seen))


def seen_tag(unit: str) -> str:
    """Name of the units-seen tag for ``unit``: ``cbs/tokens_seen`` or ``cbs/samples_seen``."""
    if unit not in _UNITS:
        raise ValueError(f"unit={unit!r} is not supported; expected one of {_UNITS}")
    return f"cbs/{unit}_seen"
