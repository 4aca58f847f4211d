"""A run checkpointed on 2 data-parallel ranks resumes on 1, 4 and 3 ranks with the global batch kept.

The truth is one process that ran every microbatch of every global batch from the start
(the run that never moved): from the resume on, the resumed run's global batch, learning
rate, decisions, noise scale and weights must equal it (float64: to rounding). The data is
indexed by the microbatch's place in the global batch, so it is the same however the batch
is split over ranks. 3 ranks cannot split the checkpoint's batch of 8 microbatches: the run
warns, naming both batches, and couples the learning rate to the batch that runs.
"""

from __future__ import annotations

import json

import pytest
import torch

from cbs_tracker.policy.ranks import RankChange, nearest_accumulation
from tests import resize_workers as rw
from tests.spawning import spawn

SAVE_AT = 7  # the checkpoint holds a pending doubling (8 -> 16 microbatches decided at step 7)
END = 16


@pytest.fixture(scope="module")
def reference():
    return rw.reference(END)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_ranks")
    ckpt = root / "ckpt.pt"
    spawn(rw.worker, args=(2, str(root / "pg"), str(root), 0, SAVE_AT, None, str(ckpt)), nprocs=2)
    return ckpt, json.loads((root / "rank0.json").read_text())


def _resume(tmp_path, ckpt, world):
    if world == 1:
        rw.worker(0, 1, "", str(tmp_path), SAVE_AT, END, str(ckpt), None)
    else:
        spawn(rw.worker, args=(world, str(tmp_path / "pg"), str(tmp_path), SAVE_AT, END, str(ckpt), None),
              nprocs=world)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def _same(a, b, keys=("step", "global_batch", "microbatches", "next_microbatches", "tokens_seen",
                      "starting_batch_steps")):
    for k in keys:
        assert a[k] == b[k], (k, a["step"], a[k], b[k])
    for k in ("lr", "scheduled_lr", "lr_coupling", "noise_scale", "grad_sq_norm", "trace_cov"):
        if b[k] is None:
            assert a[k] is None, (k, a["step"])
        else:
            assert a[k] == pytest.approx(b[k], rel=1e-9), (k, a["step"], a[k], b[k])


def test_the_checkpoint_holds_a_grown_batch_and_a_pending_doubling(checkpoint, reference):
    _, first = checkpoint
    for a, b in zip(first["records"], reference["records"][:SAVE_AT], strict=True):
        _same(a, b)
    last = first["records"][-1]
    assert last["microbatches"] == 8 and last["next_microbatches"] == 16


@pytest.mark.parametrize("world", [1, 4])
def test_a_two_rank_checkpoint_resumes_on_another_number_of_ranks_as_if_it_never_moved(
    tmp_path, checkpoint, reference, world
):
    ckpt, _ = checkpoint
    ranks = _resume(tmp_path, ckpt, world)
    expected = reference["records"][SAVE_AT:]
    assert len(expected) == END - SAVE_AT
    for out in ranks:
        assert not [w for w in out["warnings"] if "resumed" in w], out["warnings"]
        assert [r["dp_degree"] for r in out["records"]] == [world] * len(expected)
        for a, b in zip(out["records"], expected, strict=True):
            _same(a, b)
        assert len({r["next_microbatches"] for r in expected}) > 1, "a decision must follow the resume"
        for p, q in zip(out["params"], reference["params"], strict=True):
            assert p == pytest.approx(q, rel=1e-9, abs=1e-12)
    # the saved state in global terms equals the reference's (per-rank counts times the ranks)
    state, ref = ranks[0]["state"], reference["state"]
    assert state["dp_degree"] == world and ref["dp_degree"] == 1
    for key in ("accumulation_steps", "starting_accumulation", "starting_batch_carry"):
        assert state[key] * world == pytest.approx(ref[key], rel=1e-12), key
    for key in ("step", "tokens_seen", "starting_batch_steps", "lr_coupling", "schedule", "cadence"):
        assert state[key] == ref[key], key
    ctl, ref_ctl = state["controller"], ref["controller"]
    for key in ("start_accumulation_steps", "accumulation_sum"):
        assert ctl[key] * world == pytest.approx(ref_ctl[key], rel=1e-12), key
    for key in ("exponent", "units_sum", "recent_noise_scales", "grow_count", "pending", "effective_tokens"):
        assert ctl[key] == pytest.approx(ref_ctl[key], rel=1e-9), key


