"""End to end in a plain loop: the controller grows the accumulation, resumes exactly, agrees across ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import plain_workers
from tests.spawning import spawn

ROOT = Path(__file__).resolve().parents[1]
STEPS = 300


@pytest.fixture(scope="module")
def uninterrupted():
    return plain_workers.train(STEPS)


def _changes(log):
    return [r["step"] for r in log if r["next_accumulation_steps"] != r["accumulation_steps"]]


def test_accumulation_grows_and_each_step_aggregates_exactly_the_decided_microbatches(uninterrupted):
    log = uninterrupted
    assert len(_changes(log)) >= 3, "the rising noise scale must make the controller double several times"
    assert log[-1]["accumulation_steps"] >= 16
    seen = 0.0
    for prev, cur in zip(log, log[1:]):
        # a decision takes effect at the next window, never inside one
        assert cur["accumulation_steps"] == prev["next_accumulation_steps"]
    for r in log:
        # counted independently by the model's own forward counter
        assert r["forward_calls"] == r["accumulation_steps"]
        assert r["global_batch"] == r["samples_fed"]
        seen += r["samples_fed"]
        assert r["tokens_seen"] == seen
    # only power-of-two multiples of the starting accumulation
    assert {r["accumulation_steps"] for r in log} <= {2 * 2**e for e in range(10)}


def test_resume_in_a_new_process_gives_the_same_schedule(uninterrupted, tmp_path):
    changes = _changes(uninterrupted)
    save_at = (changes[0] + changes[1]) // 2  # between two doublings
    ckpt = tmp_path / "ckpt.pt"
    first = plain_workers.train(save_at, ckpt_out=str(ckpt), save_at=save_at)
    assert first == uninterrupted[:save_at]
    out = tmp_path / "resumed.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run(
        [sys.executable, "-m", "tests.plain_workers", str(STEPS), str(out), str(ckpt)],
        cwd=ROOT, env=env, check=True, timeout=300,
    )
    resumed = json.loads(out.read_text())
    assert [r["step"] for r in resumed] == list(range(save_at + 1, STEPS + 1))
    expected = uninterrupted[save_at:]
    assert [r["accumulation_steps"] for r in resumed] == [r["accumulation_steps"] for r in expected]
    assert _changes(resumed) == [c for c in changes if c > save_at]
    for a, b in zip(resumed, expected):
        assert a["noise_scale"] == pytest.approx(b["noise_scale"], rel=1e-9, abs=0) if b["noise_scale"] else a["noise_scale"] is None


def test_two_gloo_ranks_with_different_data_take_identical_decisions(tmp_path):
    steps = 300
    spawn(
        plain_workers.ddp_worker,
        args=(2, str(tmp_path / "pg"), str(tmp_path), steps),
        nprocs=2,
        join=True,
    )
    logs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert len(_changes(logs[0])) >= 1, "the run must contain at least one decision to compare"
    for a, b in zip(*logs):
        assert a["accumulation_steps"] == b["accumulation_steps"]
        assert a["next_accumulation_steps"] == b["next_accumulation_steps"]
        assert a["noise_scale"] == b["noise_scale"]  # bitwise: decided from all-reduced values only
        # the global batch counts both ranks' samples
        assert a["global_batch"] == a["samples_fed"] + b["samples_fed"]


# ---------------------------------------------------------------------------- LR set by the loop itself
def _nanogpt_style(use_set_lr: bool, steps: int = 8):
    """A loop that computes its LR every iteration (nanoGPT's get_lr), with a plan that doubles at step 3."""
    import warnings

    import torch

    from cbs_tracker import CBSTracker
    from tests.doubles import PlanController

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    tracker = CBSTracker(model, opt, accumulation_steps=2, unit="samples", controller=PlanController({3: 4}))

    def get_lr(it: int) -> float:
        return 1e-3 * (1.0 - it / 100)

    seen = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for it in range(steps):
            if use_set_lr:
                tracker.set_lr(get_lr(tracker.starting_batch_steps))
            else:
                for g in opt.param_groups:
                    g["lr"] = get_lr(it)
            for _ in range(tracker.accumulation_steps):
                with tracker.microbatch(size=4):
                    (model(torch.randn(4, 4)).pow(2).mean() / tracker.accumulation_steps).backward()
            tracker.step()
            seen.append((tracker.starting_batch_steps, opt.param_groups[0]["lr"], tracker.lr_coupling))
            opt.step()
            opt.zero_grad()
    return [str(w.message) for w in caught if "set from outside" in str(w.message)], seen, get_lr


def test_a_loop_that_sets_the_lr_itself_is_told_once_what_to_do():
    messages, _, _ = _nanogpt_style(use_set_lr=False)
    assert len(messages) == 1
    assert "`tracker.set_lr(schedule(t))`" in messages[0]
    assert "tracker.starting_batch_steps for one written in optimizer steps (nanoGPT's get_lr(it))" in messages[0]


def test_set_lr_clocks_the_schedule_in_starting_batch_steps_and_keeps_the_coupling():
    messages, seen, get_lr = _nanogpt_style(use_set_lr=True)
    assert messages == []
    # after the doubling each step holds two starting-batch steps, and the LR carries sqrt(2) (AdamW)
    assert seen[-1][2] == pytest.approx(2**0.5)
    for (_sbs_after, lr, coupling), (sbs_before, _, _) in zip(seen[1:], seen[:-1]):
        assert lr == pytest.approx(get_lr(sbs_before) * coupling, rel=1e-12)


class _RecordingController:
    """Grows the accumulation 2 -> 4 at step 3 and records the scheduled LR each update gets."""

    observe_only = False
    kappa = 1.0

    def __init__(self):
        self.scheduled: list[float | None] = []

    def update(self, *, step, accumulation_steps, scheduled_lr=None, **_):
        import types

        self.scheduled.append(scheduled_lr)
        new = 4 if step == 3 else None
        return types.SimpleNamespace(accumulation_steps=new or accumulation_steps, changed=new is not None,
                                     critical_batch=None, lr_factor=1.0, reason="plan")

    def state_dict(self):
        return {"version": 1}

    def load_state_dict(self, state):
        pass


@pytest.mark.parametrize("optimizer,how", [("SGD", "write"), ("AdamW", "write"), ("SGD", "set_lr"), (None, None)])
def test_the_scheduled_lr_a_controller_gets_from_a_loop_that_sets_its_own(optimizer, how):
    # A loop writing param_group["lr"] itself overwrites the coupling (x2 for SGD, x sqrt 2 for AdamW
    # after the doubling): its LR over the coupling would read as a halving of the schedule, which
    # the default controller would turn into a doubling. Once seen, no scheduled LR is passed (a
    # warning says why); tracker.set_lr keeps the schedule's own value; no optimizer passes none.
    import warnings

    import torch
    from cbs_tracker.integrations.plain import CBSTracker

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = None if optimizer is None else getattr(torch.optim, optimizer)(model.parameters(), lr=0.1)
    ctrl = _RecordingController()
    tracker = CBSTracker(model, opt, accumulation_steps=2, controller=ctrl, unit="samples")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(8):
            if how == "write":
                for g in opt.param_groups:
                    g["lr"] = 0.1
            elif how == "set_lr":
                tracker.set_lr(0.1)
            for _ in range(tracker.accumulation_steps):
                with tracker.microbatch(size=8):
                    (model(torch.randn(8, 4)).pow(2).mean() / tracker.accumulation_steps).backward()
            tracker.step()
            if opt is not None:
                opt.step()
                opt.zero_grad()
    assert tracker.accumulation_steps == 4 and len(ctrl.scheduled) == 8
    outside = [w for w in caught if "set from outside the tracker" in str(w.message)]
    if how == "write":
        # the coupling is applied when the doubled window starts (step 4), after that step's write;
        # the write before step 5 overwrites it
        assert ctrl.scheduled[:4] == [0.1] * 4 and ctrl.scheduled[4:] == [None] * 4 and len(outside) == 1
    elif how == "set_lr":
        assert ctrl.scheduled == pytest.approx([0.1] * 8) and not outside
    else:
        assert ctrl.scheduled == [None] * 8
