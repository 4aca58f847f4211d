"""How close and how sure the default ``NoiseScaleEstimator`` is on synthetic gradients with a known noise scale.

Per-example gradients ~ N(G, I + G G^T) in d = 256 dimensions with |G|^2 = 1, so
tr(Sigma) = 257 and B_simple = 257 (the covariance of a linear-regression gradient).
Each row feeds K microbatches of b examples per step for 1,500 steps and prints the
mean over seeds of the reported noise scale averaged over the second half, the seed
spread, and how often the final 90% interval holds the truth.

    python benchmarks/estimator_accuracy.py [--seeds 20] [--coverage-seeds 200] [--steps 1500] [--json]
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

DIM = 256
GRAD_SQ = 1.0
TRACE = DIM + GRAD_SQ  # tr(I + G G^T)
TRUTH = TRACE / GRAD_SQ
# (microbatch b, microbatches K, outlier clipping on)
ROWS: tuple[tuple[int, int, bool], ...] = ((4, 2, True), (4, 2, False), (4, 4, True), (16, 2, True), (64, 2, True))


def synthetic_norms(
    rng: np.random.Generator, b: int, k: int, steps: int, grad_sq: float = GRAD_SQ
) -> tuple[np.ndarray, np.ndarray]:
    """Exact draws of a step's small and big squared norms, without the d-dimensional gradients.

    Per-example gradients ~ N(G, I + G G^T) in ``DIM`` dimensions, so ``tr(Sigma) = DIM + |G|^2``.
    With ``G = |G| e_1`` a microbatch mean is ``m_k = e_1 (|G| + u_k) + xi_k / sqrt(b)`` with
    ``u_k ~ N(0, (1 + |G|^2)/b)`` and ``xi_k`` standard normal in the ``DIM - 1`` other
    directions; the Gram matrix of the ``xi_k`` is Wishart, drawn by Bartlett's
    decomposition ``L L^T``.

    Args:
        rng: the random generator.
        b: examples per microbatch.
        k: microbatches per step (>= 2).
        steps: steps to draw.
        grad_sq: ``|G|^2``.

    Returns:
        ``(small, big)``: per step the mean of the ``|m_k|^2`` and ``|mean_k m_k|^2``.
    """
    g = math.sqrt(grad_sq)
    u = rng.normal(0.0, math.sqrt((1.0 + grad_sq) / b), size=(steps, k))
    lower = np.tril(rng.standard_normal((steps, k, k)), -1)
    diag = np.sqrt(rng.chisquare(DIM - 1 - np.arange(k), size=(steps, k)))
    lower[:, np.arange(k), np.arange(k)] = diag
    along = (g + u) ** 2
    small = np.mean(along + np.sum(lower**2, axis=2) / b, axis=1)
    big = (g + u.mean(axis=1)) ** 2 + np.sum(lower.sum(axis=1) ** 2, axis=1) / (k * k * b)
    return small, big


@dataclass(frozen=True)
class SeedRun:
    """One seed of one row.

    Attributes:
        second_half_mean: mean of the reported noise scale over the second half of the steps.
        oracle: the noise scale from all steps' norms averaged flat (the statistical floor).
        final: the noise scale after the last step.
        low: lower end of the final 90% interval.
        high: upper end of the final 90% interval.
    """

    second_half_mean: float
    final: float
    low: float
    high: float
    oracle: float = math.nan


def run_seed(b: int, k: int, clip: bool, seed: int, steps: int, **estimator_kwargs: object) -> SeedRun:
    """Feed one seed's synthetic norms to a fresh estimator."""
    rng = np.random.default_rng([seed, b, k])
    small, big = synthetic_norms(rng, b, k, steps)
    kwargs = dict(estimator_kwargs)
    if not clip:
        kwargs["outlier_clip"] = None
    est = NoiseScaleEstimator(**kwargs)  # type: ignore[arg-type]
    half = steps // 2
    reported = []
    for i, (s, g) in enumerate(zip(small.tolist(), big.tolist())):
        ns = est.update(s, g, float(b), float(k * b)).noise_scale
        if i >= half:
            reported.append(math.nan if ns is None else ns)
    interval = est.noise_scale_interval or (math.nan, math.nan)
    final = est.noise_scale
    s_mean, g_mean = float(small.mean()), float(big.mean())
    oracle = ((s_mean - g_mean) / (1 / b - 1 / (k * b))) / ((k * g_mean - s_mean) / (k - 1))
    return SeedRun(float(np.mean(reported)), math.nan if final is None else final, *interval, oracle)


@dataclass(frozen=True)
class Row:
    """One row of the table (ratios to the truth)."""

    microbatch: int
    microbatches: int
    clipping: bool
    start_over_truth: float
    mean_ratio: float
    spread_ratio: float
    seeds: int
    coverage: float | None
    coverage_seeds: int
    oracle_spread: float = math.nan


def run_row(b: int, k: int, clip: bool, *, seeds: int, steps: int, coverage_seeds: int = 0,
            **estimator_kwargs: object) -> Row:
    """The table's row for ``(b, K, clipping)``: mean and spread over seeds, and coverage."""
    runs = [run_seed(b, k, clip, s, steps, **estimator_kwargs) for s in range(max(seeds, coverage_seeds))]
    means = np.array([r.second_half_mean for r in runs[:seeds]]) / TRUTH
    coverage = None
    if coverage_seeds:
        hits = [r.low <= TRUTH <= r.high for r in runs[:coverage_seeds]]
        coverage = float(np.mean(hits))
    oracle = np.array([r.oracle for r in runs[:seeds]]) / TRUTH
    return Row(b, k, clip, b * k / TRUTH, float(means.mean()), float(means.std(ddof=1)), seeds, coverage,
               coverage_seeds, float(oracle.std(ddof=1)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--coverage-seeds", type=int, default=200, help="seeds for the coverage of the hardest and easiest row")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--measure-every", type=int, default=1,
                   help="a tracker measuring one window in n: the estimator sees steps // n of the steps")
    p.add_argument("--hardest-only", action="store_true", help="only the first row (b = 4, K = 2, clipping on)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    start = time.perf_counter()
    steps = args.steps // args.measure_every
    rows = []
    for i, (b, k, clip) in enumerate(ROWS[:1] if args.hardest_only else ROWS):
        cov = args.coverage_seeds if i in (0, len(ROWS) - 1) else 0
        rows.append(run_row(b, k, clip, seeds=args.seeds, steps=steps, coverage_seeds=cov))
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
        return 0
    every = f" (measure_every={args.measure_every}: {steps} of them measured)" if args.measure_every > 1 else ""
    print(f"truth B_simple = {TRUTH:g}; {args.steps} steps{every}; mean over the second half; {args.seeds} seeds")
    print(f"{'b':>3} {'K':>2} {'clip':>5} {'start/B':>8} {'mean/truth':>10} {'sd/truth':>9} {'flat oracle sd':>15} "
          f"{'90% coverage':>14}")
    for r in rows:
        cov = "" if r.coverage is None else f"{r.coverage:.3f} ({r.coverage_seeds})"
        print(f"{r.microbatch:>3} {r.microbatches:>2} {'on' if r.clipping else 'off':>5} "
              f"1/{1 / r.start_over_truth:<6.3g} {r.mean_ratio:>10.3f} {r.spread_ratio:>9.3f} {r.oracle_spread:>15.3f} "
              f"{cov:>14}")
    print(f"({time.perf_counter() - start:.1f}s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
