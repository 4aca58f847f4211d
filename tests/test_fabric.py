"""The plain ``CBSTracker`` in a Lightning Fabric loop (LitGPT's ``pretrain.py`` shape): 1 process and 2 gloo ranks.

The loop is :func:`tests.fabric_workers.litgpt_loop` (``fabric.setup``, ``fabric.backward``,
``fabric.clip_gradients``, ``fabric.save``/``fabric.load``), with ``tracker.microbatch`` in
place of ``fabric.no_backward_sync``. Each run is held against a truth computed without Fabric:

* every window's ``.grad`` at ``tracker.step()`` with the mean, over every rank's microbatches
  of the window, of each one's own gradient by autograd at the weights the window ran at
  (float64; a loss divided by a stale accumulation is off by the ratio);
* the DDP bucket syncs of each step (a communication hook on the DDP module inside Fabric's
  wrapper): each bucket once per window, so no microbatch before the last synchronised;
* the records and weights of the plain ``CBSTracker`` loop on the same global windows in one
  process (float64: 1e-9), under bf16 autocast and an fp16 ``GradScaler`` too;
* a run stopped, ``fabric.save``-d and ``fabric.load``-ed into fresh objects with the
  uninterrupted run.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("lightning")

from tests import dist_workers as dw  # noqa: E402
from tests import fabric_workers as fw  # noqa: E402
from tests.spawning import spawn  # noqa: E402

STEPS = 12
WORLD = 2
TWO = ["fabric_ddp", "fabric_resume", "fabric_bf16", "fabric_fp16", "fabric_user_no_sync"]
MEASURED = ("noise_scale", "grad_sq_norm", "trace_cov", "critical_batch")
needs_gloo = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")
    tmp = tmp_path_factory.mktemp("fabric2")
    spawn(fw.run_scenarios, args=(WORLD, str(tmp / "pg"), str(tmp), TWO, STEPS), nprocs=WORLD)
    out = {}
    for name in TWO:
        out[name] = [json.loads((tmp / f"{name}.rank{r}.json").read_text()) for r in range(WORLD)]
        for payload in out[name]:
            if "failed" in payload:
                pytest.fail(f"scenario {name!r} raised on a rank:\n{payload['failed']}")
    return out


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """One process: Fabric on one CPU device runs both ranks' microbatches of the two-rank windows."""
    tmp = tmp_path_factory.mktemp("fabric1")
    common = {"steps": STEPS, "dp_rank": None, "dp_size": WORLD, "devices": 1}
    ckpt = str(tmp / "resume.ckpt")
    first = fw.fabric_run(save_to=ckpt, **common)
    rest = fw.fabric_run(resume_from=ckpt, **common)
    return {
        "fabric": fw.fabric_run(**common),
        "fabric_bf16": fw.fabric_run(precision="bf16-mixed", **common),
        "fabric_fp16": fw.fabric_run(fp16=True, **common),
        "fabric_clip_tracker": fw.fabric_run(fp16=True, clip_with_tracker=True, **common),
        # an L1 clip: the tracker's step norm cannot be reused, torch's clip runs on the gradients themselves
        "fabric_l1": fw.fabric_run(fp16=True, norm_type=1.0, **common),
        "fabric_l1_tracker": fw.fabric_run(fp16=True, clip_with_tracker=True, norm_type=1.0, **common),
        "fabric_resume": {"records": first["records"] + rest["records"], "params": rest["params"]},
    }


@pytest.fixture(scope="module")
def plain() -> dict[str, dict[str, Any]]:
    """The plain-loop references in one process, on both ranks' microbatches."""
    common = {"steps": STEPS, "dp_rank": None, "dp_size": WORLD, "distributed": False}
    return {
        "fp64": fw.plain_run(**common),
        "bf16": fw.plain_run(dtype=torch.float32, autocast=torch.bfloat16, **common),
        "fp16": fw.plain_run(dtype=torch.float32, fp16=True, **common),
    }


