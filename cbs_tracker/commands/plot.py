"""``cbs-tracker plot LOGDIR -o schedule.png``: the batch schedule against tokens, from TensorBoard logs.

Reads the ``cbs/`` tags of every run under ``LOGDIR`` (each folder holding event
files is a run) and draws, against the units seen, the noise scale with its 90%
interval as a band, the critical batch, the global batch and a line at each change of the batch. ``read_cbs_scalars``
and ``find_batch_changes`` are plain functions for scripts that analyse runs; the
tags and what counts as a change are in ``docs/design.md`` (Logging).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "BatchChange",
    "RunScalars",
    "change_indices",
    "draw_schedule",
    "find_batch_changes",
    "main",
    "noise_scale_band",
    "read_cbs_scalars",
    "run_unit",
]

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


def _as_map(run: RunScalars, tag: str) -> dict[int, float]:
    """``{step: value}`` of one tag."""
    steps, values = run[tag]
    return dict(zip(steps.tolist(), values.tolist(), strict=True))


def _against_seen(run: RunScalars, tag: str, seen: dict[int, float]) -> tuple[np.ndarray, np.ndarray]:
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
    seen = _as_map(run, f"cbs/{unit}_seen")
    accum = _as_map(run, "cbs/accumulation_steps")
    dp = _as_map(run, "cbs/dp_degree") if "cbs/dp_degree" in run else {}
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


def noise_scale_band(
    run: RunScalars, seen: dict[int, float]
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``(x, low, high)`` of the noise scale's 90% interval, or ``None`` when not logged.

    Steps where the upper end is infinite (``|G|^2`` not distinguishable from 0)
    or the lower end is not positive are NaN, so the band shows a gap there on
    the log axis rather than a made-up bound.

    Args:
        run: one run of ``read_cbs_scalars``.
        seen: ``{step: units seen}`` of the run.
    """
    if "cbs/noise_scale_low" not in run or "cbs/noise_scale_high" not in run:
        return None
    low_map = _as_map(run, "cbs/noise_scale_low")
    high_map = _as_map(run, "cbs/noise_scale_high")
    steps = [s for s in sorted(low_map) if s in high_map and s in seen]
    if not steps:
        return None
    x = np.array([seen[s] for s in steps], dtype=np.float64)
    low = np.array([low_map[s] for s in steps], dtype=np.float64)
    high = np.array([high_map[s] for s in steps], dtype=np.float64)
    bad = ~(np.isfinite(low) & np.isfinite(high) & (low > 0))
    low[bad] = np.nan
    high[bad] = np.nan
    return x, low, high


def _positive(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    keep = np.isfinite(y) & (y > 0)
    return x[keep], y[keep]


def draw_schedule(
    runs: dict[str, RunScalars], *, title: str | None = None, log_x: bool = False
) -> Figure:
    """Draw noise scale, critical batch and global batch against units seen, one colour per run.

    Uses matplotlib's object-oriented API with the Agg canvas, so it neither
    needs a display nor changes the caller's pyplot backend. Each batch change
    is an ``axvline`` with ``gid="batch-change"``.

    Args:
        runs: the output of ``read_cbs_scalars`` (or a subset of it).
        title: figure title.
        log_x: log-scale x-axis as well.

    Returns:
        The figure (save it with ``fig.savefig(path)``).

    Raises:
        ValueError: no run, or runs in different units.
        ImportError: matplotlib is not installed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import EngFormatter
    except ImportError as err:
        raise ImportError("cbs-tracker plot needs matplotlib: pip install cbs-tracker[plot]") from err

    if not runs:
        raise ValueError("draw_schedule(runs={}): expected at least one run")
    units = {name: run_unit(run) for name, run in runs.items()}
    if len(set(units.values())) > 1:
        raise ValueError(f"runs in different units cannot share an axis: {units}")
    unit = next(iter(units.values()))

    fig = Figure(figsize=(9.0, 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colors = [f"C{i % 10}" for i in range(len(runs))]
    several = len(runs) > 1
    for color, (name, run) in zip(colors, runs.items(), strict=True):
        prefix = f"{name}: " if several else ""
        seen = _as_map(run, f"cbs/{unit}_seen")
        x, y = _positive(*_against_seen(run, f"cbs/global_batch_{unit}", seen))
        if x.size:
            # Step i consumed the units (seen[i] - batch[i], seen[i]]: draw each
            # batch from where its step started, up to the last point.
            ax.plot(np.append(x - y, x[-1]), np.append(y, y[-1]), drawstyle="steps-post",
                    color=color, lw=3, alpha=0.35, label=f"{prefix}global batch")
        x, y = _positive(*_against_seen(run, "cbs/noise_scale", seen))
        if x.size:
            ax.plot(x, y, color=color, lw=1.5, label=f"{prefix}noise scale B_simple")
        band = noise_scale_band(run, seen)
        if band is not None:
            ax.fill_between(*band, color=color, alpha=0.18, lw=0, gid="noise-scale-band",
                            label=f"{prefix}90% interval of B_simple")
        x, y = _positive(*_against_seen(run, "cbs/critical_batch", seen))
        if x.size:
            ax.plot(x, y, color=color, lw=1.2, ls="--", label=f"{prefix}critical batch (target)")
        for change in find_batch_changes(run):
            ax.axvline(change.seen, color=color, ls=":", lw=1.2, gid="batch-change")
            ax.text(change.seen, 1.0, f" ×{change.factor:g}", color=color, fontsize=8,
                    transform=ax.get_xaxis_transform(), va="top", ha="left")
    ax.set_yscale("log")
    if log_x:
        ax.set_xscale("log")
    else:
        ax.xaxis.set_major_formatter(EngFormatter())
    ax.set_xlabel(f"{unit} seen")
    ax.set_ylabel(f"batch size ({unit})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    ax.set_title(title if title is not None else "critical batch size tracking")
    return fig


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cbs-tracker plot",
        description="Draw noise scale, critical batch and global batch against tokens "
        "from the cbs/ tags of TensorBoard logs (one line set per run folder).",
    )
    p.add_argument("logdir", metavar="LOGDIR", help="folder of TensorBoard logs (searched recursively)")
    p.add_argument("-o", "--output", default="schedule.png", help="image to write (default: schedule.png)")
    p.add_argument("--title", default=None, help="figure title")
    p.add_argument("--log-x", action="store_true", help="log-scale x-axis as well")
    p.add_argument("--dpi", type=int, default=120, help="resolution of the image (default: 120)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``cbs-tracker plot``; returns 0 on success, 2 when LOGDIR holds nothing to draw."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        runs = read_cbs_scalars(args.logdir)
        fig = draw_schedule(runs, title=args.title, log_x=args.log_x)
    except (FileNotFoundError, ValueError) as err:
        print(f"cbs-tracker plot: error: {err}", file=sys.stderr)
        return 2
    out = Path(args.output)
    if out.parent != Path(""):
        out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=args.dpi)
    changes = sum(len(find_batch_changes(run)) for run in runs.values())
    print(f"wrote {out}: {len(runs)} run(s), {changes} batch change(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
