"""The bucketed gradient-norm collector against slow references.

The single-process references materialise every microbatch's gradient with
``torch.autograd.grad`` on the bundled GPT (embedding tied to the head); the
spawned DDP and FSDP2 runs (``tests/collector_workers.py``, 2 gloo ranks) compare
with a norm taken inside each parameter's hook. Operator counts and the absence
of host syncs are checked with a ``TorchDispatchMode`` that sees every aten call.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from cbs_tracker.core.collector import (
    MIN_BUCKET_BYTES,
    GradStatsCollector,
    adam_preconditioner,
    local_grad_sq_norm,
)
from cbs_tracker.demo.gpt import GPT, GPTConfig
from tests import collector_workers as cw
from tests.spawning import spawn


def _gpt(dtype: torch.dtype = torch.float32) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, context_length=8, n_layer=2, d_model=16, n_head=2)).to(dtype)


def _micro(seed: int, shapes: list[tuple[int, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 32, s, generator=g), torch.randint(0, 32, s, generator=g)) for s in shapes]


def _ref_sq(model: GPT, micro, scale: float = 1.0, transform=None) -> list[float]:
    """Slow reference: each microbatch's gradient materialised, its squared norm in float64."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for x, y in micro:
        grads = torch.autograd.grad(model(x, y)[1] * scale, params)
        if transform is not None:
            grads = [transform(p, g) for p, g in zip(params, grads, strict=True)]
        out.append(sum(float(g.double().pow(2).sum()) for g in grads))
    return out


def _run(model: GPT, collector: GradStatsCollector, micro, scale: float = 1.0, unsynced: bool = False) -> list[torch.Tensor]:
    for x, y in micro:
        collector.begin_microbatch(unsynced=unsynced)
        (model(x, y)[1] * scale).backward()
        collector.end_microbatch(float(x.numel()))
    return collector.microbatch_sq_norms()


