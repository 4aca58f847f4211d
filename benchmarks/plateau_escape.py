"""Where growth loses the loss on the GPTs whose loss sits on a plateau, read off the frontier's runs.

A table from ``docs/frontier.json``, and with ``--traces`` a line per run record:

- **the gap**: a rule's validation loss minus the constant batch's of the same seed, the mean over the seeds, at
  fractions of the run (``--rule``, default the library's default);
- **the escape**: where each run's validation loss first falls ``drop`` nats below the constant run's loss at a
  fifth of the run (on the plateau GPTs, the loss on its plateau): the median tokens over the seeds for the
  constant batch and the rule, how many of the rule's seeds got there later, at the same evaluation or earlier, and
  the share of the constant's optimizer steps the rule had saved by then. A loss that leaves its plateau after a
  number of steps leaves it later in tokens at a larger batch; one that leaves it after a number of tokens does not;
- **the noise scale around the escape** (``--traces``, run records such as ``runs/frontier/wide/runs/*.json``
  of runs that stayed at their starting batch): where the run's own loss falls ``drop`` below its loss at a fifth
  of the run, and the median ``B_simple`` and ``|G|^2`` of its trace over the tokens before (from half of them)
  and after it (to 1.5 times).

    python benchmarks/plateau_escape.py --settings wide,wide_lr3,long,narrow
    python benchmarks/plateau_escape.py --traces runs/frontier/wide/runs/tracker_library_plateau15_*
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import frontier  # this script's folder is on the path, as for frontier.py itself

#: the fractions of the run the gap is read at
GAP_MARKS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 0.85, 0.995)
#: the constant run's loss at this fraction of the run is the plateau's
PLATEAU_MARK = 0.2


def steps_at(batch_changes: list[list[float]], tokens: float) -> float:
    """Optimizer steps taken by ``tokens``, from a run's ``batch_changes``: ``[tokens, batch]`` of each change, the
    first the starting batch (counted from 0 tokens; the record dates it at its first step). The records date a
    change on their trace's grid (every 8,192 tokens), up to one interval late, so a grown run's steps come out high
    by up to ``8192 x (1 / B_before - 1 / B_after)`` a change (under 2% of the run's steps here)."""
    steps = 0.0
    starts = [0.0] + [t for t, _ in batch_changes[1:]]
    for t0, t1, (_, batch) in zip(starts, [*starts[1:], float("inf")], batch_changes):
        if tokens <= t0:
            break
        steps += (min(tokens, t1) - t0) / batch
    return steps


def escape_tokens(curve: list[list[float]], below: float) -> float | None:
    """The first evaluation's tokens where the validation loss is below ``below`` (``None``: never)."""
    return next((t for t, loss in curve if loss < below), None)


def gap_row(pairs: list[tuple[dict, dict]], marks: tuple[float, ...] = GAP_MARKS) -> list[float]:
    """The rule's validation loss minus the constant's, the mean over the pairs, at each fraction of the run."""
    total = pairs[0][0]["tokens"]
    return [statistics.mean(frontier.loss_at(g["val_curve"], m * total) - frontier.loss_at(c["val_curve"], m * total)
                            for c, g in pairs) for m in marks]


def escape_row(pairs: list[tuple[dict, dict]], drop: float) -> dict[str, Any]:
    """Where each run's loss first falls ``drop`` below the constant run's loss at :data:`PLATEAU_MARK`: the medians
    over the seeds of the constant's and the rule's tokens there (over the seeds that got there; ``escaped`` says how
    many did), how many of the rule's came evaluations later, at the same one (the nearest; the runs' grids differ by
    a step's tokens) and earlier than its constant's, and the
    median (and range) over the seeds of the share of the constant's steps the rule saved by then."""
    tokens: dict[str, list[float]] = {"constant": [], "rule": []}
    order, saved = [0, 0, 0], []
    for c, g in pairs:
        below = frontier.loss_at(c["val_curve"], PLATEAU_MARK * c["tokens"]) - drop
        tc, tg = escape_tokens(c["val_curve"], below), escape_tokens(g["val_curve"], below)
        for key, t in (("constant", tc), ("rule", tg)):
            if t is not None:
                tokens[key].append(t)
        if tc is not None and tg is not None:
            apart = round((tg - tc) / (c["val_curve"][1][0] - c["val_curve"][0][0]))  # evaluations (their grids differ)
            order[0 if apart > 0 else 1 if apart == 0 else 2] += 1
            saved.append(1 - steps_at(g["batch_changes"], tg) / steps_at(c["batch_changes"], tc))
    return {"escaped": {k: len(v) for k, v in tokens.items()}, "seeds": len(pairs),
            "tokens": {k: statistics.median(v) if v else None for k, v in tokens.items()},
            "later_same_earlier": order, "saved": (statistics.median(saved), min(saved), max(saved)) if saved else None}


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
        if not idx:
            raise ValueError(f"{record.get('name', 'run')}: no noise scale in its trace over [{lo:.0f}, {hi:.0f}) tokens")
        out[f"noise_{name}"] = statistics.median(tr["noise_scale"][i] for i in idx)
        out[f"grad_{name}"] = statistics.median(tr["grad_sq_norm"][i] for i in idx)
    return out


def _tokens_cell(row: dict[str, Any], key: str) -> str:
    t, n = row["tokens"][key], row["escaped"][key]
    if t is None:
        return "never"
    return f"{t / 1e3:.0f}k" + ("" if n == row["seeds"] else f" ({n} of {row['seeds']} seeds)")


def escape_table(runs: list[dict[str, Any]], settings: list[str], rule: str, drop: float) -> str:
    """:func:`gap_row` and :func:`escape_row` of each setting and LR schedule as a markdown table."""
    lines = ["| setting | LR schedule | seeds | " + " | ".join(f"{m:.0%}" for m in GAP_MARKS)
             + " | escape, constant | escape, rule | rule later / same / earlier | fewer steps by then |",
             "|---|---|---|" + "---|" * (len(GAP_MARKS) + 4)]
    for setting in settings:
        for schedule in ("cosine", "wsd"):
            pairs = frontier.paired_by_seed(runs, setting, schedule, rule)
            if not pairs:
                continue
            row = escape_row(pairs, drop)
            saved = "" if row["saved"] is None else "{:.0%} ({:.0%}–{:.0%})".format(*row["saved"])
            cells = [_tokens_cell(row, "constant"), _tokens_cell(row, "rule"),
                     " / ".join(map(str, row["later_same_earlier"])), saved]
            lines.append(f"| {setting} | {schedule} | {len(pairs)} | "
                         + " | ".join(f"{x:+.3f}" for x in gap_row(pairs)) + " | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", default=None,
                   help="comma-separated (default: the four plateau GPTs; none with --traces alone)")
    p.add_argument("--rule", default=frontier.KAPPA_RULE)
    p.add_argument("--drop", type=float, default=0.1, help="nats below the plateau that count as its escape")
    p.add_argument("--doc", default=str(frontier.DOC))
    p.add_argument("--traces", nargs="*", default=[], help="run records (with traces) to read around the escape")
    args = p.parse_args(argv)
    if not args.drop > 0:
        p.error(f"--drop={args.drop}: must be > 0 (nats below the plateau's loss)")
    runs = frontier.load(Path(args.doc))["runs"]
    settings = args.settings if args.settings is not None else "" if args.traces else "wide,wide_lr3,long,narrow"
    if settings:
        print(escape_table(runs, [s.strip() for s in settings.split(",") if s.strip()], args.rule, args.drop), end="")
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
