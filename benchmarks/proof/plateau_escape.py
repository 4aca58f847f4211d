"""Where growth loses the loss on the GPTs whose loss sits on a plateau, read off the frontier's runs.

Three tables, from ``docs/frontier.json`` (and, for the third, run records with their traces):

- **the gap**: a rule's validation loss minus the constant batch's of the same seed, the mean over the seeds, at
  fractions of the run (``--rule``, default the library's default);
- **the escape**: where each run's validation loss first falls ``drop`` nats below the constant run's loss at a
  fifth of the run (on the plateau GPTs, the loss on its plateau), in tokens and in optimizer steps, the median
  over the seeds, for the constant batch and the rule: a loss that leaves its plateau after a number of steps
  leaves it later in tokens at a larger batch, one that leaves it after a number of tokens does not;
- **the noise scale around the escape** (``--traces``, run records such as ``runs/frontier/wide/runs/*.json``
  of runs that stayed at their starting batch): the median ``B_simple`` and ``|G|^2`` of the trace over the
  tokens before the escape (from half its tokens) and after it (to 1.5 times).

    python benchmarks/proof/plateau_escape.py --settings wide,wide_lr3,long,narrow,prose
    python benchmarks/proof/plateau_escape.py --settings wide --traces runs/frontier/wide/runs/tracker_library_plateau15_*
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import frontier  # noqa: E402

#: the fractions of the run the gap is read at
GAP_MARKS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 0.85, 0.995)
#: the constant run's loss at this fraction of the run is the plateau's
PLATEAU_MARK = 0.2


def steps_at(batch_changes: list[list[float]], tokens: float) -> float:
    """Optimizer steps taken by ``tokens``, from a run's ``batch_changes`` (``[tokens, batch]`` from each change
    on, the first at the start)."""
    steps = 0.0
    for (t0, batch), nxt in zip(batch_changes, [*batch_changes[1:], [float("inf"), 0.0]]):
        if tokens <= t0:
            break
        steps += (min(tokens, nxt[0]) - t0) / batch
    return steps


def escape_tokens(curve: list[list[float]], below: float) -> float | None:
    """The first evaluation's tokens where the validation loss is below ``below`` (``None``: never)."""
    return next((t for t, loss in curve if loss < below), None)


def _pairs(runs: list[dict[str, Any]], setting: str, schedule: str, rule: str) -> list[tuple[dict, dict]]:
    mine = {(r["rule"], r["seed"]): r for r in runs if r["setting"] == setting and r["lr_schedule"] == schedule}
    return [(mine[("constant", s)], mine[(rule, s)]) for (name, s) in sorted(mine)
            if name == rule and ("constant", s) in mine]


def gap_row(pairs: list[tuple[dict, dict]], marks: tuple[float, ...] = GAP_MARKS) -> list[float]:
    """The rule's validation loss minus the constant's, the mean over the pairs, at each fraction of the run."""
    total = pairs[0][0]["tokens"]
    return [statistics.mean(frontier.loss_at(g["val_curve"], m * total) - frontier.loss_at(c["val_curve"], m * total)
                            for c, g in pairs) for m in marks]


def escape_row(pairs: list[tuple[dict, dict]], drop: float) -> dict[str, list[float] | None]:
    """Per rule (``constant``, the rule), the median over the seeds of the tokens and of the optimizer steps where
    the loss first falls ``drop`` below the constant run's loss at :data:`PLATEAU_MARK` (``None``: some seed never
    did)."""
    found: dict[str, list[tuple[float, float]]] = {"constant": [], "rule": []}
    for c, g in pairs:
        below = frontier.loss_at(c["val_curve"], PLATEAU_MARK * c["tokens"]) - drop
        for key, r in (("constant", c), ("rule", g)):
            t = escape_tokens(r["val_curve"], below)
            found[key].append((t, steps_at(r["batch_changes"], t)) if t is not None else None)
    return {key: None if None in v else [statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)]
            for key, v in found.items()}


def around_escape(record: dict[str, Any], drop: float) -> dict[str, float] | None:
    """A run record's escape (its own validation loss ``drop`` below its loss at :data:`PLATEAU_MARK`) and the
    medians of its trace's noise scale and ``|G|^2`` over ``[T/2, T)`` and ``[T, 1.5 T)``. Only for a run whose
    batch never changed: the noise scale of the constant batch, which growth would have read."""
    if len(set(record["trace"]["global_batch"])) > 1:
        raise ValueError(f"{record.get('name', 'run')}: its batch changed ({sorted(set(record['trace']['global_batch']))}); "
                         "give runs that stayed at their starting batch")
    curve = [list(p) for p in zip(record["evals"]["tokens"], record["evals"]["val_loss"])]
    t = escape_tokens(curve, frontier.loss_at(curve, PLATEAU_MARK * record["tokens"]) - drop)
    if t is None:
        return None
    tr = record["trace"]
    out: dict[str, float] = {"tokens": t}
    for name, lo, hi in (("before", t / 2, t), ("after", t, 1.5 * t)):
        idx = [i for i, x in enumerate(tr["tokens"]) if lo <= x < hi and tr["noise_scale"][i] is not None]
        out[f"noise_{name}"] = statistics.median(tr["noise_scale"][i] for i in idx)
        out[f"grad_{name}"] = statistics.median(tr["grad_sq_norm"][i] for i in idx)
    return out


def escape_table(runs: list[dict[str, Any]], settings: list[str], rule: str, drop: float) -> str:
    """:func:`gap_row` and :func:`escape_row` of each setting and LR schedule as a markdown table."""
    lines = ["| setting | LR schedule | seeds | " + " | ".join(f"{m:.0%}" for m in GAP_MARKS)
             + " | escape, constant: tokens, steps | escape, rule: tokens, steps |",
             "|---|---|---|" + "---|" * (len(GAP_MARKS) + 2)]
    for setting in settings:
        for schedule in ("cosine", "wsd"):
            pairs = _pairs(runs, setting, schedule, rule)
            if not pairs:
                continue
            cells = [("never" if v is None else f"{v[0] / 1e3:.0f}k, {v[1]:,.0f}")
                     for v in escape_row(pairs, drop).values()]
            lines.append(f"| {setting} | {schedule} | {len(pairs)} | "
                         + " | ".join(f"{x:+.3f}" for x in gap_row(pairs)) + " | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", default="wide,wide_lr3,long,narrow,prose")
    p.add_argument("--rule", default=frontier.DEFAULT_RULE)
    p.add_argument("--drop", type=float, default=0.1, help="nats below the plateau that count as its escape")
    p.add_argument("--doc", default=str(frontier.DOC))
    p.add_argument("--traces", nargs="*", default=[], help="run records (with traces) to read around the escape")
    args = p.parse_args(argv)
    if not args.drop > 0:
        p.error(f"--drop={args.drop}: must be > 0 (nats below the plateau's loss)")
    runs = frontier.load(Path(args.doc))["runs"]
    print(escape_table(runs, [s.strip() for s in args.settings.split(",") if s.strip()], args.rule, args.drop), end="")
    for path in args.traces:
        record = json.loads(Path(path).read_text())
        try:
            a = around_escape(record, args.drop)
        except ValueError as e:
            print(f"{path}: skipped, {e}")
            continue
        print(f"{path}: " + ("no escape" if a is None else
              f"escape at {a['tokens'] / 1e3:.0f}k tokens; B_simple {a['noise_before']:.0f} -> {a['noise_after']:.0f}, "
              f"|G|^2 {a['grad_before']:.3f} -> {a['grad_after']:.3f}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
