"""The frontier of batch-growth rules, measured end to end: final loss against optimizer steps saved.

Each rule trains the whole run (the same model, data order, token budget and LR schedule as the
constant batch of its seed) and is read at its end, after the LR schedule's last decay: the
held-out loss minus the constant batch's, paired by seed (mean and the 90% t-interval over the
seeds), against the share of the constant run's optimizer steps it did not take. A rule that
trains branches (``cooled``) adds their tokens, shown beside its steps.

Sixteen settings (the first five unlike each other) (``benchmarks/proof/gpt_proof.py``): ``full``, the proof GPT (2 layers x
128, context 128, the standard library's code, 5.2M tokens from 512-token batches, about 9
minutes a run on one core), ``prose`` (3 layers x 96, context 64, the standard library's
docstrings, 2.1M tokens from 256-token batches, about 5 minutes), ``synth`` (4 layers x 64,
context 32, peak LR 3e-3, a synthetic word-chain language of known entropy, 1M tokens from 128-token
batches, about 2 minutes) and ``heldout`` (3 layers x 80, context 48, peak LR 3e-3, the code corpus, 1M tokens
from 192-token batches, about 1.5 minutes, run only after a candidate was chosen on the other three) and ``wide``
(2 layers x 112, context 96, peak LR 1.5e-3, the docstrings, 1M tokens from 192-token batches, run only after
``convert_until`` was chosen on the other four) and ``wide_lr3`` (``wide`` at twice its peak LR, 3e-3, run after
``wide``'s) and ``tall`` (6 layers x 64, context 64, peak LR 2.5e-3, the code corpus, 1M tokens from
256-token batches, defined before any run of the rise-gated rule) and ``long`` (4 layers x 80, context 128, peak
LR 2e-3, the docstrings, 1M tokens from 256-token batches, defined before any run of the loss-slope rule on it)
and ``narrow`` (3 layers x 48, context 80, peak LR 4e-3, the docstrings, 1M tokens from 160-token batches, defined
before any run of the plateau rule) and ``tail`` (1 layer x 32, context 32, peak LR 3e-3, the docstrings, 4M tokens
from 256-token batches, 190 per parameter, defined after every rule) and ``tail_long`` (``tail`` on 8M tokens, 380
per parameter, defined after every rule) and ``tail_code`` (1 layer x 48, the code corpus, 8M tokens, 200 per
parameter, defined after ``tail_long``'s runs) and ``tail_synth`` (2 layers x 32, the synthetic language, 8M tokens,
240 per parameter, defined before any run of the size-gated plateau option) and ``mid`` (3 layers x 64, context 112,
peak LR 2e-3, the docstrings, 1M tokens from 224-token batches, defined after every rule and before any of its runs)
and ``code96`` (5 layers x 48, context 96, the code corpus, 1M tokens, defined after the hold became the default) and
``duo_code`` (2 layers x 32, context 64, peak LR 2.5e-3, the code corpus, 4M tokens from 256-token batches, 117 per
parameter, defined before any run of the long-run rule); what was tuned on which is ``README_SETTINGS``.
Rules (``RULES``):
``constant`` (the setting's starting batch throughout), ``kappa0.2`` ... ``kappa0.7`` (the controller
at that ``kappa``; ``kappa0.5`` is the earlier default), ``seesaw`` (LR decay turned into growth alone:
the batch doubles where the scheduled LR halves), ``kappa0.4+convert`` (the controller with
``convert_lr_decay``, every halving converted: the default until ``convert_until``; ``+peak``: with
``cap_lr_at_peak=True``; ``-until0.85``: halvings after 0.85 of the run not converted, ``convert_until=0.85``:
the ``kappa`` rule alone, ``KAPPA_RULE``, the default before its hold on a loss plateau), ``kappaA-B+convert`` (``kappa`` rising from A to B
over the budget: ``BatchSizeController(kappa=A, kappa_rise=B/A)``), ``eff0.08`` / ``eff0.12`` (the
efficiency budget, ``efficiency_budget`` with the setting's budget as ``total_tokens``, no conversion), ``measured`` / ``cooled`` (``kappa`` from branches
without and with an LR cooldown), ``hand_ramp`` (4, 8, 16, 32 x the starting batch from 0, 1/2, 3/4,
9/10 of the run), ``kappa0.4+convert-until0.85+rise1.3`` (the default with its growth held until the noise
scale has risen to 1.3 x its level at a tenth of the run: ``gpt_proof_lr.rise_gated``), ``...+linear`` (the LR
coupled linearly to the batch, x 2 per doubling, in place of the square root), ``...+wd`` (AdamW's weight decay
coupled to the batch and the LR so that its decay per token stays the scheduled LR's at the starting batch),
``slope1.0+convert-until0.85`` (the default's conversion with ``kappa`` = 1.0 x the run's own training loss's fall
per e-fold of tokens over the second half of the tokens so far: ``gpt_proof_lr.slope_kappa``), ``...+hold`` (no
doubling from the noise scale after ``convert_until`` of the run: ``gpt_proof_lr.held_late``), ``slope0.8`` /
``slope1.2`` (its scale 20% lower / higher), ``kappa0.4+convert-until0.85+gate0.2`` (the default with every
doubling and conversion held while the training loss falls by less than 0.2 nats per e-fold of tokens, a plateau:
``gpt_proof_lr.slope_gated``), ``...+plateau0.15`` (the default with no growth before a quarter of the run, and
none after if the training loss then falls by less than 0.15 nats per e-fold of tokens: ``gpt_proof_lr.plateau_held``;
``plateau0.11``: its threshold 25% lower; ``plateau0.15@0.19`` / ``@0.31``: its verdict at 0.19 / 0.31 of the run;
``...+plateau0.15+exit0.3``: a run held at the verdict grows, as the default, from the first update where the loss
falls by 0.3 nats per e-fold of tokens, off its plateau),
``library:hold_on_plateau=0.15`` (the library's ``BatchSizeController(hold_on_plateau=0.15,
plateau_tokens_per_parameter=None)``, the plateau rule as users get it, without the size gate: the loss given by
``tracker.observe_loss``, the LR's warm-up read from its schedule), ``library:hold_on_plateau=0.15+tpp20`` (the
same with its size gate: a verdict that holds does not past 20 tokens per parameter of the model, counted by the
tracker; the library's default, ``DEFAULT_RULE``),
``kappa0.4-1.2+convert+plateau0.15`` (the rising ``kappa`` with every halving converted, behind the plateau rule's
hold and verdict), ``library:hold_on_plateau=0.15+tpp20+long`` / ``+long50`` (the default read as a run long for its
model past 20 tokens per parameter, ``gpt_proof_lr.long_run``: the hold ends there before its verdict, and ``kappa``
x (tokens per parameter / 20) ** 0.25, at most 2 x / ** 0.5, at most 3 x; ``+long50`` decides as the library's
``long_run_kappa=0.5``).

Every finished run is kept in ``docs/frontier.json`` (``runs``), so the frontier grows over
sessions; ``points`` is recomputed from them at each report::

    python benchmarks/frontier.py --setting prose --rules constant,kappa0.4,kappa0.5,seesaw --seeds 0,1,2,3
    python benchmarks/frontier.py --setting full --schedule wsd --rules constant,kappa0.4 --seeds 0,1
    python benchmarks/frontier.py --report          # the JSON's points, the table and docs/frontier.png

Runs go to ``--out`` (default ``runs/frontier/<setting>``), two processes at a time (``--jobs``);
a run already in the JSON for the same setting key is not run again.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from proof import gpt_proof as base
from proof import gpt_proof_lr as proof_lr

ROOT = base.ROOT

#: frontier rule -> the run schedule of ``benchmarks/proof/gpt_proof_lr.py``
RULES = {
    "constant": "constant",
    "kappa0.2": "tracker_kappa02",
    "kappa0.3": "tracker_kappa03",
    "kappa0.4": "tracker_kappa04",
    "kappa0.5": "tracker_default",
    "kappa0.6": "tracker_kappa06",
    "kappa0.7": "tracker_kappa07",
    "seesaw": "seesaw",
    "kappa0.4+convert": "tracker_kappa04_convert",
    "kappa0.4+convert+peak": "tracker_kappa04_convert_peak",
    "kappa0.4+convert-until0.85": "tracker_kappa04_convert_until085",
    "kappa0.4-0.8+convert-until0.85": "tracker_kappa04_08_convert_until085",
    "kappa0.4+convert-until0.85+linear": "tracker_kappa04_convert_until085_linear",
    "kappa0.5+convert": "tracker_convert",
    "kappa0.4-0.8+convert": "tracker_kappa04_08_convert",
    "kappa0.4-1.2+convert": "tracker_kappa04_12_convert",
    "measured": "tracker_measured",
    "cooled": "tracker_cooled",
    "hand_ramp": "hand_ramp",
    "eff0.08": "tracker_eff008",
    "eff0.12": "tracker_eff012",
    "kappa0.4+convert-until0.85+rise1.3": "tracker_kappa04_convert_until085_rise13",
    "kappa0.4+convert-until0.85+wd": "tracker_kappa04_convert_until085_wd",
    "slope1.0+convert-until0.85": "tracker_kappa04_convert_until085_slope10",
    "slope1.0+convert-until0.85+hold": "tracker_kappa04_convert_until085_slope10_hold",
    "slope0.8+convert-until0.85": "tracker_kappa04_convert_until085_slope08",
    "slope1.2+convert-until0.85": "tracker_kappa04_convert_until085_slope12",
    "kappa0.4+convert-until0.85+gate0.2": "tracker_kappa04_convert_until085_gate02",
    "kappa0.4+convert-until0.85+plateau0.15": "tracker_kappa04_convert_until085_plateau15",
    "kappa0.4+convert-until0.85+plateau0.11": "tracker_kappa04_convert_until085_plateau11",
    "kappa0.4+convert-until0.85+plateau0.15@0.19": "tracker_kappa04_convert_until085_plateau15_at19",
    "kappa0.4+convert-until0.85+plateau0.15@0.31": "tracker_kappa04_convert_until085_plateau15_at31",
    "kappa0.4+convert-until0.85+plateau0.15+exit0.3": "tracker_kappa04_convert_until085_plateau15_exit30",
    "library:hold_on_plateau=0.15": "tracker_library_plateau15",
    "library:hold_on_plateau=0.15+tpp20": "tracker_library_plateau15_tpp20",
    "kappa0.4-1.2+convert+plateau0.15": "tracker_kappa04_12_convert_plateau15",
    "library:hold_on_plateau=0.15+tpp20+long": "tracker_library_plateau15_tpp20_long",
    "library:hold_on_plateau=0.15+tpp20+long50": "tracker_library_plateau15_tpp20_long50",
}
SCHEDULE_OF = {v: k for k, v in RULES.items()}
#: the ``kappa`` rule alone (``BatchSizeController(hold_on_plateau=None)``): the library's default until its hold on
#: a loss plateau became the default
KAPPA_RULE = "kappa0.4+convert-until0.85"
#: the library's plateau option without its size gate (``BatchSizeController(hold_on_plateau=0.15,
#: plateau_tokens_per_parameter=None)``), as it ran before the library had the gate
PLATEAU_RULE = "library:hold_on_plateau=0.15"
#: the hold as users get it: gated at 20 tokens per parameter of the model (the library's default
#: ``plateau_tokens_per_parameter``; its first runs wrapped the ungated option in ``gpt_proof_lr.plateau_gated_by_size``)
GATED_RULE = "library:hold_on_plateau=0.15+tpp20"
#: the library's default, ``BatchSizeController()``: the gated hold. Where it was not run, the ungated rule's runs
#: stand for it (:func:`option_point`); the points that stand for it carry ``"default": true``
DEFAULT_RULE = GATED_RULE
#: panels left to right: the two settings that chose the default's `κ`, then the twelve that only judged it
SETTING_ORDER = {"full": 0, "prose": 1, "synth": 2, "heldout": 3, "wide": 4, "wide_lr3": 5, "tall": 6, "long": 7, "narrow": 8,
                 "tail": 9, "tail_long": 10, "tail_code": 11, "tail_synth": 12, "mid": 13, "code96": 14}
DOC = ROOT / "docs" / "frontier.json"
PICTURE = ROOT / "docs" / "frontier.png"
#: two-sided 90% t quantiles (0.95) by degrees of freedom
T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833}
KEEP = ("final_val_loss", "steps", "tokens", "final_batch_tokens", "lr_conversions", "library_commit", "train_only_s")


def load(path: Path = DOC) -> dict[str, Any]:
    if path.exists():
        return json.loads(path.read_text())
    return {"runs": [], "points": []}


def run_key(r: dict[str, Any]) -> tuple[str, str, str, int]:
    return (r["setting_key"], r["schedule"], r["lr_schedule"], int(r["seed"]))


def compact(result: dict[str, Any], setting: base.Setting, source: str) -> dict[str, Any]:
    """What the frontier keeps of a run: its end, its batch changes and its validation curve."""
    trace = result.get("trace", {})
    changes, last = [], None
    for tokens, batch in zip(trace.get("tokens", []), trace.get("global_batch", [])):
        if batch != last:
            changes.append([tokens, batch])
            last = batch
    row = {"setting": setting.name, "setting_key": setting.key(), "rule": SCHEDULE_OF[result["schedule"]],
           "schedule": result["schedule"], "lr_schedule": result["lr_schedule"], "seed": result["seed"],
           **{k: result.get(k) for k in KEEP}, "branch_tokens": result.get("branch_tokens", 0),
           "batch_changes": changes, "source": source}
    if "evals" in result:
        row["val_curve"] = [[t, v] for t, v in zip(result["evals"]["tokens"], result["evals"]["val_loss"])]
    return row


def paired(deltas: list[float]) -> tuple[float, float | None, float | None]:
    """Mean, standard error and the upper end of the two-sided 90% t-interval of paired differences."""
    mean = statistics.fmean(deltas)
    if len(deltas) < 2:
        return mean, None, None
    se = statistics.stdev(deltas) / math.sqrt(len(deltas))
    return mean, se, mean + T95[min(len(deltas) - 1, 9)] * se


def paired_by_seed(runs: list[dict[str, Any]], setting: str, lr_schedule: str,
                   rule: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """``(constant run, rule's run)`` of each seed both ran, in seed order, for one setting and LR schedule."""
    mine = {(r["rule"], r["seed"]): r for r in runs if (r["setting"], r["lr_schedule"]) == (setting, lr_schedule)}
    return [(mine[("constant", s)], r) for (name, s), r in sorted(mine.items(), key=lambda kv: kv[0][1])
            if name == rule and ("constant", s) in mine]


def points(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One point per setting, LR schedule and rule, paired by seed against the constant batch."""
    out = []
    for setting, lr_schedule, rule in sorted({(r["setting"], r["lr_schedule"], r["rule"]) for r in runs}):
        if rule == "constant":
            continue
        pairs = paired_by_seed(runs, setting, lr_schedule, rule)
        if not pairs:
            continue
        seeds = [r["seed"] for _, r in pairs]
        rows, refs = [r for _, r in pairs], [c for c, _ in pairs]
        deltas = [r["final_val_loss"] - c["final_val_loss"] for r, c in zip(rows, refs)]
        saved = [1.0 - r["steps"] / c["steps"] for r, c in zip(rows, refs)]
        mean, se, upper = paired(deltas)
        out.append({
            "setting": setting, "schedule": lr_schedule, "rule": rule, "seeds": seeds,
            "delta_mean": round(mean, 5), "delta_se": None if se is None else round(se, 5),
            "delta_upper90": None if upper is None else round(upper, 5),
            "deltas": [round(d, 5) for d in deltas],
            "steps_saved": round(statistics.fmean(saved), 4), "steps_saved_range": [round(min(saved), 4),
                                                                                    round(max(saved), 4)],
            "branch_tokens": statistics.fmean(r.get("branch_tokens", 0) for r in rows),
            "final_batch": [r["final_batch_tokens"] for r in rows],
            "default": False,
        })
    by = {(p["setting"], p["schedule"], p["rule"]): p for p in out}
    for setting, schedule in {(p["setting"], p["schedule"]) for p in out}:
        default = option_point(by, setting, schedule)
        if default is not None:
            default["default"] = True
    return out


def table(pts: list[dict[str, Any]]) -> str:
    lines = ["| setting | LR schedule | rule | seeds | loss vs constant (mean) | upper end of 90% interval | "
             "fewer optimizer steps (mean, range) | branch tokens |", "|---|---|---|---|---|---|---|---|"]
    for p in pts:
        upper = "" if p["delta_upper90"] is None else f"{p['delta_upper90']:+.4f}"
        lo, hi = p["steps_saved_range"]
        branches = f" {p['branch_tokens'] / 1e6:.1f}M" if p["branch_tokens"] else ""
        lines.append(f"| {p['setting']} | {p['schedule']} | {p['rule']} | {','.join(map(str, p['seeds']))} | "
                     f"{p['delta_mean']:+.4f} | {upper} | {p['steps_saved']:.0%} ({lo:.0%}–{hi:.0%}) |{branches} |")
    return "\n".join(lines) + "\n"


X_RANGE = (0.0, 90.0)  # the frontier panels' steps saved, percent


def _label_corner(shown: list[dict[str, Any]], labels: int, bottom: float, top: float) -> tuple[str, str]:
    """The corner of a panel (``("left" | "right", "top" | "bottom")``) whose block of ``labels`` lines covers the
    fewest of the points drawn in it (marker or error bar), top-left first among equals."""
    if not labels:
        return ("left", "top")
    height = 0.07 * labels + 0.05

    def covered(side: str, end: str) -> int:
        x0, x1 = (0.0, 0.62) if side == "left" else (0.38, 1.0)
        y0, y1 = (0.92 - height, 0.92) if end == "top" else (0.02, 0.02 + height)
        n = 0
        for p in shown:
            x = (100 * p["steps_saved"] - X_RANGE[0]) / (X_RANGE[1] - X_RANGE[0])
            lo = (p["delta_mean"] - bottom) / (top - bottom)
            hi = lo if p["delta_upper90"] is None else (min(p["delta_upper90"], top) - bottom) / (top - bottom)
            n += x0 <= x <= x1 and lo - 0.03 <= y1 and hi + 0.03 >= y0
        return n

    corners = [("left", "top"), ("left", "bottom"), ("right", "top"), ("right", "bottom")]
    return min(corners, key=lambda c: covered(*c))


def draw(pts: list[dict[str, Any]], path: Path) -> None:
    """One panel per setting and LR schedule; each rule one colour, named once in the legend below (no labels
    on the points, so none overlap); the default a star; bars the upper end of the paired 90% interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(p["setting"], p["schedule"]) for p in pts}, key=lambda k: (SETTING_ORDER.get(k[0], len(SETTING_ORDER)), k))
    rules = [r for r in RULES if r != "constant" and any(p["rule"] == r for p in pts)]
    palette = [plt.get_cmap("tab10")(i) for i in range(10)] + ["black", "goldenrod", "teal", "magenta", "navy"]
    colours = {r: palette[i % len(palette)] for i, r in enumerate(rules)}
    shapes = {r: "*" if r in (GATED_RULE, PLATEAU_RULE) else "osD^vPX"[(i // 10 + 2 * (i % 3)) % 7] for i, r in enumerate(rules)}
    top = 0.03  # points above are drawn at the top edge, their value written beside them
    columns = max(1, len({s for s, _ in panels}))
    fig, axes = plt.subplots(2, columns, figsize=(4.6 * columns, 7.6), squeeze=False, sharex=True)
    settings = sorted({s for s, _ in panels}, key=lambda s: SETTING_ORDER.get(s, len(SETTING_ORDER)))
    for col, setting in enumerate(settings):
        for row, schedule in enumerate(("cosine", "wsd")):
            ax = axes[row][col]
            mine = [p for p in pts if p["setting"] == setting and p["schedule"] == schedule]
            bottom = min([p["delta_mean"] for p in mine], default=0.0)
            bottom = min(bottom, 0.0) - 0.003
            off = [p for p in mine if p["delta_mean"] > top]
            corner = _label_corner([p for p in mine if p["delta_mean"] <= top], len(off), bottom, top + 0.002)
            for i, p in enumerate(off):  # drawn at the top edge, listed in the panel's emptiest corner
                y_label = 0.86 - 0.07 * i if corner[1] == "top" else 0.04 + 0.07 * (len(off) - 1 - i)
                ax.annotate(f"↑ {p['rule']} {p['delta_mean']:+.3f} at {100 * p['steps_saved']:.0f}%",
                            (0.02 if corner[0] == "left" else 0.98, y_label), xycoords="axes fraction",
                            ha=corner[0], fontsize=6.5, color=colours[p["rule"]], zorder=5,
                            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 0.5})
            for p in mine:
                up = None if p["delta_upper90"] is None else [[0.0], [p["delta_upper90"] - p["delta_mean"]]]
                star = p["default"]
                x, y = 100 * p["steps_saved"], p["delta_mean"]
                if y > top:
                    y, up = top, None
                ax.errorbar(x, y, yerr=up, fmt=shapes[p["rule"]], markersize=14 if star else 6, capsize=3,
                            color=colours[p["rule"]], markeredgecolor="black" if star else colours[p["rule"]],
                            alpha=1.0 if len(p["seeds"]) >= 4 else 0.45, zorder=3 if star else 2)
            ax.set_xlim(*X_RANGE)
            ax.set_ylim(bottom=bottom, top=top + 0.002)
            ax.axhline(0.0, color="black", lw=0.8)
            ax.axhline(KEEPS_THE_LOSS, color="gray", lw=0.8, ls=":")
            ax.axvline(55, color="gray", lw=0.8, ls=":")
            ax.set_title(f"{setting}, {schedule}", fontsize=10)
            if row == 1:
                ax.set_xlabel("optimizer steps saved (%)")
            if col == 0:
                ax.set_ylabel("final loss − constant's (nats)")
    handles = [plt.Line2D([], [], marker=shapes[r], ls="", color=colours[r],
                          markeredgecolor="black" if r in (GATED_RULE, PLATEAU_RULE) else colours[r],
                          markersize=12 if r in (GATED_RULE, PLATEAU_RULE) else 7,
                          label=_legend(r)) for r in rules]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 5), fontsize=8, frameon=False)
    fig.suptitle("Final loss against the constant batch, paired by seed (bar: upper end of the 90% interval;\n"
                 "faint: fewer than 4 seeds; dotted: +0.005 nats and 55% of the steps saved)", fontsize=9)
    fig.tight_layout(rect=(0, 0.05 + 0.025 * math.ceil(len(handles) / 5), 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _legend(rule: str) -> str:
    """A rule's name in the picture's legend: the default's two stand-ins (big stars, black-edged where they are
    the default) say so."""
    if rule == GATED_RULE:
        return f"{rule} (the default)"
    if rule == PLATEAU_RULE:
        return f"{rule} (the default where the gate cannot act)"
    return f"{rule} (the default before the hold)" if rule == KAPPA_RULE else rule


RESULTS = ROOT / "docs" / "results.md"
TABLE_MARK = "<!-- frontier-table -->\n"


def update_results_table(pts: list[dict[str, Any]], path: Path = RESULTS) -> None:
    """Replace the tables after ``TABLE_MARK`` and ``KAPPA_MARK`` in ``docs/results.md`` (each up to the next
    blank line) with ``pts``' and the calibrations'."""
    text = path.read_text()
    for mark, body in ((TABLE_MARK, table(pts)), (KAPPA_MARK, kappa_table(pts))):
        text = _replace_after(text, mark, body)
    path.write_text(text)


def _replace_after(text: str, mark: str, body: str) -> str:
    """``text`` with what follows ``mark`` up to the next blank line replaced by ``body`` (unchanged without it)."""
    if mark not in text:
        return text
    head, rest = text.split(mark, 1)
    tail = rest.split("\n\n", 1)[1] if "\n\n" in rest else ""
    return head + mark + body + "\n" + tail


def option_point(by: dict[tuple[str, str, str], dict[str, Any]], setting: str, schedule: str) -> dict[str, Any] | None:
    """The default (the hold on a loss plateau, gated) as users get it on ``setting``: the gated rule's point where it
    ran, else the ungated rule's, whose verdicts the gate cannot change there (each such run is checked by
    ``tests/test_frontier.py``: under 20 tokens per parameter by the run's end, or a verdict that let it grow)."""
    return by.get((setting, schedule, GATED_RULE)) or by.get((setting, schedule, PLATEAU_RULE))


#: the README's name for each setting, and what was tuned on it: the default's ``κ`` (under cosine) and its limit
#: ``convert_until=0.85``, the plateau option's threshold and quarter, and its size gate (made where the option held
#: runs long for their model); a setting without a choice judged it
README_SETTINGS = {
    "full": ("proof GPT: 2 layers × 128, code", ("`κ`", "limit", "plateau")),
    "prose": ("3 × 96, English prose", ("`κ`", "limit", "plateau")),
    "synth": ("4 × 64, a synthetic language", ("limit", "plateau")),
    "heldout": ("3 × 80, code", ("limit", "plateau")),
    "wide": ("2 × 112, prose", ("plateau",)),
    "wide_lr3": ("the same at twice its LR", ("plateau",)),
    "tall": ("6 × 64, code, context 64", ("plateau",)),
    "long": ("4 × 80, prose, context 128", ("plateau",)),
    "narrow": ("3 × 48, prose, LR 4e-3", ()),
    "tail": ("1 × 32, prose, 190 tokens per parameter", ()),
    "tail_long": ("the same on twice the tokens, 380 per parameter", ("gate",)),
    "tail_code": ("1 × 48, code, 200 tokens per parameter", ("gate",)),
    "tail_synth": ("2 × 32, the synthetic language, 240 tokens per parameter", ()),
    "mid": ("3 × 64, prose, context 112", ()),
    "code96": ("5 × 48, code, context 96", ()),
    "duo_code": ("2 × 32, code, context 64, 117 tokens per parameter", ()),
}
README_MARK = "<!-- frontier-readme -->\n"


def held_out(setting: str, rule: str) -> bool:
    """Whether nothing of ``rule`` (the ``kappa`` rule alone, or the default: the hold, gated or not, on it) was tuned
    on ``setting``."""
    tuned = set(README_SETTINGS[setting][1])
    if rule == PLATEAU_RULE:
        return not {"`κ`", "limit", "plateau"} & tuned
    if rule == GATED_RULE:
        return not {"`κ`", "limit", "plateau", "gate"} & tuned
    return not {"`κ`", "limit"} & tuned


def _cell(p: dict[str, Any] | None) -> str:
    """A point as the README's table gives it: mean (upper end), steps saved; bold where it loses the loss."""
    if p is None:
        return ""
    if p["steps_saved_range"] == [0.0, 0.0] and not any(p["deltas"]):
        return "never grew"
    text = f"{p['delta_mean']:+.3f} ({p['delta_upper90']:+.3f})".replace("-", "−")
    return f"{'**' + text + '**' if p['delta_upper90'] > KEEPS_THE_LOSS else text}, {p['steps_saved']:.0%}"


def keeps(p: dict[str, Any]) -> bool:
    """A point of four seeds or more whose upper end is within :data:`KEEPS_THE_LOSS`."""
    return len(p["seeds"]) >= 4 and p["delta_upper90"] is not None and p["delta_upper90"] <= KEEPS_THE_LOSS


def readme_table(pts: list[dict[str, Any]]) -> str:
    """The README's table: per setting, the default as users get it (:func:`option_point`) and the ``kappa`` rule
    alone under cosine and WSD, and the most steps any rule of four seeds or more saved there with the loss kept."""
    by = {(p["setting"], p["schedule"], p["rule"]): p for p in pts}
    lines = ["| GPT (layers × width, data) | tuned on it | default, cosine | default, WSD | "
             "`hold_on_plateau=None`, cosine | `hold_on_plateau=None`, WSD | best any rule, in hindsight: cosine / WSD |",
             "|---|---|---|---|---|---|---|"]
    for setting, (name, tuned) in README_SETTINGS.items():
        best = []
        for sch in ("cosine", "wsd"):
            kept = [p["steps_saved"] for p in pts if (p["setting"], p["schedule"]) == (setting, sch) and keeps(p)]
            best.append(f"{max(kept):.0%}" if kept else "none")
        cells = [_cell(option_point(by, setting, sch)) for sch in ("cosine", "wsd")]
        cells += [_cell(by.get((setting, sch, KAPPA_RULE))) for sch in ("cosine", "wsd")]
        lines.append(f"| {name} | {', '.join(tuned) or '—'} | " + " | ".join(cells) + f" | {best[0]} / {best[1]} |")
    return "\n".join(lines) + "\n"


def update_readme_table(pts: list[dict[str, Any]], path: Path = ROOT / "README.md") -> None:
    """Replace the table after ``README_MARK`` in the README (up to the next blank line) with ``pts``'."""
    path.write_text(_replace_after(path.read_text(), README_MARK, readme_table(pts)))


KAPPA_MARK = "<!-- kappa-table -->\n"
#: a rule "keeps the loss" when the upper end of its paired 90% interval is at most this (nats)
KEEPS_THE_LOSS = 0.005


def kappa_table(pts: list[dict[str, Any]], root: Path = ROOT / "docs") -> str:
    """Per setting and branch point: the critical batch and ``kappa`` of uncooled and cooled branches from the
    same state (``docs/calibration_{uncooled,cooled}_<setting>_seed0.json``), beside the frontier's best rule
    under cosine (the most steps saved among the rules at or below the constant: the upper end of the paired
    90% interval at most ``KEEPS_THE_LOSS``)."""
    lines = ["| setting | tokens | B_simple (tracker) | uncooled: critical batch, κ | cooled: critical batch, κ | "
             "frontier's best rule (cosine, upper end ≤ +0.005) |", "|---|---|---|---|---|---|"]
    for setting in ("full", "prose", "wide", "heldout"):
        files = {kind: root / f"calibration_{kind}_{setting}_seed0.json" for kind in ("uncooled", "cooled")}
        if not all(f.exists() for f in files.values()):
            continue
        loaded = {kind: json.loads(f.read_text())["points"] for kind, f in files.items()}
        ok = [p for p in pts if p["setting"] == setting and p["schedule"] == "cosine" and p["rule"] != "constant"
              and p["delta_upper90"] is not None and p["delta_upper90"] <= KEEPS_THE_LOSS]
        best = max(ok, key=lambda p: p["steps_saved"], default=None)
        best_text = "none within the loss" if best is None else (f"{best['rule']}: {best['delta_mean']:+.4f}, {best['steps_saved']:.0%} "
                                             f"fewer steps ({len(best['seeds'])} seed{'s' if len(best['seeds']) > 1 else ''})")

        def cell(point: dict[str, Any]) -> str:
            c = point["critical"]
            high = "∞" if c["high"] is None else f"{c['high']:,.0f}"
            kappa = "" if point["kappa"] is None else f", {point['kappa']:.2f}"
            return f"[{c['low']:,.0f}, {high}){'' if c['resolved'] else '?'}{kappa}"

        for unc, coo in zip(loaded["uncooled"], loaded["cooled"]):
            ns = "" if unc["noise_scale"] is None else f"{unc['noise_scale']:,.0f}"
            lines.append(f"| {setting} | {unc['tokens']:,.0f} | {ns} | {cell(unc)} | {cell(coo)} | {best_text} |")
    return "\n".join(lines) + "\n"


#: the stretches of the run (fractions of its tokens) the loss slopes are read over
SLOPE_MARKS = (0.1, 0.2, 0.3, 0.4, 0.6, 0.8)


def loss_at(curve: list[list[float]], tokens: float) -> float:
    """The validation loss at ``tokens``, linear between the curve's points (``[tokens, loss]``, in order)."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if t0 <= tokens <= t1:
            return l0 + (l1 - l0) * (tokens - t0) / (t1 - t0)
    raise ValueError(f"loss_at: {tokens} tokens outside the curve's {curve[0][0]}..{curve[-1][0]}")


def loss_slopes(runs: list[dict[str, Any]], marks: tuple[float, ...] = SLOPE_MARKS) -> dict[tuple[str, str], list]:
    """Per setting and LR schedule, how fast the constant batch's validation loss falls per e-fold of tokens,
    ``(L(a) - L(b)) / ln(b / a)`` between consecutive ``marks`` (fractions of the run's tokens): the median over
    its seeds, one value per stretch."""
    slopes: dict[tuple[str, str], list[list[float]]] = {}
    for r in runs:
        if r["rule"] != "constant":
            continue
        curve, total = r["val_curve"], r["val_curve"][-1][0]
        slopes.setdefault((r["setting"], r["lr_schedule"]), []).append(
            [(loss_at(curve, a * total) - loss_at(curve, b * total)) / math.log(b / a)
             for a, b in zip(marks, marks[1:])])
    return {key: [statistics.median(col) for col in zip(*rows)] for key, rows in sorted(slopes.items())}


def slope_table(runs: list[dict[str, Any]], marks: tuple[float, ...] = SLOPE_MARKS) -> str:
    """:func:`loss_slopes` as a markdown table, a row per setting and LR schedule (``--slopes``)."""
    head = " | ".join(f"{a:.0%}–{b:.0%}" for a, b in zip(marks, marks[1:]))
    lines = [f"| setting | LR schedule | {head} |", "|---|---|" + "---|" * (len(marks) - 1)]
    for (setting, schedule), values in loss_slopes(runs, marks).items():
        lines.append(f"| {setting} | {schedule} | " + " | ".join(f"{v:.2f}" for v in values) + " |")
    return "\n".join(lines) + "\n"


def report(doc: dict[str, Any], path: Path = DOC, picture: Path | None = PICTURE) -> None:
    doc["points"] = points(doc["runs"])
    doc["runs"].sort(key=lambda r: (r["setting"], r["lr_schedule"], r["rule"], r["seed"]))
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(doc["points"]))
    if path == DOC:
        update_results_table(doc["points"])
        update_readme_table(doc["points"])
    if picture is not None and doc["points"]:
        draw(doc["points"], picture)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setting", choices=sorted(base.SETTINGS), default="prose")
    p.add_argument("--schedule", choices=("cosine", "wsd"), default="cosine", help="the LR schedule of every run")
    p.add_argument("--rules", default="constant", help=f"comma-separated, of {', '.join(RULES)}")
    p.add_argument("--seeds", default="0,1,2,3")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", default=None, help="per-run outputs (default runs/frontier/<setting>)")
    p.add_argument("--doc", default=str(DOC), help="the frontier JSON the runs are added to")
    p.add_argument("--report", action="store_true", help="run nothing; recompute the points and the picture")
    p.add_argument("--slopes", action="store_true", help="run nothing; print the constant runs' loss slopes")
    args = p.parse_args(argv)
    doc_path = Path(args.doc)
    doc = load(doc_path)
    picture = PICTURE if doc_path == DOC else doc_path.with_suffix(".png")
    if args.report:
        report(doc, doc_path, picture)
        return 0
    if args.slopes:
        print(slope_table(doc["runs"]), end="")
        return 0
    setting = base.SETTINGS[args.setting]
    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    unknown = [r for r in rules if r not in RULES]
    if unknown:
        p.error(f"--rules: unknown {unknown}; choose from {list(RULES)}")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds={args.seeds!r}: expected integers separated by commas")
    if args.jobs < 1:
        p.error(f"--jobs={args.jobs}: must be >= 1")
    out = Path(args.out or f"runs/frontier/{setting.name}")
    have = {run_key(r) for r in doc["runs"]}
    todo = [proof_lr.Run(RULES[rule], seed, args.schedule) for seed in seeds for rule in rules
            if (setting.key(), RULES[rule], args.schedule, seed) not in have]
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if setting.corpus == "docs":
        base.load_setting_corpus(setting)  # parsed once here, so the workers read it from the cache file
    running: list[tuple[proof_lr.Run, subprocess.Popen[bytes]]] = []
    while todo or running:
        while todo and len(running) < args.jobs:
            run = todo.pop(0)
            cmd, env = base.worker_command("gpt_proof_lr", "--worker", json.dumps([asdict(run)]),
                                           "--setting", setting.name, "--out", str(out))
            log = open(out / "logs" / f"{run.name}.log", "wb")  # noqa: SIM115
            running.append((run, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)))
            print(f"[{time.strftime('%H:%M:%S')}] start {setting.name} {run.name}", flush=True)
        time.sleep(1.0)
        for item in list(running):
            run, proc = item
            if proc.poll() is None:
                continue
            running.remove(item)
            path = out / "runs" / f"{run.name}.json"
            if proc.returncode != 0 or not path.exists():
                print(f"[{time.strftime('%H:%M:%S')}] FAILED {run.name} (log: {out / 'logs' / run.name}.log)",
                      flush=True)
                continue
            result = json.loads(path.read_text())
            doc = load(doc_path)  # another invocation may have added runs meanwhile
            doc["runs"] = [r for r in doc["runs"] if run_key(r) != (setting.key(), run.schedule, run.lr_schedule,
                                                                    run.seed)]
            doc["runs"].append(compact(result, setting, source=f"python benchmarks/frontier.py --setting "
                                       f"{setting.name} --schedule {run.lr_schedule} --rules "
                                       f"{SCHEDULE_OF[run.schedule]} --seeds {run.seed}"))
            report(doc, doc_path, None)
            print(f"[{time.strftime('%H:%M:%S')}] done  {run.name}: {result['final_val_loss']:.5f}, "
                  f"{result['steps']} steps", flush=True)
    report(load(doc_path), doc_path, picture)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
