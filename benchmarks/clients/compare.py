"""Compare a traced run with growth against the constant-batch run of the same script on the same data.

    python benchmarks/clients/compare.py CONSTANT.json GROWN.json [--coupling sqrt|linear|keep]
    python benchmarks/clients/compare.py CONSTANT.json FIRST.json --resumed RESUMED.json --checkpoint-step K

Prints, and exits 1 unless all hold: the grown run trained the constant run's microbatches in their
order, none twice, and past their end at most the rest of its last window (``tracker.done`` stops at
the first optimizer step that reaches the budget); no microbatch ran without an optimizer step; at
each of its optimizer steps the LR equals the constant run's LR at the same data position times the
coupling of the step's batch (``sqrt(B/B0)`` for AdamW, the tracker's default). With ``--resumed``:
the resumed run starts exactly where the checkpoint's windows ended (FIRST's first K optimizer
steps), and FIRST's microbatches up to there followed by RESUMED's are checked as above.
"""

from __future__ import annotations

import argparse
import json
import math
import sys


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("constant")
    p.add_argument("grown")
    p.add_argument("--resumed", help="the trace of a run resumed from GROWN's checkpoint")
    p.add_argument("--checkpoint-step", type=int, help="with --resumed: the optimizer steps the checkpoint holds")
    p.add_argument("--coupling", default="sqrt", choices=("sqrt", "linear", "keep"))
    p.add_argument("--rtol", type=float, default=1e-9, help="LR difference allowed, as a fraction of the peak")
    p.add_argument("--lr-clock", default="data", choices=("data", "end", "schedule"),
                   help="data: the constant run's LR at a step starting on the same token; end: at a step ending on "
                        "the same token (a loop that sets the LR before every microbatch, as LitGPT's, steps with the "
                        "last one's); schedule: the constant "
                        "run's scheduler at step (microbatches before) / A0 (for epochs that end inside a window, where "
                        "the constant run takes a short step)")
    args = p.parse_args()
    const, grown = load(args.constant), load(args.grown)
    a0 = const["steps"][0]["micro"]
    lr_at = {s["before"]: s["lr"] for s in const["steps"]}
    lr_ending = {s["before"] + s["tokens"]: s["lr"] for s in const["steps"]}
    ok = True

    micro, steps = grown["micro"], grown["steps"]
    if args.resumed:
        res = load(args.resumed)
        k = args.checkpoint_step
        position = sum(s["micro"] for s in grown["steps"][:k])  # microbatches of the checkpoint's windows
        try:
            start = grown["micro"].index(res["micro"][0])
        except ValueError:
            print("resumed run starts on a microbatch the first run never trained")
            return 1
        print(f"resume from the checkpoint after optimizer step {k}: its windows held {position} microbatches; "
              f"the resumed run started at microbatch {start}: {max(0, position - start)} trained twice, "
              f"{max(0, start - position)} never trained")
        ok &= start == position
        micro = grown["micro"][:position] + res["micro"]
        done = sum(s["tokens"] for s in grown["steps"][:k])
        steps = grown["steps"][:k] + [dict(s, before=s["before"] + done) for s in res["steps"]]
        grown = dict(res, micro=micro)

    n = len(const["micro"])
    prefix = micro[:n] == const["micro"]
    extra = len(micro) - n
    last = steps[-1]["micro"] if steps else 0
    dup = len(micro) - len(set(micro))
    print(f"microbatches: constant {n}, grown {len(micro)}; the constant run's {n} trained in its order: {prefix}; "
          f"past its end: {extra} (the last window, of {last}, crosses it); trained twice: {dup}")
    ok &= prefix and 0 <= extra < last and dup == 0

    tokens_c = sum(s["tokens"] for s in const["steps"])
    tokens_g = sum(s["tokens"] for s in steps)
    print(f"tokens stepped: constant {tokens_c:,}, grown {tokens_g:,} ({tokens_g / tokens_c:.4f}x); "
          f"microbatches without an optimizer step at the end: constant {const['unstepped']}, "
          f"grown {grown['unstepped']}")
    ok &= grown["unstepped"] == 0

    worst, worst_at, missing, sizes = 0.0, None, 0, {}
    schedule = [s["lr"] for s in const["steps"]]  # the scheduler's value at each of its steps
    position = 0  # microbatches before the step
    for s in steps:
        ratio = s["micro"] / a0
        sizes[s["micro"]] = sizes.get(s["micro"], 0) + 1
        couple = {"sqrt": math.sqrt(ratio), "linear": ratio, "keep": 1.0}[args.coupling]
        if args.lr_clock == "data":
            ref = lr_at.get(s["before"])  # the constant run's LR at a step that started on the same token
        elif args.lr_clock == "end":
            ref = lr_ending.get(s["before"] + s["tokens"])  # ... at the step that ended on the same token
        else:
            k = position // a0
            ref = schedule[k] if k < len(schedule) and position % a0 == 0 else None
        position += s["micro"]
        if ref is None:
            missing += 1
            continue
        diff = abs(s["lr"] - ref * couple)
        if diff > worst:
            worst, worst_at = diff, s["before"]
    peak = max(schedule)
    one_step = max(abs(x - y) for x, y in zip(schedule, schedule[1:]))
    clock = {"data": "the constant run's at the step starting on the same token",
             "end": "the constant run's at the step ending on the same token",
             "schedule": f"the schedule's at step (microbatches before it) / {a0}"}[args.lr_clock]
    print(f"optimizer steps: constant {len(const['steps'])}, grown {len(steps)}; microbatches per step "
          f"{dict(sorted(sizes.items()))}; LR against {clock} x {args.coupling}(B/B0): max |difference| "
          f"{worst:.3g} ({worst / peak:.2g} of the peak {peak:.3g}; the schedule's largest change in one step "
          f"{one_step:.3g}) at token {worst_at}; steps with no reference: {missing}")
    ok &= missing == 0 and worst <= args.rtol * peak
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
