"""The tracker in a Hugging Face Accelerate loop (``AcceleratorTracker``): 1 process and 2 gloo processes.

One spawn runs every two-process scenario (:func:`tests.accelerate_workers.run_ranks`: the
Accelerator is built in each child after ``init_process_group``, from the environment
``PartialState`` reads; it is a ``MULTI_CPU`` DDP run); the one-process scenarios run in this
process (Accelerate's singletons reset before and after). Each is compared with a truth
computed without Accelerate, or with Accelerate but without the tracker:

* every window's ``.grad`` at ``tracker.step()`` with the mean, over every rank's microbatches
  of the window, of each one's own gradient by autograd (a loss divided by a stale
  accumulation is off by the ratio);
* what Accelerate did per microbatch (``sync_gradients``, ``gradient_accumulation_steps``,
  its counter), the optimizer steps and the DDP bucket syncs (a communication hook), against
  the window the tracker set;
* the records and weights with the plain ``CBSTracker`` loop in one process on the same global
  windows (float64: 1e-9; the estimates divide differences of norms, see test_distributed);
* the learning rate of each step with a constant-batch Accelerate run's at the same samples seen;
* a run resumed by ``accelerator.save_state``/``load_state`` with the uninterrupted one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("accelerate")

from tests import accelerate_workers as aw  # noqa: E402
from tests.spawning import spawn  # noqa: E402

TWO = ["grow", "bf16", "lr", "resume"]
ONE = ["grow", "bf16", "lr", "resume", "loader", "fp16"]
RTOL = 1e-9
MEASURED = ("noise_scale", "grad_sq_norm", "trace_cov", "critical_batch")
needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo"
)


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")
    tmp = tmp_path_factory.mktemp("accelerate2")
    spawn(aw.run_ranks, args=(2, str(tmp / "pg"), str(tmp), TWO), nprocs=2, join=True)
    return {
        n: [torch.load(tmp / f"{n}.rank{r}.pt", weights_only=False) for r in range(2)] for n in TWO
    }


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("accelerate1")
    try:
        return {name: [aw.run_scenario(name, 0, 1, str(tmp))] for name in ONE}
    finally:
        aw.reset_accelerate()


@pytest.fixture
def clean() -> Any:
    yield
    aw.reset_accelerate()


def runs(request: pytest.FixtureRequest, world: int, name: str) -> list[dict[str, Any]]:
    """Scenario ``name``'s payloads (one per process); a scenario that raised fails the test with its traceback."""
    return _ok(name, request.getfixturevalue("one" if world == 1 else "two")[name])


