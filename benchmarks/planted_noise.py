"""Growth rules on a noise scale planted by construction, against the best schedule that knows it in advance.

The noise scale rises through the run in a known way (``NOISE``: linear, steeper, square root) under a
cosine or WSD LR (``SCHEDULES``); the controller is fed it with an interval of 0.8x to 1.25x, and a training loss
that falls 0.5 nats per e-fold of tokens (``LOSS``: off any plateau, so the default's hold on a loss plateau lets
the rule grow a quarter into the run, where its verdict comes). The reference
(``offline_optimum``) is the power-of-two schedule with the fewest steps whose waste fits a budget: each
step's tokens x McCandlish's share of tokens lost to its batch (``waste_share``) x LR / peak LR, summed.
Prints, per LR schedule and noise shape, the steps saved (against the starting batch throughout) by the
default at ``kappa`` 0.3, 0.32, 0.4 (the default) and 0.5, the waste the default spent, the optimum's saving at
that waste and at 5% and 8% of the run's tokens, and the ``kappa`` rule alone (``hold_on_plateau=None``, the
earlier default: it grows from the start). ``tests/test_default_rule.py`` asserts on it.

    python benchmarks/planted_noise.py      # a few seconds
"""

from __future__ import annotations

import math
from collections.abc import Callable

from cbs_tracker.policy.controller import BatchSizeController
from cbs_tracker.policy.efficiency import waste_share

MICRO = 256.0  # units per accumulation step
TOTAL, B0 = 4e6, 2 * MICRO  # the run's units; its starting batch (accumulation 2)
SCHEDULES: dict[str, Callable[[float], float]] = {  # LR / peak at a fraction of the run
    "cosine": lambda p: 0.1 + 0.45 * (1 + math.cos(math.pi * min(p, 1.0))),
    "wsd": lambda p: 1.0 if p < 0.8 else 1.0 - 0.9 * (p - 0.8) / 0.2,
}
NOISE: dict[str, Callable[[float], float]] = {  # the noise scale after t units
    "linear": lambda t: B0 * (2.5 + 12 * t / TOTAL),
    "steeper": lambda t: B0 * (4 + 16 * t / TOTAL),
    "sqrt": lambda t: B0 * (2 + 14 * math.sqrt(t / TOTAL)),
}


def LOSS(t: float) -> float:  # noqa: N802 - a planted quantity, as NOISE
    """The training loss after ``t`` units: 0.5 nats per e-fold of tokens, off any plateau."""
    return 10.0 - 0.5 * math.log(t)


def run(controller: BatchSizeController, noise: Callable[[float], float], lr: Callable[[float], float],
        total: float = TOTAL) -> tuple[int, list[tuple[float, float]], float]:
    """The controller over the run, fed the planted noise scale: its steps, ``(units, batch)`` after every
    step, and the waste it spent."""
    acc, tokens, steps, batches, waste, peak = 2, 0.0, 0, [], 0.0, 0.0
    while tokens + MICRO * acc <= total:
        batch = MICRO * acc
        tokens += batch
        steps += 1
        n, lr_now = noise(tokens), lr(tokens / total)
        peak = max(peak, lr_now)
        waste += batch * waste_share(batch, B0, n) * lr_now / peak
        controller.observe_loss(tokens, LOSS(tokens))
        d = controller.update(step=steps, tokens_seen=tokens, global_batch=batch, accumulation_steps=acc,
                              noise_scale=n, noise_scale_low=0.8 * n, noise_scale_high=1.25 * n, scheduled_lr=lr_now)
        batches.append((tokens, batch))
        acc = d.accumulation_steps
    return steps, batches, waste


def offline_optimum(budget: float, total: float, b0: float, noise, lr, *, segments: int = 200, levels: int = 7):
    """The power-of-two schedule (non-decreasing, never above the noise scale) with the fewest steps whose
    LR-weighted waste is at most ``budget * total``: dynamic programming over ``segments`` equal spans for
    ``steps + lam * waste``, ``lam`` bisected to the budget. Returns its waste, its steps and its level
    (the batch is ``b0 * 2**level``) in each span. A slow exact reference for the online rules."""
    dt = total / segments
    mids = [(i + 0.5) * dt for i in range(segments)]

    def solve(lam):
        cost = [0.0] + [math.inf] * (levels - 1)
        back = []
        for t in mids:
            new, arg = [math.inf] * levels, [0] * levels
            for e in range(levels):
                j = min(range(e + 1), key=cost.__getitem__)
                b = b0 * 2**e
                if e and b > noise(t):
                    continue
                new[e] = cost[j] + dt / b + lam * dt * waste_share(b, b0, noise(t)) * lr(t)
                arg[e] = j
            back.append(arg)
            cost = new
        e = min(range(levels), key=cost.__getitem__)
        path = [e]
        for arg in reversed(back[1:]):
            e = arg[e]
            path.append(e)
        path.reverse()
        waste = sum(dt * waste_share(b0 * 2**e, b0, noise(t)) * lr(t) for e, t in zip(path, mids))
        return waste, sum(dt / (b0 * 2**e) for e in path), path

    lo, hi = 1e-9, 1e-1
    for _ in range(40):
        lam = math.sqrt(lo * hi)
        if solve(lam)[0] > budget * total:
            lo = lam
        else:
            hi = lam
    return solve(hi)


def saved(steps: float) -> float:
    """The share of the starting batch's steps not taken."""
    return 1 - steps / (TOTAL / B0)


def main() -> int:
    print("| LR | noise scale | kappa 0.3 | 0.32 | 0.4 (default) | 0.5 | default's waste | optimum at it | at 5% | at 8% "
          "| kappa 0.4 alone |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for schedule, lr in SCHEDULES.items():
        for shape, noise in NOISE.items():
            by_kappa = {k: saved(run(BatchSizeController(kappa=k, total_tokens=TOTAL), noise, lr)[0])
                        for k in (0.3, 0.32, 0.4, 0.5)}
            waste = run(BatchSizeController(total_tokens=TOTAL), noise, lr)[2] / TOTAL
            best = [saved(offline_optimum(b, TOTAL, B0, noise, lambda t, lr=lr: lr(t / TOTAL))[1])
                    for b in (waste, 0.05, 0.08)]
            print(f"| {schedule} | {shape} | " + " | ".join(f"{v:.0%}" for v in by_kappa.values())
                  + f" | {waste:.1%} | " + " | ".join(f"{v:.0%}" for v in best)
                  + f" | {saved(run(BatchSizeController(total_tokens=TOTAL, hold_on_plateau=None), noise, lr)[0]):.0%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