def _grad_bytes(model: GPT) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class _OpCounter(TorchDispatchMode):
    def __init__(self, forbid: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self.forbid = forbid

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.forbid:
            raise AssertionError(f"host sync: {name}")
        self.counts[name] += 1
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------------------------ single process
@pytest.mark.parametrize("unsynced", [False, True], ids=["hooks", "first-from-grad"])
@pytest.mark.parametrize("bucket", ["default", "tiny", "all", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tied_gpt_matches_materialised_gradients(bucket, dtype, unsynced):
    model = _gpt(dtype)
    size = {"default": None, "tiny": 3000, "all": 10 * _grad_bytes(model), "eager": 0}[bucket]
    collector = GradStatsCollector(model.parameters(), bucket_bytes=size)
    micro = _micro(1, [(2, 8), (3, 5), (1, 8)])
    ref = _ref_sq(model, micro, scale=64.0)  # an AMP-like loss scale stays in the hooked norms
    # step 0 starts from .grad None (autograd steals the gradient; unsynced: the first microbatch
    # is read from .grad), step 1 accumulates onto step 0's .grad (unsynced: hooks again throughout)
    for step in range(2):
        got = _run(model, collector, micro, scale=64.0, unsynced=unsynced)
        collector.reset_window()
        rel = 1e-12 if dtype == torch.float64 else 2e-6  # float64 is never narrowed to float32
        assert [float(t) for t in got] == pytest.approx(ref, rel=rel)
        assert all(t.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) for t in got)
        if step == 1:
            model.zero_grad(set_to_none=True)
    # the tied head and embedding are one parameter: its hook fires once per backward
    assert collector.hooks_fired_in_last_microbatch == len(list(model.parameters())) == collector.num_hooks


def test_autograd_still_steals_the_gradient_into_grad():
    """Holding a gradient must not make autograd copy it into ``.grad`` (a copy per parameter)."""
    model = _gpt()
    collector = GradStatsCollector(model.parameters(), bucket_bytes=10 * _grad_bytes(model))
    incoming: dict[int, int] = {}
    for p in model.parameters():
        p.register_hook(lambda g, p=p: incoming.__setitem__(id(p), g.data_ptr()))
    (x, y), = _micro(2, [(2, 8)])
    collector.begin_microbatch()
    model(x, y)[1].backward()
    collector.end_microbatch(16.0)
    assert all(p.grad.data_ptr() == incoming[id(p)] for p in model.parameters())


@pytest.mark.parametrize("unsynced", [False, True], ids=["hooks", "first-from-grad-requested"])
def test_held_gradient_changed_through_grad_is_detected_and_not_measured(unsynced):
    """A post-accumulate-grad hook changes .grad: the hooks' check sees it (``.grad`` is then not read)."""
    model = _gpt()
    collector = GradStatsCollector(model.parameters(), bucket_bytes=10 * _grad_bytes(model))
    # e.g. an optimizer step in backward that scales .grad in place right after accumulation
    def scale_grad(p: torch.nn.Parameter) -> None:
        p.grad.mul_(3.0)

    handle = model.lm_head.weight.register_post_accumulate_grad_hook(scale_grad)
    micro = _micro(3, [(2, 8), (2, 8)])
    with pytest.warns(RuntimeWarning, match="modified in place"):
        _run(model, collector, micro[:1], unsynced=unsynced)
    assert collector.window_unmeasurable
    collector.reset_window()
    handle.remove()
    model.zero_grad(set_to_none=True)
    # afterwards every norm is taken inside its hook: right again
    got = _run(model, collector, micro)
    assert not collector.window_unmeasurable
    assert [float(t) for t in got] == pytest.approx(_ref_sq(model, micro), rel=2e-6)


def test_two_backwards_in_one_microbatch_sum_per_backward():
    """Each backward's gradient is read before the next one accumulates into it."""
    model = _gpt()
    collector = GradStatsCollector(model.parameters(), bucket_bytes=10 * _grad_bytes(model))
    (x1, y1), (x2, y2) = _micro(4, [(2, 8), (2, 8)])
    ref = _ref_sq(model, [(x1, y1), (x2, y2)])
    collector.begin_microbatch()
    model(x1, y1)[1].backward()
    model(x2, y2)[1].backward()
    collector.end_microbatch(32.0)
    assert float(collector.microbatch_sq_norms()[0]) == pytest.approx(sum(ref), rel=2e-6)
    assert collector.hooks_fired_in_last_microbatch == 2 * collector.num_hooks


def test_first_microbatch_read_from_grad_does_no_hook_work_and_falls_back_when_grad_is_set():
    model = _gpt()
    collector = GradStatsCollector(model.parameters(), bucket_bytes=10 * _grad_bytes(model))
    micro = _micro(10, [(2, 8), (2, 8)])
    ref = _ref_sq(model, micro)
    (x, y), (x2, y2) = micro
    plain = _OpCounter()
    with plain:
        model(x, y)[1].backward()
    model.zero_grad(set_to_none=True)
    collector.begin_microbatch(unsynced=True)
    tracked = _OpCounter()
    with tracked:
        model(x, y)[1].backward()
    # the hooks only counted: the backward ran exactly the untracked backward's operators, held nothing
    assert tracked.counts == plain.counts
    assert collector.held_bytes == 0
    ends = _OpCounter()
    with ends:  # the norm is read from .grad when the microbatch ends: one fused norm
        collector.end_microbatch(16.0)
    assert ends.counts == Counter({"_foreach_norm": 1, "stack": 1, "dot": 1})
    assert collector.hooks_fired_in_last_microbatch == collector.num_hooks
    # the second microbatch finds .grad set: measured in its hooks, not from .grad
    collector.begin_microbatch(unsynced=True)
    model(x2, y2)[1].backward()
    collector.end_microbatch(16.0)
    assert [float(t) for t in collector.microbatch_sq_norms()] == pytest.approx(ref, rel=2e-6)


def test_later_microbatches_file_straight_into_one_bucket_after_a_first_read_from_grad(monkeypatch):
    """A window whose first microbatch was read from .grad and found the whole model in one bucket: the
    hooks of its later microbatches only file (``_file`` is not called) and measure what ``_file``
    measures, bit for bit; a second backward in a microbatch is measured apart, as ``_file`` measures it
    (the first backward's gradients are measured when it ends); a tiny bucket, a
    window not read from .grad first, or a per-parameter transform take ``_file`` throughout."""
    micro = _micro(12, [(2, 8), (3, 5), (2, 8)])
    double = _micro(13, [(2, 8), (2, 8)])
    filed = [0]
    real = GradStatsCollector._file

    def counted(self, param, grad):
        filed[0] += 1
        return real(self, param, grad)

    monkeypatch.setattr(GradStatsCollector, "_file", counted)

    def window(bucket_bytes=None, unsynced=True, transform=None):
        model = _gpt()
        collector = GradStatsCollector(model.parameters(), bucket_bytes=bucket_bytes, transform=transform)
        filed[0] = 0
        got = [float(t) for t in _run(model, collector, micro, unsynced=unsynced)]
        # a later microbatch with two backward passes
        collector.begin_microbatch(unsynced=unsynced)
        for x, y in double:
            model(x, y)[1].backward()
        collector.end_microbatch(32.0)
        got.append(float(collector.microbatch_sq_norms()[-1]))
        return got, filed[0], collector

    fast, fast_filed, collector = window()
    assert fast_filed == 0  # every later gradient went straight into the bucket (the first backward's flushed at its end)
    assert collector.held_bytes == 0 and not collector._fast
    general, general_filed, _ = window(bucket_bytes=3000)  # several buckets: _file cuts them
    assert general_filed > 0
    hooked, hooked_filed, _ = window(unsynced=False)  # no first microbatch from .grad: _file throughout
    assert hooked_filed > 0
    assert fast[1:] == hooked[1:]  # the same gradients filed in the same order: the same norms, bit for bit
    model = _gpt()
    params = list(model.parameters())
    want = _ref_sq(model, micro)
    g1 = torch.autograd.grad(model(*double[0])[1], params)
    g2 = torch.autograd.grad(model(*double[1])[1], params)
    # each backward's gradient is measured before the next adds into it (as _file does)
    want.append(sum(float(a.double().pow(2).sum() + b.double().pow(2).sum()) for a, b in zip(g1, g2, strict=True)))
    assert fast == pytest.approx(want, rel=2e-6) and general == pytest.approx(want, rel=2e-6)
    scaled, scaled_filed, _ = window(transform=lambda p, g: 2.0 * g)  # a per-parameter transform: _file
    assert scaled_filed > 0
    assert scaled == pytest.approx([4.0 * v for v in want], rel=2e-6)


def test_first_microbatch_from_grad_with_adam_preconditioner_and_an_unused_parameter():
    model = _gpt()
    extra = torch.nn.Parameter(torch.randn(5))  # hooked and trainable, but no microbatch uses it
    params = [*model.parameters(), extra]
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-6)
    pre = adam_preconditioner(opt)
    micro = _micro(11, [(2, 8), (3, 6)])
    for _ in range(2):
        for x, y in micro:
            model(x, y)[1].backward()
        extra.grad = torch.ones(5)  # optimizer state for it too
        opt.step()
        opt.zero_grad(set_to_none=True)
    collector = GradStatsCollector(params, transform=pre)

    def formula(p, g):
        st = opt.state[p]
        return g / ((st["exp_avg_sq"] / (1 - 0.95 ** float(st["step"]))).sqrt() + 1e-6)

    want = _ref_sq(model, micro, transform=formula)
    got = _run(model, collector, micro, unsynced=True)
    assert not collector.window_unmeasurable
    assert [float(t) for t in got] == pytest.approx(want, rel=2e-6)


def test_two_backwards_in_a_microbatch_read_from_grad_measure_their_sum():
    """Read from ``.grad``, the microbatch's norm is that of its whole gradient ``|g1 + g2|^2``."""
    model = _gpt()
    collector = GradStatsCollector(model.parameters())
    (x1, y1), (x2, y2) = _micro(4, [(2, 8), (2, 8)])
    params = list(model.parameters())
    g1 = torch.autograd.grad(model(x1, y1)[1], params)
    g2 = torch.autograd.grad(model(x2, y2)[1], params)
    want = sum(float((a.double() + b.double()).pow(2).sum()) for a, b in zip(g1, g2, strict=True))
    collector.begin_microbatch(unsynced=True)
    model(x1, y1)[1].backward()
    model(x2, y2)[1].backward()
    collector.end_microbatch(32.0)
    assert float(collector.microbatch_sq_norms()[0]) == pytest.approx(want, rel=2e-6)


def test_host_window_sums_equal_the_device_form():
    collector = _window_with_every_kind_of_size()
    host = collector.host_window_sums()
    assert host == pytest.approx(collector.window_sums(torch.device("cpu")).tolist(), rel=1e-15)
    pulled, extra = collector.pulled_window_sums([torch.tensor(2.5), torch.tensor([7], dtype=torch.int64)])
    assert pulled == host and extra == [2.5, 7.0]  # the accelerator's one copy gives the same numbers
    per_unit = 2 / 4**2 + 7 / 8**2 + 19 / 2**2
    assert host == pytest.approx([28.0, 3, 1 / 4 + 1 / 8 + 1 / 2, 14.0, 3, per_unit], rel=1e-15)


def test_held_bytes_stay_within_the_bucket_bound():
    model = _gpt()
    cap = 3500
    collector = GradStatsCollector(model.parameters(), bucket_bytes=cap)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    assert largest > cap  # a gradient above the bound is reduced at once, never held
    seen: list[int] = []
    for p in model.parameters():  # registered after the collector's: runs after it filed the gradient
        p.register_hook(lambda g: seen.append(collector.held_bytes))
    _run(model, collector, _micro(5, [(2, 8), (2, 8)]))
    assert max(seen) <= cap
    assert max(seen) > 0
    assert collector.held_bytes == 0
    auto = GradStatsCollector(model.parameters())
    assert _grad_bytes(model) / 8 < MIN_BUCKET_BYTES and auto.bucket_bytes == MIN_BUCKET_BYTES  # a small model
    big = [torch.nn.Parameter(torch.zeros(2**22)) for _ in range(5)]  # 80 MiB: an eighth is above the floor
    assert GradStatsCollector(big).bucket_bytes == 5 * 2**24 // 8


def test_adam_preconditioner_fused_and_per_parameter_agree_with_the_formula():
    model = _gpt()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-6)
    pre = adam_preconditioner(opt)
    collector = GradStatsCollector(params, transform=pre)
    micro = _micro(6, [(2, 8), (3, 6)])
    _run(model, collector, micro)
    assert collector.window_unmeasurable  # no optimizer state yet
    collector.reset_window()
    for _ in range(2):
        opt.step()
        opt.zero_grad(set_to_none=True)
        _run(model, collector, micro)
        collector.reset_window()
    opt.step()
    opt.zero_grad(set_to_none=True)

    def formula(p, g):  # written out from the optimizer's state, independent of the collector
        st = opt.state[p]
        v_hat = st["exp_avg_sq"] / (1 - 0.95 ** float(st["step"]))
        return g / (v_hat.sqrt() + 1e-6)

    ref = _ref_sq(model, micro, transform=formula)
    got = _run(model, collector, micro)
    assert not collector.window_unmeasurable
    assert [float(t) for t in got] == pytest.approx(ref, rel=2e-6)
    assert [float(t) for t in got] != pytest.approx(_ref_sq(model, micro), rel=1e-2)  # really preconditioned
    for p in params:
        p.grad = torch.randn_like(p)
    fused = local_grad_sq_norm(params, pre)
    per_param = sum(float(pre(p, p.grad).double().pow(2).sum()) for p in params)
    assert float(fused) == pytest.approx(per_param, rel=2e-6)
    assert float(fused) == pytest.approx(sum(float(formula(p, p.grad).double().pow(2).sum()) for p in params),
                                         rel=2e-6)