def _ok(name: str, payloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for p in payloads:
        if "error" in p:
            pytest.fail(f"scenario {name!r} raised:\n{p['error']}")
    return payloads


WORLDS = [1, pytest.param(2, marks=needs_gloo)]


def _num(x: float | None) -> float:
    return float("nan") if x is None else float(x)


# ---------------------------------------------------------------------------- windows
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", ["grow", "bf16"])
def test_accelerate_windows_are_the_trackers(request, world, name):
    """(c, e) Per window of A microbatches: Accelerate syncs and the optimizer steps on the last only, with
    gradient_accumulation_steps = A and its counter 1..A, before and after the batch grew; under DDP the
    gradients are all-reduced in the last microbatch's backward only."""
    for payload in runs(request, world, name):
        rows = payload["rows"]
        sizes = [r["record"]["accumulation_steps"] for r in rows]
        assert sizes[0] == aw.START // world and max(sizes) >= 2 * sizes[0], sizes  # the batch grew
        for row in rows:
            a = row["record"]["accumulation_steps"]
            mbs = row["microbatches"]
            assert len(mbs) == a
            assert [m["sync"] for m in mbs] == [False] * (a - 1) + [True]
            # accelerator.backward divides by the window's A
            assert [m["ga"] for m in mbs] == [a] * a
            assert [m["counter"] for m in mbs] == list(range(1, a + 1))
            assert [m["optimizer_steps"] for m in mbs] == [0] * (a - 1) + [1]
            if world > 1:
                assert [m["buckets"] > 0 for m in mbs] == [False] * (a - 1) + [True], mbs
        if name == "bf16":
            assert payload["autocast"] == ["torch.bfloat16"]  # Accelerate's autocast really ran


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", ["grow", "bf16"])
def test_accelerate_window_gradient_is_the_mean_of_its_microbatches(request, world, name):
    """(a, e) .grad at tracker.step() equals the mean of the window's microbatch gradients (all ranks), also
    after growth: the loss was divided by the window's own accumulation."""
    tol = dict(rtol=1e-10, atol=1e-13) if name == "grow" else dict(rtol=1e-5, atol=1e-7)
    for payload in runs(request, world, name):
        for row in payload["rows"]:
            torch.testing.assert_close(row["grad"], row["ref"], **tol)


@needs_gloo
def test_accelerate_two_processes_stay_replicas(request):
    """(b) Both processes: the same records, gradients and weights, bit for bit."""
    for name in ("grow", "bf16"):
        r0, r1 = runs(request, 2, name)
        assert torch.equal(r0["params"], r1["params"]), name
        for a, b in zip(r0["rows"], r1["rows"], strict=True):
            assert a["record"] == b["record"]
            assert torch.equal(a["grad"], b["grad"])
    grow = runs(request, 2, "grow")[0]
    assert grow["distributed_type"] == "DistributedType.MULTI_CPU" and grow["ddp"]


# ---------------------------------------------------------------------------- against the plain loop
@pytest.mark.parametrize(("world", "name"), [
    (1, "grow"), (1, "bf16"), (1, "loader"), (1, "fp16"),  # the loader and fp16 scenarios run on one process only
    pytest.param(2, "grow", marks=needs_gloo), pytest.param(2, "bf16", marks=needs_gloo),
])
def test_accelerate_noise_scale_equals_the_plain_loop(request, world, name):
    """(d) The records (noise scale, |G|^2, tr(Sigma), batches) and the weights equal the plain CBSTracker
    loop's in one process on the same global windows; bf16 and fp16 (a GradScaler through
    accelerator.scaler) against the plain loop under the same autocast without a scaler, at frozen weights."""
    kw: dict[str, Any] = {
        "grow": {},
        "loader": {"source": aw.loader_source},
        "bf16": {"dtype": torch.float32, "lr": 0.0, "autocast": torch.bfloat16},
        "fp16": {"dtype": torch.float32, "lr": 0.0, "autocast": torch.float16},
    }[name]
    rtol = RTOL if name in ("grow", "loader") else 1e-6
    ref = aw.plain_reference(world=world, windows=aw.WINDOWS, **kw)
    payload = runs(request, world, name)[0]
    got = [r["record"] for r in payload["rows"]]
    assert sum(r["noise_scale"] is not None for r in got) >= 4
    for g, w in zip(got, ref["records"], strict=True):
        assert g["global_batch"] == w["global_batch"]
        assert g["accumulation_steps"] * world == w["accumulation_steps"]
        assert g["next_accumulation_steps"] * world == w["next_accumulation_steps"]
        for key in MEASURED:
            assert (g[key] is None) == (w[key] is None), key
            torch.testing.assert_close(
                _num(g[key]), _num(w[key]), rtol=rtol, atol=0.0, equal_nan=True
            )
    if "params" in payload:
        torch.testing.assert_close(payload["params"], ref["params"], rtol=RTOL, atol=1e-12)
    if name == "fp16":
        # the hooked and the step gradients carried the loss scale; it was removed from both
        assert all(r["scale"] == 2.0**12 for r in payload["rows"])
        assert payload["autocast"] == ["torch.float16"]
        for row in payload["rows"]:
            torch.testing.assert_close(row["grad"] / row["scale"], row["ref"], rtol=1e-5, atol=1e-7)


def test_accelerate_loader_end_inside_a_window_is_not_cut(request):
    """A prepared DataLoader of 10 batches under windows of 4: Accelerate's end-of-dataloader sync would cut
    the third window; the window runs on into the next epoch and the run says so once."""
    payload = runs(request, 1, "loader")[0]
    starts = [r["start"] for r in payload["rows"]]
    assert starts[2] < aw.LOADER_BATCHES < starts[3]  # the third window crossed the loader's end
    ended = [w for w in payload["warnings"] if "the data loader ended in microbatch" in w]
    assert len(ended) == 1, payload["warnings"]


# ---------------------------------------------------------------------------- learning rate
@pytest.mark.parametrize("world", WORLDS)
def test_accelerate_lr_per_sample_is_the_constant_runs_times_the_coupling(request, world):
    """(f) The prepared scheduler (stepped num_processes times per call by Accelerate) keeps its timing in
    samples: each step's LR is the constant-batch Accelerate run's at the same samples seen, exactly with
    lr_coupling='keep', times A/A0 with 'linear'."""
    payload = runs(request, world, "lr")[0]
    constant = {c["units_before"]: c["lr"] for c in payload["constant"]}
    start = aw.START // world
    for coupling in ("keep", "linear"):
        rows = payload[coupling]
        sizes = [r["record"]["accumulation_steps"] for r in rows]
        assert sizes == [start, 2 * start, 2 * start, 2 * start] + [4 * start] * 4, sizes
        for row in rows:
            rec = row["record"]
            before = rec["tokens_seen"] - rec["global_batch"]
            factor = 1.0 if coupling == "keep" else rec["accumulation_steps"] / start
            assert row["lr"] == pytest.approx(constant[before] * factor, rel=1e-12), (
                coupling,
                before,
            )
            if coupling == "keep":
                assert row["lr"] == constant[before]
    # the schedule moved: a run whose scheduler kept the step count would differ
    assert len(set(constant.values())) > 5


# ---------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("world", WORLDS)
def test_accelerate_save_state_resumes_identically(request, world):
    """(g) accelerator.save_state halfway (the tracker registered for checkpointing), new objects,
    accelerator.load_state, the data from tracker.microbatches_seen: the records and weights of the
    uninterrupted run, bit for bit, across a growth."""
    payload = runs(request, world, "resume")[0]
    assert payload["resumed"] == payload["full"]
    assert torch.equal(payload["resumed_params"], payload["full_params"])
    sizes = [r["accumulation_steps"] for r in payload["full"]]
    half = aw.WINDOWS // 2
    assert sizes[half] > sizes[0], sizes  # the resumed half starts grown: the state carried it


def test_accelerate_resume_without_the_tracker_state_differs(tmp_path, clean):
    """The truth of the resume test can disagree: without registering the tracker the resumed run restarts
    at the starting accumulation."""
    payload = aw.resume_scenario(0, 1, str(tmp_path), checkpoint=False)
    assert payload["resumed"] != payload["full"]


# ---------------------------------------------------------------------------- misuse and bad input
def _parts(**kw: Any) -> dict[str, Any]:
    acc = aw.make_accelerator(1, **kw.pop("accelerator", {}))
    parts = aw.build(acc, world=1, **kw)
    parts["acc"] = acc
    return parts


def _microbatch(parts: dict[str, Any], m: int) -> None:
    x, y = aw.data(m, 0)
    with parts["tracker"].accumulate(size=len(y)):
        parts["acc"].backward(aw.loss_of(parts["model"](x), y))


def test_accelerate_bad_arguments_name_themselves(clean):
    from accelerate.utils import GradientAccumulationPlugin  # noqa: F401 (accelerate is installed)
    from cbs_tracker.integrations.accelerate import AcceleratorTracker

    acc = aw.make_accelerator(1)
    net, other = aw.Net(), aw.Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, optimizer = acc.prepare(net, opt)
    with pytest.raises(
        TypeError, match=r"accelerator=object\): expected an accelerate.Accelerator"
    ):
        AcceleratorTracker(object(), model, optimizer)
    with pytest.raises(ValueError, match=r"model=Net\): not a model this accelerator prepared"):
        AcceleratorTracker(acc, other, optimizer)
    with pytest.raises(
        TypeError, match=r"optimizer=SGD\): expected the optimizer accelerator.prepare returned"
    ):
        AcceleratorTracker(acc, model, opt)
    with pytest.raises(
        ValueError,
        match=r"accumulation_steps=8\): the accelerator was built with "
        r"gradient_accumulation_steps=4",
    ):
        AcceleratorTracker(acc, model, optimizer, accumulation_steps=8)
    with pytest.raises(TypeError, match=r"grad_scaler=.*accelerator.scaler"):
        AcceleratorTracker(acc, model, optimizer, grad_scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(
        TypeError, match=r"loss_normalization='window'\).*accelerator.backward divides"
    ):
        AcceleratorTracker(acc, model, optimizer, loss_normalization="window")
    sched = acc.prepare(torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0))
    sched.step_with_optimizer = False
    with pytest.raises(ValueError, match=r"step_scheduler_with_optimizer=False"):
        AcceleratorTracker(acc, model, optimizer, lr_scheduler=sched)


def test_accelerate_refuses_deepspeed_and_fsdp(clean):
    from types import SimpleNamespace

    from cbs_tracker.integrations.accelerate import AcceleratorTracker

    for kind in ("DEEPSPEED", "FSDP"):
        fake = SimpleNamespace(
            gradient_state=None,
            accumulate=None,
            backward=None,
            _models=[],
            distributed_type=SimpleNamespace(name=kind),
        )
        with pytest.raises(RuntimeError, match=rf"distributed_type={kind}>\): not supported"):
            AcceleratorTracker(fake, torch.nn.Linear(2, 1))


def test_accelerate_misuse_is_stopped(clean):
    """A window ended without tracker.step(), the optimizer stepped before it, or an accelerator.accumulate
    nested inside tracker.accumulate: each stops with the fix."""
    parts = _parts()
    tracker, acc = parts["tracker"], parts["acc"]
    for m in range(4):  # the window's four microbatches, without tracker.step()
        _microbatch(parts, m)
    with pytest.raises(RuntimeError, match=r"optimizer.step\(\) ran before tracker.step\(\)"):
        parts["optimizer"].step()
    with pytest.raises(RuntimeError, match=r"microbatches ran but tracker.step\(\) was not called"):
        _microbatch(parts, 4)
    tracker.step()
    parts["optimizer"].step()
    parts["optimizer"].zero_grad()
    x, y = aw.data(0, 0)
    with tracker.accumulate(size=len(y)):
        acc.backward(aw.loss_of(parts["model"](x), y))
        with pytest.raises(RuntimeError, match=r"called in microbatch 1 of the window's 4"):
            tracker.step()
    with pytest.raises(RuntimeError, match=r"do not nest accelerator.accumulate"):
        with acc.accumulate(parts["model"]):
            with tracker.accumulate(size=len(y)):
                pass


def test_accelerate_step_outside_the_block_and_remove_hooks(clean):
    """tracker.step() after the block (the plain-loop order) works too; remove_hooks gives Accelerate its
    settings back (end-of-dataloader sync, accumulation, the scheduler's split_batches)."""
    parts = _parts(scheduler=True, controller=None)
    tracker, acc = parts["tracker"], parts["acc"]
    state = acc.gradient_state
    assert (
        state.plugin_kwargs["sync_with_dataloader"] is False
        and parts["scheduler"].split_batches is True
    )
    for m in range(4):
        _microbatch(parts, m)
    assert acc.sync_gradients
    rec = tracker.step()
    assert rec.accumulation_steps == 4 and tracker.microbatches_seen == 4
    tracker.remove_hooks()
    assert "sync_with_dataloader" not in state.plugin_kwargs and state.sync_with_dataloader
    assert state.num_steps == 4 and parts["scheduler"].split_batches is False


def test_accelerate_is_not_a_hard_dependency():
    """The adapter imports accelerate only when a tracker is built (and the package never imports it)."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['accelerate'] = None\n"
        "import cbs_tracker, cbs_tracker.integrations.accelerate as m\nprint(m.AcceleratorTracker.__name__)"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "AcceleratorTracker", out.stderr
