"""``cbs-tracker plot LOGDIR -o schedule.png``: the batch schedule against tokens, from TensorBoard logs.

Reads the ``cbs/`` tags of every run under ``LOGDIR`` (each folder holding event
files is a run) and draws, against the units seen, the noise scale with its 90%
interval as a band, the critical batch, the global batch and a line at each change of the batch. The
log reading (``read_cbs_scalars``, ``find_batch_changes``) lives in :mod:`cbs_tracker.runlog`
and is re-exported here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cbs_tracker.runlog import (  # re-exported: scripts import them from here
    BatchChange,
    RunScalars,
    against_seen,
    as_map,
    change_indices,
    find_batch_changes,
    read_cbs_scalars,
    run_unit,
)

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
    low_map = as_map(run, "cbs/noise_scale_low")
    high_map = as_map(run, "cbs/noise_scale_high")
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
    runs: dict[str, RunScalars], *, title: str | None = None, log_x: bool = False, ax=None
) -> Figure:
    """Draw noise scale, critical batch and global batch against units seen, one colour per run.

    Uses matplotlib's object-oriented API with the Agg canvas, so it neither
    needs a display nor changes the caller's pyplot backend. Each batch change
    is an ``axvline`` with ``gid="batch-change"``.

    Args:
        runs: the output of ``read_cbs_scalars`` (or a subset of it).
        title: figure title.
        log_x: log-scale x-axis as well.
        ax: a matplotlib axis to draw on (its figure is returned); ``None``: a new figure.

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

    if ax is None:
        fig = Figure(figsize=(9.0, 5.5), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
    else:
        fig = ax.figure
    colors = [f"C{i % 10}" for i in range(len(runs))]
    several = len(runs) > 1
    for color, (name, run) in zip(colors, runs.items(), strict=True):
        prefix = f"{name}: " if several else ""
        seen = as_map(run, f"cbs/{unit}_seen")
        x, y = _positive(*against_seen(run, f"cbs/global_batch_{unit}", seen))
        if x.size:
            # Step i consumed the units (seen[i] - batch[i], seen[i]]: draw each
            # batch from where its step started, up to the last point.
            ax.plot(np.append(x - y, x[-1]), np.append(y, y[-1]), drawstyle="steps-post",
                    color=color, lw=3, alpha=0.35, label=f"{prefix}global batch")
        x, y = _positive(*against_seen(run, "cbs/noise_scale", seen))
        if x.size:
            ax.plot(x, y, color=color, lw=1.5, label=f"{prefix}noise scale B_simple")
        band = noise_scale_band(run, seen)
        if band is not None:
            ax.fill_between(*band, color=color, alpha=0.18, lw=0, gid="noise-scale-band",
                            label=f"{prefix}90% interval of B_simple")
        x, y = _positive(*against_seen(run, "cbs/critical_batch", seen))
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
