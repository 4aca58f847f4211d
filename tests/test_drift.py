"""The estimator against a noise scale that moves: synthetic drift with a known value at every step."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location("drift_bench", Path(__file__).parents[1] / "benchmarks" / "drift.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["drift_bench"] = bench
_spec.loader.exec_module(bench)


def test_truth_is_what_the_draws_average_to():
    # the generator's per-step estimates average to the stated |G|^2 and tr(Sigma)
    grad_sq, sigma_sq, truth = bench.drifting_truth(4000, 64.0)
    assert truth[-1] == pytest.approx(bench.B_END)
    assert truth[-1] / truth[0] > 100
    steps, b, k = 20000, 64.0, 2
    g2 = np.full(steps, grad_sq[200])
    s2 = np.full(steps, sigma_sq[200])
    small, big = bench.drifting_norms(np.random.default_rng(0), b, k, g2, s2)
    g = (k * big - small) / (k - 1)
    t = (small - big) / (1 / b - 1 / (k * b))
    assert g.mean() == pytest.approx(g2[0], rel=4 * g.std() / np.sqrt(steps) / g2[0])
    assert t.mean() == pytest.approx(s2[0] * bench.DIM, rel=4 * t.std() / np.sqrt(steps) / (s2[0] * bench.DIM))


@pytest.mark.parametrize("start", [1 / 8, 1 / 2])
def test_default_estimator_follows_the_drift(start):
    row = bench.run_row(start, seeds=4, steps=4000)
    assert row.missing < 0.01, row
    assert row.mean_abs_error <= 0.10, row
    assert row.coverage >= 0.80, row


def test_default_estimator_covers_the_drift_with_the_smallest_microbatches():
    # Microbatches at 1/32 of the late noise scale: the interval must still hold the
    # current truth (the EMA memory this default replaced covered it at 11% of steps).
    # The mean error, 13% in the benchmark, misses the 10% aimed at; 15% guards it.
    row = bench.run_row(1 / 32, seeds=4, steps=4000)
    assert row.coverage >= 0.80, row
    assert row.mean_abs_error <= 0.15, row
    # trailing windows of the same per-step estimates, their lengths picked with hindsight
    # from the truth, do not reach the 10% either (10.3% in the results table)
    assert 0.10 < row.hindsight_error < row.mean_abs_error, row


def test_trailing_windows_are_the_weighted_ratio_of_the_last_steps():
    # the hindsight reference against a plain loop over the steps it averages
    rng = np.random.default_rng(3)
    grad_sq, sigma_sq, truth = bench.drifting_truth(300, 128.0)
    small, big = bench.drifting_norms(rng, 64.0, 2, grad_sq, sigma_sq)
    errors = bench.trailing_errors(small, big, 64.0, 2, truth, 40)
    weights, scale = [], small[0]
    for s in small:
        weights.append(1 / scale)
        scale = np.exp(-1 / 8) * scale + (1 - np.exp(-1 / 8)) * s
    for i in (0, 5, 39, 40, 41, 150, 299):
        lo = max(0, i - 39)
        g = sum(w * (128 * bg - 64 * sm) / 64 for w, sm, bg in zip(weights[lo:i + 1], small[lo:i + 1], big[lo:i + 1]))
        t = sum(w * (sm - bg) / (1 / 64 - 1 / 128) for w, sm, bg in zip(weights[lo:i + 1], small[lo:i + 1], big[lo:i + 1]))
        assert errors[i] == pytest.approx(abs(t / g / truth[i] - 1), rel=1e-9)
    # each part of the run takes its own best length
    # (parts of 10 steps: 0-1, 2-4, 5-9); one length wins each part, none wins them all
    e = {1: np.array([[0.1, 0.1, 0.9, 0.9, 0.9, 0.2, 0.2, 0.2, 0.2, 0.2]]),
         2: np.array([[0.5, 0.5, 0.3, 0.3, 0.3, 0.4, 0.4, 0.4, 0.4, 0.4]])}
    assert bench.hindsight_error(e, 0) == pytest.approx((2 * 0.1 + 3 * 0.3 + 5 * 0.2) / 10)
