"""Misuse and faults: no silent wrong number, no diverged replica, no stuck run; and the shared engine's state.

Each test is named after what it protects. References are independent: a slow
per-microbatch autograd computation, a fresh tracker, the constant-batch run, or
the analytic noise scale of a frozen linear regression.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch import nn

from cbs_tracker import BatchSizeController, CBSCallback, CBSTracker, NoiseScaleEstimator
from tests import engine_workers
from tests.lightning_workers import PlanController, Recorder, Regression, regression_data
from tests.spawning import spawn

LIGHTNING_FILTERS = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
    pytest.mark.filterwarnings("ignore:.*isinstance.*treespec.*"),
]


def _trainer(**kw) -> pl.Trainer:
    defaults = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
    defaults.update(kw)
    return pl.Trainer(**defaults)


def _loader(ds, batch_size=2):
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=False)


def _micro(model, x, y, acc):
    return (0.5 * (model(x).squeeze(-1) - y).pow(2).mean() / acc)


def _data(n, seed, d=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randn(n, generator=g)


# ---------------------------------------------------------------------------- 1. window size
def test_ddp_loop_that_ignores_the_accumulation_stops_before_replicas_diverge(tmp_path):
    spawn(engine_workers.loop_ignores_accumulation, args=(2, str(tmp_path / "pg"), str(tmp_path)), nprocs=2,
             join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["steps"] == 2  # two windows of 2 ran as set; the third (set to 8) ran 2 and stopped
        assert re.search(r"accumulation_steps=8.*replicas diverge; stopped", r["error"])
    # no optimizer step ran on unsynced gradients: the replicas are identical
    assert ranks[0]["params"] == ranks[1]["params"]


def test_single_process_window_of_another_size_warns_once_and_records_what_ran():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    tracker = CBSTracker(model, accumulation_steps=4, unit="samples", lr_coupling="keep")
    with pytest.warns(UserWarning, match=r"the window ran 3 microbatches per rank .* accumulation_steps=4"):
        for i in range(3):
            x, y = _data(5, i)
            with tracker.microbatch(size=5):
                _micro(model, x, y, 4).backward()
        record = tracker.step()
    assert record.accumulation_steps == 3 and record.global_batch == 15
    # measured with the microbatches it ran: the big norm is the mean of those 3 gradients
    grads = []
    for i in range(3):
        model.zero_grad()
        x, y = _data(5, i)
        (0.5 * (model(x).squeeze(-1) - y).pow(2).mean()).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]).double())
    mean = torch.stack(grads).mean(0)
    assert tracker.last_stats.big_sq_norm == pytest.approx(float(mean.pow(2).sum()), rel=1e-6)
    assert tracker.last_stats.small_sq_norm == pytest.approx(float(torch.stack(grads).pow(2).sum(1).mean()), rel=1e-6)


# ---------------------------------------------------------------------------- 2. unfreezing
def _two_part_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    for p in model[0].parameters():
        p.requires_grad_(False)
    return model


def _reference_norms(model, batches, acc):
    """Slow reference: per-microbatch gradients of every parameter trainable now."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for x, y in batches:
        g = torch.autograd.grad(0.5 * (model(x).squeeze(-1) - y).pow(2).mean(), params)
        grads.append(torch.cat([t.flatten() for t in g]).double())
    stacked = torch.stack(grads)
    return float(stacked.pow(2).sum(1).mean()), float(stacked.mean(0).pow(2).sum())


def test_unfreezing_mid_run_keeps_small_and_big_norms_on_the_same_parameters():
    model = _two_part_model()
    tracker = CBSTracker(model, accumulation_steps=2, unit="samples")
    for step in range(4):
        if step == 2:
            for p in model[0].parameters():
                p.requires_grad_(True)  # gradual unfreezing between two windows
        batches = [_data(6, 10 * step + j) for j in range(2)]
        for x, y in batches:
            with tracker.microbatch(size=6):
                _micro(model, x, y, 2).backward()
        tracker.step()
        small, big = _reference_norms(model, batches, 2)
        assert tracker.last_stats.small_sq_norm == pytest.approx(small, rel=1e-6), step
        assert tracker.last_stats.big_sq_norm == pytest.approx(big, rel=1e-6), step
        model.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------- 3. common mistakes
