"""Would the noise scale measured through Adam's preconditioner make ``kappa`` agree across models?

The frontier's best fixed ``kappa`` differs by model: the largest that keeps the loss is about 0.2 on the wide GPT,
0.4 on the proof and code GPTs, 0.5-0.7 on prose and 0.5 or more on the synthetic language. If ``kappa`` were the
same quantity on every model, the preconditioned noise scale ``B_adam = tr(P Sigma P) / |P G|^2``
(``preconditioner="adam"``) would stand to ``B_simple = tr(Sigma) / |G|^2`` in the ratio of those ``kappa``:
a rule ``kappa_adam * B_adam >= 2B`` would then read each model with one ``kappa_adam``.

This trains the frontier's constant run twice (``constant`` and ``constant_adam``: the same run, the same data and
weights at every step, only the measurement differs) and prints the median of each noise scale and of their ratio
over ``--marks`` equal stretches of the run.

    python -m benchmarks.proof.adam_scale --setting wide --out docs/adam_scale.json     # 2-10 minutes a setting
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from . import gpt_proof as base
from . import gpt_proof_lr as proof_lr
from .step_ratio import save_run


def stretches(tokens: list[float], simple: list[float | None], adam: list[float | None], budget: float,
              marks: int) -> list[dict[str, Any]]:
    """Medians of both noise scales and of their ratio over ``marks`` equal stretches of ``budget`` tokens, from
    the points where both were measured (a point belongs to the stretch its token count falls in)."""
    out = []
    for k in range(marks):
        lo, hi = budget * k / marks, budget * (k + 1) / marks
        pairs = [(s, a) for t, s, a in zip(tokens, simple, adam) if lo <= t < hi and s and a]
        out.append({"from_tokens": lo, "to_tokens": hi, "points": len(pairs),
                    "b_simple": statistics.median(s for s, _ in pairs) if pairs else None,
                    "b_adam": statistics.median(a for _, a in pairs) if pairs else None,
                    "ratio": statistics.median(a / s for s, a in pairs) if pairs else None})
    return out


def measure(setting: base.Setting, seed: int, lr_schedule: str, marks: int, runs: Path,
            log: Any = print) -> dict[str, Any]:
    """Both runs (each read from ``runs/runs/<name>.json`` when a run of this setting is there, else trained) and
    their stretches."""
    results = {}
    for schedule in ("constant", "constant_adam"):
        run = proof_lr.Run(schedule, seed, lr_schedule)
        path = runs / "runs" / f"{run.name}.json"
        saved = json.loads(path.read_text()) if path.exists() else None
        if saved is None or saved.get("setting_key") != setting.key() or "trace" not in saved:
            saved = proof_lr.train(run, setting, runs)
        results[schedule] = saved
    plain, adam = results["constant"], results["constant_adam"]
    if (plain["final_val_loss"], plain["steps"]) != (adam["final_val_loss"], adam["steps"]):
        raise RuntimeError(f"the two runs trained differently: {plain['final_val_loss']} after {plain['steps']} "
                           f"steps against {adam['final_val_loss']} after {adam['steps']}")
    if plain["trace"]["tokens"] != adam["trace"]["tokens"]:
        raise RuntimeError("the two runs traced different token counts")
    points = stretches(plain["trace"]["tokens"], plain["trace"]["noise_scale"], adam["trace"]["noise_scale"],
                       setting.budget_tokens, marks)
    for p in points:
        if p["ratio"] is not None:
            log(f"{setting.name} {p['from_tokens']:>10,.0f}-{p['to_tokens']:>10,.0f} tokens: B_simple "
                f"{p['b_simple']:8,.0f}  B_adam {p['b_adam']:8,.0f}  ratio {p['ratio']:.2f}")
    return {"setting": setting.name, "setting_key": setting.key(), "seed": seed, "lr_schedule": lr_schedule,
            "final_val_loss": plain["final_val_loss"], "library_commit": base._library_commit(),
            "run_commits": {k: r.get("library_commit") for k, r in results.items()}, "points": points}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setting", choices=sorted(base.SETTINGS), default="wide")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schedule", choices=("cosine", "wsd"), default="cosine")
    p.add_argument("--marks", type=int, default=4, help="equal stretches of the run (default 4)")
    p.add_argument("--runs", type=Path, default=None,
                   help="where the two runs are kept and read back (default runs/adam_scale/<setting>)")
    p.add_argument("--out", type=Path, required=True, help="a JSON file; runs of other settings in it are kept")
    args = p.parse_args(argv)
    if args.marks < 1:
        p.error(f"--marks must be >= 1, got {args.marks}")
    setting = base.SETTINGS[args.setting]
    runs = args.runs or base.ROOT / "runs" / "adam_scale" / setting.name
    save_run(args.out, measure(setting, args.seed, args.schedule, args.marks, runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
