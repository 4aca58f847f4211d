"""The critical batch measured by branches at checkpoints of the proof setting, and kappa from it.

Trains the proof's constant 512-token run (256-token microbatches, A = 2, AdamW, the
cosine schedule in tokens) with an observe-only tracker and calibrates at each checkpoint
with ``cbs_tracker.commands.calibrate.calibrate_gpt``: branches at 1/2 .. 8 x 512 tokens,
LR x sqrt(k) on the schedule's own timing, two replicates over data orders, a control at
512 with the largest branch's LR, every branch on the same held-out set. The run continues
unchanged after each calibration. Writes ``<out>/calibration_<setting>_seed<s>.json`` after
every point.

    python -m benchmarks.proof.calibrate_proof --out runs/calib                                   # proof setting
    python -m benchmarks.proof.calibrate_proof --setting deep --branch-tokens 131072 --out runs/calib  # second setting
    python -m benchmarks.proof.calibrate_proof --setting quick --out /tmp/calib                   # smoke test
    python -m benchmarks.proof.calibrate_proof --setting prose --cooldowns 0,0.5 --multiples 1,2,4,8 --no-control --out runs/calib
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

from . import gpt_proof as base

#: the second setting: a narrower, twice as deep GPT at half the context (64 tokens, 4-sequence
#: microbatches: the same 256-token microbatch), about the same cost per token on a CPU
DEEP = replace(base.FULL, name="deep", seq_len=64, n_layer=4, d_model=96, n_head=3, tracker_micro_sequences=4)
SETTINGS = {"full": base.FULL, "deep": DEEP, "quick": base.QUICK, "prose": base.PROSE, "wide": base.WIDE,
            "heldout": base.HELDOUT}
CHECKPOINTS = {"full": (250_000, 500_000, 1_000_000, 2_000_000), "deep": (250_000, 500_000, 1_000_000, 2_000_000),
               "quick": (8192, 16384), "prose": (250_000, 500_000, 1_000_000),
               "wide": (100_000, 250_000, 500_000), "heldout": (100_000, 250_000, 500_000)}
BRANCH_TOKENS = {"full": 262_144, "deep": 262_144, "quick": 4096, "prose": 131_072, "wide": 65_536, "heldout": 65_536}


def _num(x: float | None, spec: str = ",.0f") -> str:
    return "" if x is None else format(x, spec)


def markdown_table(saved: dict) -> str:
    """The calibration file's points as the table of ``docs/results.md``."""
    lines = [f"| {saved['setting']} setting: tokens | critical batch | losses 1/2·B … 8·B (± s.e.) | control | "
             "B_simple (tracker) | frozen | preconditioned | κ | κ frozen | κ precond. | branch tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in saved["points"]:
        c = p["critical"]
        crit = f"[{c['low']:,.0f}, {'∞' if c['high'] is None else format(c['high'], ',.0f')})"
        if not c["resolved"]:
            crit += " (unresolved)"
        def mean_se(b: dict) -> str:
            n = len(b["losses"])
            m = sum(b["losses"]) / n
            se = (sum((x - m) ** 2 for x in b["losses"]) / (n - 1) / n) ** 0.5 if n > 1 else float("nan")
            return f"{m:.3f}±{se:.3f}"
        losses = " / ".join(mean_se(b) for b in p["branches"])
        ctl = "" if p["control"] is None else mean_se(p["control"])
        fz = p["frozen"] or {}
        lines.append(
            f"| {p['tokens']:,.0f} | {crit} | {losses} | {ctl} | {_num(p['noise_scale'])} | "
            f"{_num(fz.get('noise_scale'))} | {_num(fz.get('preconditioned'))} | {_num(p['kappa'], '.2f')} | "
            f"{_num(p['kappa_frozen'], '.2f')} | {_num(p['kappa_preconditioned'], '.2f')} | "
            f"{p['total_branch_tokens']:,.0f} |")
    return "\n".join(lines) + "\n"


def merge_frozen(calibration_path: Path, frozen_path: Path) -> None:
    """Take the preconditioned noise scale (and its kappa) from a ``--frozen-only`` run of the same
    checkpoints; the raw frozen values must be identical (the same weights and microbatches)."""
    saved = json.loads(calibration_path.read_text())
    frozen = json.loads(frozen_path.read_text())
    if len(frozen["points"]) != len(saved["points"]):
        raise SystemExit(f"{frozen_path}: {len(frozen['points'])} points, {calibration_path} has {len(saved['points'])}")
    for point, f in zip(saved["points"], frozen["points"]):
        if f["tokens"] != point["tokens"] or f["noise_scale"] != point["frozen"]["noise_scale"]:
            raise SystemExit(f"{frozen_path}: the point at {f['tokens']} does not repeat the calibration's weights "
                             f"(raw {f['noise_scale']} against {point['frozen']['noise_scale']})")
        point["frozen"]["preconditioned"] = f["preconditioned"]
        point["frozen"]["preconditioned_stderr"] = f["preconditioned_stderr"]
        point["kappa_preconditioned"] = point["critical"]["low"] / f["preconditioned"]
    saved["preconditioned_from"] = {"file": frozen_path.name, "library_commit": frozen["library_commit"]}
    calibration_path.write_text(json.dumps(saved, indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setting", choices=sorted(SETTINGS), default="full")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--replicates", type=int, default=2)
    p.add_argument("--branch-tokens", type=int, default=None)
    p.add_argument("--checkpoints", type=str, default=None, help="comma-separated token marks")
    p.add_argument("--cooldowns", type=str, default="0",
                   help="comma-separated fractions of each branch over which its LR anneals (1-sqrt) before the "
                        "evaluation; one measurement per value at every checkpoint, from the same state (default 0: "
                        "none). Points with a cooldown go to <out>/calibration_cooled_<setting>_seed<s>.json")
    p.add_argument("--multiples", type=str, default="0.5,1,2,4,8", help="branch batch multiples (default 0.5,1,2,4,8)")
    p.add_argument("--no-control", action="store_true", help="no LR control branch")
    p.add_argument("--frozen-microbatches", type=int, default=32,
                   help="microbatch gradients of the frozen noise scale at each checkpoint (default 32)")
    p.add_argument("--frozen-only", action="store_true",
                   help="measure only the frozen noise scales at the checkpoints (no branches); writes "
                        "<out>/frozen_<setting>_seed<s>.json")
    p.add_argument("--merge-frozen", nargs=2, type=Path, default=None, metavar=("CALIBRATION", "FROZEN"),
                   help="replace the preconditioned noise scales of CALIBRATION with FROZEN's (a --frozen-only run "
                        "at the same checkpoints, whose raw values must agree exactly), in place")
    p.add_argument("--report", nargs="+", type=Path, default=None,
                   help="run nothing: print the Markdown table of these calibration files")
    args = p.parse_args(argv)
    if args.merge_frozen:
        merge_frozen(*args.merge_frozen)
        return 0
    if args.report:
        for path in args.report:
            print(markdown_table(json.loads(path.read_text())))
        return 0

    import torch

    from cbs_tracker.commands.calibrate import GPTCalibration, calibrate_gpt

    s = SETTINGS[args.setting]
    marks = (tuple(float(x) for x in args.checkpoints.split(",")) if args.checkpoints else CHECKPOINTS[args.setting])
    branch_tokens = args.branch_tokens or BRANCH_TOKENS[args.setting]
    start = s.constant_tokens or (512 if args.setting != "quick" else s.tracker_start_tokens)
    cooldowns = tuple(float(x) for x in args.cooldowns.split(","))
    if not cooldowns or any(not 0.0 <= x <= 1.0 for x in cooldowns) or sum(x > 0 for x in cooldowns) > 1:
        p.error(f"--cooldowns={args.cooldowns!r}: fractions in [0, 1], at most one of them above 0")
    micro = s.tracker_micro_sequences * s.seq_len
    c = GPTCalibration(
        marks=marks, run_tokens=s.budget_tokens, branch_tokens=branch_tokens, seq_len=s.seq_len, n_layer=s.n_layer,
        d_model=s.d_model, n_head=s.n_head, micro_sequences=s.tracker_micro_sequences, accumulation=start // micro,
        lr=s.lr, min_lr_ratio=s.min_lr_ratio, warmup_tokens=s.warmup_tokens, weight_decay=s.weight_decay,
        clip=s.clip, replicates=args.replicates, eval_sequences=s.eval_sequences, max_bytes=s.corpus_max_bytes,
        seed=args.seed, corpus=s.corpus, cooldowns=cooldowns,
        multiples=tuple(float(x) for x in args.multiples.split(",")), control=not args.no_control,
        frozen_microbatches=args.frozen_microbatches)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    def save(calibration) -> None:
        from cbs_tracker.calibrate import Calibration

        print(calibration.table(), flush=True)
        for cooled in (False, True):
            points = [pt for pt in calibration.points if (pt.cooldown > 0) == cooled]
            if not points:
                continue
            name = f"calibration_{'cooled_' if cooled else ''}{s.name}_seed{args.seed}.json"
            (args.out / name).write_text(json.dumps({
                "setting": s.name, "setting_key": s.key(), "seed": args.seed, "start_batch": start,
                "branch_tokens": branch_tokens, "replicates": args.replicates, "run_tokens": s.budget_tokens,
                "cooldown": points[0].cooldown, "multiples": list(c.multiples), "control": not args.no_control,
                "library_commit": base._library_commit(), "points": json.loads(Calibration(points).to_json()),
            }, indent=1))

    if args.frozen_only:
        frozen = calibrate_gpt(c, log=lambda line: print(line, flush=True), frozen_only=True)
        out = args.out / f"frozen_{s.name}_seed{args.seed}{'' if args.frozen_microbatches == 32 else f'_{args.frozen_microbatches}'}.json"
        out.write_text(json.dumps({"setting": s.name, "setting_key": s.key(), "seed": args.seed,
                                   "library_commit": base._library_commit(),
                                   "points": [{"tokens": t, **asdict(f)} for t, f in frozen]}, indent=1))
        print(f"wrote {out}")
        return 0
    calibrate_gpt(c, log=lambda line: print(line, flush=True), on_point=save)
    print(f"wrote {args.out}/calibration_*{s.name}_seed{args.seed}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