def _reference_grad(before: list[list[float]], step: int, accumulation: int, bf16: bool = False) -> torch.Tensor:
    """The mean over the window's microbatches (every rank's) of each one's own gradient by autograd: float64,
    or (``bf16``) a float32 model under bf16 autocast, as Fabric's "bf16-mixed" runs it, the mean in float64."""
    dtype = torch.float32 if bf16 else torch.float64
    model = dw.make_model(dtype)
    with torch.no_grad():
        for p, values in zip(model.parameters(), before, strict=True):
            p.copy_(torch.tensor(values, dtype=dtype).view_as(p))
    grads = []
    for r in range(WORLD):
        for j in range(accumulation // WORLD):
            x, y = dw.microbatch_data(step, r, j, dtype=dtype)
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                pred = model(x).squeeze(-1)
            (0.5 * (pred.to(y.dtype) - y).pow(2).mean()).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double())
    return torch.stack(grads).mean(0)


def _runs(request: pytest.FixtureRequest, world: int, name: str) -> list[dict[str, Any]]:
    if world == 1:
        return [request.getfixturevalue("one")["fabric" if name == "fabric_ddp" else name]]
    return request.getfixturevalue("two")[name]


def _global_accumulation(record: dict[str, Any], world: int) -> int:
    return record["accumulation_steps"] * world


WORLDS = [1, pytest.param(WORLD, marks=needs_gloo)]


# ---------------------------------------------------------------------------- windows
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", ["fabric_ddp", "fabric_bf16"])
def test_fabric_window_gradient_is_the_mean_of_its_microbatches(request, world, name):
    """.grad at tracker.step() is the mean of the window's microbatch gradients (all ranks), before and after
    the batch grew: fabric.backward(loss / tracker.accumulation_steps) ran on every microbatch of the window."""
    tol = dict(rtol=1e-10, atol=1e-13) if name == "fabric_ddp" else dict(rtol=1e-5, atol=1e-7)
    for payload in _runs(request, world, name):
        sizes = [_global_accumulation(r, world) for r in payload["records"]]
        assert sizes[0] == fw.START_ACCUMULATION * WORLD and max(sizes) >= 4 * sizes[0], sizes  # it grew twice
        for step, (record, before, grad) in enumerate(zip(payload["records"], payload["before"],
                                                          payload["grads"], strict=True)):
            want = _reference_grad(before, step, _global_accumulation(record, world), bf16=name == "fabric_bf16")
            torch.testing.assert_close(torch.tensor(grad, dtype=torch.float64), want, **tol)
        # the module saw exactly the window's microbatches and samples (tracker.microbatch counted them)
        for record, fed in zip(payload["records"], payload["fed"], strict=True):
            assert fed["forwards"] == record["accumulation_steps"]


@needs_gloo
def test_fabric_ddp_syncs_each_bucket_once_per_window(two):
    """The tracker's no_sync reached the DDP module inside Fabric's wrapper: each DDP bucket is all-reduced once
    per window (an earlier microbatch that synchronised would hand its buckets over again), and the
    tracker's own communication is one all-reduce per step."""
    for payload in two["fabric_ddp"]:
        steps = payload["communication"]
        assert len(steps) == STEPS
        buckets = {b for s in steps for b in s["bucket_syncs"]}
        assert len(buckets) >= 2  # ~100-byte buckets: the 65 float64 parameters take more than one
        for k, (s, record) in enumerate(zip(steps, payload["records"], strict=True)):
            # DDP rebuilds its buckets after the first iteration (one bucket before): from then on every one
            want = [0] if k == 0 else sorted(buckets)
            assert sorted(s["bucket_syncs"]) == want, (k, record["accumulation_steps"], s)
            assert [c[0] for c in s["collectives"]] == ["all_reduce"]
        assert payload["unsynced_first"] is True  # a window's first microbatch runs under no_sync


@needs_gloo
def test_fabric_two_ranks_stay_replicas(two):
    for name in ("fabric_ddp", "fabric_bf16", "fabric_fp16", "fabric_resume"):
        r0, r1 = two[name]
        assert r0["records"] == r1["records"], name
        assert r0["params"] == r1["params"], name
        assert r0.get("grads") == r1.get("grads"), name


