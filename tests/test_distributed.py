"""Distributed runs (spawned gloo ranks) against a single process on the same concatenated data.

Two spawns do all the distributed work (starting ranks costs seconds, mostly
importing torch): 2 ranks run DDP (plain; ``gradient_as_bucket_view`` +
``static_graph``), FSDP2 in both sync modes, FSDP2 with bf16 parameters, a
non-finite rank under DDP and FSDP2, a rank whose data runs out, and the
FSDP2 configuration errors (the DDP runs also count their gradient syncs
and the tracker's collectives per step); 4 ranks run 2-D meshes (``dp x tp`` with DDP and
FSDP2, HSDP) and the mesh-layout errors. Each rank writes its records; the tests
below compare them with :func:`tests.dist_workers.reference_run`, one process
without ``torch.distributed`` running every rank's microbatches in one window.

Every process group has a 60 s timeout, so a collective that one rank skips
fails the spawn instead of hanging the suite.

Tolerances. The float64 runs differ from the reference only in the order of
float64 sums (per-rank partial sums, then the all-reduce). Each norm then has a
relative error of a few 1e-16 times the number of terms; the estimates divide
differences of norms (``|G_small|^2 - |G_big|^2`` is ~1/10 of either here) and
ten SGD steps carry the weights along, so 1e-9 is a wide margin, while every
plausible bug (a missing ``D`` or ``A`` factor, a replica counted twice, a
wrong harmonic mean, a skipped microbatch) moves the numbers by more than 1%.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests import dist_workers as dw
from tests.spawning import spawn

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)

STEPS = 10
RTOL = 1e-9  # see the module docstring
TWO_RANK = [
    "ddp", "ddp_static_bucket_view", "ddp_one_microbatch", "ddp_device_path", "ddp_cadence", "fsdp_last", "fsdp_every",
    "ddp_nonfinite", "fsdp_nonfinite",
    "fsdp_bf16", "manual_ranout", "errors_2", "ddp_schedule", "fsdp_schedule",
]
FOUR_RANK = ["mesh_ddp_dp_tp", "mesh_fsdp_dp_tp", "mesh_hsdp", "errors_4"]
MEASURED = ("noise_scale", "grad_sq_norm", "trace_cov")


def _spawn(tmp: Path, world: int, names: list[str]) -> dict[str, list[dict[str, Any]]]:
    spawn(dw.run_scenarios, args=(world, str(tmp / "pg"), str(tmp), names, STEPS), nprocs=world, join=True)
    return {
        name: [json.loads((tmp / f"{name}.rank{r}.json").read_text()) for r in range(world)] for name in names
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return _spawn(tmp_path_factory.mktemp("dist2"), 2, TWO_RANK)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return _spawn(tmp_path_factory.mktemp("dist4"), 4, FOUR_RANK)


def _num(x: float | None) -> float:
    return float("nan") if x is None else float(x)


def assert_same_run(
    ranks: list[dict[str, Any]], ref: dict[str, Any], dp_size: int, *, params: bool = True, ragged_from: int | None = None
) -> None:
    """Every rank's records equal each other exactly and the reference to ``RTOL``."""
    first = ranks[0]["records"]
    for other in ranks[1:]:
        assert other["records"] == first, "ranks disagree (a decision must be identical on every rank)"
    assert len(first) == len(ref["records"]) == STEPS
    for got, want in zip(first, ref["records"], strict=True):
        step = got["step"]
        assert got["global_batch"] == want["global_batch"], step
        assert got["dp_degree"] == dp_size, step
        assert got["dropped"] == want["dropped"], step
        # the reference runs dp_size times the per-rank accumulation in one window
        if ragged_from is None or step < ragged_from:
            assert got["accumulation_steps"] * dp_size == want["accumulation_steps"], step
        else:
            # a window in which a rank ran short: one process records what it ran, several ranks
            # that mean per rank when it is whole, else the set accumulation (more than the mean)
            ran = want["accumulation_steps"]
            if ran % dp_size == 0:
                assert got["accumulation_steps"] * dp_size == ran, step
            else:
                assert got["accumulation_steps"] * dp_size > ran, step
        assert got["next_accumulation_steps"] * dp_size == want["next_accumulation_steps"], step
        for key in MEASURED + ("critical_batch",):
            assert (got[key] is None) == (want[key] is None), (step, key)
            torch.testing.assert_close(_num(got[key]), _num(want[key]), rtol=RTOL, atol=0.0, equal_nan=True)
    if params:
        for got_p, want_p in zip(ranks[0]["params"], ref["params"], strict=True):
            torch.testing.assert_close(torch.tensor(got_p), torch.tensor(want_p), rtol=RTOL, atol=1e-12)


