"""The estimator against analytic truth (pure math; numpy only)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cbs_tracker.core.estimator import NoiseScaleEstimator, estimate_from_norms


def _synthetic_step(rng, mean, cov_sqrt, sizes):
    """Per-microbatch mean gradients of per-example gradients ~ N(mean, Sigma)."""
    micro = []
    for b in sizes:
        ex = mean + rng.standard_normal((b, mean.size)) @ cov_sqrt.T
        micro.append(ex.mean(axis=0))
    micro = np.array(micro)
    small = float(np.mean(np.sum(micro**2, axis=1)))
    big = float(np.sum(micro.mean(axis=0) ** 2))
    harm = len(sizes) / float(np.sum(1.0 / np.asarray(sizes, dtype=float)))
    return small, big, harm, len(sizes) * harm


@pytest.mark.parametrize("sizes", [[16] * 4, [4, 8, 16, 32, 64]])
def test_per_step_estimates_are_unbiased(sizes):
    # Known mean and covariance; the average of N per-step estimates must match
    # |G|^2 and tr(Sigma) within 4 standard errors (the errors measured from the
    # same N draws, so the tolerance follows the sample count).
    rng = np.random.default_rng(0)
    d = 8
    mean = rng.standard_normal(d) * 0.5
    a = rng.standard_normal((d, d)) * 0.4
    sigma = a @ a.T + 0.1 * np.eye(d)
    cov_sqrt = np.linalg.cholesky(sigma)
    n = 3000
    est = np.array(
        [
            (lambda e: (e.grad_sq_norm, e.trace_cov))(estimate_from_norms(*_synthetic_step(rng, mean, cov_sqrt, sizes)))
            for _ in range(n)
        ]
    )
    m, se = est.mean(axis=0), est.std(axis=0) / math.sqrt(n)
    assert abs(m[0] - mean @ mean) < 4 * se[0]
    assert abs(m[1] - np.trace(sigma)) < 4 * se[1]


def test_estimate_formula_matches_mccandlish_with_two_sizes():
    # Exact expectations plugged in give exact answers (B_small=8, B_big=32).
    g2, tr = 2.0, 48.0
    small, big = g2 + tr / 8, g2 + tr / 32
    e = estimate_from_norms(small, big, 8, 32)
    assert e.grad_sq_norm == pytest.approx(g2)
    assert e.trace_cov == pytest.approx(tr)


def test_first_update_is_bias_corrected_exactly():
    est = NoiseScaleEstimator(min_steps=1)
    r = est.update(2.0 + 48 / 8, 2.0 + 48 / 32, 8, 32)
    assert r.accepted
    assert r.grad_sq_norm == pytest.approx(2.0)
    assert r.trace_cov == pytest.approx(48.0)
    assert r.noise_scale == pytest.approx(24.0)


def test_decay_is_per_unit_so_a_doubling_keeps_the_memory():
    # One step of 2n units must leave the same state as two steps of n units with the
    # same values: the average forgets per token, not per step.
    a = NoiseScaleEstimator(horizon=1000.0, min_steps=1, outlier_clip=None)
    b = NoiseScaleEstimator(horizon=1000.0, min_steps=1, outlier_clip=None)
    for v in (3.0, 5.0):
        a.update(v + 10, v + 1, 8, 32, units=32)
    a.update(7.0 + 10, 7.0 + 1, 8, 32, units=32)
    a.update(7.0 + 10, 7.0 + 1, 8, 32, units=32)
    for v in (3.0, 5.0):
        b.update(v + 10, v + 1, 8, 32, units=32)
    b.update(7.0 + 10, 7.0 + 1, 8, 32, units=64)
    assert a.grad_sq_norm == pytest.approx(b.grad_sq_norm, rel=1e-12)
    assert a.trace_cov == pytest.approx(b.trace_cov, rel=1e-12)


def test_default_horizon_is_relative_to_the_first_batch():
    for first in (16.0, 4.0e6):
        est = NoiseScaleEstimator()
        est.update(10.0, 2.0, first / 4, first)
        assert est.horizon == pytest.approx(100 * first)


def test_non_finite_inputs_are_dropped_without_touching_state():
    est = NoiseScaleEstimator(min_steps=1)
    est.update(10.0, 4.0, 8, 32)
    before = est.state_dict()
    for bad in (math.nan, math.inf, -math.inf):
        r = est.update(bad, 4.0, 8, 32)
        assert not r.accepted
        r = est.update(10.0, bad, 8, 32)
        assert not r.accepted
    assert not est.update(10.0, 4.0, 8, 8).accepted  # a single microbatch: no second size
    assert est.state_dict() == before


def test_negative_step_estimates_are_absorbed_and_no_number_until_supported():
    est = NoiseScaleEstimator(min_steps=3, outlier_clip=None)
    # |G|^2 estimate negative on the first step (big norm < small/K noise)
    r = est.update(10.0, 0.1, 8, 32)
    assert r.step.grad_sq_norm < 0
    assert est.noise_scale is None
    est.update(10.0, 6.0, 8, 32)
    assert est.noise_scale is None  # only 2 steps < min_steps
    est.update(10.0, 6.0, 8, 32)
    assert est.grad_sq_norm > 0
    assert est.noise_scale == pytest.approx(est.trace_cov / est.grad_sq_norm)


def test_rare_huge_spikes_do_not_move_the_average():
    # 1000x spikes in the small-batch norm on 1% of steps (what the Adam-preconditioned
    # estimates showed on a small GPT): the clipped average stays within 10% of the
    # truth, the unclipped one does not.
    rng = np.random.default_rng(1)
    g2, tr, bs, bb = 1.0, 64.0, 8, 64
    robust = NoiseScaleEstimator(horizon_steps=200)
    plain = NoiseScaleEstimator(horizon_steps=200, outlier_clip=None)
    for i in range(2000):
        small = g2 + tr / bs + rng.normal(0, 0.5)
        big = g2 + tr / bb + rng.normal(0, 0.2)
        if i % 100 == 50:
            small *= 1000
        robust.update(small, big, bs, bb)
        plain.update(small, big, bs, bb)
    assert robust.noise_scale == pytest.approx(tr / g2, rel=0.1)
    assert robust.grad_sq_norm == pytest.approx(g2, rel=0.1)
    # unclipped: a spike's |G|^2 estimate is hugely negative and dominates the average
    assert abs(plain.grad_sq_norm - g2) > 0.5 * g2


def test_state_dict_round_trip_continues_identically():
    rng = np.random.default_rng(2)
    seq = [(10 + rng.normal(), 3 + rng.normal(0, 0.1)) for _ in range(80)]
    a = NoiseScaleEstimator()
    for s, b in seq[:40]:
        a.update(s, b, 8, 32)
    b2 = NoiseScaleEstimator()
    b2.load_state_dict(a.state_dict())
    for s, b in seq[40:]:
        ra = a.update(s, b, 8, 32)
        rb = b2.update(s, b, 8, 32)
        assert ra == rb


def test_state_dict_errors():
    est = NoiseScaleEstimator()
    with pytest.raises(KeyError, match=r"missing keys \['ema_trace'\]"):
        est.load_state_dict({"version": 1, "horizon": 1.0, "ema_grad_sq": 0.0, "keep": 1.0, "steps": 0})
    state = est.state_dict()
    state["version"] = 99
    with pytest.raises(ValueError, match="state version 99 is newer"):
        est.load_state_dict(state)
    state = est.state_dict()
    state["some_future_key"] = 1  # tolerated
    est.load_state_dict(state)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"horizon": 0}, r"NoiseScaleEstimator\(horizon=0\): must be a positive number of units or None"),
        ({"horizon_steps": -1}, r"NoiseScaleEstimator\(horizon_steps=-1\): must be a positive number"),
        ({"min_steps": 0}, r"NoiseScaleEstimator\(min_steps=0\): must be an integer >= 1"),
        ({"outlier_clip": 0}, r"NoiseScaleEstimator\(outlier_clip=0\): must be a positive number or None"),
        ({"outlier_window": 2}, r"NoiseScaleEstimator\(outlier_window=2\): must be an integer >= 4"),
    ],
)
def test_bad_configuration_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NoiseScaleEstimator(**kwargs)


def test_estimate_from_norms_refuses_one_size():
    with pytest.raises(ValueError, match=r"need 0 < small_batch < big_batch"):
        estimate_from_norms(1.0, 1.0, 8, 8)
