"""SGD learning-rate schedules on the noisy quadratic model against their conversion into batch growth.

Each halving of the scheduled step size becomes a doubling of the batch at the step
size held (up to ``2**max_doublings`` times the starting batch), at equal samples;
the losses are the exact expected losses of the recursion
``v <- (1 - eta_k h)^2 v + eta_k^2 sigma^2 / B_k``. Run ``python -m cbs_tracker.theory.nqm_lr``.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from cbs_tracker.theory.nqm import ExactNQM

__all__ = ["ScheduleComparison", "compare_conversion", "converted_schedule", "exact_final_loss",
           "fixed_batch_schedule", "lr_schedule"]

SCHEDULES = ("step", "cosine", "cosine_to_10pct")


def lr_schedule(name: str) -> Callable[[float], float]:
    """The LR multiplier (peak 1) at a fraction ``f`` of the samples.

    ``step``: x0.1 at 50% and again at 75% of the samples; ``cosine``: ``(1 + cos(pi f)) / 2``;
    ``cosine_to_10pct``: ``0.1 + 0.9 (1 + cos(pi f)) / 2``.

    Raises:
        ValueError: an unknown name.
    """
    if name == "step":
        return lambda f: 1.0 if f < 0.5 else 0.1 if f < 0.75 else 0.01
    if name == "cosine":
        return lambda f: 0.5 * (1.0 + math.cos(math.pi * min(f, 1.0)))
    if name == "cosine_to_10pct":
        return lambda f: 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(f, 1.0)))
    raise ValueError(f"lr_schedule(name={name!r}): expected one of {list(SCHEDULES)}")


def fixed_batch_schedule(multiplier: Callable[[float], float], budget: float, batch: float,
                         peak_lr: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-step ``(lrs, batches)`` of the schedule at a constant ``batch`` (a short last step scales its step size)."""
    lrs, batches, tokens = [], [], 0.0
    while tokens < budget * (1 - 1e-12):
        batches.append(min(batch, budget - tokens))
        lrs.append(peak_lr * multiplier(tokens / budget) * batches[-1] / batch)
        tokens += batches[-1]
    return np.asarray(lrs), np.asarray(batches)


def converted_schedule(multiplier: Callable[[float], float], budget: float, batch: float, peak_lr: float,
                       max_doublings: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-step ``(lrs, batches)`` of the conversion: ``k`` halvings of the multiplier so far
    (at most ``max_doublings``) give batch ``batch * 2**k`` and step size ``multiplier * 2**k * peak_lr``.

    The step size per sample (``lr / batch``) is the schedule's, so a short last step
    (what is left of the budget) gets a proportionally smaller step size.
    """
    lrs, batches, tokens = [], [], 0.0
    while tokens < budget * (1 - 1e-12):
        m = multiplier(tokens / budget)
        k = max_doublings if m <= 0 else min(max_doublings, int(math.floor(math.log2(1.0 / m) + 1e-9)))
        batches.append(min(batch * 2**k, budget - tokens))
        lrs.append(peak_lr * m * batches[-1] / batch)
        tokens += batches[-1]
    return np.asarray(lrs), np.asarray(batches)


def exact_final_loss(model: ExactNQM, lrs: np.ndarray, batches: np.ndarray) -> float:
    """Expected loss after SGD with step sizes ``lrs`` and batches ``batches`` (runs of equal steps in closed form)."""
    h, sigma2 = model.curvatures, model.noise_variance
    v = model.initial_second_moment.copy()
    start, n = 0, len(lrs)
    while start < n:
        end = start + 1
        while end < n and lrs[end] == lrs[start] and batches[end] == batches[start]:
            end += 1
        a = (1.0 - lrs[start] * h) ** 2
        inject = lrs[start] ** 2 * sigma2 / batches[start]
        if end - start == 1:
            v = a * v + inject
        else:
            a_n = a ** (end - start)
            v = v * a_n + inject * (1.0 - a_n) / (1.0 - a)
        start = end
    return float(0.5 * np.dot(h, v))


@dataclass(frozen=True)
class ScheduleComparison:
    """One schedule and its conversion at equal samples.

    Attributes:
        schedule: the schedule's name (see :func:`lr_schedule`).
        fixed_loss / converted_loss: exact expected final losses.
        fixed_steps / converted_steps: optimizer steps.
        loss_ratio: ``converted_loss / fixed_loss``.
        largest_batch: the converted run's largest batch.
    """

    schedule: str
    fixed_loss: float
    converted_loss: float
    fixed_steps: int
    converted_steps: int
    loss_ratio: float
    largest_batch: float


def compare_conversion(schedule: str, *, budget: float = 3e6, batch: float = 8.0, max_doublings: int = 3,
                       model: ExactNQM | None = None) -> ScheduleComparison:
    """A schedule at a fixed ``batch`` against its conversion, on the NQM (the model's ``lr`` is the peak).

    Raises:
        ValueError: an unknown schedule, ``budget < batch``, ``batch <= 0`` or ``max_doublings < 0``.
    """
    if not (isinstance(batch, (int, float)) and batch > 0 and math.isfinite(batch)):
        raise ValueError(f"compare_conversion(batch={batch!r}): expected a finite number > 0")
    if not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget >= batch):
        raise ValueError(f"compare_conversion(budget={budget!r}): expected a finite number >= batch={batch!r}")
    if isinstance(max_doublings, bool) or not isinstance(max_doublings, int) or max_doublings < 0:
        raise ValueError(f"compare_conversion(max_doublings={max_doublings!r}): expected an int >= 0")
    model = model or ExactNQM()
    multiplier = lr_schedule(schedule)
    fixed = fixed_batch_schedule(multiplier, budget, batch, model.lr)
    converted = converted_schedule(multiplier, budget, batch, model.lr, max_doublings)
    fixed_loss, converted_loss = exact_final_loss(model, *fixed), exact_final_loss(model, *converted)
    return ScheduleComparison(
        schedule=schedule, fixed_loss=fixed_loss, converted_loss=converted_loss, fixed_steps=len(fixed[0]),
        converted_steps=len(converted[0]), loss_ratio=converted_loss / fixed_loss,
        largest_batch=float(converted[1].max()),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cbs_tracker.theory.nqm_lr", description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=3e6, help="samples per run (default 3e6)")
    parser.add_argument("--batch", type=float, default=8.0, help="the fixed (starting) batch (default 8)")
    parser.add_argument("--max-doublings", type=int, default=3, help="cap of the conversion (default 3: x8)")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON object (last line)")
    args = parser.parse_args(argv)
    rows = [compare_conversion(s, budget=args.budget, batch=args.batch, max_doublings=args.max_doublings)
            for s in SCHEDULES]
    print(f"NQM, SGD, budget {args.budget:.4g} samples, batch {args.batch:g}, conversion up to x{2**args.max_doublings}")
    print(f"{'schedule':<16} {'fixed loss':>11} {'converted':>11} {'ratio':>7} {'steps':>8} {'conv. steps':>11}")
    for r in rows:
        print(f"{r.schedule:<16} {r.fixed_loss:>11.6f} {r.converted_loss:>11.6f} {r.loss_ratio:>7.4f} "
              f"{r.fixed_steps:>8d} {r.converted_steps:>8d} ({r.converted_steps / r.fixed_steps - 1:+.1%})")
    if args.json:
        print(json.dumps({r.schedule: asdict(r) for r in rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
