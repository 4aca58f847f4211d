"""Microbatch-first growth in the plain loop: the layout, the data it uses, the gradients and the estimate."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cbs_tracker import CBSTracker
from cbs_tracker.core.estimator import estimate_from_norms
from tests.doubles import PlanController

D, ROWS = 6, 2  # features; rows per loader batch
PLAN = {3: 4, 6: 8, 9: 16}  # the batch level (loader batches per window) decided at these steps


class Indexed(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, D, generator=g, dtype=torch.float64)
        self.y = torch.randn(n, generator=g, dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return {"x": self.x[i], "y": self.y[i], "index": i}


def _run(n: int, *, max_microbatch: int | None, workers: int = 0):
    data = Indexed(n)
    loader = torch.utils.data.DataLoader(data, batch_size=ROWS, shuffle=False, num_workers=workers)
    model = nn.Linear(D, 1, bias=False).double()
    tracker = CBSTracker(model, accumulation_steps=2, unit="samples", controller=PlanController(PLAN),
                         max_microbatch=max_microbatch)
    windows, records = [], []
    for window in tracker.windows(loader):
        grads = []
        for mb in window:
            with tracker.microbatch(size=len(mb["index"])):
                loss = 0.5 * (model(mb["x"]).squeeze(-1) - mb["y"]).pow(2).mean()
                (loss / tracker.accumulation_steps).backward()
            w = model.weight.detach().flatten()
            grads.append(((mb["x"] @ w - mb["y"])[:, None] * mb["x"]).mean(0))
        records.append(tracker.step())
        windows.append(dict(indices=[mb["index"].tolist() for mb in window], grad=model.weight.grad.flatten().clone(),
                            parts=torch.stack(grads)))
        model.zero_grad(set_to_none=True)
    return tracker, windows, records, data


def test_the_microbatch_grows_first_and_every_sample_is_used_once_in_order():
    n = ROWS * (2 * 3 + 4 * 3 + 8 * 3 + 16 * 4)
    tracker, windows, records, _ = _run(n, max_microbatch=8)
    seen = [i for w in windows for mb in w["indices"] for i in mb]
    assert seen == list(range(n))  # each sample once, in the loader's order, across every layout change
    layout = [(len(w["indices"]), len(w["indices"][0])) for w in windows]
    # (microbatches, rows per microbatch): level 2 -> 2 x 2; 4 -> 2 x 4; 8 -> 2 x 8; 16 -> 4 x 8 (the cap: 8 rows)
    assert layout == [(2, 2)] * 3 + [(2, 4)] * 3 + [(2, 8)] * 3 + [(4, 8)] * 4
    for w in windows:  # no microbatch mixes two layouts
        assert len({len(mb) for mb in w["indices"]}) == 1
    # the records count the batch level in loader batches, and the data like a constant run at the same samples
    assert [r.accumulation_steps for r in records] == [2] * 3 + [4] * 3 + [8] * 3 + [16] * 4
    assert [r.micro_batch for r in records] == [2.0] * 3 + [4.0] * 3 + [8.0] * 3 + [8.0] * 4
    assert tracker.tokens_seen == n
    assert tracker.starting_batch_steps == n // (2 * ROWS)


def test_without_a_cap_only_the_accumulation_grows():
    n = ROWS * (2 * 3 + 4 * 3 + 8 * 3 + 16 * 1)
    _, windows, records, _ = _run(n, max_microbatch=None)
    assert [len(w["indices"][0]) for w in windows] == [ROWS] * len(windows)
    assert [len(w["indices"]) for w in windows] == [2] * 3 + [4] * 3 + [8] * 3 + [16]


def test_window_gradients_and_per_step_estimates_are_exact_across_microbatch_changes():
    n = ROWS * (2 * 3 + 4 * 3 + 8 * 3 + 16 * 2)
    _, windows, records, _ = _run(n, max_microbatch=8)
    for w, r in zip(windows, records, strict=True):
        parts = w["parts"]
        # the step's gradient is the mean over the window's microbatches of their own means
        torch.testing.assert_close(w["grad"], parts.mean(0), rtol=1e-12, atol=1e-14)
        b = float(len(w["indices"][0]))
        k = len(w["indices"])
        want = estimate_from_norms(float(parts.pow(2).sum(1).mean()), float(parts.mean(0).pow(2).sum()), b, k * b)
        assert r.step_grad_sq_norm == pytest.approx(want.grad_sq_norm, rel=1e-9)
        assert r.step_trace_cov == pytest.approx(want.trace_cov, rel=1e-9)


def test_windows_work_with_loader_workers():
    n = ROWS * (2 * 3 + 4 * 3 + 8 * 1)
    _, windows, _, _ = _run(n, max_microbatch=4, workers=2)
    assert [i for w in windows for mb in w["indices"] for i in mb] == list(range(n))


def test_a_bad_cap_is_refused():
    with pytest.raises(ValueError, match=r"max_microbatch=0\): must be None or an integer >= 1"):
        CBSTracker(nn.Linear(2, 1), max_microbatch=0)


def test_loader_batches_of_every_container_kind_are_joined_field_by_field():
    from collections import namedtuple

    from cbs_tracker.core.loop import _join

    Pair = namedtuple("Pair", "x y")
    a, b = torch.arange(4).reshape(2, 2), torch.arange(4, 8).reshape(2, 2)
    joined = _join([(a, a[:, 0]), (b, b[:, 0])])
    assert isinstance(joined, tuple) and torch.equal(joined[0], torch.arange(8).reshape(4, 2))
    assert torch.equal(joined[1], torch.tensor([0, 2, 4, 6]))
    named = _join([Pair(a, a), Pair(b, b)])
    assert isinstance(named, Pair) and torch.equal(named.y, torch.arange(8).reshape(4, 2))
    nested = _join([{"ids": [a]}, {"ids": [b]}])
    assert isinstance(nested["ids"], list) and torch.equal(nested["ids"][0], torch.arange(8).reshape(4, 2))
    with pytest.raises(TypeError, match="cannot join loader batches of type str"):
        _join(["a", "b"])
