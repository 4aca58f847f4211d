"""TensorBoard logging of the tracker's per-step report: ``TensorBoardLogger``.

``TensorBoardLogger(log_dir).log(record)`` writes one ``StepRecord`` per optimizer
step: the ``cbs/`` tags against the optimizer step and the schedule tags again
under ``cbs_{unit}/`` against the units seen. The tag names live in
:mod:`cbs_tracker.core.tags` (re-exported here); ``docs/design.md`` (Logging)
has the tag table and explains the two x-axes.
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
    """Writes each ``StepRecord`` to TensorBoard event files (tags and x-axes: ``docs/design.md``, Logging).

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

    def _open(self) -> Any:
        """The event writer (opened on first use), or ``None`` on a rank that does not write."""
        if not self._should_write():
            return None
        if self._writer is None:
            self._writer = self._writer_cls(log_dir=self.log_dir, flush_secs=self.flush_secs)
        return self._writer

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
        writer = self._open()
        if writer is None:
            return
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, global_step=record.step)
        for tag, value in schedule.items():
            writer.add_scalar(tag, value, global_step=x_seen)

    def log_calibration(self, point: Any) -> None:
        """Write a branched calibration's ``cbs_calibration/`` scalars at x = its units seen.

        Raises:
            RuntimeError: the logger is closed.
        """
        if self._closed:
            raise RuntimeError("TensorBoardLogger.log_calibration() called after close()")
        from cbs_tracker.calibrate import calibration_scalars

        scalars = calibration_scalars(point)
        writer = self._open()
        if writer is None:
            return
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, global_step=int(round(point.tokens)))

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
