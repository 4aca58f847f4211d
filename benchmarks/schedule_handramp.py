"""The proof's hand ramp as a ``BatchSchedule`` against the hand-written controller it replaced, full setting.

    python benchmarks/schedule_handramp.py [--out runs/schedule_handramp] [--seed 0]

Trains ``hand_ramp_seed<seed>`` of ``benchmarks/proof/gpt_proof.py`` (2-layer GPT, 5M tokens, 2k -> 4k -> 8k -> 16k
tokens at 1/2, 3/4 and 9/10 of the budget, constant LR after warm-up) twice in parallel, one process each:
with ``BatchSchedule(ramp_marks(setting))`` and with ``HandRampController``. Prints the batch changes, the
final losses and the schedule's warnings, and writes ``docs/schedule_handramp_full_seed<seed>.json``.
About 4-7 minutes on two cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from proof import gpt_proof

ROOT = gpt_proof.ROOT


def _one(kind: str, seed: int, out: Path) -> None:
    proof = gpt_proof
    if kind == "hand_written":
        proof.make_controller = lambda spec, setting, micro: proof.HandRampController(setting, micro)
    result = proof.train_run(proof.RunSpec("hand_ramp", seed), proof.FULL, out / kind)
    print(json.dumps({"final_val_loss": result["final_val_loss"]}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/schedule_handramp")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    out = Path(args.out)
    if args.worker:
        _one(args.worker, args.seed, out)
        return 0
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", kind, "--seed", str(args.seed), "--out", str(out)])
             for kind in ("batch_schedule", "hand_written")]
    if any(proc.wait() for proc in procs):
        return 1
    rows = {}
    for kind in ("batch_schedule", "hand_written"):
        r = json.loads((out / kind / "runs" / f"hand_ramp_seed{args.seed}.json").read_text())
        rows[kind] = {"final_val_loss": r["final_val_loss"], "steps": r["steps"], "tokens": r["tokens"],
                      "batch_changes": r["batch_changes"], "val_loss": r["evals"]["val_loss"],
                      "library_commit": r.get("library_commit"),
                      "schedule_warnings": [w for w in r["warnings"] if "BatchSchedule" in w]}
        print(f"{kind:15s} final val loss {r['final_val_loss']:.5f}, {r['steps']} steps, changes "
              + ", ".join(f"{c['from']}->{c['to']:.0f} at {c['tokens']:.0f}" for c in r["batch_changes"]))
    same = rows["batch_schedule"]["val_loss"] == rows["hand_written"]["val_loss"] and (
        rows["batch_schedule"]["batch_changes"] == rows["hand_written"]["batch_changes"])
    print("identical batches and evaluations:", same)
    for w in rows["batch_schedule"]["schedule_warnings"]:
        print("warning:", w)
    doc = ROOT / "docs" / f"schedule_handramp_full_seed{args.seed}.json"
    doc.write_text(json.dumps({"command": f"python benchmarks/schedule_handramp.py --seed {args.seed}",
                               "identical": same, **rows}, indent=1))
    print("wrote", doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
