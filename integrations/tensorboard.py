"""TensorBoard logging of the tracker's per-step report, without Lightning.

One ``StepRecord`` per optimizer step becomes a fixed set of scalars. The tag
names are built here only: ``record_scalars`` and ``schedule_scalars`` are pure
functions that the Lightning callback reuses, so both adapters write identical
tags, and ``cbs-tracker plot`` reads them back.

``{unit}`` below is the record's unit, ``tokens`` or ``samples``: every size
carries its unit in its name (``cbs/global_batch_tokens``,
``cbs/samples_seen``, ``cbs_samples/noise_scale`` ...). A value that is
``None`` in the record (not measured yet, no controller) is not written at all,
so a tag's first point is its first measurement.

X-axes. TensorBoard's x-axis ("step") is an integer per point, so the record is
written twice:

* under ``cbs/``, every tag, against the **optimizer step**
  (``StepRecord.step``: 1 after the first optimizer step, the same number as
  Lightning's ``trainer.global_step`` after that step);
* under ``cbs_{unit}/``, the schedule tags again, against the **units seen**
  (``round(StepRecord.tokens_seen)``, units consumed by all DP ranks up to and
  including this step). In TensorBoard's UI the ``cbs_tokens/`` charts show the
  batch schedule and the noise scale against tokens.

Values are stored as float32 (TensorBoard's ``simple_value``): ``cbs/{unit}_seen``
is exact up to 2**24 = 16,777,216 units and has a relative error below 6e-8
beyond; the integer step of the ``cbs_{unit}/`` tags is exact (int64). TensorBoard's
UI down-samples long scalar series (``--samples_per_plugin scalars=N`` shows all);
``cbs-tracker plot`` reads every point.

Tags (``TAGS`` holds the same table; a test keeps the two identical):

| tag | record field | meaning |
|---|---|---|
| `cbs/noise_scale` | `noise_scale` | B_simple = tr(Sigma) / abs(G)^2, smoothed, in {unit} |
| `cbs/noise_scale_low` | `noise_scale_low` | lower end of the 90% confidence interval of cbs/noise_scale |
| `cbs/noise_scale_high` | `noise_scale_high` | upper end of the 90% confidence interval of cbs/noise_scale |
| `cbs/critical_batch` | `critical_batch` | controller target kappa * B_simple, clipped, in {unit} |
| `cbs/grad_sq_norm` | `grad_sq_norm` | smoothed estimate of abs(G)^2 |
| `cbs/trace_cov` | `trace_cov` | smoothed estimate of tr(Sigma) (per-example covariance trace) |
| `cbs/step_grad_sq_norm` | `step_grad_sq_norm` | this step's own unbiased abs(G)^2 estimate (noisy, may be < 0) |
| `cbs/step_trace_cov` | `step_trace_cov` | this step's own unbiased tr(Sigma) estimate (noisy, may be < 0) |
| `cbs/global_batch_{unit}` | `global_batch` | {unit} in this optimizer step, all DP ranks and microbatches |
| `cbs/micro_batch_{unit}` | `micro_batch` | mean {unit} of one microbatch on one rank |
| `cbs/accumulation_steps` | `accumulation_steps` | microbatches per rank in this step's window |
| `cbs/dp_degree` | `dp_degree` | data-parallel ranks (ranks that see different data) |
| `cbs/{unit}_seen` | `tokens_seen` | {unit} consumed by all DP ranks, this step included |
| `cbs/lr` | `lr` | learning rate of the first param group after this step |
| `cbs/scheduled_lr` | `scheduled_lr` | learning rate the schedule sets, before the batch-size coupling |
| `cbs/lr_coupling` | `lr_coupling` | factor the batch-size coupling multiplies the schedule by |
| `cbs/lr_conversions` | `lr_conversions` | doublings made in place of a halving of the scheduled LR |
| `cbs/dropped` | `dropped` | 1 if the step's gradients were not finite (not measured), else 0 |
| `cbs_{unit}/noise_scale` | `noise_scale` | as cbs/noise_scale, x = {unit} seen |
| `cbs_{unit}/critical_batch` | `critical_batch` | as cbs/critical_batch, x = {unit} seen |
| `cbs_{unit}/global_batch_{unit}` | `global_batch` | as cbs/global_batch_{unit}, x = {unit} seen |
| `cbs_{unit}/accumulation_steps` | `accumulation_steps` | as cbs/accumulation_steps, x = {unit} seen |

With Lightning, write ``record_scalars(r)`` at ``step=r.step`` and
``schedule_scalars(r)`` at ``step=schedule_step(r)``. Loggers that require
monotonically increasing steps across calls (Weights & Biases) must not get the
second call: ``cbs/{unit}_seen`` is there to pick as their x-axis instead.
"""