def test_an_uneven_split_warns_naming_both_batches_and_couples_the_lr_to_the_batch_that_runs(
    tmp_path, checkpoint, reference
):
    ckpt, first = checkpoint
    ranks = _resume(tmp_path, ckpt, 3)
    out = ranks[0]
    warned = [w for w in out["warnings"] if "resumed on 3 data-parallel ranks" in w]
    assert len(warned) == 1, out["warnings"]
    assert "8 microbatches" in warned[0] and "9 microbatches" in warned[0], warned[0]
    # the doubling decided at the checkpoint (8 -> 16) runs as the same doubling of 9: 18 (6 per rank)
    assert "to 16 microbatches, runs as 18" in warned[0], warned[0]
    records = out["records"]
    assert records[0]["microbatches"] == 18 and records[0]["dp_degree"] == 3
    assert records[0]["global_batch"] == sum(len(rw.microbatch_data(SAVE_AT, 0, g)[1]) for g in range(18))
    # the LR is the schedule's times the coupling of the batch that runs (SGD: linear in the batch);
    # the starting batch is still the 4 microbatches the run began with
    k0 = rw.START_ACCUMULATION * rw.START_RANKS
    for r in records:
        assert r["lr_coupling"] == pytest.approx(r["microbatches"] / k0, rel=1e-12), r
        assert r["lr"] == pytest.approx(r["scheduled_lr"] * r["microbatches"] / k0, rel=1e-12), r
    # the schedule's clock is the starting batch's steps: at the first step it is where the reference's was
    assert records[0]["scheduled_lr"] == pytest.approx(reference["records"][SAVE_AT]["scheduled_lr"], rel=1e-12)
    assert first["records"][-1]["lr_coupling"] == pytest.approx(8 / k0)
    # the replicas agree
    for other in ranks[1:]:
        assert other["params"] == out["params"]


@pytest.mark.parametrize(
    ("k", "d", "expected"),
    [(8, 1, 8), (8, 4, 2), (8, 3, 3), (4, 3, 1), (6, 4, 1), (2, 4, 1), (3, 1, 3), (2, 3, 1), (1, 1, 2), (5, 2, 2)],
)
def test_nearest_accumulation_keeps_the_batch_or_the_nearest_smaller_on_a_tie(k, d, expected):
    a = nearest_accumulation(k, d)
    assert a == expected
    assert a * d >= 2
    # no other feasible per-rank accumulation is nearer (ties to the smaller)
    for other in range(1, 4 * k + 2):
        if other * d >= 2:
            assert (abs(other * d - k), other) >= (abs(a * d - k), a)


def test_a_rank_change_scales_per_rank_counts_by_the_ranks_and_pending_by_the_ladder():
    change = RankChange.plan(2, 4, 4)
    assert change.exact and change.new_accumulation == 2 and change.per_rank == 0.5
    assert change.accumulation(8) == 4 and change.accumulation(2) == 1 and change.accumulation(1) is None
    uneven = RankChange.plan(2, 3, 4)
    assert not uneven.exact and uneven.new_microbatches == 9 and uneven.old_microbatches == 8
    assert uneven.accumulation(8) == 6


