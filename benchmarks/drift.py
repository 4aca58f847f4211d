"""Does the estimator follow a noise scale that moves? Synthetic gradients with a known drift.

Per-example gradients ~ N(G(u), sigma(u)^2 I_d) in d = 128 dimensions, ``u`` the units
seen. ``|G(u)|^2`` decays as a power law from 100x its late value,
``1 + 99 (1 + u / u_c)^-1.5`` with ``u_c`` 2% of the run (normalised to 1 at the end),
while ``tr(Sigma) = d sigma^2`` rises linearly by 1.5x; so ``B_simple(u)`` is known at
every step and rises ~150x over the run. Each row runs K = 2 microbatches of
``b = B_end * start`` examples per step for 4,000 steps and prints, over the steps after
the first 5% of the run, the mean of ``|reported / truth - 1|`` and how often the 90%
interval holds the current truth (means over seeds).

Beside each row it prints a reference that knows the truth: the ratio of the weighted
means of the per-step estimates (weighted as the estimator weighs them, without its
outlier clipping and ratio-bias correction) over a trailing window, its length picked
*with hindsight* from ``HINDSIGHT_LENGTHS``, one length for all seeds in each of three
parts of the run (5-20%, 20-50%, 50-100% of the steps). It says how well a well-chosen
trailing window does; it is not a bound on every memory rule (a trend can beat it).

    python benchmarks/drift.py [--seeds 4] [--steps 4000] [--memory window] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from cbs_tracker.core.estimator import NoiseScaleEstimator

DIM = 128
B_END = 4096.0
STARTS = (1 / 32, 1 / 8, 1 / 2)


def drifting_truth(steps: int, units_per_step: float, *, decay: float = 100.0, power: float = 1.5,
                   knee: float = 0.02, trace_rise: float = 1.5) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(|G|^2, sigma^2, B_simple)`` at each step's end; ``B_simple`` reaches ``B_END`` at the last step."""
    total = steps * units_per_step
    u = units_per_step * np.arange(1, steps + 1)
    shape = 1 + (decay - 1) * (1 + u / (knee * total)) ** (-power)
    grad_sq = shape / shape[-1]
    trace = B_END * (1 + (trace_rise - 1) * u / total) / trace_rise
    return grad_sq, trace / DIM, trace / grad_sq


