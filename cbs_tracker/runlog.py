"""Reading the tracker's TensorBoard logs back: its scalars per run and the run's batch changes.

Plain functions for scripts that analyse runs and for what replays a run
(:meth:`cbs_tracker.BatchSchedule.from_tensorboard`, ``cbs-tracker plot``). It imports
nothing of the tracker's, so both the rules and the command line can depend on it; the
tags and what counts as a change are in ``docs/design.md`` (Logging).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["BatchChange", "RunScalars", "change_indices", "find_batch_changes", "read_cbs_scalars", "run_unit"]

_PREFIXES = ("cbs/", "cbs_tokens/", "cbs_samples/")
_UNITS = ("tokens", "samples")

# tag -> (steps int64, values float64), steps sorted and unique
RunScalars = dict[str, tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class BatchChange:
    """One change of the batch in a run.

    Attributes:
        step: first optimizer step (logged) with the new batch.
        seen: units seen when the new batch started: ``{unit}_seen`` of the
            previous logged step, i.e. the x-position of the line in the plot.
        old_microbatches: ``accumulation_steps * dp_degree`` before the change.
        new_microbatches: ``accumulation_steps * dp_degree`` from ``step`` on.
    """

    step: int
    seen: float
    old_microbatches: int
    new_microbatches: int

    @property
    def factor(self) -> float:
        """``new_microbatches / old_microbatches`` (2.0 for a doubling)."""
        return self.new_microbatches / self.old_microbatches


def _is_event_file(name: str) -> bool:
    # TensorBoard's own test (io_wrapper.IsSummaryEventsFile).
    return "tfevents" in name


def read_cbs_scalars(logdir: str | os.PathLike[str]) -> dict[str, RunScalars]:
    """Read every ``cbs/`` (and ``cbs_tokens/``, ``cbs_samples/``) scalar under ``logdir``.

    Each folder under ``logdir`` (``logdir`` included) that holds event files
    is a run, named by its path relative to ``logdir`` (``"."`` for ``logdir``
    itself); several event files in one folder (a resumed run) are read in
    file-name order, i.e. in the order they were written, and where a step
    appears twice the value written last wins. Runs without any ``cbs`` tag
    are left out.

    Args:
        logdir: a folder of TensorBoard logs, or one event file.

    Returns:
        ``{run: {tag: (steps, values)}}`` with ``steps`` an int64 array sorted
        ascending and unique, ``values`` a float64 array (float32 precision, as
        stored by TensorBoard).

    Raises:
        FileNotFoundError: ``logdir`` does not exist.
        ValueError: no event file under ``logdir``, or none with a ``cbs/`` tag.
        ImportError: TensorBoard is not installed.
    """
    try:
        from tensorboard.backend.event_processing import event_accumulator
    except ImportError as err:
        raise ImportError(
            "reading TensorBoard logs needs TensorBoard: pip install cbs-tracker[plot]"
        ) from err

    root = Path(logdir)
    if not root.exists():
        raise FileNotFoundError(f"LOGDIR {os.fspath(logdir)!r} does not exist")
    sources: list[tuple[str, Path]] = []
    if root.is_file():
        sources.append((root.name, root))
    else:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            if any(_is_event_file(f) for f in filenames):
                sources.append((Path(dirpath).relative_to(root).as_posix(), Path(dirpath)))
    if not sources:
        raise ValueError(
            f"no TensorBoard event files (*tfevents*) under LOGDIR {os.fspath(logdir)!r}"
        )

    runs: dict[str, RunScalars] = {}
    for name, path in sources:
        acc = event_accumulator.EventAccumulator(
            str(path), size_guidance={event_accumulator.SCALARS: 0}
        )
        acc.Reload()
        run: RunScalars = {}
        for tag in acc.Tags()["scalars"]:
            if not tag.startswith(_PREFIXES):
                continue
            by_step: dict[int, float] = {}
            for event in acc.Scalars(tag):
                by_step[int(event.step)] = float(event.value)
            steps = np.array(sorted(by_step), dtype=np.int64)
            values = np.array([by_step[s] for s in steps.tolist()], dtype=np.float64)
            run[tag] = (steps, values)
        if any(tag.startswith("cbs/") for tag in run):
            runs[name] = run
    if not runs:
        raise ValueError(
            f"no cbs/ scalar tags in the event files under LOGDIR {os.fspath(logdir)!r} "
            f"({len(sources)} run folder(s) read); write them with "
            "cbs_tracker.TensorBoardLogger or cbs_tracker.CBSCallback"
        )
    return runs


def run_unit(run: RunScalars) -> str:
    """The run's unit, from which units-seen tag it has: ``"tokens"`` or ``"samples"``.

    Raises:
        ValueError: the run has neither ``cbs/tokens_seen`` nor ``cbs/samples_seen``, or both.
    """
    found = [u for u in _UNITS if f"cbs/{u}_seen" in run]
    if len(found) != 1:
        raise ValueError(
            f"a run needs exactly one of cbs/tokens_seen, cbs/samples_seen; found {found}"
        )
    return found[0]


def as_map(run: RunScalars, tag: str) -> dict[int, float]:
    """``{step: value}`` of one tag."""
    steps, values = run[tag]
    return dict(zip(steps.tolist(), values.tolist(), strict=True))


def against_seen(run: RunScalars, tag: str, seen: dict[int, float]) -> tuple[np.ndarray, np.ndarray]:
    """``(seen, values)`` of ``tag``, joined with the units-seen tag on the optimizer step."""
    if tag not in run:
        return np.zeros(0), np.zeros(0)
    steps, values = run[tag]
    keep = [i for i, s in enumerate(steps.tolist()) if s in seen]
    x = np.array([seen[int(steps[i])] for i in keep], dtype=np.float64)
    return x, values[keep]


def change_indices(levels: Sequence[int]) -> list[int]:
    """Indices where a sequence of batch levels changes to a value that lasts.

    ``i`` is a change when ``levels[i]`` differs from the current level and
    ``levels[i + 1] == levels[i]``; a single differing entry (the short last
    window of an epoch, with fewer microbatches) changes nothing, and neither
    does a differing last entry.

    Args:
        levels: microbatches per optimizer step (``accumulation_steps * dp_degree``),
            one per logged step in step order.

    Returns:
        The indices of the first step at each new level.
    """
    out: list[int] = []
    if not levels:
        return out
    current = levels[0]
    for i in range(1, len(levels) - 1):
        if levels[i] != current and levels[i + 1] == levels[i]:
            out.append(i)
            current = levels[i]
    return out


def find_batch_changes(run: RunScalars) -> list[BatchChange]:
    """Where a run's batch changed (doublings, and halvings when shrinking is on).

    The batch level of a step is ``cbs/accumulation_steps * cbs/dp_degree``
    (the global batch in tokens varies a little from step to step with
    unpadded data, so it is not used). See ``change_indices`` for which
    changes count.

    Args:
        run: one run of ``read_cbs_scalars``.

    Returns:
        One ``BatchChange`` per change, in step order; empty when the run has no
        ``cbs/accumulation_steps`` tag.

    Raises:
        ValueError: the run has no units-seen tag (see ``run_unit``).
    """
    unit = run_unit(run)
    if "cbs/accumulation_steps" not in run:
        return []
    seen = as_map(run, f"cbs/{unit}_seen")
    accum = as_map(run, "cbs/accumulation_steps")
    dp = as_map(run, "cbs/dp_degree") if "cbs/dp_degree" in run else {}
    steps = [s for s in sorted(accum) if s in seen]
    levels = [int(round(accum[s] * dp.get(s, 1.0))) for s in steps]
    changes: list[BatchChange] = []
    # The old level is the one the last change set, not levels[i - 1]: that may
    # be a short window just before the change.
    old = levels[0] if levels else 0
    for i in change_indices(levels):
        changes.append(
            BatchChange(step=steps[i], seen=seen[steps[i - 1]], old_microbatches=old,
                        new_microbatches=levels[i])
        )
        old = levels[i]
    return changes