def test_operators_per_microbatch_are_per_bucket_not_per_parameter():
    model = _gpt()
    collector = GradStatsCollector(model.parameters(), bucket_bytes=10 * _grad_bytes(model))
    micro = _micro(7, [(2, 8)])
    (x, y), = micro
    collector.begin_microbatch()  # the first microbatch: autograd steals each gradient into .grad
    model(x, y)[1].backward()
    collector.end_microbatch(16.0)
    counts = {}
    for label, c in (("tracked", collector), ("plain", None)):
        counter = _OpCounter()
        with counter:
            if c is not None:
                c.begin_microbatch()
            model(x, y)[1].backward()
            if c is not None:
                c.end_microbatch(16.0)
        counts[label] = counter.counts
        collector.remove()
    added = counts["tracked"] - counts["plain"]
    # one fused norm for the one bucket, then stack + dot for the microbatch
    assert added == Counter({"_foreach_norm": 1, "stack": 1, "dot": 1})


def test_no_host_sync_in_hooks_microbatch_end_or_window_sums():
    model = _gpt()
    collector = GradStatsCollector(model.parameters())
    with _OpCounter(forbid=("_local_scalar_dense", "item")):
        for x, y in _micro(8, [(2, 8), (1, 8)]):
            collector.begin_microbatch()
            model(x, y)[1].backward()
            collector.end_microbatch((y >= 0).sum())
        collector.window_sums(torch.device("cpu"))


