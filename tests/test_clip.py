"""``tracker.clip_grad_norm_`` against ``torch.nn.utils.clip_grad_norm_`` on the same run.

Two copies of one model take the same steps; one clips with torch's function, the
other with the tracker's, which reuses the norm ``step()`` measured. Their returned
norms and their weights must agree to float32 rounding; the fallbacks (a
preconditioner, another norm type, no step since the last microbatch) must be
torch's function exactly. The two-rank DDP case is in ``tests/test_distributed.py``
(``ddp_one_microbatch``).
"""

from __future__ import annotations

import copy

import pytest
import torch

from cbs_tracker import BatchSizeController, CBSTracker
from tests.collector_workers import tiny_gpt


def _setup():
    return tiny_gpt()


def _batches(step: int, k: int):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g)) for _ in range(k)]


def _run(model, *, use_tracker_clip: bool, max_norm: float, steps: int = 6, **tracker_kw):
    # SGD: the weights move by the clipped gradient itself (Adam would amplify float32
    # rounding of near-zero gradient entries into visible differences)
    adam = tracker_kw.get("preconditioner") == "adam"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2) if adam else torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = CBSTracker(model, opt, accumulation_steps=2, controller=BatchSizeController(observe_only=True),
                         **tracker_kw)
    norms = []
    for step in range(steps):
        for x, y in _batches(step, 2):
            with tracker.microbatch(labels=y):
                (model(x, y)[1] / 2).backward()
        tracker.step()
        if use_tracker_clip:
            norms.append(tracker.clip_grad_norm_(max_norm))
        else:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        opt.step()
        opt.zero_grad(set_to_none=True)
    tracker.remove_hooks()
    return norms, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("max_norm", [0.3, 1e6], ids=["clips", "never-clips"])
def test_tracker_clip_equals_torch_clip(max_norm):
    base = _setup()
    want_norms, want_params = _run(copy.deepcopy(base), use_tracker_clip=False, max_norm=max_norm)
    got_norms, got_params = _run(copy.deepcopy(base), use_tracker_clip=True, max_norm=max_norm)
    if max_norm < 1:  # the "clips" case clips every step, the other none
        assert min(float(n) for n in want_norms) > max_norm
    else:
        assert max(float(n) for n in want_norms) < max_norm
    for g, w in zip(got_norms, want_norms, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape == ()
        assert float(g) == pytest.approx(float(w), rel=2e-6)  # float64 sum of float32 norms vs torch's float32
    for g, w in zip(got_params, want_params, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_tracker_clip_falls_back_to_torch_where_the_norm_cannot_be_reused(monkeypatch):
    calls = []
    real = torch.nn.utils.clip_grad_norm_

    def spy(*args, **kwargs):
        calls.append(kwargs.get("norm_type"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    model = _setup()
    _run(model, use_tracker_clip=True, max_norm=0.3, steps=2)
    assert calls == []  # reused: torch's function never ran
    _run(model, use_tracker_clip=True, max_norm=0.3, steps=2, preconditioner="adam")
    assert calls == [2.0, 2.0]  # the measured norm is the preconditioned one: torch's norm is needed
    calls.clear()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    tracker = CBSTracker(model, opt, accumulation_steps=1)
    (x, y), (x2, y2) = _batches(0, 2)
    with tracker.microbatch(labels=y):
        model(x, y)[1].backward()
    tracker.step()
    tracker.clip_grad_norm_(1e6, norm_type=1.0)
    assert calls == [1.0]
    with tracker.microbatch(labels=y2):  # .grad changes after the step that measured it
        model(x2, y2)[1].backward()
    want = float(torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in model.parameters()])))
    assert float(tracker.clip_grad_norm_(1e6)) == pytest.approx(want, rel=1e-5)
    assert calls == [1.0, 2.0]


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), True, "x", None])
def test_tracker_clip_refuses_a_bad_max_norm(bad):
    model = _setup()
    tracker = CBSTracker(model, None, accumulation_steps=2)
    with pytest.raises(ValueError, match=r"clip_grad_norm_\(max_norm=.*finite number >= 0"):
        tracker.clip_grad_norm_(bad)


def test_tracker_clip_twice_clips_once_like_torch():
    base = _setup()
    got_model, want_model = copy.deepcopy(base), copy.deepcopy(base)
    (x, y), (x2, y2) = _batches(7, 2)
    tracker = CBSTracker(got_model, None, accumulation_steps=2)
    for xb, yb in ((x, y), (x2, y2)):
        with tracker.microbatch(labels=yb):
            (got_model(xb, yb)[1] / 2).backward()
        (want_model(xb, yb)[1] / 2).backward()
    tracker.step()
    for _ in range(2):  # the second call sees the clipped gradients
        got = tracker.clip_grad_norm_(0.05)
        want = torch.nn.utils.clip_grad_norm_(want_model.parameters(), 0.05)
        assert float(got) == pytest.approx(float(want), rel=2e-6)
    for g, w in zip(got_model.parameters(), want_model.parameters(), strict=True):
        torch.testing.assert_close(g.grad, w.grad, rtol=1e-5, atol=1e-8)
