"""Microbatch-first growth in the plain loop: the layout, the data it uses, the gradients and the estimate."""

from __future__ import annotations

import re
import warnings

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


@pytest.mark.parametrize("left", [3, 5])  # loader batches in the last window: one short microbatch; 4 + 1
def test_a_window_cut_short_by_the_loader_runs_and_divides_by_what_is_there(left):
    n = ROWS * (2 * 3 + 4 * 3 + left)
    _, windows, records, _ = _run(n, max_microbatch=8)
    last = windows[-1]
    assert [len(mb) for mb in last["indices"]] == ([6] if left == 3 else [8, 2])
    assert [i for w in windows for mb in w["indices"] for i in mb] == list(range(n))
    # the loop divided by tracker.accumulation_steps, which counted the microbatches really there
    torch.testing.assert_close(last["grad"], last["parts"].mean(0), rtol=1e-12, atol=1e-14)
    assert records[-1].tokens_seen == n


def test_windows_work_with_loader_workers():
    n = ROWS * (2 * 3 + 4 * 3 + 8 * 1)
    _, windows, _, _ = _run(n, max_microbatch=4, workers=2)
    assert [i for w in windows for mb in w["indices"] for i in mb] == list(range(n))


def test_a_bad_cap_is_refused():
    with pytest.raises(ValueError, match=r"max_microbatch=0\): must be None, an integer >= 1 \(sequences\) or 'auto'"):
        CBSTracker(nn.Linear(2, 1), max_microbatch=0)
    with pytest.raises(ValueError, match=r"max_microbatch='auto'\): reads CUDA memory, but the model is on cpu"):
        CBSTracker(nn.Linear(2, 1), max_microbatch="auto")


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


# ---------------------------------------------------------------- out of memory at a larger microbatch
class _OOM(torch.autograd.Function):
    """Identity whose forward or backward runs out of memory on microbatches above ``limit`` rows."""

    @staticmethod
    def forward(ctx, h, limit, where):
        ctx.rows, ctx.limit, ctx.where = h.shape[0], limit, where
        if where == "forward" and h.shape[0] > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected at {h.shape[0]} rows)")
        return h.view_as(h)

    @staticmethod
    def backward(ctx, g):
        if ctx.where == "backward" and ctx.rows > ctx.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected in backward at {ctx.rows} rows)")
        return g, None, None


class TwoLayer(nn.Module):
    def __init__(self, limit: int | None, where: str) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a, self.b = nn.Linear(D, 3).double(), nn.Linear(3, 1).double()
        self.limit, self.where, self.calls = limit, where, 0

    def forward(self, x):
        self.calls += 1
        h = torch.tanh(self.a(x))
        if self.limit is not None:
            h = _OOM.apply(h, self.limit, self.where)
        return self.b(h).squeeze(-1)  # b's gradient is accumulated before _OOM's backward runs


def _train(n: int, *, max_microbatch, limit: int | None = None, where: str = "forward", plan=PLAN,
           tracker_class=CBSTracker):
    data = Indexed(n)
    loader = torch.utils.data.DataLoader(data, batch_size=ROWS, shuffle=False)
    model = TwoLayer(limit, where)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = tracker_class(model, optimizer, accumulation_steps=2, unit="samples",
                            controller=PlanController(plan), max_microbatch=max_microbatch)
    used, records, grads = [], [], []
    for window in tracker.windows(loader):
        for mb in window:
            with tracker.microbatch(size=len(mb["index"])):
                loss = 0.5 * (model(mb["x"]) - mb["y"]).pow(2).mean()
                (loss / tracker.accumulation_steps).backward()
                used.append(mb["index"].tolist())  # only once the backward went through
        records.append(tracker.step())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]).clone())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return tracker, used, records, grads, model


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_out_of_memory_at_the_first_larger_microbatch_redoes_the_window_at_the_old_one(where):
    """The truth: the same run with the cap at the microbatch that fits from the start."""
    n = ROWS * (2 * 3 + 4 * 3 + 8 * 3 + 16 * 2)
    with pytest.warns(UserWarning, match="out of memory at a microbatch of 4 loader batches; the window is redone"):
        tracker, used, records, grads, model = _train(n, max_microbatch=8, limit=4, where=where)
    ref_tracker, ref_used, ref_records, ref_grads, ref_model = _train(n, max_microbatch=4)
    assert [i for mb in used for i in mb] == list(range(n))  # each sample once, in order
    assert used == ref_used  # and in the layout of the run that never tried the larger microbatch
    assert max(len(mb) for mb in used) == 4 and tracker.microbatch_batches == 2  # the layout stays there
    for g, ref in zip(grads, ref_grads, strict=True):  # the failed attempt left nothing in any gradient
        torch.testing.assert_close(g, ref, rtol=1e-12, atol=1e-14)
    for r, ref in zip(records, ref_records, strict=True):
        assert (r.accumulation_steps, r.micro_batch, r.tokens_seen) == (ref.accumulation_steps, ref.micro_batch,
                                                                       ref.tokens_seen)
        assert r.step_grad_sq_norm == pytest.approx(ref.step_grad_sq_norm, rel=1e-12)
        assert r.step_trace_cov == pytest.approx(ref.step_trace_cov, rel=1e-12)
        assert (r.noise_scale is None) == (ref.noise_scale is None)
        assert r.noise_scale is None or r.noise_scale == pytest.approx(ref.noise_scale, rel=1e-12)
    assert sum(r.noise_scale is not None for r in records) >= 2
    torch.testing.assert_close(model.a.weight, ref_model.a.weight, rtol=1e-12, atol=1e-14)
    assert tracker.steps == ref_tracker.steps