def _regression(d=8, sigma=0.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    w_star = torch.randn(d, generator=g)
    model = nn.Linear(d, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_((w_star + 0.3 * torch.randn(d, generator=g))[None])
    return model, w_star


def _frozen_run(mistake: str, steps: int = 40):
    model, w_star = _regression()
    tracker = CBSTracker(model, accumulation_steps=2, unit="samples")
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for _ in range(2):
            x = torch.randn(16, 8, generator=gen)
            y = x @ w_star + 0.5 * torch.randn(16, generator=gen)
            with tracker.microbatch(size=16):
                loss = _micro(model, x, y, 2)
                if mistake == "unpassed_scaler":
                    loss = loss * 2.0**16  # what GradScaler.scale does
                loss.backward()
        if mistake == "clip_first":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        if mistake == "zero_grad_first":
            model.zero_grad(set_to_none=False)
        if mistake == "unpassed_scaler":
            for p in model.parameters():
                p.grad /= 2.0**16  # scaler.unscale_(optimizer), but the tracker was not told
        tracker.step()
        model.zero_grad(set_to_none=True)
    return tracker


@pytest.mark.parametrize("mistake", ["clip_first", "zero_grad_first", "unpassed_scaler"])
def test_reading_the_step_gradient_wrongly_is_reported(mistake):
    with pytest.warns(UserWarning, match=r"per-microbatch gradients were .* larger \(squared\) than the step's"):
        _frozen_run(mistake)


def test_a_correct_run_gives_no_misuse_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tracker = _frozen_run("none", steps=60)
    assert tracker.noise_scale is not None


def test_backward_outside_microbatch_is_reported():
    model, w_star = _regression()
    tracker = CBSTracker(model, accumulation_steps=2, unit="samples")
    x = torch.randn(4, 8)
    with pytest.warns(UserWarning, match=r"no gradient reached the tracker during a microbatch"):
        with tracker.microbatch(size=4):
            pass  # forgot the backward here ...
    model(x).sum().backward()  # ... and ran it outside
    with tracker.microbatch(size=4):
        model(x).sum().backward()
    with pytest.warns(UserWarning, match=r"gradients arrived outside `with tracker.microbatch"):
        tracker.step()


# ---------------------------------------------------------------------------- 4. no loss-contributing tokens
def test_a_step_without_loss_contributing_tokens_is_skipped_not_fatal():
    torch.manual_seed(0)
    emb, head = nn.Embedding(8, 4), nn.Linear(4, 8)
    model = nn.Sequential(emb, head)
    controller = BatchSizeController(warmup_steps=1, patience=1, window=1, cooldown_tokens=0)
    tracker = CBSTracker(model, accumulation_steps=2, controller=controller)
    x = torch.randint(0, 8, (2, 5))
    labels = torch.full((2, 5), -100)
    for _ in range(2):
        with tracker.microbatch(labels=labels):
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), labels.flatten(), reduction="sum")
            loss.backward()
    record = tracker.step()  # raised ValueError in update(global_batch=0.0) before
    assert record.global_batch == 0 and record.critical_batch is None
    assert controller.state_dict() == BatchSizeController(warmup_steps=1, patience=1, window=1,
                                                          cooldown_tokens=0).state_dict()


def test_an_all_ignored_microbatch_is_left_out_of_the_step_consistently():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    tracker = CBSTracker(model, accumulation_steps=3, unit="tokens")
    batches = []
    for j in range(3):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(j))
        y = torch.randint(0, 3, (6,), generator=torch.Generator().manual_seed(10 + j))
        if j == 1:
            y = torch.full_like(y, -100)
        batches.append((x, y))
    for x, y in batches:
        with tracker.microbatch(labels=y):
            n = (y != -100).sum().clamp_min(1)
            (nn.functional.cross_entropy(model(x), y, ignore_index=-100, reduction="sum") / n / 3).backward()
    tracker.step()
    grads = []
    for x, y in batches:
        if (y != -100).any():
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y, ignore_index=-100).backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]).double())
    stacked = torch.stack(grads)
    # K = 2 and the mean over those 2 (the step's gradient was divided by the 3 it ran)
    assert tracker.last_stats.num_microbatches == 2
    assert tracker.last_stats.small_sq_norm == pytest.approx(float(stacked.pow(2).sum(1).mean()), rel=1e-6)
    assert tracker.last_stats.big_sq_norm == pytest.approx(float((stacked.sum(0) / 3).pow(2).sum() * (3 / 2) ** 2),
                                                           rel=1e-6)