# ---------------------------------------------------------------------------- 2 ranks
@pytest.mark.parametrize(
    "name", ["ddp", "ddp_static_bucket_view", "ddp_one_microbatch", "ddp_device_path", "fsdp_last", "fsdp_every"]
)
def test_two_ranks_match_single_process(two_ranks, name):
    # ddp_one_microbatch starts at one microbatch per rank: every backward of its first window syncs
    one = name == "ddp_one_microbatch"  # also clips with tracker.clip_grad_norm_ (the reference: torch's)
    ref = dw.reference_run(steps=STEPS, dp_size=2, start_accumulation=1 if one else 2,
                           clip=dw.ONE_MICROBATCH_CLIP if one else None)
    if one:
        norms = ref["clip_norms"]
        assert min(norms) < dw.ONE_MICROBATCH_CLIP < max(norms)  # it clipped some steps, not all
        for rank in two_ranks[name]:
            torch.testing.assert_close(torch.tensor(rank["clip_norms"]), torch.tensor(norms), rtol=RTOL, atol=0.0)
    # the run is not trivial: the controller grows the batch (from 2 per rank), and every step is measured
    if name != "ddp_one_microbatch":
        assert any(r["next_accumulation_steps"] != r["accumulation_steps"] for r in ref["records"])
        assert all(r["noise_scale"] is not None for r in ref["records"][1:])
    else:  # two microbatches a step: |G|^2 is measured every step, the noise scale once it is positive
        assert all(r["grad_sq_norm"] is not None for r in ref["records"])
        assert sum(r["noise_scale"] is not None for r in ref["records"]) >= STEPS // 2
    assert_same_run(two_ranks[name], ref, 2)