def test_out_of_memory_where_the_microbatch_already_ran_is_raised():
    # the limit is below the first layout (2 rows would fit; here nothing larger than 1 row does)
    with pytest.raises(torch.OutOfMemoryError):
        _train(ROWS * 8, max_microbatch=8, limit=1)
    with pytest.raises(torch.OutOfMemoryError):  # no microbatch growth configured: nothing to fall back to
        _train(ROWS * 8, max_microbatch=None, limit=1)


class _FakeMemory:
    """A device whose peak is ``base + per_row * rows`` of the largest microbatch since the last reset."""

    def __init__(self, base: int, per_row: int, total: int) -> None:
        self.base, self.per_row, self.total_bytes, self.rows = base, per_row, total, 0

    def allocated(self) -> int:
        return self.base

    def reset_peak(self) -> None:
        self.rows = 0

    def peak(self) -> int:
        return self.base + self.per_row * self.rows

    def total(self) -> int:
        return self.total_bytes


def test_auto_picks_the_largest_microbatch_the_measured_memory_allows(monkeypatch):
    import cbs_tracker.core.loop as loop

    # 0.85 * 1500 - 100 = 1175 bytes for activations at 40 per row: 29 rows, so 16 (8 loader batches); without
    # the margin 1400 bytes would take 32 rows
    memory = _FakeMemory(base=100, per_row=40, total=1500)
    monkeypatch.setattr(loop, "_cuda_memory_probe", lambda model, owner: memory)
    data = Indexed(ROWS * (2 * 3 + 4 * 3 + 8 * 3 + 16 * 3 + 32 * 2))
    loader = torch.utils.data.DataLoader(data, batch_size=ROWS, shuffle=False)
    model = nn.Linear(D, 1, bias=False).double()
    tracker = CBSTracker(model, accumulation_steps=2, unit="samples",
                         controller=PlanController({3: 4, 6: 8, 9: 16, 12: 32}), max_microbatch="auto")
    rows = []
    for window in tracker.windows(loader):
        for mb in window:
            with tracker.microbatch(size=len(mb["index"])):
                memory.rows = max(memory.rows, len(mb["index"]))
                model(mb["x"]).pow(2).mean().backward()
        rows.append((len(window), len(window[0]["index"])))
        tracker.step()
        model.zero_grad(set_to_none=True)
    # levels 2, 4, 8, 16, 32 loader batches: the microbatch doubles with the level up to 16 rows, then accumulates
    assert rows == [(2, 2)] * 3 + [(2, 4)] * 3 + [(2, 8)] * 3 + [(2, 16)] * 3 + [(4, 16)] * 2


def test_what_an_out_of_memory_error_taught_survives_a_checkpoint():
    n = ROWS * (2 * 3 + 4 * 3 + 8 * 3)
    with pytest.warns(UserWarning, match="out of memory at a microbatch of 4 loader batches"):
        tracker, _, _, _, _ = _train(n, max_microbatch=8, limit=4)
    state = tracker.state_dict()
    assert state["microbatch_layout"] == {"good_group": 2, "oom_group": 2}
    model = TwoLayer(4, "forward")  # the same memory limit: 8 rows fail
    fresh = CBSTracker(model, accumulation_steps=2, unit="samples", controller=PlanController({}), max_microbatch=8)
    fresh.load_state_dict(state)
    loader = torch.utils.data.DataLoader(Indexed(ROWS * 8 * 2), batch_size=ROWS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second out-of-memory attempt
        for window in fresh.windows(loader):
            for mb in window:
                with fresh.microbatch(size=len(mb["index"])):
                    model(mb["x"]).pow(2).mean().backward()
            assert len(window[0]["index"]) == 4  # level 8 at the learned cap of 2 loader batches
            fresh.step()
            model.zero_grad(set_to_none=True)


@pytest.mark.parametrize(("layout", "named"), [
    ({"good_group": -2, "oom_group": None}, "'good_group'] must be an int >= 1, got -2"),
    ({"good_group": 2, "oom_group": 0}, "'oom_group'] must be an int >= 1 or None, got 0"),
    ({"good_group": 1.5, "oom_group": None}, "'good_group'] must be an int >= 1, got 1.5"),
    ({"good_group": 2}, "must be a dict with 'good_group' and 'oom_group'"),
])
def test_a_bad_saved_layout_is_refused_naming_the_key_and_nothing_is_loaded(layout, named):
    tracker, _, _, _, _ = _train(ROWS * 2 * 3, max_microbatch=8, limit=None)
    state = {**tracker.state_dict(), "microbatch_layout": layout}
    fresh = CBSTracker(TwoLayer(4, "forward"), accumulation_steps=2, unit="samples", controller=PlanController({}),
                       max_microbatch=8)
    before = fresh.state_dict()
    with pytest.raises(ValueError, match=re.escape(named)):
        fresh.load_state_dict(state)
    assert fresh.state_dict() == before


def test_out_of_memory_is_raised_where_dropping_the_gradients_cannot_redo_the_window():
    class NotRecoverable(CBSTracker):  # what FSDPTracker declares (its backward keeps state of its own)
        oom_recoverable = False

    with pytest.warns(UserWarning, match="under DDP or FSDP2 the failed backward leaves state"):
        with pytest.raises(torch.OutOfMemoryError):
            _train(ROWS * (2 * 3 + 4 * 3 + 8 * 3), max_microbatch=8, limit=4, tracker_class=NotRecoverable)