from __future__ import annotations

import math
import os
from types import TracebackType
from typing import Any

from cbs_tracker.core import distributed as cbs_dist
from cbs_tracker.core.record import StepRecord
from cbs_tracker.core.tags import (  # noqa: F401  (re-exported: the logger writes these)
    TAGS,
    TagSpec,
    record_scalars,
    schedule_scalars,
    schedule_step,
    seen_tag,
)

__all__ = [
    "TAGS",
    "TagSpec",
    "TensorBoardLogger",
    "record_scalars",
    "schedule_scalars",
    "schedule_step",
    "seen_tag",
]


class TensorBoardLogger:
    """Writes each ``StepRecord`` to TensorBoard event files (tags and x-axes: see the module docstring).

    A small wrapper around ``torch.utils.tensorboard.SummaryWriter``. The
    writer (and ``log_dir``) is created on the first ``log`` call of the rank
    that writes; with ``rank_zero_only=True`` and ``torch.distributed``
    initialised, other ranks write nothing and create no files. Every rank may
    call ``log`` with the same record; the records are identical on all ranks.

    Example::

        with TensorBoardLogger("runs/exp1") as tb:
            for ...:
                record = tracker.step(...)
                tb.log(record)

    Args:
        log_dir: directory of the event files (a run in TensorBoard).
        flush_secs: seconds between flushes of pending events to disk.
        rank_zero_only: write only on global rank 0 when ``torch.distributed``
            is initialised; ``False`` writes on every rank (give each rank its own
            ``log_dir`` then).

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: ``flush_secs`` is not a positive finite number.
        ImportError: TensorBoard is not installed.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        *,
        flush_secs: float = 120.0,
        rank_zero_only: bool = True,
    ) -> None:
        if not isinstance(log_dir, (str, os.PathLike)):
            raise TypeError(
                f"TensorBoardLogger(log_dir={log_dir!r}): expected a str or os.PathLike, "
                f"got {type(log_dir).__name__}"
            )
        if isinstance(flush_secs, bool) or not isinstance(flush_secs, (int, float)):
            raise TypeError(
                f"TensorBoardLogger(flush_secs={flush_secs!r}): expected a number of seconds, "
                f"got {type(flush_secs).__name__}"
            )
        if not math.isfinite(flush_secs) or flush_secs <= 0:
            raise ValueError(
                f"TensorBoardLogger(flush_secs={flush_secs!r}): expected a finite number of seconds > 0"
            )
        if not isinstance(rank_zero_only, bool):
            raise TypeError(
                f"TensorBoardLogger(rank_zero_only={rank_zero_only!r}): expected True or False, "
                f"got {type(rank_zero_only).__name__}"
            )
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError(
                "cbs_tracker.TensorBoardLogger needs TensorBoard: "
                "pip install cbs-tracker[tensorboard]"
            ) from err
        self._writer_cls = SummaryWriter
        self.log_dir = os.fspath(log_dir)
        self.flush_secs = float(flush_secs)
        self.rank_zero_only = rank_zero_only
        self._writer: Any = None
        self._closed = False

    def _should_write(self) -> bool:
        return not self.rank_zero_only or cbs_dist.global_rank() == 0

    def log(self, record: StepRecord) -> None:
        """Write one step: ``record_scalars`` at ``record.step`` and ``schedule_scalars`` at ``schedule_step``.

        Raises:
            TypeError: ``record`` is not a ``StepRecord``.
            ValueError: ``record.unit`` or ``record.tokens_seen`` is invalid.
            RuntimeError: the logger is closed.
        """
        if self._closed:
            raise RuntimeError("TensorBoardLogger.log() called after close()")
        # Validate on every rank, so a bad record fails the same way everywhere.
        scalars = record_scalars(record)
        schedule = schedule_scalars(record)
        x_seen = schedule_step(record)
        if not self._should_write():
            return
        if self._writer is None:
            self._writer = self._writer_cls(log_dir=self.log_dir, flush_secs=self.flush_secs)
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, global_step=record.step)
        for tag, value in schedule.items():
            self._writer.add_scalar(tag, value, global_step=x_seen)

    def flush(self) -> None:
        """Write pending events to disk now."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file; further ``log`` calls raise. Closing twice is allowed."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._closed = True

    def __enter__(self) -> TensorBoardLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
