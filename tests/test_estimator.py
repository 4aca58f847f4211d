"""The estimator against analytic truth (pure math; numpy only)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from cbs_tracker.core.estimator import (
    NoiseScaleEstimator,
    NoiseScaleEstimatorProtocol,
    estimate_from_norms,
    fieller_interval,
)


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


def test_horizon_steps_is_relative_to_the_first_batch():
    for first in (16.0, 4.0e6):
        est = NoiseScaleEstimator(horizon_steps=100)
        assert est.memory == "fixed"
        est.update(10.0, 2.0, first / 4, first)
        est.update(10.0, 2.0, first / 2, 2 * first)  # a doubling keeps the memory in units
        assert est.horizon == pytest.approx(100 * first)
    assert NoiseScaleEstimator().memory == "window"
    assert NoiseScaleEstimator(memory="adaptive").memory == "adaptive"
    assert NoiseScaleEstimator(horizon=5.0).memory == "fixed"


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
    low, high = est.noise_scale_interval
    assert low <= est.noise_scale <= high


def test_noise_scale_is_the_plain_ratio_when_the_averages_are_exact():
    est = NoiseScaleEstimator(min_steps=3)
    for _ in range(20):
        _feed(est, 2.0, 48.0)
    assert est.noise_scale == pytest.approx(24.0, rel=1e-12)
    assert est.noise_scale_interval == pytest.approx((24.0, 24.0), rel=1e-9)


def test_beale_correction_removes_the_bias_of_a_noisy_ratio():
    # |G|^2 steps of 1 +- 1, tr(Sigma) 100 +- 5 (independent): over 30 equal-weight steps
    # the plain ratio T/G is high by about var(G)/G^2 = 1/30 (+3%), several standard
    # errors of the mean over 400 seeds (~0.9%); the corrected one must not be biased.
    plain, corrected = [], []
    for seed in range(400):
        rng = np.random.default_rng([seed, 8])
        est = NoiseScaleEstimator(horizon=1e12, outlier_clip=None)
        for g, t in zip(1 + rng.standard_normal(30), 100 + 5 * rng.standard_normal(30)):
            _feed(est, g, t)
        plain.append(est.trace_cov / est.grad_sq_norm / 100)
        corrected.append(est.noise_scale / 100)
    se = np.std(corrected) / math.sqrt(len(corrected))
    assert np.mean(plain) - 1 > 2.5 * se, (np.mean(plain), se)
    assert abs(np.mean(corrected) - 1) < 2.5 * se, (np.mean(corrected), se)


@pytest.mark.parametrize("memory", ["fixed", "adaptive", "window"])
def test_rare_huge_spikes_do_not_move_the_average(memory):
    # 1000x spikes in the small-batch norm on 1% of steps (what the Adam-preconditioned
    # estimates showed on a small GPT): the clipped average stays within 3 standard
    # errors of the truth (3.3% with the fixed memory), the unclipped one does not.
    rng = np.random.default_rng(1)
    g2, tr, bs, bb = 1.0, 64.0, 8, 64
    sd_small, sd_big = 0.5, 0.2
    kwargs = {"horizon_steps": 200} if memory == "fixed" else {"memory": memory}
    robust = NoiseScaleEstimator(**kwargs)
    plain = NoiseScaleEstimator(**kwargs, outlier_clip=None)
    for i in range(2000):
        small = g2 + tr / bs + rng.normal(0, sd_small)
        big = g2 + tr / bb + rng.normal(0, sd_big)
        if i % 100 == 50:
            small *= 1000
        robust.update(small, big, bs, bb)
        plain.update(small, big, bs, bb)
    # Standard error from the noise put in: per-step sd of t - B g over sqrt(effective steps).
    sd_g = math.hypot(bb * sd_big, bs * sd_small) / (bb - bs)
    sd_t = math.hypot(sd_small, sd_big) / (1 / bs - 1 / bb)
    rel_se = math.hypot(sd_t, tr / g2 * sd_g) / tr / math.sqrt(robust.effective_steps)
    tol = 3 * rel_se
    # the fixed 200-step memory holds ~400 effective steps; the adaptive one aims at 5% error
    assert tol < (0.1 if memory == "adaptive" else 0.04), rel_se
    if memory == "window":
        # A clipped spike still enters at the band's edge (median + 5 IQR, IQR = 1.349 sd):
        # 1% of steps moves each average by at most that much, which the window's 2,000
        # effective steps no longer hide.
        tol += 0.01 * 5 * 1.349 * (sd_g / g2 + sd_t / tr)
    assert robust.noise_scale == pytest.approx(tr / g2, rel=tol)
    assert robust.grad_sq_norm == pytest.approx(g2, rel=tol)
    low, high = robust.noise_scale_interval
    if memory == "window":  # 2,000 effective steps: the interval is narrower than the clip's bias
        low, high = low * (1 - tol), high * (1 + tol)
    assert low < tr / g2 < high
    # unclipped: a spike's |G|^2 estimate is hugely negative and dominates the average
    assert plain.grad_sq_norm is None or abs(plain.grad_sq_norm - g2) > 0.5 * g2


def test_state_dict_round_trip_continues_identically():
    rng = np.random.default_rng(2)
    seq = [(10 + rng.normal(), 3 + rng.normal(0, 0.1)) for _ in range(80)]
    for kwargs in ({}, {"memory": "adaptive"}, {"horizon_steps": 100}):
        a = NoiseScaleEstimator(**kwargs)
        for s, b in seq[:40]:
            a.update(s, b, 8, 32)
        b2 = NoiseScaleEstimator(**kwargs)
        b2.load_state_dict(a.state_dict())
        assert b2.noise_scale_interval == a.noise_scale_interval
        for s, b in seq[40:]:
            ra = a.update(s, b, 8, 32)
            rb = b2.update(s, b, 8, 32)
            assert ra == rb


def _trained(**kwargs):
    est = NoiseScaleEstimator(**kwargs)
    rng = np.random.default_rng(3)
    for _ in range(30):
        est.update(10 + rng.normal(), 3 + rng.normal(0, 0.1), 8, 32)
    return est


def test_state_dict_errors():
    est = NoiseScaleEstimator()
    with pytest.raises(KeyError, match=r"missing keys \['ema_trace'\]"):
        est.load_state_dict({"version": 1, "horizon": 1.0, "ema_grad_sq": 0.0, "keep": 1.0, "steps": 0})
    state = est.state_dict()
    del state["q_gt"]
    with pytest.raises(KeyError, match=r"missing keys \['q_gt'\]"):
        est.load_state_dict(state)
    state = est.state_dict()
    state["version"] = 99
    with pytest.raises(ValueError, match="state version 99 is newer"):
        est.load_state_dict(state)
    state = est.state_dict()
    state["some_future_key"] = 1  # tolerated
    est.load_state_dict(state)
    with pytest.raises(TypeError, match=r"load_state_dict\(state=list\): expected a mapping"):
        est.load_state_dict([])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("key", "value", "error", "match"),
    [
        ("version", "2", TypeError, r"version='2' must be an integer"),
        ("version", True, TypeError, r"version=True must be an integer"),
        ("version", 0, ValueError, r"state version 0 is unknown; expected 1..3"),
        ("steps", -4, ValueError, r"steps=-4 must be an integer >= 0"),
        ("steps", 3.0, TypeError, r"steps=3.0 must be an integer >= 0"),
        ("horizon", 0.0, ValueError, r"horizon=0.0 must be a positive number or None"),
        ("horizon", "big", TypeError, r"horizon='big' must be a positive number or None"),
        ("keep", 1.5, ValueError, r"keep=1.5 must be finite and in \[0.0, 1.0\]"),
        ("keep", 1.0, ValueError, r"keep=1.0 must be below 1 once steps > 0 \(steps=30\)"),
        ("ema_trace", math.nan, ValueError, r"ema_trace=nan must be finite"),
        ("ema_grad_sq", None, TypeError, r"ema_grad_sq=None must be a real number"),
        ("units_seen", -1.0, ValueError, r"units_seen=-1.0 must be finite and in \[0.0, inf\]"),
        ("w2", -1e-3, ValueError, r"w2=-0.001 must be finite and in \[0.0, inf\]"),
        ("q_gt", math.inf, ValueError, r"q_gt=inf must be finite"),
        ("moments_keep", 2.0, ValueError, r"moments_keep=2.0 must be finite and in"),
        ("memory", "long", ValueError, r"memory='long' must be 'window', 'adaptive' or 'fixed'"),
        ("recent_trace", [1.0, math.nan], TypeError, r"recent_trace must be a list of finite real numbers"),
    ],
)
def test_bad_state_values_are_refused_and_leave_the_estimator_untouched(key, value, error, match):
    est = _trained(memory="adaptive")
    before = est.state_dict()
    state = est.state_dict()
    state[key] = value
    with pytest.raises(error, match=match):
        est.load_state_dict(state)
    assert est.state_dict() == before
    # the caller's dict is not mutated either
    assert state[key] is value


@pytest.mark.parametrize(
    ("window", "error", "match"),
    [
        (None, KeyError, r"missing keys \['window'\]"),
        ({"blocks": [[1.0, 2.0]], "scale": 1.0}, TypeError, r"window.blocks must be a list of lists of 16 finite"),
        ({"blocks": [], "scale": -1.0}, ValueError, r"window.scale=-1.0 must be a positive number or None"),
        ({"blocks": [], "scale": 1.0, "steps": -2}, ValueError, r"window.steps=-2 must be an integer >= 0"),
    ],
)
def test_bad_window_states_are_refused_and_leave_the_estimator_untouched(window, error, match):
    est = _trained()
    before = est.state_dict()
    state = est.state_dict()
    if window is None:
        del state["window"]
    else:
        state["window"] = window
    with pytest.raises(error, match=match):
        est.load_state_dict(state)
    assert est.state_dict() == before


def test_version_1_state_loads_its_averages_and_reports_an_interval_once_covered():
    # What a version-1 estimator saved: a fixed horizon of 100 first batches of 32.
    v1 = {"version": 1, "horizon": 3200.0, "ema_grad_sq": 0.0, "ema_trace": 0.0, "keep": 1.0,
          "steps": 0, "recent_grad_sq": [], "recent_trace": []}
    ref = NoiseScaleEstimator(horizon=3200.0, outlier_clip=None)
    rng = np.random.default_rng(4)
    seq = [(10 + rng.normal(), 3 + rng.normal(0, 0.1)) for _ in range(500)]
    for s, b in seq[:50]:
        ref.update(s, b, 8, 32)
    v1.update(ema_grad_sq=ref.state_dict()["ema_grad_sq"], ema_trace=ref.state_dict()["ema_trace"],
              keep=ref.state_dict()["keep"], steps=50)
    est = NoiseScaleEstimator(horizon_steps=100, outlier_clip=None)
    est.load_state_dict(v1)
    assert est.noise_scale == pytest.approx(ref.trace_cov / ref.grad_sq_norm, rel=1e-12)
    assert est.units_seen == pytest.approx(50 * 32)
    assert est.noise_scale_interval == (0.0, math.inf)  # no second moments yet
    for s, b in seq[50:]:
        est.update(s, b, 8, 32)
        ref.update(s, b, 8, 32)
    assert est.horizon == 3200.0  # rebuilt from the checkpoint: 100 first batches of 32
    assert est.trace_cov / est.grad_sq_norm == pytest.approx(ref.trace_cov / ref.grad_sq_norm, rel=1e-12)
    # the steps before the resume (1% of the weight now) lack second moments
    assert est.noise_scale == pytest.approx(ref.noise_scale, rel=1e-3)
    low, high = est.noise_scale_interval
    ref_low, ref_high = ref.noise_scale_interval
    assert high < math.inf
    assert low == pytest.approx(ref_low, rel=0.05) and high == pytest.approx(ref_high, rel=0.05)


def test_configured_memory_wins_over_the_checkpoint_with_a_warning():
    saved = _trained(horizon=1000.0).state_dict()
    est = NoiseScaleEstimator(horizon=500.0)
    with pytest.warns(RuntimeWarning, match=r"saved with horizon=1000, this estimator has horizon=500; "
                      r"the configured memory is used"):
        est.load_state_dict(saved)
    assert est.horizon == 500.0
    est = NoiseScaleEstimator(memory="adaptive")
    with pytest.warns(RuntimeWarning, match=r"saved with a fixed memory, this estimator has a adaptive one"):
        est.load_state_dict(saved)
    assert est.memory == "adaptive"
    est = NoiseScaleEstimator()
    with pytest.warns(RuntimeWarning, match=r"saved with a fixed memory, this estimator has a window one; "
                      r"the configured memory is used from now on; its averages cannot be carried over"):
        est.load_state_dict(saved)
    assert est.memory == "window" and est.steps == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        NoiseScaleEstimator(horizon=1000.0).load_state_dict(saved)  # same settings: silent
        NoiseScaleEstimator().load_state_dict(_trained().state_dict())

@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"horizon": 0}, ValueError, r"NoiseScaleEstimator\(horizon=0\): must be a positive number of units or None"),
        ({"horizon": "1e6"}, TypeError, r"NoiseScaleEstimator\(horizon='1e6'\): must be a positive number"),
        ({"horizon_steps": -1}, ValueError, r"NoiseScaleEstimator\(horizon_steps=-1\): must be a positive number"),
        ({"target_rel_error": 0.0}, ValueError, r"NoiseScaleEstimator\(target_rel_error=0.0\): must be a positive"),
        ({"target_rel_error": math.nan}, ValueError, r"NoiseScaleEstimator\(target_rel_error=nan\)"),
        ({"min_horizon_steps": True}, TypeError, r"NoiseScaleEstimator\(min_horizon_steps=True\): must be a positive"),
        ({"max_horizon_fraction": -0.5}, ValueError, r"NoiseScaleEstimator\(max_horizon_fraction=-0.5\)"),
        ({"min_steps": 0}, ValueError, r"NoiseScaleEstimator\(min_steps=0\): must be an integer >= 1"),
        ({"min_steps": 2.0}, TypeError, r"NoiseScaleEstimator\(min_steps=2.0\): must be an integer >= 1"),
        ({"outlier_clip": 0}, ValueError, r"NoiseScaleEstimator\(outlier_clip=0\): must be a positive number or None"),
        ({"outlier_window": 2}, ValueError, r"NoiseScaleEstimator\(outlier_window=2\): must be an integer >= 4"),
    ],
)
def test_bad_configuration_is_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        NoiseScaleEstimator(**kwargs)


def test_the_estimator_implements_the_protocol():
    assert isinstance(NoiseScaleEstimator(), NoiseScaleEstimatorProtocol)
    assert not isinstance(object(), NoiseScaleEstimatorProtocol)


# ---------------------------------------------------------------------------- interval
def _reference_interval(values, horizons, units):
    """Slow reference: explicit weights, weighted means, sandwich variances, Fieller by np.roots."""
    from cbs_tracker.core.estimator import _student_quantile

    g = np.array([v[0] for v in values])
    t = np.array([v[1] for v in values])
    keep = np.exp(-np.asarray(units) / np.asarray(horizons))
    later = np.append(np.cumprod(keep[::-1])[::-1][1:], 1.0)  # prod of the keeps after each step
    w = (1 - keep) * later
    w /= w.sum()
    mg, mt = w @ g, w @ t
    n_eff = 1 / np.sum(w**2)
    c = n_eff / (n_eff - 1)
    vgg = c * np.sum(w**2 * (g - mg) ** 2)
    vtt = c * np.sum(w**2 * (t - mt) ** 2)
    vgt = c * np.sum(w**2 * (g - mg) * (t - mt))
    beale = mt / mg * (1 + vgt / (mt * mg)) / (1 + vgg / mg**2)
    q2 = _student_quantile(n_eff - 1) ** 2
    # (mt - r mg)^2 - q^2 (vtt - 2 r vgt + r^2 vgg) = 0
    roots = np.sort(np.roots([mg**2 - q2 * vgg, -2 * (mt * mg - q2 * vgt), mt**2 - q2 * vtt]).real)
    return beale, (max(roots[0], 0.0), roots[1])


@pytest.mark.parametrize("kwargs", [{"horizon": 1600.0}, {"memory": "adaptive"}])
def test_interval_matches_a_slow_reference_with_explicit_weights(kwargs):
    rng = np.random.default_rng(5)
    est = NoiseScaleEstimator(outlier_clip=None, **kwargs)
    values, horizons, units = [], [], []
    for i in range(300):
        n = 32 if i < 150 else 64  # a doubling half-way: steps of two sizes
        e = est.update(10 + rng.normal(0, 2), 3 + rng.normal(0, 0.5), n / 4, n)
        values.append((e.step.grad_sq_norm, e.step.trace_cov))
        horizons.append(est.horizon)
        units.append(n)
    ratio, (low, high) = _reference_interval(values, horizons, units)
    assert est.noise_scale == pytest.approx(ratio, rel=1e-9)
    assert est.noise_scale_interval == pytest.approx((low, high), rel=1e-9)
    assert est.effective_steps > 20


def test_fieller_interval_against_a_grid():
    # the set {r >= 0: (num - r den)^2 <= q^2 (vn - 2 r c + r^2 vd)} read off a fine grid
    grid = np.linspace(0, 400, 400_001)
    cases = [
        (100.0, 1.0, 25.0, 0.01, 0.1),  # precise: near-symmetric
        (100.0, 1.0, 400.0, 0.2, 2.0),  # |G|^2 noisy: skewed
        (100.0, 0.5, 100.0, 0.2, 0.0),  # |G|^2 not significant, tr significant: (low, inf)
        (3.0, 0.5, 100.0, 0.2, 0.0),  # neither significant: (0, inf)
    ]
    for num, den, vn, vd, cov in cases:
        low, high = fieller_interval(num, den, vn, vd, cov, 1.645)
        inside = (num - grid * den) ** 2 <= 1.645**2 * (vn - 2 * grid * cov + grid**2 * vd)
        assert grid[inside].min() == pytest.approx(low, abs=2e-3)
        if math.isinf(high):
            assert inside[-1]
        else:
            assert grid[inside].max() == pytest.approx(high, abs=2e-3)
    assert fieller_interval(100.0, 0.5, 100.0, 0.2, 0.0, 1.645)[1] == math.inf


def test_student_quantile_against_the_table():
    from cbs_tracker.core.estimator import _student_quantile

    # t_{0.95} from standard tables
    for dof, t in ((5, 2.0150), (10, 1.8125), (20, 1.7247), (60, 1.6706), (1e9, 1.6449)):
        assert _student_quantile(dof) == pytest.approx(t, abs=2e-3)


def _feed(est, g, t, small_batch=8, big_batch=32):
    """Feed norms whose step estimates are exactly ``g`` and ``t`` (E|G_B|^2 = g + t / B)."""
    return est.update(g + t / small_batch, g + t / big_batch, small_batch, big_batch)


def test_interval_is_none_with_the_noise_scale_and_unbounded_without_signal():
    est = NoiseScaleEstimator(min_steps=3, horizon=1e9, outlier_clip=None)
    assert est.noise_scale_interval is None
    for g in (0.1 + 5, 0.1 - 5):
        _feed(est, g, 10.0)
    assert est.noise_scale is None and est.noise_scale_interval is None
    # averaged |G|^2 = 0.1 with a per-step spread of 5: positive, but indistinguishable
    # from 0 (its standard error is 5 / sqrt(steps)); tr(Sigma) = 10 is certain
    for i in range(98):
        r = _feed(est, 0.1 + (5 if i % 2 == 0 else -5), 10.0)
    assert est.trace_cov / est.grad_sq_norm == pytest.approx(100.0)
    low, high = est.noise_scale_interval
    assert high == math.inf
    # the smallest ratio the data allow: 10 / (0.1 + t * 5 / sqrt(100)), t ~ 1.66
    assert 10 / (0.1 + 1.70 * 0.5) < low < 10 / (0.1 + 1.62 * 0.5)
    assert est.noise_scale == low  # "at least this much", not a ratio of noise
    assert (r.noise_scale_low, r.noise_scale_high) == (low, high)
    # once |G|^2 is known well enough, the interval closes
    for i in range(20000):
        _feed(est, 0.1 + (5 if i % 2 == 0 else -5), 10.0)
    low, high = est.noise_scale_interval
    assert low < 100.0 < high < math.inf


# ---------------------------------------------------------------------------- adaptive memory
def test_adaptive_horizon_stays_within_its_bounds():
    rng = np.random.default_rng(7)
    est = NoiseScaleEstimator(memory="adaptive")
    seen = 0.0
    for i in range(400):
        n = 32.0 if i < 200 else 64.0
        seen += n
        est.update(10 + rng.normal(0, 3), 3 + rng.normal(0, 1), n / 4, n)
        assert 10 * n * (1 - 1e-12) <= est.horizon <= max(10 * n, 0.75 * seen) * (1 + 1e-12)
    assert est.units_seen == seen

def test_estimate_from_norms_refuses_one_size():
    with pytest.raises(ValueError, match=r"need 0 < small_batch < big_batch"):
        estimate_from_norms(1.0, 1.0, 8, 8)


# ---------------------------------------------------------------------------- window memory
def _reference_window(window):
    """The window choice as a plain loop, one candidate at a time, newest blocks first.

    Each candidate's interval: the trend's Wald interval where the window trusts the
    trend, else Fieller's interval of its means; the longest run of candidates whose
    intervals intersect, within the cap; then the same settling as the library's.
    Returns ``(window sums, extended)`` and leaves ``window`` as it was.
    """
    from cbs_tracker.core import window as win
    from cbs_tracker.core.intervals import student_quantile

    scale = window.agreement
    acc, low, high, chosen, capped = [0.0] * win._FIELDS, -math.inf, math.inf, None, False
    for block in window.blocks[::-1]:
        if acc[win.STEPS] >= window.min_steps and acc[win.STEPS] + block[win.STEPS] > window.max_fraction * window.steps:
            capped = True
            break
        acc = [x + y for x, y in zip(acc, block[: win._FIELDS])]
        if acc[win.STEPS] < window.min_steps:
            continue
        fit = window._trend(acc)
        if fit is not None:
            b0, se, dof = fit
            interval = (b0 - scale * student_quantile(dof) * se, b0 + scale * student_quantile(dof) * se)
        else:
            m = win.level_moments(acc)
            if m is None:
                continue
            interval = fieller_interval(m.trace_cov, m.grad_sq_norm, m.var_trace, m.var_grad_sq, m.cov,
                                        scale * student_quantile(m.effective_steps - 1.0))
        if interval[0] > high or interval[1] < low:
            break
        low, high = max(low, interval[0]), min(high, interval[1])
        chosen = list(acc)
    total = [sum(b[i] for b in window.blocks) for i in range(win._FIELDS)]
    kept = (window.window, window.extended)
    window._settle(chosen, capped, lambda: total)
    result = (window.window, window.extended)
    window.window, window.extended = kept
    return result


def _drifting_windows(est, seed):
    """``(step, est's window)`` after each step of a stream with a level shift, a drift and a batch
    doubling, once the window is chosen."""
    rng = np.random.default_rng(seed)
    for i in range(2500):
        g2 = 1.0 if i < 900 else 0.2 * (1 + (i - 900) / 800)
        n = 8.0 if i < 1800 else 16.0
        est.update(g2 + 64 / (n / 2) + rng.normal(0, 2), g2 + 64 / n + rng.normal(0, 1), n / 2, n)
        if est._window.window is not None:
            yield i, est._window


def test_window_choice_matches_the_plain_loop_reference():
    # the vectorised choice against a plain loop over the candidates on a stream with a
    # level shift, a drift and a batch doubling
    est = NoiseScaleEstimator()
    kinds = set()
    for _, window in _drifting_windows(est, 11):
        slow, slow_extended = _reference_window(window)
        np.testing.assert_allclose(window.window, slow, rtol=1e-9, atol=1e-12)
        assert window.extended == slow_extended
        fast_extended = window.extended
        kinds.add((fast_extended, est.window_steps < est.steps))
    # both outcomes were exercised: the whole run (older data agree) and a cut window
    assert (True, False) in kinds and (False, True) in kinds


def _vectorised_choice(window):
    """The window choice as the library made it before it priced candidates one at a time: every
    candidate priced at once in NumPy (each formula a vectorised expression). Returns
    ``(window sums, extended)`` and leaves ``window`` as it was."""
    from cbs_tracker.core import window as win
    from cbs_tracker.core.intervals import fieller_intervals, student_quantile

    F = win._FIELDS
    sums = np.cumsum(np.asarray(window.blocks, dtype=float)[::-1, :F], axis=0)
    steps = sums[:, win.STEPS]
    before = np.concatenate(([0.0], steps[:-1]))
    allowed = (before < window.min_steps) | (steps <= window.max_fraction * window.steps)
    n = len(steps) if allowed.all() else int(np.argmin(allowed))
    capped = n < len(steps)
    s, x0, scale = sums[:n], window.position, window.agreement
    w, w2 = s[:, win.W], s[:, win.W2]
    with np.errstate(divide="ignore", invalid="ignore"):
        n_eff = w * w / w2
        ok = (w > 0) & (w2 > 0) & (n_eff > 1.0)
        g, t = s[:, win.SG] / w, s[:, win.ST] / w
        norm = n_eff / (n_eff - 1.0) / (w * w)
        v_gg = np.maximum(s[:, win.QGG] - 2 * g * s[:, win.LG] + g * g * w2, 0.0) * norm
        v_tt = np.maximum(s[:, win.QTT] - 2 * t * s[:, win.LT] + t * t * w2, 0.0) * norm
        v_gt = (s[:, win.QGT] - g * s[:, win.LT] - t * s[:, win.LG] + g * t * w2) * norm
        low, high = fieller_intervals(t, g, v_tt, v_gg, v_gt, scale * student_quantile(n_eff - 1.0))
        a = s[:, win.SG]
        b = s[:, win.GX] - x0 * a
        d = s[:, win.GXX] - 2 * x0 * s[:, win.GX] + x0 * x0 * a
        det = a * d - b * b
        trend = (ok & (g > 0) & (v_gg <= (win.TREND_MAX_REL_SE * g) ** 2) & (s[:, win.STEPS] >= 4) & (a > 0)
                 & (det > 1e-12 * a * d))
        y0, y1 = s[:, win.ST], s[:, win.TX] - x0 * s[:, win.ST]
        b0 = (d * y0 - b * y1) / det
        level = s[:, win.ST] / a
        rho = np.maximum(s[:, win.QTT] - 2 * level * s[:, win.QGT] + level * level * s[:, win.QGG], 0.0) / w2
        rho = rho * n_eff / np.maximum(n_eff - 2.0, 1.0)
        s01 = s[:, win.W2X] - x0 * w2
        s11 = s[:, win.W2XX] - 2 * x0 * s[:, win.W2X] + x0 * x0 * w2
        se = np.sqrt(np.maximum(rho * (d * d * w2 - 2 * d * b * s01 + b * b * s11) / (det * det), 0.0))
        half = scale * student_quantile(np.maximum(n_eff - 2.0, 1.0)) * se
        low = np.where(trend, b0 - half, low)
        high = np.where(trend, b0 + half, high)
    low, high = np.where(ok, low, np.nan), np.where(ok, high, np.nan)
    valid = (steps[:n] >= window.min_steps) & ~np.isnan(low)
    run_low = np.maximum.accumulate(np.where(valid, low, -np.inf))
    run_high = np.minimum.accumulate(np.where(valid, high, np.inf))
    prev_low = np.concatenate(([-np.inf], run_low[:-1]))
    prev_high = np.concatenate(([np.inf], run_high[:-1]))
    disjoint = valid & ((low > prev_high) | (high < prev_low))
    stop, capped = (int(np.argmax(disjoint)), False) if disjoint.any() else (n, capped)
    agreeing = np.flatnonzero(valid[:stop])
    chosen = None if agreeing.size == 0 else sums[agreeing[-1]].tolist()
    kept = (window.window, window.extended)
    window._settle(chosen, capped, lambda: sums[-1].tolist())
    result = (window.window, window.extended)
    window.window, window.extended = kept
    return result


@pytest.mark.parametrize("seed, fraction", [(11, 0.35), (12, 0.375)])
def test_window_choice_is_the_vectorised_one_exactly(seed, fraction):
    # candidates priced one at a time in Python floats choose the same window, to the last bit of its
    # sums, as every candidate priced at once in NumPy, on streams with a level shift, a drift, a batch
    # doubling and a noise that makes the window cut, hit its cap and be joined by the older data
    # (a cap of 0.375 of the steps is a whole number every 8 steps: candidates end exactly on it)
    est = NoiseScaleEstimator(max_window_fraction=fraction)
    kinds, cut_or_capped = set(), 0
    for i, window in _drifting_windows(est, seed):
        ref, ref_extended = _vectorised_choice(window)
        assert window.window == ref, i  # lists of floats: equal element for element
        assert window.extended == ref_extended
        kinds.add((window.extended, est.window_steps < est.steps))
        cut_or_capped += est.window_steps < est.steps
    assert (True, False) in kinds and (False, True) in kinds
    assert cut_or_capped > 100


def test_window_reaches_its_cap_exactly():
    # 20 steps at |G|^2 = 5, then 12 at 1: with the cap at 0.375 x 32 = 12 steps, the window is the
    # newest 12 steps exactly (a candidate that ends on the cap is allowed), as the vectorised form says
    from cbs_tracker.core import window as win

    w = win.DriftWindow(per_level=4, max_fraction=0.375, agreement=2.0 / win_z(), extend_threshold=3.0 / win_z(),
                        min_steps=10, scale_steps=8.0)
    rng = np.random.default_rng(0)
    for i in range(32):
        g = (5.0 if i < 20 else 1.0) * (1 + 0.01 * rng.normal())
        t = 100.0 * (1 + 0.01 * rng.normal())
        w.add(g, t, 16.0, g + t / 8)
    assert w.window_steps == 12 and not w.extended
    assert (w.window, w.extended) == _vectorised_choice(w)


def win_z():
    from cbs_tracker.core.intervals import Z

    return Z


def test_scalar_interval_and_quantile_are_the_array_forms_exactly():
    # the Python-float forms the window prices its candidates with against the NumPy array forms:
    # every branch of Fieller's set (bounded, a = 0, a < 0 < c, c <= 0) and non-finite inputs
    from cbs_tracker.core.intervals import fieller_interval, fieller_intervals, student_quantile

    rng = np.random.default_rng(5)
    cases = [(t, g, vt, vg, c, q) for t, g, vt, vg, c, q in rng.normal(1.0, 1.0, (4000, 6)).tolist()]
    cases = [(t, g, abs(vt), abs(vg), c, abs(q) + 0.1) for t, g, vt, vg, c, q in cases]
    cases += [(1.0, 2.0, 0.5, 4.0, 0.0, 1.0), (1.0, 2.0, 0.5, 4.0, 0.0, 1.0), (-1.0, 2.0, 0.5, 4.0, 0.0, 1.0),
              (4.0, 1.0, 1.0, 4.0, 0.0, 1.0), (float("nan"), 1.0, 1.0, 1.0, 0.0, 1.0), (1.0, float("inf"), 1.0, 1.0, 0.0, 1.0)]
    kinds = set()
    for t, g, vt, vg, c, q in cases:
        low, high = fieller_interval(t, g, vt, vg, c, q)
        with np.errstate(invalid="ignore"):  # (the infinite case)
            a_low, a_high = (float(x[0]) for x in fieller_intervals(np.array([t]), np.array([g]), vt, vg, c, q))
        assert _same(low, a_low) and _same(high, a_high), (t, g, vt, vg, c, q)
        a = g * g - q * q * vg
        kinds.add("bounded" if a > 0 else "a=0" if a == 0 else "c<=0" if t * t - q * q * vt <= 0 else "a<0<c")
    assert kinds == {"bounded", "a=0", "c<=0", "a<0<c"}
    for dof in [0.5, 1.0, 1.5, 2.0, 3.0, 7.25, 10.0, 99.0, 1e4, float("nan")] + rng.uniform(1, 500, 500).tolist():
        z, nu = win_z(), np.maximum(np.float64(dof), 1.0)  # the NumPy-scalar form it replaced, verbatim
        g1, g2 = (z**3 + z) / 4, (5 * z**5 + 16 * z**3 + 3 * z) / 96
        g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
        assert _same(student_quantile(dof), float(z + g1 / nu + g2 / nu**2 + g3 / nu**3)), dof


def _same(x, y):
    """Equal floats, NaN equal to NaN."""
    return x == y or (math.isnan(x) and math.isnan(y))


def test_window_follows_a_level_shift_that_an_exponential_memory_keeps():
    # |G|^2 drops 20x at step 600 (B_simple 64 -> 1280); 300 steps later the window reads
    # the new value within 20%, the earlier adaptive EMA still reads it several times low
    rng = np.random.default_rng(2)
    window, ema = NoiseScaleEstimator(), NoiseScaleEstimator(memory="adaptive")
    for i in range(900):
        g2 = 1.0 if i < 600 else 0.05
        small = g2 + 64 / 8 + rng.normal(0, 0.05)
        big = g2 + 64 / 64 + rng.normal(0, 0.01)
        window.update(small, big, 8, 64)
        ema.update(small, big, 8, 64)
    truth = 64 / 0.05
    assert window.noise_scale == pytest.approx(truth, rel=0.2)
    low, high = window.noise_scale_interval
    assert low <= truth <= high
    assert ema.noise_scale < 0.5 * truth