def test_a_controller_without_convert_ranks_is_refused_with_the_reason():
    from cbs_tracker import CBSTracker
    from tests.doubles import PlanController

    model = torch.nn.Linear(2, 1)
    tracker = CBSTracker(model, accumulation_steps=2, unit="samples", controller=PlanController({}))
    state = tracker.state_dict()
    state["dp_degree"] = 2
    state["controller"] = {"anything": 1}
    with pytest.raises(ValueError, match="convert_ranks"):
        tracker.load_state_dict(state)


# ---------------------------------------------------------------------------- FSDP2
@pytest.fixture(scope="module")
def fsdp_reference():
    return rw.reference(END, momentum=rw.FSDP_MOMENTUM)


@pytest.fixture(scope="module")
def fsdp_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp_two_ranks")
    ckpt = root / "dcp"
    spawn(rw.fsdp_worker, args=(2, str(root / "pg"), str(root), 0, SAVE_AT, None, str(ckpt)), nprocs=2)
    return ckpt, json.loads((root / "rank0.json").read_text())


@pytest.mark.parametrize("world", [1, 4])
def test_an_fsdp2_checkpoint_of_two_ranks_resharded_onto_another_number_resumes_as_if_it_never_moved(
    tmp_path, fsdp_checkpoint, fsdp_reference, world
):
    ckpt, first = fsdp_checkpoint
    for a, b in zip(first["records"], fsdp_reference["records"][:SAVE_AT], strict=True):
        _same(a, b)
    spawn(rw.fsdp_worker, args=(world, str(tmp_path / "pg"), str(tmp_path), SAVE_AT, END, str(ckpt), None),
          nprocs=world)
    expected = fsdp_reference["records"][SAVE_AT:]
    for r in range(world):
        out = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert [x["dp_degree"] for x in out["records"]] == [world] * len(expected)
        for a, b in zip(out["records"], expected, strict=True):
            _same(a, b)
        # the momentum buffers came through the resharding: the weights are the reference's
        for p, q in zip(out["params"], fsdp_reference["params"], strict=True):
            assert p == pytest.approx(q, rel=1e-9, abs=1e-12)


# ---------------------------------------------------------------------------- a batch schedule in units
SCHEDULE_SAVE_AT, SCHEDULE_END = 5, 12  # saved at 6 microbatches with 8 pending


def test_a_batch_schedule_resumes_on_one_rank_as_if_it_never_moved_and_refuses_ranks_it_cannot_lay_out(tmp_path):
    reference = rw.reference(SCHEDULE_END, schedule=True)
    ckpt = tmp_path / "ckpt.pt"
    first_dir, one_dir = tmp_path / "two", tmp_path / "one"
    first_dir.mkdir(), one_dir.mkdir()
    spawn(rw.worker, args=(2, str(tmp_path / "pg"), str(first_dir), 0, SCHEDULE_SAVE_AT, None, str(ckpt), True),
          nprocs=2)
    first = json.loads((first_dir / "rank0.json").read_text())
    assert first["records"][-1]["microbatches"] == 6 and first["records"][-1]["next_microbatches"] == 8
    rw.worker(0, 1, "", str(one_dir), SCHEDULE_SAVE_AT, SCHEDULE_END, str(ckpt), None, True)
    out = json.loads((one_dir / "rank0.json").read_text())
    for a, b in zip(first["records"] + out["records"], reference["records"], strict=True):
        _same(a, b)
    for p, q in zip(out["params"], reference["params"], strict=True):
        assert p == pytest.approx(q, rel=1e-9, abs=1e-12)
    # 4 ranks of 3 samples hold 12 per microbatch slot: the mark at 18 cannot be laid out there
    from cbs_tracker import CBSTracker

    model = rw.make_model()
    tracker = CBSTracker(model, accumulation_steps=2, unit="samples", controller=rw.make_schedule())
    tracker.session.dp_degree = 4  # what a 4-rank run would have (no process group needed to load a state)
    state = torch.load(ckpt, weights_only=False)["tracker"]
    before = tracker.state_dict()
    with pytest.raises(ValueError, match=r"the mark \(30, 18\) cannot be laid out"):
        tracker.load_state_dict(state)
    assert tracker.state_dict() == before