# ---------------------------------------------------------------------------- 5-7. Lightning
@pytest.mark.parametrize("batches", [6, 13])
@LIGHTNING_FILTERS[0]
@LIGHTNING_FILTERS[2]
def test_lightning_growth_is_capped_at_what_an_epoch_holds(batches):
    lrs = []

    class LR(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            lrs.append((trainer.accumulate_grad_batches, optimizer.param_groups[0]["lr"]))

    controller = BatchSizeController(warmup_steps=1, warmup_tokens=0, patience=1, window=1, cooldown_tokens=0,
                                     kappa=1e6, feedback_guard=False, hold_on_plateau=None)
    cbs = CBSCallback(controller=controller, estimator=NoiseScaleEstimator(horizon_steps=3, min_steps=2),
                      lr_coupling="linear")
    trainer = _trainer(max_epochs=6, accumulate_grad_batches=2, limit_train_batches=batches, callbacks=[cbs, LR()])
    cap = {6: 4, 13: 8}[batches]  # the largest 2 * 2**e an epoch of that many batches holds
    with pytest.warns(UserWarning, match=rf"growth is capped at accumulation {cap}: an epoch holds {batches} batches"):
        trainer.fit(Regression(lr=0.05), _loader(regression_data(64)))
    assert max(a for a, _ in lrs) == cap
    assert cbs.pending_accumulation_steps is None  # never stuck waiting
    # the LR carries the factor of the accumulation actually in use, never of one not applied
    for a, lr in lrs:
        assert lr == pytest.approx(0.05 * a / 2)


@LIGHTNING_FILTERS[0]
@LIGHTNING_FILTERS[2]
def test_lightning_starting_accumulation_comes_from_the_trainer_not_from_what_ran():
    class SkipFirst(Regression):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 0 and batch_idx == 0:
                return None  # Lightning skips this batch's backward
            return super().training_step(batch, batch_idx)

    lrs = []

    class LR(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            lrs.append(optimizer.param_groups[0]["lr"])

    controller = PlanController({})
    cbs = CBSCallback(controller=controller, lr_coupling="sqrt")
    _trainer(max_steps=6, accumulate_grad_batches=2, callbacks=[cbs, LR()]).fit(
        SkipFirst(lr=0.05), _loader(regression_data(64)))
    assert {c["accumulation_steps"] for c in controller.calls} == {2}
    assert lrs == pytest.approx([0.05] * len(lrs))  # no phantom 1 -> 2 change scaled it


@LIGHTNING_FILTERS[0]
@LIGHTNING_FILTERS[2]
def test_lightning_max_steps_under_growth_means_the_constant_runs_data():
    def run(controller):
        rec_units = []

        class Units(pl.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                rec_units.append(len(batch[0]))

        cbs = CBSCallback(controller=controller)
        trainer = _trainer(max_steps=12, accumulate_grad_batches=2, callbacks=[cbs, Units()])
        trainer.fit(Regression(lr=0.05), _loader(regression_data(256)))
        return sum(rec_units), trainer.global_step

    const_units, const_steps = run(None)
    with pytest.warns(UserWarning, match=r"Trainer\(max_steps=12\) counts optimizer steps.*stops the run once the data"):
        grown_units, grown_steps = run(PlanController({2: 4, 4: 8}))
    # the constant run's data, to within the last window (8 batches of 2 samples)
    assert const_units == 12 * 2 * 2 and const_units <= grown_units < const_units + 8 * 2
    assert grown_steps < const_steps


# ---------------------------------------------------------------------------- 9. size=
def test_microbatch_size_accepts_real_numbers_and_refuses_wrong_things():
    model = nn.Linear(2, 1)
    tracker = CBSTracker(model, accumulation_steps=2, unit="samples")
    for bad, exc, match in [
        (torch.ones(16), TypeError, r"size=<tensor of shape \(16,\)>\): expected a number or a one-element tensor"),
        (True, TypeError, r"a bool is not a size"),
        (-1.0, ValueError, r"must be a finite number >= 0"),
        (float("nan"), ValueError, r"must be a finite number >= 0"),
        ("16", TypeError, r"expected a real number or a one-element tensor"),
    ]:
        with pytest.raises(exc, match=match):
            with tracker.microbatch(size=bad):
                pass
    for good in (np.int64(3), np.float32(3.0), torch.tensor([3]), torch.tensor(3.0)):
        with tracker.microbatch(size=good):
            model(torch.ones(1, 2)).sum().backward()
    # a negative or NaN device tensor is checked when the step reduces (no host sync before)
    tracker.step()
    for bad in (torch.tensor(-2.0), torch.tensor(float("nan"))):
        for _ in range(2):
            with tracker.microbatch(size=bad):
                model(torch.ones(1, 2)).sum().backward()
        with pytest.raises(ValueError, match=r"microbatch size\(s\) of this step were negative or not finite"):
            tracker.step()


# ---------------------------------------------------------------------------- 10. state values
def _tracker_with_state():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = CBSTracker(model, opt, accumulation_steps=2, unit="samples",
                         controller=BatchSizeController(warmup_steps=1), estimator=NoiseScaleEstimator())
    for _ in range(3):
        for _ in range(2):
            with tracker.microbatch(size=1):
                model(torch.randn(1, 2)).sum().backward()
        tracker.step()
        model.zero_grad()
    return tracker


@pytest.mark.parametrize(("patch", "exc", "match"), [
    ({"accumulation_steps": 0}, ValueError, r"state\['accumulation_steps'\]=0: expected an int >= 1"),
    ({"accumulation_steps": -4}, ValueError, r"state\['accumulation_steps'\]=-4: expected an int >= 1"),
    ({"tokens_seen": float("nan")}, ValueError, r"state\['tokens_seen'\]=nan: expected a finite number >= 0"),
    ({"lr_coupling": -1.0}, ValueError, r"state\['lr_coupling'\]=-1.0: expected a finite number > 0"),
    ({"version": "1"}, ValueError, r"state version '1' is not a version"),
    ({"version": 99}, ValueError, r"state version 99 is newer than 2"),
    ({"step": 2.5}, TypeError, r"state\['step'\]=2.5: expected an int >= 0"),
    ({"cadence": {"measure_every": 1, "every_now": 0, "since_measured": 0}}, ValueError,
     r"its 'cadence'\): state\['every_now'\]=0: expected an int >= 1"),
    ({"cadence": {"measure_every": 1, "every_now": 1, "since_measured": "x"}}, TypeError,
     r"its 'cadence'\): state\['since_measured'\]='x': expected an int >= 0"),
    ({"critical_batch": -1.0}, ValueError, r"state\['critical_batch'\]=-1.0: expected a finite number >= 0"),
    ({"critical_batch": "big"}, TypeError, r"state\['critical_batch'\]='big': expected a finite number >= 0"),
    ({"estimator": {"version": 1}}, (KeyError, TypeError, ValueError), None),
    ({"controller": {"version": 1, "exponent": "x"}}, (KeyError, TypeError, ValueError), None),
])
def test_a_corrupted_state_raises_and_leaves_the_tracker_unchanged(patch, exc, match):
    tracker = _tracker_with_state()
    before = copy.deepcopy(tracker.state_dict())
    other = _tracker_with_state()
    for _ in range(2):
        with other.microbatch(size=1):
            other.model(torch.randn(1, 2)).sum().backward()
    other.step()
    state = {**other.state_dict(), **patch}
    with pytest.raises(exc, match=match):
        tracker.load_state_dict(state)
    assert tracker.state_dict() == before


def test_a_missing_key_is_named():
    tracker = _tracker_with_state()
    state = tracker.state_dict()
    del state["estimator"]
    with pytest.raises(KeyError, match=r"missing keys \['estimator'\]"):
        _tracker_with_state().load_state_dict(state)


def test_a_controller_class_or_a_string_scheduler_is_refused_at_construction():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"CBSTracker\(controller=BatchSizeController\): pass an instance"):
        CBSTracker(model, opt, controller=BatchSizeController)
    with pytest.raises(TypeError, match=r"CBSCallback\(controller=BatchSizeController\): pass an instance"):
        CBSCallback(controller=BatchSizeController)
    with pytest.raises(TypeError, match=r"lr_scheduler='cosine'"):
        CBSTracker(model, opt, lr_scheduler="cosine")


def test_state_saved_by_one_adapter_is_refused_by_another_on_unit_or_dp_degree():
    tracker = CBSTracker(nn.Linear(2, 1), accumulation_steps=2, unit="samples")
    state = tracker.state_dict()
    with pytest.raises(ValueError, match=r"the checkpoint counts samples but this callback counts tokens"):
        CBSCallback(unit="tokens", batch_size_fn=lambda b: 1).load_state_dict(state)
    lightning_state = CBSCallback(unit="tokens", batch_size_fn=lambda b: 1).state_dict()
    with pytest.raises(ValueError, match=r"the checkpoint counts 'tokens' but this run counts 'samples'"):
        CBSTracker(nn.Linear(2, 1), unit="samples").load_state_dict(lightning_state)
    # another degree converts (the global batch kept); a controller that cannot convert is refused
    moved = CBSTracker(nn.Linear(2, 1), unit="tokens")
    moved.load_state_dict({**lightning_state, "dp_degree": 4})
    assert moved.accumulation_steps == 4 * lightning_state["accumulation_steps"]
    # the same unit and degree: one adapter's state loads in the other
    CBSTracker(nn.Linear(2, 1), unit="tokens").load_state_dict(lightning_state)


# ---------------------------------------------------------------------------- 11. small ones
def test_a_model_without_trainable_parameters_is_refused():
    model = nn.Linear(2, 1).requires_grad_(False)
    with pytest.raises(ValueError, match=r"the model has no parameter with requires_grad=True"):
        CBSTracker(model)


@pytest.mark.parametrize(("argv", "match"), [
    (["plan", "--budget", "1e6", "--b-min", "8", "--b-max", "64", "--floor-ratio", "1.5"],
     r"--floor-ratio: '1.5': must be a ratio strictly between 0 and 1"),
    (["demo", "--accumulation", "0"], r"--accumulation: '0': must be an integer >= 1"),
])
def test_cli_refuses_out_of_range_options_with_an_argparse_error(argv, match):
    out = subprocess.run([sys.executable, "-m", "cbs_tracker.cli", *argv], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert re.search(match, out.stderr)


# ---------------------------------------------------------------------------- one engine, two adapters
@LIGHTNING_FILTERS[0]
@LIGHTNING_FILTERS[2]
def test_plain_loop_and_lightning_give_the_same_records_step_for_step():
    ds = regression_data(96)
    plan = {2: 4, 3: 8}  # decided where Lightning's counters allow the change at once, as the loop does

    cbs = CBSCallback(controller=PlanController(plan), estimator=NoiseScaleEstimator(horizon_steps=5, min_steps=3),
                      lr_coupling="keep")
    rec = Recorder(cbs)
    _trainer(max_epochs=1, accumulate_grad_batches=2, callbacks=[cbs, rec]).fit(Regression(lr=0.05), _loader(ds))

    module = Regression(lr=0.05)
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    tracker = CBSTracker(module, opt, accumulation_steps=2, unit="samples", controller=PlanController(plan),
                         estimator=NoiseScaleEstimator(horizon_steps=5, min_steps=3), lr_coupling="keep")
    loader = iter(_loader(ds))
    plain = []
    done = False
    while not done:
        acc = tracker.accumulation_steps
        batches = []
        for _ in range(acc):
            try:
                batches.append(next(loader))
            except StopIteration:
                done = True
                break
        if not batches:
            break
        for b in batches:
            with tracker.microbatch(size=len(b[0])):
                (module.training_step(b, 0) / acc).backward()
        plain.append(tracker.step())
        opt.step()
        opt.zero_grad(set_to_none=True)
    lightning = [r["record"] for r in rec.rows]
    assert len(plain) == len(lightning) >= 6
    assert any(p.noise_scale is not None for p in plain)  # the estimates compared below exist
    for p, q in zip(plain, lightning):
        for key in ("step", "tokens_seen", "global_batch", "accumulation_steps", "next_accumulation_steps",
                    "dropped", "lr"):
            assert getattr(p, key) == q[key], (p.step, key)
        for key in ("grad_sq_norm", "trace_cov", "noise_scale", "step_grad_sq_norm", "step_trace_cov"):
            a, b = getattr(p, key), q[key]
            assert (a is None) == (b is None), (p.step, key)
            if a is not None:
                assert a == pytest.approx(b, rel=1e-5, abs=1e-12), (p.step, key)



def test_growing_the_microbatch_is_refused_where_it_cannot_be_exact_with_the_reason():
    from cbs_tracker.integrations.transformers import CBSTrainer

    with pytest.raises(ValueError, match=r"CBSTrainer\(max_microbatch='auto'\): growing the microbatch is not "
                                         r"supported by the Hugging Face Trainer.*prefetched"):
        CBSTrainer(max_microbatch="auto")
    with pytest.raises(ValueError, match=r"CBSCallback\(max_microbatch='auto'\): must be None or an integer >= 1"):
        CBSCallback(max_microbatch="auto")


@pytest.mark.parametrize(
    ("optimizer", "kwargs", "warns"),
    [("adamw", {"cap_lr_at_peak": False}, True), ("sgd", {"cap_lr_at_peak": False}, True),
     ("adamw", {}, False), ("sgd", {}, False),  # the default caps with a budget
     ("adamw", {"cap_lr_at_peak": True}, False), ("adamw", {"lr_coupling": "keep"}, False)],
)
def test_a_budget_whose_plan_would_raise_the_lr_with_the_batch_is_warned(optimizer, kwargs, warns):
    # The budget's plan grows the batch whatever the noise scale says; with a coupling that raises
    # the LR at each doubling, a small GPT at a constant LR reached 16x its peak LR and diverged.
    model = nn.Linear(4, 1)
    opt = (torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD)(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        CBSTracker(model, opt, accumulation_steps=2, controller=BatchSizeController(budget_tokens=1e6), **kwargs)
        CBSTracker(model, opt, accumulation_steps=2, controller=BatchSizeController(), **kwargs)  # no budget
    budget = [w for w in seen if "budget_tokens" in str(w.message)]
    assert len(budget) == (1 if warns else 0), [str(w.message) for w in seen]
    if warns:
        assert "cap_lr_at_peak=False" in str(budget[0].message) and "lr_coupling='keep'" in str(budget[0].message)


def test_a_cap_lr_at_peak_that_is_not_a_flag_is_refused_naming_it():
    model = nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(TypeError, match=r"CBSTracker\(cap_lr_at_peak='yes'\): expected True, False or None"):
        CBSTracker(model, opt, accumulation_steps=2, cap_lr_at_peak="yes")
    from cbs_tracker.integrations.transformers import CBSTrainer

    with pytest.raises(TypeError, match=r"CBSTrainer\(cap_lr_at_peak='yes'\): expected True, False or None"):
        CBSTrainer(cap_lr_at_peak="yes")


def test_a_pipeline_stage_or_schedule_is_refused_with_the_reason(tmp_path):
    """torch.distributed.pipelining runs its own microbatches inside schedule.step(): refused, naming why (before,
    a stage or schedule got the generic "expected a torch.nn.Module")."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()) or dist.is_initialized():
        pytest.skip("needs gloo and no process group in this process")
    from cbs_tracker.integrations.fsdp import FSDPTracker
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        module = nn.Linear(3, 1)
        stage = PipelineStage(module, 0, 1, torch.device("cpu"))
        schedule = ScheduleGPipe(stage, 2, loss_fn=lambda out, target: (out - target).pow(2).mean())
        for cls in (CBSTracker, FSDPTracker):
            for model in (stage, schedule):
                with pytest.raises(TypeError, match=rf"{cls.__name__}\(model={type(model).__name__}\): pipeline "
                                                    "parallelism is not supported.*inside one step\\(\\) call"):
                    cls(model, torch.optim.SGD(module.parameters(), lr=0.1), accumulation_steps=2)
    finally:
        dist.destroy_process_group()


def _adapter(name: str):
    if name == "CBSCallback":
        return CBSCallback
    if name == "CBSTrainer":
        return pytest.importorskip("integrations.transformers").CBSTrainer
    return pytest.importorskip("integrations.olmo_core").CBSOlmoCallback


@pytest.mark.parametrize("adapter", ["CBSCallback", "CBSTrainer", "CBSOlmoCallback"])
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"controller": "always"}, ValueError, r"\(controller='always'\): expected 'auto', None, a BatchSizeController"),
        ({"controller": BatchSizeController}, TypeError, r"\(controller=BatchSizeController\): pass an instance"),
        ({"controller": object()}, TypeError, r"\(controller=object\): expected 'auto', None, a BatchSizeController"),
        ({"controller": BatchSizeController(), "observe_only": True}, ValueError,
         r"\(controller=<BatchSizeController>, observe_only=True\): pass BatchSizeController\(observe_only=True\)"),
        ({"observe_only": "yes"}, TypeError, r"\(observe_only='yes'\): expected True or False"),
    ],
)
def test_every_adapter_checks_its_controller_the_same_way(adapter, kwargs, error, match):
    """The three adapters that take ``controller="auto"`` refuse the same mistakes with the same words
    (a class for an instance, an object that is no controller, ``observe_only`` that would be ignored),
    each message naming the adapter."""
    cls = _adapter(adapter)
    with pytest.raises(error, match=rf"^{adapter}{match}"):
        cls(**kwargs)


def test_auto_builds_an_observing_controller_when_asked():
    from cbs_tracker.policy.controller import adapter_controller

    built = adapter_controller("X", "auto", True)
    assert isinstance(built, BatchSizeController) and built.observe_only
    assert adapter_controller("X", None, True) is None
    mine = BatchSizeController(kappa=0.4)
    assert adapter_controller("X", mine, False) is mine
