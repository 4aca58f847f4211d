"""What the tracker reports after each optimizer step: one frozen record, shared by all adapters.

Loggers (TensorBoard, Lightning) and the plot read only this record, so every
adapter writes the same tags with the same meaning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Unit = Literal["tokens", "samples"]

#: the fields a window's units make: in a window not measured whose ``labels=`` were counted on an
#: accelerator they are filled when the counts reach the host (read earlier, they wait for them)
PENDING_FIELDS = ("tokens_seen", "global_batch", "micro_batch", "dropped")


@dataclass(frozen=True)
class StepRecord:
    """The tracker's view of one optimizer step.

    Every size is in ``unit`` (loss-contributing tokens or samples), summed as
    stated. ``None`` means "not measured yet" (too few steps, or ``K = 1``).

    Attributes:
        step: optimizer steps completed, this one included (1 after the first step).
        tokens_seen: units consumed by all DP ranks since the start, this step included
            (in ``unit``; the name says tokens because that is the usual unit).
        unit: ``"tokens"`` or ``"samples"``.
        global_batch: units in this optimizer step, summed over DP ranks and the window.
        micro_batch: mean units of one microbatch on one rank in this step.
        accumulation_steps: microbatches per rank in this step's window.
        dp_degree: data-parallel ranks (ranks that see different data).
        grad_sq_norm: smoothed estimate of ``|G|^2`` (McCandlish et al. 2018, App. A).
        trace_cov: smoothed estimate of ``tr(Sigma)``, per-example covariance trace, in
            squared-gradient units times ``unit``.
        noise_scale: ``B_simple = trace_cov / grad_sq_norm`` in ``unit``.
        critical_batch: the controller's target ``kappa * noise_scale`` clipped to its
            bounds, in ``unit`` (``None`` without a controller or before a measurement).
        lr: learning rate of the first param group after this step's coupling.
        step_grad_sq_norm: this step's own unbiased ``|G|^2`` estimate (noisy, may be < 0).
        step_trace_cov: this step's own unbiased ``tr(Sigma)`` estimate (noisy, may be < 0).
        dropped: the step's gradients were not finite on some rank; nothing was measured.
        next_accumulation_steps: microbatches per rank in the next window (after a decision).
        noise_scale_low: lower end of the 90% confidence interval of ``noise_scale``
            (``None`` when the estimator gives none).
        noise_scale_high: upper end of that interval (may be ``inf`` while the averaged
            ``|G|^2`` is indistinguishable from 0).
        scheduled_lr: the learning rate the user's schedule sets for this step, before the
            batch-size coupling (``None`` without an optimizer).
        lr_coupling: the factor the batch-size coupling multiplies the schedule by
            (1.0 at the starting batch).
        measured: the window's norms were measured (``False``: the measuring cadence let it
            pass; its units, the counters and the schedule still count it).
        lr_conversions: doublings made so far in place of a halving of the scheduled
            learning rate (the controller's ``convert_lr_decay`` mode; 0 otherwise).
        kappa: the controller's ``kappa`` in force at this step (its constant, or the value
            of a measured :class:`~cbs_tracker.policy.kappa.KappaSchedule`; ``None`` without
            a controller).
    """

    step: int
    tokens_seen: float
    unit: Unit
    global_batch: float
    micro_batch: float
    accumulation_steps: int
    dp_degree: int
    grad_sq_norm: float | None = None
    trace_cov: float | None = None
    noise_scale: float | None = None
    critical_batch: float | None = None
    lr: float | None = None
    step_grad_sq_norm: float | None = None
    step_trace_cov: float | None = None
    dropped: bool = False
    next_accumulation_steps: int | None = None
    noise_scale_low: float | None = None
    noise_scale_high: float | None = None
    scheduled_lr: float | None = None
    lr_coupling: float | None = None
    lr_conversions: int | None = None
    measured: bool = True
    kappa: float | None = None

    def __getattr__(self, name: str) -> object:
        # only for a field not yet filled: a record whose window's counts are still on their way to the
        # host (see PENDING_FIELDS) waits for them here, once
        pending = self.__dict__.get("_tokens")
        if pending is not None and name in PENDING_FIELDS:
            pending.resolve()
            return self.__dict__[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __getstate__(self) -> dict[str, object]:
        if "_tokens" in self.__dict__:  # a copy or a pickle holds the numbers, not the tracker
            self.__dict__["_tokens"].resolve()
        return self.__dict__

    @classmethod
    def _of(cls, **values: object) -> StepRecord:
        """The record of ``values``, every field given: what ``StepRecord(**values)`` builds, without the
        frozen dataclass's one ``object.__setattr__`` per field (the tracker builds one per step)."""
        record = object.__new__(cls)
        record.__dict__.update(values)
        return record

    @classmethod
    def _like(cls, record: StepRecord, changes: dict[str, object]) -> StepRecord:
        """``dataclasses.replace(record, **changes)`` in one dict (a window not measured builds one per step)."""
        new = object.__new__(cls)
        values = new.__dict__
        values.update(record.__dict__)
        values.update(changes)
        return new
