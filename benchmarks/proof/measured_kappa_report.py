"""The proof under cosine, four seeds paired: the tracker with the measured kappa against constant 512,
the default kappa = 0.5 and kappa = 0.4.

Reads the ``tracker_measured`` runs of ``benchmarks/proof/gpt_proof_lr.py`` (``<runs>/runs/*.json``) and the
earlier runs of the same setting from ``docs/`` (constant 512, kappa = 0.5, kappa = 0.4), prints the
Markdown table of ``docs/results.md`` and writes the JSON it is made from.

    python -m benchmarks.proof.measured_kappa_report --runs runs/proof_measured --json docs/proof_measured_results.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: where the earlier runs of each seed are recorded (the same setting key)
EARLIER = {0: ("proof_lr_results.json", "proof_lr_window_results.json", "proof_kappa04_results.json"),
           1: ("proof_lr_results.json", "proof_lr_window_results.json", "proof_kappa04_results.json"),
           2: ("proof_seeds_results.json",), 3: ("proof_seeds_results.json",)}
#: one-sided 95% quantile of Student's t with 3 degrees of freedom (four paired seeds)
T95_3 = 2.3533634348018264
SCHEDULES = {"constant": "constant 512", "tracker_default": "κ = 0.5", "tracker_kappa04": "κ = 0.4",
             "tracker_measured": "measured κ", "tracker_measured_cap": "measured κ, LR capped at its peak"}


def _earlier(seed: int) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    for name in EARLIER[seed]:  # later files win: the window-estimator rerun replaces the first default runs
        for r in json.loads((ROOT / "docs" / name).read_text())["runs"]:
            if r["seed"] == seed and r["lr_schedule"] == "cosine" and r["schedule"] in SCHEDULES and not r.get(
                    "cap_lr_at_peak"):
                rows[r["schedule"]] = r
    return rows


def paired(diffs: list[float]) -> dict[str, float]:
    n = len(diffs)
    mean = sum(diffs) / n
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1) / n) if n > 1 else float("nan")
    return {"mean": mean, "stderr": se, "upper90": mean + T95_3 * se if n == 4 else None}


def report(runs_dir: Path, seeds: tuple[int, ...] = (0, 1, 2, 3)) -> dict:
    per_seed = {}
    for seed in seeds:
        rows = _earlier(seed)
        for key, name in (("tracker_measured", f"tracker_measured_cosine_seed{seed}"),
                          ("tracker_measured_cap", f"tracker_measured_cap_cosine_seed{seed}")):
            path = runs_dir / "runs" / f"{name}.json"
            if path.exists():
                r = json.loads(path.read_text())
                rows[key] = {k: r[k] for k in ("name", "schedule", "seed", "final_val_loss", "steps",
                                               "final_batch_tokens", "library_commit")}
        per_seed[seed] = {k: {"final_val_loss": v["final_val_loss"], "steps": v["steps"],
                              "final_batch_tokens": v.get("final_batch_tokens")} for k, v in rows.items()}
    summary = {}
    for key in ("tracker_default", "tracker_kappa04", "tracker_measured", "tracker_measured_cap"):
        have = [s for s in seeds if key in per_seed[s] and "constant" in per_seed[s]]
        if not have:
            continue
        d = [per_seed[s][key]["final_val_loss"] - per_seed[s]["constant"]["final_val_loss"] for s in have]
        fewer = [1 - per_seed[s][key]["steps"] / per_seed[s]["constant"]["steps"] for s in have]
        summary[key] = {"seeds": have, "vs_constant": paired(d), "fewer_steps_min": min(fewer),
                        "fewer_steps_max": max(fewer), "fewer_steps_mean": sum(fewer) / len(fewer)}
    return {"per_seed": per_seed, "summary": summary}


def markdown(rep: dict) -> str:
    lines = ["| seed | " + " | ".join(f"{v}: loss, steps" for v in SCHEDULES.values()) + " |",
             "|---|" + "---|" * len(SCHEDULES)]
    for seed, rows in rep["per_seed"].items():
        cells = []
        for key in SCHEDULES:
            r = rows.get(key)
            cells.append("" if r is None else f"{r['final_val_loss']:.4f}, {r['steps']:,}")
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    lines += ["", "| against constant 512, paired by seed | mean difference (nats) | standard error | "
                  "upper end of the 90% interval | fewer optimizer steps |", "|---|---|---|---|---|"]
    for key, s in rep["summary"].items():
        v = s["vs_constant"]
        upper = "(four seeds needed)" if v["upper90"] is None else f"{v['upper90']:+.4f}"
        lines.append(f"| {SCHEDULES[key]} (seeds {', '.join(map(str, s['seeds']))}) | {v['mean']:+.4f} | "
                     f"{v['stderr']:.4f} | {upper} | {s['fewer_steps_min']:.0%}–{s['fewer_steps_max']:.0%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=Path, required=True, help="the --out directory of the tracker_measured runs")
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = p.parse_args(argv)
    rep = report(args.runs)
    if args.json is not None:
        args.json.write_text(json.dumps(rep, indent=1))
    print(markdown(rep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
