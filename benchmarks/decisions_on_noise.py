"""Does the controller grow on noise? A frozen regression whose noise scale is known and never changes.

Per-step norms are sampled exactly as a frozen linear regression gives them (|G|^2 = 1,
tr(Sigma) = truth, d = 256), fed to the library's estimator and controller unchanged,
starting at 1/32 of the noise scale. The right final batch is the largest power-of-two
step of the start at or below kappa * B_simple / (1 + margin); the script prints, over
seeds, how many runs reached it, stopped short, or went beyond.

    python benchmarks/decisions_on_noise.py [--seeds 20] [--steps 3000] [--truth 257]
"""

from __future__ import annotations

import argparse
import math
import warnings

import numpy as np

from cbs_tracker.core.estimator import NoiseScaleEstimator
from cbs_tracker.policy.controller import BatchSizeController


def run(seed: int, *, truth: float, steps: int, micro: float, a0: int, evidence: bool) -> list[float]:
    rng = np.random.default_rng(seed)
    d = 256
    var = truth / d  # per-coordinate variance of one example's gradient: tr(Sigma) = truth
    est = NoiseScaleEstimator()
    ctrl = BatchSizeController(hold_on_plateau=None)  # a noise scale, no loss: the rule alone
    acc, units, batches = a0, 0.0, []
    for step in range(1, steps + 1):
        k = acc
        mean = rng.standard_normal(d) * math.sqrt(var / (k * micro))
        mean[0] += 1.0
        big = float(mean @ mean)
        small = big + var / micro * rng.chisquare(d * (k - 1)) / k  # mean of the k microbatch norms
        est.update(small, big, micro, k * micro, k * micro)
        units += k * micro
        interval = est.noise_scale_interval if evidence else None
        low, high = interval if interval is not None else (None, None)
        decision = ctrl.update(step=step, tokens_seen=units, global_batch=k * micro, accumulation_steps=acc,
                               noise_scale=est.noise_scale, noise_scale_low=low, noise_scale_high=high)
        batches.append(k * micro)
        acc = decision.accumulation_steps
    return batches


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--truth", type=float, default=257.0)
    args = p.parse_args()
    micro, a0 = 4.0, 2
    start = micro * a0
    ctrl = BatchSizeController(hold_on_plateau=None)  # a noise scale, no loss: the rule alone
    allowed = start
    while allowed * 2 <= ctrl.kappa * args.truth / (1 + ctrl.margin):
        allowed *= 2
    print(f"B_simple {args.truth:g}, start {start:g} (1/{args.truth / start:.0f}), kappa {ctrl.kappa}, "
          f"margin {ctrl.margin}: allowed final batch {allowed:g}")
    for evidence in (False, True):
        reached = short = beyond = 0
        finals = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for seed in range(args.seeds):
                b = run(seed, truth=args.truth, steps=args.steps, micro=micro, a0=a0, evidence=evidence)
                finals.append(b[-1])
                if max(b) > allowed:
                    beyond += 1
                elif b[-1] == allowed:
                    reached += 1
                else:
                    short += 1
        rule = "median + interval lower end" if evidence else "median rule alone"
        print(f"{rule:28s}: reached {reached}/{args.seeds}, stopped short {short}, went beyond {beyond}; "
              f"final batches {sorted(finals)}")


if __name__ == "__main__":
    main()
