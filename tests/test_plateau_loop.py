"""``hold_on_plateau`` in a plain loop (``tracker.observe_loss``) on one rank and two: the controller fits every
step's loss, measured window or not, to numpy's least squares; a planted plateau holds the batch, a planted fall
grows it only past a quarter of the run; two ranks with different losses read one slope and decide alike."""

from __future__ import annotations

import copy
import json
import math
import os
from datetime import timedelta

import numpy as np
import pytest
import torch
from torch import nn

from cbs_tracker import BatchSizeController, CBSTracker
from tests import plain_workers
from tests.spawning import spawn

STEPS = 1000


def wobble(t):  # a deterministic noise, so that which steps' losses are fitted shows in the slope
    return 0.03 * math.sin(0.37 * t)


def flat(t):
    return 3 - 0.1 * math.log(t) + wobble(t)


def steep(t):
    return 3 - 0.4 * math.log(t) + wobble(t)


def run(rank, world, loss_at, *, hold=0.15, measure_every=3, save_at=None, state=None, unit="samples", **options):
    """``STEPS`` steps of the plain workers' regression with ``CBSTracker``; each microbatch gives
    ``loss_at(units after its step)`` (a tensor) to ``observe_loss``. Returns the steps' (units, accumulation,
    planted loss) and the controller; with ``save_at``, also the checkpoint (model, optimizer, tracker) after
    that many steps; from ``state`` (such a checkpoint), the run resumed there."""
    torch.manual_seed(0)
    model: nn.Module = plain_workers.make_model()
    inner = model
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(inner.parameters(), lr=0.05)
    controller = BatchSizeController(kappa=1.0, warmup_steps=20, warmup_tokens=0, cooldown_tokens=64, patience=4,
                                     window=8, max_batch=256, hold_on_plateau=hold, **options)
    tracker = CBSTracker(model, optimizer, accumulation_steps=2, unit=unit, controller=controller,
                         measure_every=measure_every)
    rows, step, saved = [], 0, None
    if state is not None:
        inner.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        tracker.load_state_dict(state["tracker"])
        step = tracker.steps
    while not tracker.done(steps=STEPS):
        units = tracker.tokens_seen + tracker.accumulation_steps * plain_workers.MICRO * world
        for i in range(tracker.accumulation_steps):
            x, y = plain_workers.microbatch(step, i, rank)
            with tracker.microbatch(size=x.shape[0]):
                loss = 0.5 * (model(x).squeeze(-1) - y).pow(2).mean()
                (loss / tracker.accumulation_steps).backward()
            tracker.observe_loss(torch.tensor(loss_at(units)))
        record = tracker.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        rows.append((record.tokens_seen, record.accumulation_steps, loss_at(units)))
        step += 1
        if step == save_at:
            saved = copy.deepcopy({"model": inner.state_dict(), "optimizer": optimizer.state_dict(),
                                   "tracker": tracker.state_dict()})
    return (rows, controller) if save_at is None else (rows, controller, saved)


def reference_slope(points, tokens, warmup):
    kept = [(t, y) for t, y in points if max(tokens / 2, 2 * warmup) <= t <= tokens]
    return -np.polyfit(np.log([t for t, _ in kept]), [y for _, y in kept], 1)[0]


@pytest.mark.parametrize("loss_at", [flat, steep], ids=["plateau", "falling"])
def test_a_plain_loop_holds_on_a_planted_plateau_and_grows_past_a_quarter_on_a_fall(loss_at):
    rows, ctrl = run(0, 1, loss_at)
    plateau, total = ctrl.plateau, ctrl.total_tokens
    assert total == pytest.approx(rows[0][0] * STEPS)  # tracker.done(steps=) gave the run's length
    assert plateau.verdict_tokens >= 0.25 * total > plateau.verdict_tokens - 4 * rows[0][0]
    points = [(t, y) for t, _, y in rows if t <= plateau.verdict_tokens]
    assert plateau.slope.seen == len(points)  # every step's loss, measured (one in three) or not
    assert plateau.verdict_slope == pytest.approx(reference_slope(points, plateau.verdict_tokens,
                                                                  plateau.slope.warmup), rel=1e-6)
    grew = [t for (t, a, _), (_, b, _) in zip(rows, rows[1:]) if b != a]
    if loss_at is flat:
        assert plateau.held is True and grew == []
    else:
        assert plateau.held is False and grew and grew[0] >= plateau.verdict_tokens
        unheld, _ = run(0, 1, loss_at, hold=None)
        assert [t for (t, a, _), (_, b, _) in zip(unheld, unheld[1:]) if b != a][0] < 0.25 * total


@pytest.mark.parametrize("parameters", [None, 1_000], ids=["the-trackers-count", "the-users-count"])
def test_in_tokens_the_tracker_gives_the_models_size_and_a_run_long_for_it_is_not_held(parameters):
    """Units counted as tokens: the tracker gives the controller the model's size (``Linear(8, 1)``, 8 parameters).
    The planted plateau's verdict, at 2,000 tokens, comes 250 tokens per parameter in: the run is not held and
    changes its batch at the steps of the falling loss, whose verdict lets the rule grow (past it only the noise
    scale decides). With the user's count, 1,000, it is 2 per parameter, and the run holds as in samples."""
    rows, ctrl = run(0, 1, flat, unit="tokens", model_parameters=parameters)
    accumulations = [a for _, a, _ in rows]
    if parameters is None:
        assert ctrl.model_parameters == plain_workers.D
        assert ctrl.plateau.held is False and ctrl.plateau.gated == pytest.approx(2_000 / 8, rel=0.01)
        falling, _ = run(0, 1, steep, unit="tokens")
        assert accumulations == [a for _, a, _ in falling] and max(accumulations) > 2
    else:
        assert ctrl.model_parameters == 1_000
        assert ctrl.plateau.held is True and ctrl.plateau.gated is None and set(accumulations) == {2}