@pytest.mark.parametrize("name", ["ddp_schedule", "fsdp_schedule"])
def test_a_batch_schedule_on_two_ranks_matches_one_process_and_the_constant_runs_lr(two_ranks, name):
    # a gradual schedule (per rank A = 2, 3, 4, 6: not powers of two) with an LR scheduler; truths: the
    # schedule's marks, the single process running both ranks' microbatches, the bare scheduler
    ref = dw.reference_run(steps=STEPS, dp_size=2, schedule=True)
    assert_same_run(two_ranks[name], ref, 2)
    schedule = dw.make_schedule()
    records = two_ranks[name][0]["records"]
    assert sorted({r["accumulation_steps"] for r in records}) == [2, 3, 4, 6]
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=dw.LR)
    const = dw.make_scheduler(opt)
    const_lr = []
    for _ in range(40):
        const_lr.append(opt.param_groups[0]["lr"])
        opt.step()
        const.step()
    seen = 0
    start = schedule.marks[0][1]
    for r in records:
        assert r["global_batch"] == schedule.batch_at(seen) == r["accumulation_steps"] * 2 * dw.FIXED_ROWS
        # SGD: LR x B / B0, on the constant run's clock at the same data
        assert r["lr"] == pytest.approx(const_lr[int(seen // start)] * r["global_batch"] / start, rel=1e-12)
        seen += r["global_batch"]
    if name == "ddp_schedule":  # checkpointed after 5 steps (A = 3 in force), rebuilt, resumed: the same run
        for rank in two_ranks[name]:
            assert records[4]["accumulation_steps"] == 3
            assert rank["resumed"] == records


def _readme_tracker_collective_bytes() -> int:
    """The per-step communication the README's results table promises (bytes of one all_reduce)."""
    readme = (Path(__file__).resolve().parents[1] / "docs" / "results.md").read_text()
    m = re.search(r"\*\*1 all_reduce of (\d+) bytes\*\*", readme)
    assert m, "the README's communication claim moved"
    return int(m.group(1))


def test_ddp_measuring_one_window_in_three_matches_one_process_measuring_the_same_windows(two_ranks):
    """The windows the cadence lets pass (no hooks on the parameters, counts only) still sync once and count;
    the measured ones give the estimates of one process measuring the same windows."""
    ref = dw.reference_run(steps=STEPS, dp_size=2, measure_every=3)
    assert [r["measured"] for r in ref["records"]] == [s % 3 == 0 for s in range(STEPS)]
    assert_same_run(two_ranks["ddp_cadence"], ref, 2)
    for rank in two_ranks["ddp_cadence"]:
        assert [r["measured"] for r in rank["records"]] == [s % 3 == 0 for s in range(STEPS)]


@pytest.mark.parametrize("name", ["ddp", "ddp_static_bucket_view", "ddp_nonfinite", "ddp_device_path", "ddp_cadence"])
def test_ddp_syncs_each_bucket_once_per_step_and_the_tracker_adds_one_all_reduce(two_ranks, name):
    """A comm hook sees every gradient sync; the wrapped ``torch.distributed`` sees the rest.

    Without ``no_sync`` on all but the last microbatch each bucket would sync once per
    microbatch (A = 2 or more times a step): the gloo comparison with the reference
    gives the same numbers either way, so only counting shows it. With
    ``static_graph=True`` the first window syncs every microbatch (DDP's reducer needs
    one synced iteration). Besides, the tracker's only communication is one
    all_reduce(SUM) of float64 numbers per step, also on the dropped step.
    """
    numbers = _readme_tracker_collective_bytes() // 8  # float64
    for rank in two_ranks[name]:
        accumulation = [r["accumulation_steps"] for r in rank["records"]]
        widest = 0
        for step, (comm, a) in enumerate(zip(rank["communication"], accumulation, strict=True)):
            per_bucket = Counter(comm["bucket_syncs"])
            assert sorted(per_bucket) == list(range(len(per_bucket))), (step, comm)  # every bucket
            first_static = name == "ddp_static_bucket_view" and step == 0
            assert set(per_bucket.values()) == {a if first_static else 1}, (step, a, comm)
            assert comm["collectives"] == [["all_reduce", numbers, "torch.float64", str(dist.ReduceOp.SUM)]], step
            widest = max(widest, len(per_bucket))
        assert widest >= 2  # the small bucket cap splits the model, so "each bucket" is seen


def test_fsdp_hooks_once_per_unsharded_parameter(two_ranks):
    # 4 parameters (two Linear layers): one hook each, however many forwards ran
    assert [r["hooks"] for r in two_ranks["fsdp_last"]] == [4, 4]
    assert [r["hooks"] for r in two_ranks["fsdp_every"]] == [4, 4]


def test_every_fsdp2_rank_counts_the_whole_models_parameters(two_ranks):
    """``hold_on_plateau``'s tokens per parameter reads the model's size: each rank holds a shard (fewer parameters
    than the model), and every rank counts the whole, 6 x 8 + 8 + 8 + 1."""
    whole = dw.D_IN * dw.HIDDEN + dw.HIDDEN + dw.HIDDEN + 1
    ranks = two_ranks["fsdp_last"]
    assert [r["model_parameters"] for r in ranks] == [whole, whole]
    assert all(r["local_numel"] < whole for r in ranks)
    assert [r["controller_parameters"] for r in ranks] == [[whole, False], [whole, False]]  # FSDPTracker, in tokens


@pytest.mark.parametrize("name", ["ddp_nonfinite", "fsdp_nonfinite"])
def test_nonfinite_rank_drops_the_step_on_every_rank(two_ranks, name):
    ranks = two_ranks[name]
    for rank in ranks:
        assert [r["step"] for r in rank["records"] if r["dropped"]] == [4]  # NaN on rank 1 in step 4 only
    ref = dw.reference_run(steps=STEPS, dp_size=2, nan_at=(3, 1))
    assert_same_run(ranks, ref, 2)
    # the averages did not move on the dropped step
    rec = ranks[0]["records"]
    assert rec[3]["noise_scale"] == rec[2]["noise_scale"]


def test_rank_whose_data_ran_out_takes_part(two_ranks):
    ranks = two_ranks["manual_ranout"]
    assert [r["reads_first_from_grad"] for r in ranks] == [False, False]  # several ranks, no DDP: hooks only
    ref = dw.reference_run(steps=STEPS, dp_size=2, available=dw.ranout_available)
    assert_same_run(ranks, ref, 2, ragged_from=5)
    # step 5: rank 1 ran one of two microbatches; from step 6 on only rank 0 has data
    got = ranks[0]["records"]
    assert got[5]["global_batch"] < got[3]["global_batch"] * 1.5
    # no rank had data: every rank raised the same error after the all_reduce
    for rank in ranks:
        assert re.search(r"no microbatch since the last step.*\(on any data-parallel rank\)", rank["all_empty_error"])


def test_fsdp_bf16_params_fp32_reduce_match_slow_reference(two_ranks):
    """``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` at frozen weights.

    The hooks see bf16 microbatch gradients (normed in float32); the big norm comes
    from the fp32-reduced sharded gradient. The reference materialises the same
    bf16 gradients and does the arithmetic in float64, so what remains is float32
    accumulation (norms and the reduce: ~1e-7 relative) amplified by the
    cancellation in the estimates: 1e-4 covers it; a bf16-rounded big norm
    (what a reduction in bf16 would give) is off by ~1e-3.
    """
    ref = dw.bf16_reference(steps=STEPS, dp_size=2)
    for rank in two_ranks["fsdp_bf16"]:
        for got, want in zip(rank["records"], ref, strict=True):
            for key in MEASURED:
                torch.testing.assert_close(_num(got[key]), _num(want[key]), rtol=1e-4, atol=0.0, equal_nan=True)


def test_fsdp_configuration_errors(two_ranks):
    for rank in two_ranks["errors_2"]:
        err = rank["errors"]
        assert re.match(r"TypeError: CBSTracker\(model=FSDPSequential\): an FSDP2 \(fully_shard\) model needs "
                        r"cbs_tracker\.integrations\.fsdp\.FSDPTracker", err["cbs_tracker_on_fsdp"])
        assert re.match(r"ValueError: FSDPTracker\(gradient_sync='first'\): must be 'last' or 'every'",
                        err["gradient_sync"])
        assert re.match(r"ValueError: FSDPTracker\(preconditioner='adam'\): not supported with FSDP2",
                        err["adam"])
        assert re.match(r"ValueError: FSDPTracker\(model=\.\.\.\): parameters \['2\.bias'\] are not managed by FSDP",
                        err["unmanaged"])


def test_fsdp_tracker_needs_an_fsdp_module():
    from cbs_tracker.integrations.fsdp import FSDPTracker

    with pytest.raises(TypeError, match=r"FSDPTracker\(model=Linear\): expected the root module after "
                                        r"fully_shard\(model\)"):
        FSDPTracker(nn.Linear(2, 1))


# ---------------------------------------------------------------------------- 4 ranks
@pytest.mark.parametrize("name", ["mesh_ddp_dp_tp", "mesh_fsdp_dp_tp"])
def test_dp_x_tp_mesh_counts_only_dp_ranks(four_ranks, name):
    """4 ranks as 2 dp x 2 "tp": the tp ranks of a dp group feed identical data."""
    ranks = four_ranks[name]
    ref = dw.reference_run(steps=STEPS, dp_size=2)
    assert_same_run(ranks, ref, 2)  # global batch and estimate of the 2 dp ranks' data


def test_hsdp_counts_each_shard_once(four_ranks):
    ranks = four_ranks["mesh_hsdp"]
    assert sorted(r["reports_big_norm"] for r in ranks) == [False, False, True, True]
    ref = dw.reference_run(steps=STEPS, dp_size=4, clip=dw.HSDP_CLIP)
    assert min(ref["clip_norms"]) < dw.HSDP_CLIP < max(ref["clip_norms"])  # some steps clip, some do not
    for rank in ranks:  # tracker.clip_grad_norm_ on every rank, the replicas that report no norm included
        torch.testing.assert_close(torch.tensor(rank["clip_norms"]), torch.tensor(ref["clip_norms"]), rtol=RTOL, atol=0.0)
    assert_same_run(ranks, ref, 4)


def test_mesh_layout_errors(four_ranks):
    for rank in four_ranks["errors_4"]:
        err = rank["errors"]
        assert re.match(r"ValueError: FSDPTracker: the data-parallel group has 4 ranks but FSDP's mesh "
                        r"\('dp',\) covers 2 of them", err["covers"])
        assert re.match(r"ValueError: FSDPTracker\(device_mesh=None\): the parameters are sharded on a 2-D mesh "
                        r"\('dp', 'tp'\); name its data-parallel dimension\(s\)", err["2d_unnamed"])
        assert re.match(r"ValueError: FSDPTracker: parameters are sharded \(Shard\(dim=0\)\) along mesh dimension "
                        r"'tp', which is not data-parallel", err["tp_sharded"])
        assert re.match(r"ValueError: FSDPTracker: mesh dimension 'dim0' \(ranks \[0, 1, 2, 3\]\) partly overlaps "
                        r"the data-parallel group", err["overlap"])
        assert err["hooks_added_by_refusal"] == "0"