# ---------------------------------------------------------------------------- the plain loop's data position
def _sampler_batches(n, world, rank, batch_size, epoch=3):
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(list(range(n)), num_replicas=world, rank=rank, shuffle=True, seed=11)
    sampler.set_epoch(epoch)
    return [b.tolist() for b in DataLoader(list(range(n)), batch_size=batch_size, sampler=sampler)]


def _resumed_tracker(old_dp, new_dp):
    from cbs_tracker import CBSTracker

    saved = CBSTracker(torch.nn.Linear(2, 1), accumulation_steps=2, unit="samples").state_dict()
    saved["dp_degree"] = old_dp
    tracker = CBSTracker(torch.nn.Linear(2, 1), accumulation_steps=2, unit="samples")
    tracker.session.dp_degree = new_dp  # stands for a run on new_dp ranks (the position needs no process group)
    tracker.load_state_dict(saved)
    return tracker


@pytest.mark.parametrize(("old_dp", "new_dp"), [(2, 1), (2, 4), (4, 2), (2, 3)])
def test_resume_position_continues_a_distributed_samplers_epoch_where_the_old_ranks_stopped(old_dp, new_dp):
    n, bs, consumed = 240, 4, 7  # each old rank had consumed 7 batches of the epoch
    done = {i for r in range(old_dp) for b in _sampler_batches(n, old_dp, r, bs)[:consumed] for i in b}
    tracker = _resumed_tracker(old_dp, new_dp)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        skip = tracker.resume_position(consumed)
    after = [i for r in range(new_dp) for b in _sampler_batches(n, new_dp, r, bs)[skip:] for i in b]
    skipped = {i for r in range(new_dp) for b in _sampler_batches(n, new_dp, r, bs)[:skip] for i in b}
    seen_again = done & set(after)
    never = set(range(n)) - done - set(after)
    assert not never, "no sample of the epoch may be skipped"
    assert skipped <= done
    if (consumed * old_dp) % new_dp == 0:
        assert not seen_again and not caught
    else:  # rounded down: the warning names how many loader batches are seen again, and it is so
        repeated = consumed * old_dp - skip * new_dp
        assert len(seen_again) == repeated * bs
        assert len(caught) == 1 and f"{repeated} loader batch(es) of the epoch are seen again" in str(caught[0].message)


def test_resume_position_on_the_same_ranks_is_the_count_and_bad_input_is_refused():
    from cbs_tracker import CBSTracker

    tracker = CBSTracker(torch.nn.Linear(2, 1), accumulation_steps=2, unit="samples")
    tracker.load_state_dict(tracker.state_dict())
    assert tracker.resumed_from is None and tracker.resume_position(7) == 7
    with pytest.raises(ValueError, match=r"resume_position\(batches_per_rank=-1\): must be an int >= 0"):
        tracker.resume_position(-1)
    assert _resumed_tracker(2, 4).resumed_from == RankChange(2, 4, 2, 1)