def _window_with_every_kind_of_size() -> GradStatsCollector:
    """Norms 2, 5, 7, 11, 13, 17, 19 with sizes 4, 0, 8, nan, -1, inf, 2 (numbers and tensors)."""
    collector = GradStatsCollector([])
    sq = [2.0, 5.0, 7.0, 11.0, 13.0, 17.0, 19.0]
    sizes = [4.0, torch.tensor(0), torch.tensor(8.0), float("nan"), -1.0, torch.tensor(float("inf")), 2]
    for s, b in zip(sq, sizes, strict=True):
        collector.begin_microbatch()
        collector.end_microbatch(b)
        collector._micro_sq[-1] = torch.tensor(s)  # the norms a backward would have left
    return collector


def test_window_sums_leave_out_empty_microbatches_and_count_invalid_sizes():
    collector = _window_with_every_kind_of_size()
    out = collector.window_sums(torch.device("cpu"))
    assert out.dtype == torch.float64 and out.shape == (6,)
    valid = [(2.0, 4.0), (7.0, 8.0), (19.0, 2.0)]  # size 0 is left out; nan, -1 and inf are invalid
    expected = [sum(s for s, _ in valid), 3, sum(1 / b for _, b in valid), sum(b for _, b in valid), 3,
                sum(s / b**2 for s, b in valid)]
    assert out.tolist() == pytest.approx(expected, rel=1e-12)
    collector.reset_window()
    assert collector.window_sums(torch.device("cpu")).tolist() == [0.0] * 6