# ---------------------------------------------------------------------------- against the plain loop
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(("name", "ref", "rtol"), [
    ("fabric_ddp", "fp64", 1e-9), ("fabric_bf16", "bf16", 1e-5), ("fabric_fp16", "fp16", 1e-5),
])
def test_fabric_noise_scale_equals_the_plain_loop(request, plain, world, name, ref, rtol):
    """The records (noise scale, |G|^2, tr(Sigma), batches, LR) and the weights equal the plain CBSTracker
    loop's in one process on the same global windows. fp16: Fabric's "16-mixed" plugin scales the loss
    and the tracker found the plugin's GradScaler by itself (the plain loop passes its own)."""
    want = plain[ref]
    for payload in _runs(request, world, name):
        assert len(payload["records"]) == len(want["records"]) == STEPS
        assert sum(r["noise_scale"] is not None for r in payload["records"]) >= STEPS - 2
        for g, w in zip(payload["records"], want["records"], strict=True):
            assert g["global_batch"] == w["global_batch"]
            assert _global_accumulation(g, world) == w["accumulation_steps"]
            assert g["next_accumulation_steps"] * world == w["next_accumulation_steps"]
            assert g["dp_degree"] == world
            for key in MEASURED:
                assert (g[key] is None) == (w[key] is None), key
                if g[key] is not None:
                    assert g[key] == pytest.approx(w[key], rel=rtol), (g["step"], key)
        torch.testing.assert_close(torch.tensor(sum(payload["params"], [])), torch.tensor(sum(want["params"], [])),
                                   rtol=rtol, atol=1e-12)
        assert payload["fabric_scaler"] is (name == "fabric_fp16")


@pytest.mark.parametrize(("fabric", "tracker"), [("fabric_fp16", "fabric_clip_tracker"), ("fabric_l1", "fabric_l1_tracker")])
def test_fabric_fp16_clip_through_the_tracker_equals_fabric_clip_gradients(one, fabric, tracker):
    """tracker.clip_grad_norm_ unscales through Fabric's scaler first, as fabric.clip_gradients does: the same
    run, record for record and weight for weight (a second unscale would raise; a missing one would clip the
    L1 norm of gradients still 2^8 too large)."""
    a, b = one[fabric], one[tracker]
    assert a["records"] == b["records"]
    torch.testing.assert_close(torch.tensor(sum(a["params"], [])), torch.tensor(sum(b["params"], [])),
                               rtol=1e-6, atol=1e-9)
    assert one["fabric_l1"]["params"] != one["fabric_fp16"]["params"]  # the L1 clip changed the run


# ---------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("world", WORLDS)
def test_fabric_save_and_load_resume_identically(request, world):
    """fabric.save({"model", "optimizer", "tracker", "step"}) after 5 steps, fabric.load into fresh objects:
    the records (batch, pending doubling, noise scale) and the weights equal the uninterrupted run's."""
    whole = _runs(request, world, "fabric_ddp")
    resumed = _runs(request, world, "fabric_resume")
    for a, b in zip(whole, resumed, strict=True):
        assert [r["accumulation_steps"] for r in b["records"][fw.SAVE_AT:]] != [fw.START_ACCUMULATION] * (
            STEPS - fw.SAVE_AT)  # the resumed part runs at a grown batch
        assert b["records"] == a["records"]
        assert b["params"] == a["params"]


# ---------------------------------------------------------------------------- misuse
@needs_gloo
def test_fabric_no_backward_sync_on_the_last_microbatch_is_stopped_before_the_step(two):
    """A loop that also enters fabric.no_backward_sync(model, enabled=True) on the window's last microbatch leaves
    each rank with its own gradient: the tracker's check across ranks raises before optimizer.step(), and the
    weights are still the ones both ranks started from."""
    for payload in two["fabric_user_no_sync"]:
        assert payload["error"] is not None and "synchronised gradient differs across" in payload["error"], payload["error"]
        assert payload["params_after"] == payload["params_before"]


def test_fabric_foreign_scaler_and_sharded_strategies_are_refused():
    from lightning.fabric import Fabric

    fabric = fw.make_fabric(1, fp16=True)
    module = dw.make_model(torch.float32)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=dw.LR))
    with pytest.raises(ValueError, match=r"grad_scaler=GradScaler\): not the scaler of the Fabric model"):
        fw.CBSTracker(model, optimizer, accumulation_steps=2, grad_scaler=torch.amp.GradScaler("cpu"))

    class Wrapped(torch.nn.Module):  # a strategy whose forward module is not the user's (FSDP, DeepSpeed)
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

    fabric = Fabric(accelerator="cpu", devices=1)
    module = dw.make_model()
    model = fabric.setup(module)
    model._forward_module = Wrapped(module)
    with pytest.raises(TypeError, match="supports Fabric's single-device and DDP strategies"):
        fw.CBSTracker(model, accumulation_steps=2)

