"""``cbs-tracker plan``: the power-of-two doubling plan of the FSL optimum for a budget.

``cbs-tracker plan --budget 3e6 --b-min 8 --b-max 8192 --s 0.49 --beta 1.96`` prints
the regime, the optimum's steps and hold phase, then one line per rung: the batch,
the units consumed when it starts and that position as a fraction of the budget
(``--json`` adds one JSON object as the last line). All sizes share the budget's
unit; :func:`cbs_tracker.theory.schedule.plan_doubling` says how the free scale is
fixed (``--reference-batch``, ``--floor-ratio``, ``--steps``).
"""

from __future__ import annotations

import argparse
import json
import sys

from cbs_tracker.commands import open_unit_ratio
from cbs_tracker.theory.schedule import (
    ScalingLaw,
    doubling_plan,
    optimal_schedule,
    optimal_steps_exponent,
    regime,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cbs-tracker plan",
        description="Print the doubling plan (tokens at which each doubling happens) of the optimal "
        "batch schedule under a functional scaling law.",
    )
    parser.add_argument("--budget", type=float, required=True, help="total tokens (or samples) of the run")
    parser.add_argument("--b-min", type=float, required=True, help="smallest (starting) batch, same unit")
    parser.add_argument("--b-max", type=float, required=True, help="largest batch, same unit")
    parser.add_argument("--s", type=float, default=0.5,
                        help="FSL source exponent (> 0; default 0.5, the controller's plan_s)")
    parser.add_argument("--beta", type=float, default=2.0,
                        help="FSL capacity exponent (> 1; default 2.0, the controller's plan_beta)")
    parser.add_argument(
        "--reference-batch", type=float, default=None,
        help="best constant batch at this budget (sets the noise/signal ratio); overrides --floor-ratio",
    )
    parser.add_argument(
        "--floor-ratio", type=open_unit_ratio, default=0.5,
        help="noise floor of a constant b-min run as a fraction of the initial excess loss (default 0.5)",
    )
    parser.add_argument("--steps", type=int, default=None, help="use this number of optimizer steps T")
    parser.add_argument("--factor", type=float, default=2.0, help="ratio of consecutive batch sizes (default 2)")
    parser.add_argument(
        "--switch-at", choices=["geometric_mean", "reach"], default="geometric_mean",
        help="switch where the optimum crosses sqrt(B_j-1 B_j) (default) or B_j",
    )
    parser.add_argument("--json", action="store_true", help="also print the plan as one JSON object (last line)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.reference_batch is not None:
            law = ScalingLaw.from_reference_batch(
                s=args.s, beta=args.beta, reference_batch=args.reference_batch, budget=args.budget
            )
        else:
            law = ScalingLaw.from_noise_floor(s=args.s, beta=args.beta, b_min=args.b_min, floor_ratio=args.floor_ratio)
        sched = optimal_schedule(law, args.budget, args.b_min, args.b_max, steps=args.steps)
        plan = doubling_plan(sched, factor=args.factor, switch_at=args.switch_at)
    except (ValueError, TypeError) as exc:
        print(f"cbs-tracker plan: {exc}", file=sys.stderr)
        return 2
    reg = regime(args.s, args.beta)
    print(
        f"regime: {reg} (s={args.s:g} {'<=' if reg == 'hard' else '>'} 1 - 1/beta = {1 - 1 / args.beta:.4f}); "
        f"T* ~ D^{optimal_steps_exponent(args.s, args.beta):.3f}"
    )
    print(
        f"optimum: T={sched.steps} steps, b(t) = clip({sched.scale:.6g} (T-t+1)^{sched.exponent:.4f}, "
        f"{args.b_min:g}, {args.b_max:g}); holds b_min for {sched.hold_steps} steps "
        f"({sched.tokens_before(sched.hold_steps + 1) / args.budget:.1%} of the budget)"
    )
    print(f"staircase: {plan.steps} steps, switch rule {plan.switch_at}")
    print(f"{'batch':>12}  {'from tokens':>16}  {'fraction':>8}  {'optimum step':>12}")
    starts = (0.0, *plan.switch_tokens)
    steps = (1, *plan.switch_steps)
    for b, z, t in zip(plan.batches, starts, steps, strict=True):
        print(f"{b:>12.6g}  {z:>16.6g}  {z / plan.budget:>8.2%}  {t:>12d}")
    if args.json:
        print(
            json.dumps(
                {
                    "budget": plan.budget,
                    "regime": reg,
                    "optimum_steps": sched.steps,
                    "staircase_steps": plan.steps,
                    "batches": list(plan.batches),
                    "switch_tokens": list(plan.switch_tokens),
                    "switch_steps": list(plan.switch_steps),
                }
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
