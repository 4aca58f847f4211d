"""CBSTracker in a plain loop: analytic truth, invariances, a slow reference, errors."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from cbs_tracker import CBSTracker, NoiseScaleEstimator


# ---------------------------------------------------------------------------- helpers
def _regression(d=8, sigma=0.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    w_star = torch.randn(d, generator=g)
    delta = 0.3 * torch.randn(d, generator=g)
    model = nn.Linear(d, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_((w_star + delta)[None])
    dd = float(delta.pow(2).sum())
    truth = (d * (dd + sigma**2) + dd) / dd  # docs/design.md, ground truth
    return model, w_star, sigma, dd, truth


def _regression_batch(w_star, sigma, n, gen):
    x = torch.randn(n, w_star.numel(), generator=gen)
    y = x @ w_star + sigma * torch.randn(n, generator=gen)
    return x, y


def _run_frozen(model, w_star, sigma, *, accumulation, micro, steps, seed=1, loss_factor=1.0, scaler=None, **kw):
    tracker = CBSTracker(model, accumulation_steps=accumulation, unit="samples", **kw)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for _ in range(tracker.accumulation_steps):
            x, y = _regression_batch(w_star, sigma, micro, gen)
            with tracker.microbatch(size=micro):
                loss = 0.5 * (model(x).squeeze(-1) - y).pow(2).mean() / tracker.accumulation_steps
                loss = loss * loss_factor
                (scaler.scale(loss) if scaler is not None else loss).backward()
        tracker.step()
        if scaler is not None:  # the optimizer has lr=0: the weights stay frozen
            scaler.step(tracker.optimizer)
            scaler.update()
        model.zero_grad(set_to_none=True)
    return tracker


# ---------------------------------------------------------------------------- analytic truth
@pytest.mark.parametrize(("accumulation", "micro"), [(4, 8), (2, 16)])
def test_frozen_linear_regression_converges_to_the_analytic_noise_scale(accumulation, micro):
    model, w_star, sigma, dd, truth = _regression()
    steps = 4000
    # an (almost) flat average over all steps: the estimate is a plain mean of N iid estimates
    est = NoiseScaleEstimator(horizon_steps=1e9, min_steps=10)
    grad_sq, trace = [], []

    class Capture:
        def log(self, record):
            grad_sq.append(record.step_grad_sq_norm)
            trace.append(record.step_trace_cov)

    tracker = _run_frozen(
        model, w_star, sigma, accumulation=accumulation, micro=micro, steps=steps, estimator=est, logger=Capture()
    )
    # Tolerance from the sample count: delta-method standard error of the ratio of the
    # two means (linearised per-step terms, so the t/g correlation is included).
    g = torch.tensor(grad_sq, dtype=torch.float64)
    t = torch.tensor(trace, dtype=torch.float64)
    ratio = t.mean() / g.mean()
    z = (t - ratio * g) / g.mean()
    rel_se = float(z.std() / math.sqrt(steps) / ratio)
    assert 3.5 * rel_se < 0.05, f"the 5% tolerance must be at least 3.5 standard errors wide ({rel_se=})"
    assert tracker.noise_scale == pytest.approx(truth, rel=0.05)
    assert tracker.grad_sq_norm == pytest.approx(dd, rel=0.05)
    assert tracker.global_batch_size == accumulation * micro
    assert tracker.tokens_seen == steps * accumulation * micro


# ---------------------------------------------------------------------------- invariances
def _invariance_run(**kw):
    model, w_star, sigma, _, _ = _regression(seed=3)
    tracker = _run_frozen(model, w_star, sigma, accumulation=4, micro=8, steps=40, seed=5, **kw)
    return tracker


def test_noise_scale_is_invariant_to_loss_scaling_and_amp_loss_scale():
    ref = _invariance_run()
    # None == pytest.approx(None) holds: the reference must have measured something
    assert None not in (ref.noise_scale, ref.grad_sq_norm, ref.trace_cov)
    scaled = _invariance_run(loss_factor=37.0)
    assert scaled.noise_scale == pytest.approx(ref.noise_scale, rel=1e-5)
    # the estimates of |G|^2 and tr(Sigma) carry the factor squared; their ratio does not
    assert scaled.grad_sq_norm == pytest.approx(ref.grad_sq_norm * 37.0**2, rel=1e-5)

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    model, w_star, sigma, _, _ = _regression(seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    amp = _run_frozen(model, w_star, sigma, accumulation=4, micro=8, steps=40, seed=5, scaler=scaler, grad_scaler=scaler, optimizer=opt)
    assert amp.noise_scale == pytest.approx(ref.noise_scale, rel=1e-5)
    assert amp.grad_sq_norm == pytest.approx(ref.grad_sq_norm, rel=1e-5)
    assert amp.trace_cov == pytest.approx(ref.trace_cov, rel=1e-5)


def test_not_dividing_the_loss_by_accumulation_is_accounted_for():
    ref = _invariance_run()
    model, w_star, sigma, _, _ = _regression(seed=3)
    tracker = CBSTracker(model, accumulation_steps=4, unit="samples", loss_divided_by_accumulation=False)
    gen = torch.Generator().manual_seed(5)
    for _ in range(40):
        for _ in range(4):
            x, y = _regression_batch(w_star, sigma, 8, gen)
            with tracker.microbatch(size=8):
                (0.5 * (model(x).squeeze(-1) - y).pow(2).mean()).backward()  # summed over microbatches
        tracker.step()
        model.zero_grad()
    assert None not in (ref.noise_scale, ref.grad_sq_norm)  # approx(None) would match None
    assert tracker.noise_scale == pytest.approx(ref.noise_scale, rel=1e-5)
    assert tracker.grad_sq_norm == pytest.approx(ref.grad_sq_norm, rel=1e-5)


# ---------------------------------------------------------------------------- slow reference
class _TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.mlp = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 11))

    def forward(self, x, y):
        logits = self.mlp(self.emb(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)


def _lm_microbatches(seed, shapes):
    g = torch.Generator().manual_seed(seed)
    out = []
    for b, t in shapes:
        x = torch.randint(0, 11, (b, t), generator=g)
        y = torch.randint(0, 11, (b, t), generator=g)
        y[torch.rand(b, t, generator=g) < 0.3] = -100  # ignored labels are not tokens
        out.append((x, y))
    return out


def test_hook_collector_matches_a_slow_reference_with_unequal_microbatches():
    torch.manual_seed(0)
    model = _TinyLM()
    params = list(model.parameters())
    tracker = CBSTracker(model, accumulation_steps=3, unit="tokens")
    micro = _lm_microbatches(7, [(2, 5), (3, 7), (1, 9)])

    # slow reference: every per-microbatch mean-loss gradient materialised
    ref_grads = [torch.autograd.grad(model(x, y), params) for x, y in micro]
    sizes = [float((y != -100).sum()) for _, y in micro]
    sq = [sum(float(g.pow(2).sum()) for g in gs) for gs in ref_grads]
    mean_grad = [sum(gs[i] for gs in ref_grads) / 3 for i in range(len(params))]
    big_ref = sum(float(g.pow(2).sum()) for g in mean_grad)
    harm_ref = 3 / sum(1 / b for b in sizes)

    for x, y in micro:
        with tracker.microbatch(labels=y):
            (model(x, y) / tracker.accumulation_steps).backward()
    per_micro = [float(t) * 3**2 for t in tracker.collector.microbatch_sq_norms()]
    assert per_micro == pytest.approx(sq, rel=1e-5)
    tracker.step()
    stats = tracker.last_stats
    assert stats.num_microbatches == 3
    assert stats.small_sq_norm == pytest.approx(sum(sq) / 3, rel=1e-5)
    assert stats.big_sq_norm == pytest.approx(big_ref, rel=1e-5)
    assert stats.small_batch == pytest.approx(harm_ref, rel=1e-6)
    assert stats.units == sum(sizes)
    assert tracker.last_record.step_grad_sq_norm == pytest.approx((3 * big_ref - sum(sq) / 3) / 2, rel=1e-4)


def test_adam_preconditioned_mode_is_really_used():
    torch.manual_seed(0)
    model = _TinyLM()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-6)
    tracker = CBSTracker(model, opt, accumulation_steps=2, preconditioner="adam")
    raw = CBSTracker(model, opt, accumulation_steps=2)  # same gradients, raw norms
    for step in range(3):
        micro = _lm_microbatches(100 + step, [(2, 6), (2, 6)])
        if step == 2:  # reference with the optimizer state as it stands before this update
            denom = []
            for p in params:
                st = opt.state[p]
                bias2 = 1 - 0.95 ** float(st["step"])
                denom.append((st["exp_avg_sq"] / bias2).sqrt() + 1e-6)
            grads = [torch.autograd.grad(model(x, y), params) for x, y in micro]
            pre = [[g / dn for g, dn in zip(gs, denom)] for gs in grads]
            small_ref = sum(sum(float(g.pow(2).sum()) for g in gs) for gs in pre) / 2
            big_ref = sum(float(((a + b) / 2).pow(2).sum()) for a, b in zip(*pre))
        for x, y in micro:
            with tracker.microbatch(labels=y), raw.microbatch(labels=y):
                (model(x, y) / 2).backward()
        rec = tracker.step()
        raw.step()
        if step == 0:
            assert tracker.last_stats.finite is False  # no optimizer state yet: nothing measured
            assert rec.step_grad_sq_norm is None
        opt.step()
        opt.zero_grad()
    assert tracker.last_stats.small_sq_norm == pytest.approx(small_ref, rel=1e-4)
    assert tracker.last_stats.big_sq_norm == pytest.approx(big_ref, rel=1e-4)
    assert abs(raw.last_stats.small_sq_norm / small_ref - 1) > 0.5  # the raw norms differ a lot


def test_single_microbatch_warns_once_and_measures_nothing():
    model, w_star, sigma, _, _ = _regression()
    with pytest.warns(UserWarning, match=r"single microbatch \(accumulation_steps=1 on one data-parallel rank\)"):
        tracker = _run_frozen(model, w_star, sigma, accumulation=1, micro=8, steps=3)
    assert tracker.noise_scale is None
    assert tracker.tokens_seen == 24
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tracker2 = CBSTracker(model, accumulation_steps=1, unit="samples")
        tracker2.load_state_dict(tracker.state_dict())  # already warned: stays quiet
        x, y = _regression_batch(w_star, sigma, 8, torch.Generator().manual_seed(0))
        with tracker2.microbatch(size=8):
            model(x).sum().backward()
        tracker2.step()


def test_non_finite_gradients_drop_the_step_without_touching_the_estimate():
    model, w_star, sigma, _, _ = _regression()
    tracker = _run_frozen(model, w_star, sigma, accumulation=2, micro=8, steps=20)
    before = tracker.estimator.state_dict()
    for _ in range(2):
        with tracker.microbatch(size=8):
            (model(torch.full((8, 8), float("inf"))).sum() / 2).backward()
    rec = tracker.step()
    assert rec.dropped
    assert tracker.estimator.state_dict() == before
    assert tracker.tokens_seen == 21 * 16  # the tokens were still consumed


def test_hooks_do_not_change_gradients_and_can_be_removed():
    torch.manual_seed(0)
    model = _TinyLM()
    x, y = _lm_microbatches(3, [(2, 5)])[0]
    ref = torch.autograd.grad(model(x, y), list(model.parameters()))
    tracker = CBSTracker(model, accumulation_steps=1)
    with tracker.microbatch(labels=y):
        model(x, y).backward()
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(p.grad, r, rtol=0, atol=0)
    tracker.remove_hooks()
    assert tracker.collector.num_hooks == 0


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"accumulation_steps": 0}, ValueError, r"CBSTracker\(accumulation_steps=0\): must be an integer >= 1"),
        ({"accumulation_steps": 2.0}, ValueError, r"CBSTracker\(accumulation_steps=2.0\): must be an integer >= 1"),
        ({"unit": "bytes"}, ValueError, r"CBSTracker\(unit='bytes'\): must be 'tokens' or 'samples'"),
        ({"preconditioner": "sgd"}, ValueError, r"CBSTracker\(preconditioner='sgd'\): must be None or 'adam'"),
        ({"preconditioner": "adam"}, ValueError, r"the Adam preconditioner needs the optimizer"),
        ({"controller": object()}, TypeError, r"CBSTracker\(controller=object\): expected a BatchSizeController"),
        ({"logger": 3}, TypeError, r"CBSTracker\(logger=int\): expected an object with log\(record\)"),
        ({"grad_scaler": "x"}, TypeError, r"CBSTracker\(grad_scaler=str\): expected a torch.amp.GradScaler"),
        ({"mesh_dim": "dp"}, ValueError, r"CBSTracker\(mesh_dim='dp'\): needs device_mesh="),
        ({"ignore_index": 1.5}, TypeError, r"CBSTracker\(ignore_index=1.5\): expected an int"),
        ({"ignore_index": -(2**70)}, ValueError, r"CBSTracker\(ignore_index=-1180591620717411303424\): must fit a torch.int64"),
        ({"ignore_index": 2**63}, ValueError, r"ignore_index=9223372036854775808\): must fit a torch.int64"),
    ],
)
def test_bad_configuration_is_refused(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        CBSTracker(nn.Linear(2, 1), **kwargs)


def test_bad_model_and_optimizer_are_refused():
    with pytest.raises(TypeError, match=r"CBSTracker\(model=str\): expected a torch.nn.Module"):
        CBSTracker("model")
    with pytest.raises(TypeError, match=r"CBSTracker\(optimizer=int\): expected a torch.optim.Optimizer or None"):
        CBSTracker(nn.Linear(2, 1), 5)
    with pytest.raises(ValueError, match=r"optimizer SGD has a param group without 'betas'/'eps'"):
        m = nn.Linear(2, 1)
        CBSTracker(m, torch.optim.SGD(m.parameters(), lr=0.1), preconditioner="adam")


def test_calls_in_the_wrong_order_are_refused():
    tracker = CBSTracker(nn.Linear(2, 1), accumulation_steps=2)
    with pytest.raises(RuntimeError, match=r"no microbatch since the last step"):
        tracker.step()
    with pytest.raises(TypeError, match=r"pass exactly one of size= .* or labels="):
        with tracker.microbatch():
            pass
    # a negative size is refused; 0 is allowed (a microbatch whose labels are all ignored)
    with pytest.raises(ValueError, match=r"CBSTracker.microbatch\(size=-1\): must be a finite number >= 0"):
        with tracker.microbatch(size=-1):
            pass
    with pytest.raises(RuntimeError, match="cannot be nested"):
        with tracker.microbatch(size=1):
            with tracker.microbatch(size=1):
                pass


def test_a_state_of_another_dp_degree_converts_keeping_the_global_batch():
    tracker = CBSTracker(nn.Linear(2, 1), accumulation_steps=2)
    state = tracker.state_dict()
    state["dp_degree"] = 4
    tracker.load_state_dict(state)  # 2 microbatches on each of 4 ranks: 8 on this one
    assert tracker.accumulation_steps == 8 and tracker.session.starting_accumulation == 8
    assert tracker.state_dict()["dp_degree"] == 1
    del state["estimator"]
    with pytest.raises(KeyError, match=r"missing keys \['estimator'\]"):
        tracker.load_state_dict(state)


def test_host_and_device_reductions_give_the_same_estimates(monkeypatch):
    """On a CPU the window is reduced as host floats; an accelerator keeps tensors: same numbers."""
    from cbs_tracker.core.collector import GradStatsCollector

    def runs():
        plain = _invariance_run()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
        model, w_star, sigma, _, _ = _regression(seed=3)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        amp = _run_frozen(model, w_star, sigma, accumulation=4, micro=8, steps=40, seed=5, scaler=scaler,
                          grad_scaler=scaler, optimizer=opt)
        with amp.microbatch(size=8):  # a non-finite window: dropped on both paths
            (model(torch.full((8, 8), float("inf"))).sum() * scaler.get_scale()).backward()
        dropped = amp.step().dropped
        return [(t.noise_scale, t.grad_sq_norm, t.trace_cov, t.tokens_seen) for t in (plain, amp)], dropped

    calls = []
    real = GradStatsCollector.host_window_sums
    monkeypatch.setattr(GradStatsCollector, "host_window_sums", lambda self: calls.append(1) or real(self))
    host, host_dropped = runs()
    assert len(calls) > 80  # the host path really ran
    monkeypatch.setattr(GradStatsCollector, "host_window_sums", lambda self: None)
    device, device_dropped = runs()
    assert host_dropped and device_dropped
    assert None not in [v for row in host for v in row]
    for h, d in zip(host, device, strict=True):
        assert h == pytest.approx(d, rel=1e-12)