# ---------------------------------------------------------------------------- the microbatch grown first
def test_a_microbatch_first_run_of_two_ranks_resumes_on_one_with_its_layout_data_and_weights(tmp_path):
    save_at, end = 4, 9  # saved at 4 loader batches of 2 rows per rank (16 samples); the mark at 72 grows it
    ref_dir, two, one = tmp_path / "ref", tmp_path / "two", tmp_path / "one"
    for d in (ref_dir, two, one):
        d.mkdir()
    ckpt = tmp_path / "ckpt.pt"
    rw.microbatch_first_run(0, 1, "", str(ref_dir), end, None, None, 4)  # 1 process at the same global batch
    spawn(rw.microbatch_first_run, args=(2, str(tmp_path / "pg"), str(two), save_at, None, str(ckpt), 2),
          nprocs=2)
    rw.microbatch_first_run(0, 1, "", str(one), end - save_at, str(ckpt), None, 2)
    reference = json.loads((ref_dir / "rank0.json").read_text())
    first = [json.loads((two / f"rank{r}.json").read_text()) for r in range(2)]
    resumed = json.loads((one / "rank0.json").read_text())
    assert not resumed["warnings"], resumed["warnings"]
    before = [sorted(a["indices"] + b["indices"]) for a, b in zip(first[0]["records"], first[1]["records"])]
    assert before == [sorted(r["indices"]) for r in reference["records"][:save_at]]
    expected = reference["records"][save_at:]
    assert len({r["loader_batches"] for r in expected}) > 1, "the batch must grow after the resume"
    for a, b in zip(resumed["records"], expected, strict=True):
        # the same samples in the same order, the same layout (loader batches per microbatch), batch and LR
        for key in ("step", "global_batch", "loader_batches", "microbatches", "micro_batch", "indices"):
            assert a[key] == b[key], (key, a["step"], a[key], b[key])
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-12)
    for p, q in zip(resumed["params"], reference["params"], strict=True):
        assert p == pytest.approx(q, rel=1e-9, abs=1e-12)


def test_an_uneven_split_below_the_starting_batch_keeps_the_schedule_on_the_data(tmp_path):
    """2 ranks at the starting 2 microbatches each (4) resumed on 3: 3 microbatches a step, 3/4 of a
    starting-batch step each, so the LR schedule (sized in starting-batch steps) advances with the data."""
    ckpt, out_dir = tmp_path / "ckpt.pt", tmp_path / "three"
    out_dir.mkdir()
    spawn(rw.worker, args=(2, str(tmp_path / "pg"), str(tmp_path), 0, 2, None, str(ckpt)), nprocs=2)
    spawn(rw.worker, args=(3, str(tmp_path / "pg3"), str(out_dir), 2, 4, str(ckpt), None), nprocs=3)
    records = json.loads((out_dir / "rank0.json").read_text())["records"]
    assert [r["microbatches"] for r in records] == [3, 3]
    k0, microbatches = 4, 2 * 4  # the two steps before the checkpoint ran 4 each
    for r in records:
        # the schedule (LambdaLR 1 / (1 + 0.1 e), stepped once per starting-batch step) is where the data
        # before this step puts it
        assert r["scheduled_lr"] == pytest.approx(rw.LR / (1 + 0.1 * (microbatches // k0)), rel=1e-12)
        microbatches += r["microbatches"]
        assert r["starting_batch_steps"] == microbatches // k0, r  # 2 + floor(3/4), 2 + floor(6/4)
        assert r["lr"] == pytest.approx(r["scheduled_lr"] * 3 / 4, rel=1e-12)


def test_a_checkpoint_taken_before_the_first_window_of_an_uneven_resume_still_recouples_the_lr():
    from cbs_tracker import CBSTracker

    def tracker_on(ranks):
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        tracker = CBSTracker(model, opt, accumulation_steps=2, unit="samples", lr_coupling="linear")
        tracker.session.dp_degree = ranks  # stands for a run on that many ranks (loading needs no group)
        return tracker, opt

    saved, _ = tracker_on(2)
    state = saved.state_dict()  # 2 x 2 = 4 microbatches, coupling 1 at LR 1
    moved, _ = tracker_on(3)
    with pytest.warns(UserWarning, match="resumed on 3 data-parallel ranks"):
        moved.load_state_dict(state)
    again = moved.state_dict()  # saved before any window: the coupling to 3/4 is still to be set
    resumed, opt = tracker_on(3)
    resumed.load_state_dict(again)
    resumed.session.start_window()
    assert resumed.lr_coupling == pytest.approx(3 / 4) and opt.param_groups[0]["lr"] == pytest.approx(3 / 4)