def drifting_norms(rng: np.random.Generator, b: float, k: int, grad_sq: np.ndarray,
                   sigma_sq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact draws of each step's small and big squared norms (no d-dimensional vectors).

    A microbatch mean is ``m_k = e_1 (|G| + s u_k) + s xi_k`` with ``s = sigma / sqrt(b)``,
    ``u_k`` standard normal and ``xi_k`` standard normal in the other ``DIM - 1``
    directions, whose Gram matrix is drawn by Bartlett's decomposition.

    Returns:
        ``(small, big)``: per step the mean of the ``|m_k|^2`` and ``|mean_k m_k|^2``.
    """
    steps = len(grad_sq)
    g = np.sqrt(grad_sq)
    s = np.sqrt(sigma_sq / b)
    u = rng.standard_normal((steps, k))
    lower = np.tril(rng.standard_normal((steps, k, k)), -1)
    lower[:, np.arange(k), np.arange(k)] = np.sqrt(rng.chisquare(DIM - 1 - np.arange(k), size=(steps, k)))
    along = (g[:, None] + s[:, None] * u) ** 2
    small = np.mean(along + s[:, None] ** 2 * np.sum(lower**2, axis=2), axis=1)
    big = (g + s * u.mean(axis=1)) ** 2 + s**2 * np.sum(lower.sum(axis=1) ** 2, axis=1) / (k * k)
    return small, big


@dataclass(frozen=True)
class DriftRow:
    """One start of the table.

    Attributes:
        start_over_truth: microbatch size over the late ``B_simple``.
        mean_abs_error: mean over seeds and steps (after the first 5%) of ``|reported / truth - 1|``.
        coverage: share of those steps whose 90% interval holds the current truth.
        missing: share of those steps with no reported value (counted as error 1, not covered).
        seeds: seeds run.
        hindsight_error: the same error for trailing windows whose lengths were chosen
            with hindsight from the truth (see :func:`hindsight_error`).
    """

    start_over_truth: float
    mean_abs_error: float
    coverage: float
    missing: float
    seeds: int
    hindsight_error: float


#: trailing-window lengths (steps) the hindsight reference chooses from
HINDSIGHT_LENGTHS = (25, 50, 75, 100, 150, 200, 300, 400, 600, 800, 1000, 1200, 1600, 2000)
#: where the parts of the run that each get their own length end (shares of all its steps)
HINDSIGHT_PARTS = (0.2, 0.5)


def trailing_errors(small: np.ndarray, big: np.ndarray, b: float, k: int, truth: np.ndarray,
                    length: int, *, scale_steps: float = 8.0) -> np.ndarray:
    """``|estimate / truth - 1|`` at every step of the ratio of the weighted means over the last ``length`` steps.

    Per-step ``|G|^2`` and ``tr(Sigma)`` from the two norms, each step weighted by 1 over an
    exponential average (``scale_steps``) of the small-batch norm, as the estimator weighs them.
    """
    big_batch = b * k
    g = (big_batch * big - b * small) / (big_batch - b)
    t = (small - big) / (1 / b - 1 / big_batch)
    weight = np.empty(len(small))
    scale, keep = float(small[0]), math.exp(-1.0 / scale_steps)
    for i, s in enumerate(small):
        weight[i] = 1.0 / scale
        scale = keep * scale + (1.0 - keep) * float(s)
    cg = np.concatenate(([0.0], np.cumsum(weight * g)))
    ct = np.concatenate(([0.0], np.cumsum(weight * t)))
    end = np.arange(1, len(small) + 1)
    begin = np.maximum(0, end - length)
    with np.errstate(divide="ignore", invalid="ignore"):
        estimate = (ct[end] - ct[begin]) / (cg[end] - cg[begin])
    return np.where(np.isfinite(estimate), np.abs(estimate / truth - 1), 1.0)


def hindsight_error(errors_by_length: dict[int, np.ndarray], first: int) -> float:
    """The mean error after ``first`` when each part of the run takes its best trailing length.

    ``errors_by_length[n]``: ``(seeds, steps)`` errors of :func:`trailing_errors`.
    """
    steps = next(iter(errors_by_length.values())).shape[1]
    cuts = [first, *(max(first, int(f * steps)) for f in HINDSIGHT_PARTS), steps]
    total = 0.0
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        total += min(float(e[:, lo:hi].sum()) for e in errors_by_length.values())
    seeds = next(iter(errors_by_length.values())).shape[0]
    return total / (seeds * (steps - first))


def run_row(start: float, *, seeds: int, steps: int, k: int = 2, **estimator_kwargs: object) -> DriftRow:
    """Feed ``seeds`` drifting runs with microbatches of ``start * B_END`` to fresh estimators."""
    b = B_END * start
    grad_sq, sigma_sq, truth = drifting_truth(steps, b * k)
    first = int(0.05 * steps)
    errors, covered, missing = [], [], []
    trailing: dict[int, list[np.ndarray]] = {n: [] for n in HINDSIGHT_LENGTHS}
    for seed in range(seeds):
        small, big = drifting_norms(np.random.default_rng([seed, 20]), b, k, grad_sq, sigma_sq)
        for n in HINDSIGHT_LENGTHS:
            trailing[n].append(trailing_errors(small, big, b, k, truth, n))
        est = NoiseScaleEstimator(**estimator_kwargs)  # type: ignore[arg-type]
        for i in range(steps):
            r = est.update(float(small[i]), float(big[i]), b, b * k)
            if i < first:
                continue
            if r.noise_scale is None:
                errors.append(1.0), covered.append(False), missing.append(True)
                continue
            errors.append(abs(r.noise_scale / truth[i] - 1))
            covered.append(r.noise_scale_low <= truth[i] <= r.noise_scale_high)  # type: ignore[operator]
            missing.append(False)
    hindsight = hindsight_error({n: np.stack(e) for n, e in trailing.items()}, first)
    return DriftRow(start, float(np.mean(errors)), float(np.mean(covered)), float(np.mean(missing)), seeds, hindsight)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--memory", default="window", choices=("window", "adaptive"))
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    rows = [run_row(s, seeds=args.seeds, steps=args.steps, memory=args.memory) for s in STARTS]
    print(f"B_simple rises ~150x to {B_END:,.0f}; K = 2; {args.steps} steps; after the first 5%; "
          f"{args.seeds} seeds; memory={args.memory}")
    print(f"{'start/B_end':>11} {'mean |rep/truth-1|':>19} {'90% coverage':>13} {'hindsight windows':>18}")
    for r in rows:
        print(f"{'1/' + format(1 / r.start_over_truth, 'g'):>11} {r.mean_abs_error:>19.3f} {r.coverage:>13.2f} "
              f"{r.hindsight_error:>18.3f}")
    print(f"({time.perf_counter() - t0:.0f}s)")
    if args.json:
        print(json.dumps([asdict(r) for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