def _worker(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                         timeout=timedelta(seconds=60))
    try:
        loss_at = flat if rank == 0 else (lambda t: 3 - 0.3 * math.log(t) - wobble(t))
        rows, ctrl = run(rank, world, loss_at)
        p = ctrl.plateau
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"rows": rows, "verdict": [p.verdict_tokens, p.verdict_slope, p.held],
                       "warmup": p.slope.warmup}, f)
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_with_different_losses_read_the_slope_of_all_their_points_and_decide_alike(tmp_path):
    """Rank 0's loss on a plateau (0.1 per e-fold), rank 1's falling at 0.3: each reads numpy's fit to both
    ranks' points at the verdict, 0.2, and both grow at the same steps."""
    spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert out[0]["verdict"] == out[1]["verdict"]
    tokens, slope, held = out[0]["verdict"]
    points = [(t, y) for o in out for t, _, y in o["rows"] if t <= tokens]
    assert slope == pytest.approx(reference_slope(points, tokens, out[0]["warmup"]), rel=1e-6)
    assert 0.15 < slope < 0.25 and held is False
    assert [a for _, a, _ in out[0]["rows"]] == [a for _, a, _ in out[1]["rows"]]
    assert max(a for _, a, _ in out[0]["rows"]) > 2


@pytest.mark.parametrize("save_at, pending", [(199, 0), (200, 1), (201, 2)])
def test_a_run_resumed_before_its_verdict_decides_as_the_uninterrupted_one(save_at, pending):
    """Saved after step 199, 200 or 201: zero, one or two windows after a measured one (one in three; the losses
    not yet given to the controller are in the state), before the verdict at step 250: the resumed run measures
    the windows the uninterrupted one measures, reads the same slope and changes the batch at the same steps."""
    whole, ctrl, saved = run(0, 1, steep, save_at=save_at)
    assert len(saved["tracker"].get("pending_losses", [])) == pending
    resumed, again = run(0, 1, steep, state=saved)
    assert resumed == whole[save_at:]
    assert (again.plateau.verdict_tokens, again.plateau.verdict_slope, again.plateau.held) == (
        ctrl.plateau.verdict_tokens, ctrl.plateau.verdict_slope, ctrl.plateau.held)


def _resume_worker(rank, world, init_file, out_dir):
    """Two ranks with different losses run to step 180 and save rank 0's checkpoint (as frameworks do); both
    ranks load it and run on. Every step measured: no loss waits for a later decision at the checkpoint."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                         timeout=timedelta(seconds=60))
    try:
        loss_at = flat if rank == 0 else (lambda t: 3 - 0.3 * math.log(t) - wobble(t))
        whole, ctrl, saved = run(rank, world, loss_at, measure_every=1, save_at=180)
        path = os.path.join(out_dir, "ckpt.pt")
        if rank == 0:
            torch.save(saved, path)
        torch.distributed.barrier()
        resumed, again = run(rank, world, loss_at, measure_every=1, state=torch.load(path, weights_only=False))
        with open(os.path.join(out_dir, f"resume{rank}.json"), "w") as f:
            json.dump({"whole": whole[180:], "resumed": resumed,
                       "verdicts": [[c.plateau.verdict_tokens, c.plateau.verdict_slope, c.plateau.held]
                                    for c in (ctrl, again)]}, f)
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_resumed_from_rank_zeros_checkpoint_decide_as_the_uninterrupted_run(tmp_path):
    """The checkpoint holds rank 0's state only; the controller's points are the ranks' mean losses, the same
    on every rank, so both resumed ranks read the uninterrupted run's slope and change the batch at its steps."""
    spawn(_resume_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    out = [json.loads((tmp_path / f"resume{r}.json").read_text()) for r in (0, 1)]
    for o in out:
        assert o["resumed"] == o["whole"]
        assert o["verdicts"][0] == o["verdicts"][1]
    assert out[0]["verdicts"] == out[1]["verdicts"]
    assert out[0]["verdicts"][0][0] >= out[0]["whole"][0][0]  # the verdict came after the checkpoint


def test_a_state_with_malformed_pending_losses_is_refused_naming_the_key_before_anything_changes():
    _, ctrl, saved = run(0, 1, steep, save_at=201)
    state = copy.deepcopy(saved["tracker"])
    state["pending_losses"] = [[1600.0, "x"]]
    model = plain_workers.make_model()
    tracker = CBSTracker(model, torch.optim.SGD(model.parameters(), lr=0.05), accumulation_steps=2, unit="samples",
                         controller=BatchSizeController(hold_on_plateau=0.15))
    before = tracker.state_dict()
    with pytest.raises(TypeError, match=r"'pending_losses' must be a list of \[tokens > 0, loss or None\] pairs"):
        tracker.load_state_dict(state)
    assert tracker.state_dict() == before
