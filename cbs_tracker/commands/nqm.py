"""``cbs-tracker nqm``: batch schedules compared at equal budget on the noisy quadratic model.

``cbs-tracker nqm [--budget 3e6] [--json] [-o nqm.png] [--no-extra]`` prints one line
per schedule (final expected loss, ratio to the best constant batch and to the
optimum, optimizer steps); ``--json`` adds one JSON object keyed by schedule as the
last line; ``-o`` draws loss and batch against tokens. Rows come from
:func:`cbs_tracker.theory.nqm.compare_schedules` plus the registered rows
(``cbs_tracker.theory.nqm_online``) unless ``--no-extra``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from cbs_tracker.theory.nqm import (
    DEFAULT_B_MAX,
    DEFAULT_B_MIN,
    DEFAULT_BUDGET,
    Comparison,
    ExactNQM,
    compare_schedules,
)
from cbs_tracker.theory.schedule import power_law_schedule


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cbs-tracker nqm",
        description="Compare batch schedules at equal budget on the exact noisy quadratic model.",
    )
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET, help="samples to spend (default 3e6)")
    parser.add_argument("--b-min", type=float, default=DEFAULT_B_MIN, help="smallest batch (default 8)")
    parser.add_argument("--b-max", type=float, default=DEFAULT_B_MAX, help="largest batch (default 8192)")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON object (last line)")
    parser.add_argument("-o", "--output", type=Path, default=None, help="write the figure to this PNG")
    parser.add_argument("--no-extra", action="store_true", help="only the built-in rows (skip registered ones)")
    return parser


def format_table(comp: Comparison) -> str:
    """The comparison as aligned text lines."""
    e = comp.exponents
    width = max(14, *(len(r.name) for r in comp.rows))
    lines = [
        f"NQM, budget D={comp.budget:.4g} samples, B in [{comp.b_min:g}, {comp.b_max:g}]; "
        f"measured s={e.s:.3f} (T in {e.s_window[0]:g}..{e.s_window[1]:g}), "
        f"beta={e.beta:.3f} (lags {e.beta_window[0]:g}..{e.beta_window[1]:g}), "
        f"1-1/beta={1 - 1 / e.beta:.3f}",
        f"{'schedule':<{width}} {'final loss':>11} {'x lower':>8} {'vs opt':>7} {'steps':>8}  description",
    ]
    for r in comp.rows:
        lines.append(
            f"{r.name:<{width}} {r.final_loss:>11.6f} {comp.ratio_vs_constant(r.name):>7.2f}x "
            f"{comp.ratio_vs_optimal(r.name):>7.3f} {r.steps:>8d}  {r.label}"
        )
    lines.append("x lower = L(best constant) / L(row); vs opt = L(row) / L(optimal)")
    return "\n".join(lines)


def _decimate(x: np.ndarray, y: np.ndarray, points: int = 4000) -> tuple[np.ndarray, np.ndarray]:
    if x.size <= points:
        return x, y
    idx = np.unique(np.concatenate([np.linspace(0, x.size - 1, points).astype(int), np.geomspace(1, x.size, points).astype(int) - 1]))
    return x[idx], y[idx]


def plot_comparison(comp: Comparison, model: ExactNQM, path: Path) -> None:
    """Three panels: loss vs tokens (log-log, linear) and batch vs tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    colors = {"constant": "tab:blue", "two_stage": "tab:green", "doubling": "tab:orange", "optimal": "tab:red"}
    spare = iter(["tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray"] * 4)
    for r in comp.rows:
        if r.name not in colors:
            colors[r.name] = next(spare)
    const_batch = float(comp.row("constant").batches[0])
    floor = model.noise_floor(const_batch)
    for r in comp.rows:
        traj = model.trajectory(r.batches)
        color = colors[r.name]
        label = f"{r.name}: {r.label} ({comp.ratio_vs_constant(r.name):.1f}x)"
        width = 2.2 if r.name == "optimal" else 1.4
        axes[0].loglog(traj.tokens[1:], traj.loss[1:], color=color, lw=width, label=label)
        axes[1].plot(traj.tokens, traj.loss, color=color, lw=width, label=label)
        starts = np.concatenate([[0.0], np.cumsum(r.batches)[:-1]])
        x, y = _decimate(starts, r.batches)
        axes[2].step(x, y, where="post", color=color, lw=width, label=r.name)
    for ax in axes[:2]:
        ax.axhline(floor, color="gray", ls=":", lw=1, label=f"noise floor of B={const_batch:.0f}")
        ax.set_xlabel("samples (tokens)")
        ax.set_ylabel("expected loss")
    axes[1].set_yscale("log")
    axes[1].set_title("linear token axis")
    axes[0].set_title(f"NQM, D={comp.budget:.3g}, constant lr")
    axes[0].legend(fontsize=7)
    opt = comp.row("optimal")
    analytic = power_law_schedule(comp.budget, comp.b_min, comp.b_max, comp.exponents.beta, steps=opt.steps).batches()
    starts = np.concatenate([[0.0], np.cumsum(analytic)[:-1]])
    x, y = _decimate(starts, analytic)
    axes[2].plot(x, y, "k--", lw=1, label=f"clip(c (T-t+1)^(1/(2 beta)-1)), beta={comp.exponents.beta:.2f}")
    axes[2].set_yscale("log", base=2)
    axes[2].set_xlabel("samples (tokens)")
    axes[2].set_ylabel("batch")
    axes[2].set_title("batch schedules")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model = ExactNQM()
    try:
        comp = compare_schedules(args.budget, args.b_min, args.b_max, model=model, extra_rows=not args.no_extra)
    except (ValueError, TypeError) as exc:
        print(f"cbs-tracker nqm: {exc}", file=sys.stderr)
        return 2
    print(format_table(comp))
    if args.output is not None:
        plot_comparison(comp, model, args.output)
        print(f"wrote {args.output}")
    if args.json:
        print(json.dumps(comp.to_dict()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