def test_hook_counts_inside_and_outside_microbatches():
    model = _gpt()
    collector = GradStatsCollector(model.parameters())
    (x, y), = _micro(9, [(2, 8)])
    model(x, y)[1].backward()  # outside any microbatch: counted, not measured
    assert collector.hooks_fired_outside == collector.num_hooks
    collector.begin_microbatch()
    collector.end_microbatch(16.0)  # no backward inside
    assert collector.hooks_fired_in_last_microbatch == 0
    assert float(collector.microbatch_sq_norms()[0]) == 0.0
    collector.begin_microbatch()
    model(x, y)[1].backward()
    collector.end_microbatch(16.0)
    assert collector.hooks_fired_in_last_microbatch == collector.num_hooks
    assert collector.hooks_fired_outside == collector.num_hooks
    collector.reset_window()
    assert collector.hooks_fired_outside == 0


@pytest.mark.parametrize(("bad", "error"), [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bucket_bytes_is_checked(bad, error):
    with pytest.raises(error, match=rf"GradStatsCollector\(bucket_bytes={bad!r}\)"):
        GradStatsCollector([], bucket_bytes=bad)


# ------------------------------------------------------------------------------ DDP and FSDP2
SCENARIOS = ["ddp_sync_every", "ddp_bucket_view", "ddp_adam", "fsdp_last", "fsdp_every", "fsdp_bf16"]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.fail("torch.distributed with gloo is required")
    tmp = tmp_path_factory.mktemp("collector")
    spawn(cw.run, args=(2, str(tmp / "pg"), str(tmp), SCENARIOS), nprocs=2, join=True)
    return {n: [json.loads(Path(tmp, f"{n}.rank{r}.json").read_text()) for r in range(2)] for n in SCENARIOS}


@pytest.mark.parametrize("name", SCENARIOS)
def test_distributed_collector_matches_per_parameter_norms(spawned, name):
    for rank in spawned[name]:
        ref = rank["reference"]
        assert len(rank["collector"]) == len(ref) > 0
        assert all(math.isfinite(v) for v in ref) and max(ref) > 0
        # float32 gradients; the reference sums in float64, the collector in float32
        assert rank["collector"] == pytest.approx(ref, rel=1e-5)
    a, b = (r["reference"] for r in spawned[name])
    assert a != pytest.approx(b, rel=1e-3)  # the ranks saw different data: local gradients
    if name == "ddp_adam":
        assert [r["unmeasurable"] for r in spawned[name]] == [[True, False, False]] * 2
    if name.startswith("fsdp"):
        assert spawned[name][0]["hooks"] > 0



def test_reentrant_checkpoint_firing_a_hook_per_segment_matches_per_parameter_norms():
    """A weight used in two reentrant-checkpointed segments gets one gradient per segment."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 8))
    other = torch.nn.Parameter(torch.randn(8, 8))
    collector = GradStatsCollector([w, other], bucket_bytes=10**6)
    ref = cw.PerParameterReference()
    ref.hook(w)
    ref.hook(other)

    def segment(h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h @ w)

    x = torch.randn(4, 8)
    for _ in range(2):  # from .grad None (stolen), then accumulating
        collector.begin_microbatch()
        ref.begin()
        h = torch.utils.checkpoint.checkpoint(segment, x @ other, use_reentrant=True)
        h = torch.utils.checkpoint.checkpoint(segment, h, use_reentrant=True)
        h.pow(2).sum().backward()
        collector.end_microbatch(4.0)
        ref.end()
        assert collector.hooks_fired_in_last_microbatch == 3  # w once per segment, other once
    assert [float(t) for t in collector.microbatch_sq_norms()] == pytest.approx(ref.sq, rel=1e-6)


@pytest.mark.parametrize("path", ["host", "device"])
def test_a_loss_scale_decayed_to_zero_drops_the_step_on_both_paths(path, monkeypatch):
    from cbs_tracker.core.measure import reduce_window

    if path == "device":
        monkeypatch.setattr(GradStatsCollector, "host_window_sums", lambda self: None)
    collector = GradStatsCollector([])
    for sq in (3.0, 5.0):
        collector.begin_microbatch()
        collector.end_microbatch(4.0)
        collector._micro_sq[-1] = torch.tensor(sq)
    stats, faults = reduce_window(collector, [], dp_group=None, loss_divisor=2.0, avg_ranks=1,
                                  scale=torch.tensor(0.0))
    assert not stats.finite and faults.microbatches_run == 2
    stats, _ = reduce_window(collector, [], dp_group=None, loss_divisor=2.0, avg_ranks=1, scale=torch.tensor(4.0))
    assert stats.finite and stats.small_sq_norm == pytest.approx((3.0 + 5.0) / 2 * 2.0**2 / 4.0**2, rel=1e-12)


@pytest.mark.parametrize("normalization, divisor", [("mean", None), ("window", None), ("window", 30.0),
                                                    ("window", "tensor"), ("group", None)])
@pytest.mark.parametrize("tensor_sizes", [False, True])
def test_an_unmeasured_windows_counts_are_the_measured_reductions(normalization, divisor, tensor_sizes):
    """The counts-only reduction of a window the cadence lets pass gives the counts the full reduction
    gives for the same microbatches (sizes 0 left out; numbers or tensors; every normalisation)."""
    from cbs_tracker.core.measure import reduce_window

    param = torch.nn.Parameter(torch.ones(3))
    sizes = [4.0, 0.0, 8.0, 2.0]

    def window(measure: bool) -> GradStatsCollector:
        c = GradStatsCollector([param])
        for i, b in enumerate(sizes):
            c.begin_microbatch(measure=measure)
            (param * float(i + 1)).sum().backward()
            c.end_microbatch(torch.tensor(int(b)) if tensor_sizes else b)
        param.grad = None
        return c

    units_divisor = torch.tensor(30.0) if divisor == "tensor" else divisor
    out = {}
    for measure in (True, False):
        collector = window(measure)
        param.grad = torch.ones(3)
        out[measure] = reduce_window(collector, [param], dp_group=None, loss_divisor=2.0, avg_ranks=1,
                                     expected_microbatches=3, normalization=normalization,
                                     units_divisor=units_divisor, measured=measure, proposed_every=5.0)
    (full, full_faults), (counts, faults) = out[True], out[False]
    assert counts.measured is False and full.measured is True
    for name in ("num_microbatches", "small_batch", "big_batch", "units", "finite", "proposed_every"):
        assert getattr(counts, name) == pytest.approx(getattr(full, name), rel=1e-12), name
    assert faults == full_faults
    assert counts.num_microbatches == 3 and counts.units == 14.0 and faults.mismatched_ranks == 1


def test_labels_on_the_cpu_are_counted_exactly_whether_or_not_any_is_ignored():
    # the CPU count tries one min() first (no label ignored: the count is the size) and counts directly
    # after labels that had some ignored: against labels != ignore_index counted by hand, over windows
    # that mix both kinds, an ignore_index above every label, empty labels and a label just above it
    from cbs_tracker.core.collector import LabelCount

    gen = torch.Generator().manual_seed(0)
    cases = []
    for i in range(40):
        labels = torch.randint(0, 50, (2, 7), generator=gen)
        if i % 3 == 0:
            labels[0, i % 7] = -100
        cases.append((labels, -100))
    cases += [(torch.tensor([[0, 1], [2, 3]]), 3), (torch.tensor([[4, 5]]), 3), (torch.zeros(0, dtype=torch.long), -100),
              (torch.tensor([-99, -99]), -100), (torch.tensor([-100, -100]), -100), (torch.tensor([7]), -100)]
    collector = GradStatsCollector([])
    for start in range(0, len(cases), 2):
        window = cases[start:start + 2]
        for labels, ignore in window:
            collector.count_microbatch(LabelCount(labels, ignore))
        sizes, _ = collector.host_sizes()
        assert sizes == [float((labels != ignore).sum()) for labels, ignore in window], start
        collector.reset_window()


def test_labels_of_any_dtype_count_as_labels_ne_ignore_index_in_their_dtype_after_any_window():
    # labels != ignore_index compares in the labels' dtype (uint8 wraps -100 to 156, float16 rounds 2051 to
    # 2052): the count taken in a window not measured must be that one, after a window whose labels had
    # none ignored (the min() tried first) as after one that had some
    from cbs_tracker.core.collector import LabelCount

    cases = [(torch.tensor([156, 1], dtype=torch.uint8), -100), (torch.tensor([2052.0, 3000.0], dtype=torch.float16), 2051),
             (torch.tensor([5, 6], dtype=torch.int32), 4), (torch.tensor([1 + 0j, -100 + 0j]), -100)]
    for labels, ignore in cases:
        for before in (torch.tensor([1, 2]), torch.tensor([-100, 2])):
            collector = GradStatsCollector([])
            collector.count_microbatch(LabelCount(before, -100))
            collector.host_sizes()
            collector.reset_window()
            collector.count_microbatch(LabelCount(labels, ignore))
            assert collector.host_sizes()[0] == [float((labels != ignore).sum())], (labels, before)


def test_host_sizes_reads_labels_numbers_and_tensors_in_one_loop_or_falls_back_counting_once():
    # the CPU loop and the general path give the same sizes; a size the loop does not take (here a
    # float subclass) sends the window to the general path, and labels changed in place count once
    import numpy as np

    from cbs_tracker.core.collector import LabelCount

    labels = torch.tensor([[1, -100, 3], [-100, -100, 2]])
    for tail in (2.0, torch.tensor(5.0), np.float64(7.0)):
        collector = GradStatsCollector([])
        collector.count_microbatch(LabelCount(labels, -100))
        labels.add_(0)  # changed in place after its microbatch (the same values)
        collector.count_microbatch(tail)
        sizes, extra = collector.host_sizes()
        assert sizes == [3.0, float(tail)] and extra == []
        assert collector.labels_changed == 1
