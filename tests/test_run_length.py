"""The run's length reaches the controller's efficiency budget from every adapter, in units, exactly.

``BatchSizeController(efficiency_budget=...)`` needs ``total_tokens``, the run's length in units of all
ranks. Each adapter already knows the length in its own unit and gives it through
``BatchSizeController.set_run_length``. The truth is the units the constant-batch run of the same length
trains on, counted in that run; the grown run must then end on those units within one window.
"""

from __future__ import annotations

import json

import pytest

from cbs_tracker import BatchSizeController
from tests import plain_workers as pw
from tests.spawning import spawn

START = 2 * pw.MICRO  # the plain loop's starting global batch on one rank: 2 microbatches of 4 samples


def _ends_within_one_window(grown: dict, truth: float, world: int = 1) -> None:
    assert max(grown["accumulations"]) > grown["accumulations"][0]  # it grew
    last_window = grown["accumulations"][-1] * pw.MICRO * world
    assert truth <= grown["units"] < truth + last_window


# ---------------------------------------------------------------------------- plain loop (CBSTracker)
@pytest.mark.parametrize("budget", [{"steps": 300}, {"microbatches": 600}, {"tokens": 2400}])
def test_plain_loop_done_gives_the_constant_runs_units_to_the_efficiency_budget(budget):
    constant = pw.run_to_budget(None, budget)
    truth = constant["units"]
    assert truth == 300 * START  # the constant run: 300 steps of 8 samples
    controller = BatchSizeController(efficiency_budget=0.08)
    grown = pw.run_to_budget(controller, budget)
    assert controller.total_tokens == truth
    _ends_within_one_window(grown, truth)


def test_plain_loop_on_two_gloo_ranks_counts_the_units_of_every_rank(tmp_path):
    budget = {"microbatches": 400}
    out = {}
    for grow in (False, True):
        (tmp_path / str(grow)).mkdir()
        spawn(pw.run_length_worker, args=(2, str(tmp_path / f"pg{grow}"), str(tmp_path / str(grow)), budget, grow),
              nprocs=2, join=True)
        out[grow] = json.loads((tmp_path / str(grow) / "out.json").read_text())
    truth = out[False]["units"]
    assert truth == 400 * pw.MICRO * 2  # 400 loader batches of 4 samples on each of two ranks
    assert out[True]["total_tokens"] == truth
    _ends_within_one_window(out[True], truth, world=2)


def test_plain_loop_resumed_halfway_with_a_fresh_controller_decides_as_the_uninterrupted_run():
    budget = {"steps": 300}
    whole_controller = BatchSizeController(efficiency_budget=0.08)
    whole = pw.run_to_budget(whole_controller, budget)
    saved = pw.run_to_budget(BatchSizeController(efficiency_budget=0.08), budget, save_at=150)
    resumed_controller = BatchSizeController(efficiency_budget=0.08)  # built as the user wrote it: no total_tokens
    rest = pw.run_to_budget(resumed_controller, budget, state=saved)
    assert resumed_controller.total_tokens == whole_controller.total_tokens == 300 * START
    assert saved["accumulations"] + rest["accumulations"] == whole["accumulations"]
    assert rest["units"] == whole["units"]


def test_a_controller_without_set_run_length_keeps_working_under_done():
    from cbs_tracker import BatchSchedule

    schedule = BatchSchedule(((0, START), (800, 2 * START)), microbatch=pw.MICRO)
    grown = pw.run_to_budget(schedule, {"steps": 300})
    assert sorted(set(grown["accumulations"])) == [2, 4] and grown["units"] == 300 * START


# ---------------------------------------------------------------------------- Accelerate and Fabric loops
def _short_run_controller() -> BatchSizeController:
    # the efficiency budget on a run of a hundred steps: a short warm-up and window so that it can grow
    # (no hold on a loss plateau: the regression's loss levels off early, which the hold reads as a plateau)
    return BatchSizeController(efficiency_budget=0.08, warmup_steps=10, warmup_tokens=0, patience=4, window=8,
                               hold_on_plateau=None)


def test_accelerate_run_clm_done_max_train_steps_gives_the_constant_runs_tokens():
    """run_clm_no_trainer's loop with the README's ``tracker.done(max_train_steps)``: the tokens are the labels
    counted, known after the first step; the controller has them before that step's decision."""
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    from tests import accelerate_workers as aw
    from tests import test_client_loops as cl

    try:
        truth = cl._constant(400, 80)[-1][0]  # tokens seen by the constant run's last step
        assert truth == 80 * cl.A0 * cl.MICRO
        controller = _short_run_controller()
        p = cl._clm_parts(400, 80, controller=controller)
        rows = cl._run_clm(p, stop="tracker", num_train_epochs=1)
    finally:
        aw.reset_accelerate()
    assert controller.total_tokens == truth
    accumulations = [a for _, a, _ in rows]
    assert max(accumulations) > cl.A0
    assert truth <= rows[-1][0] < truth + accumulations[-1] * cl.MICRO


def test_fabric_litgpt_done_microbatches_gives_the_constant_runs_tokens():
    """LitGPT's loop on Fabric with the README's ``tracker.done(microbatches=max_iters)``."""
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    from cbs_tracker import CBSTracker
    from tests import test_client_loops as cl

    def litgpt(controller: BatchSizeController | None, max_iters: int) -> tuple[CBSTracker, list[int]]:
        fabric, model, optimizer, batches = cl._fabric_parts()
        tracker = CBSTracker(model, optimizer, accumulation_steps=cl.A0, controller=controller)
        accumulations = []
        while not tracker.done(microbatches=max_iters):
            for _ in range(tracker.accumulation_steps):
                tracker.set_lr(cl.get_lr(cl.LR, tracker.microbatches_seen, cl.WARMUP_ITERS, max_iters, 0.1 * cl.LR))
                batch = next(batches)
                with tracker.microbatch(labels=batch["labels"][..., 1:]):
                    fabric.backward(model(**batch).loss / tracker.accumulation_steps)
            accumulations.append(tracker.step().accumulation_steps)
            optimizer.step()
            optimizer.zero_grad()
        return tracker, accumulations

    constant, _ = litgpt(None, 180)
    truth = constant.tokens_seen
    assert truth == 180 * cl.MICRO
    controller = _short_run_controller()
    grown, accumulations = litgpt(controller, 180)
    assert controller.total_tokens == truth
    assert max(accumulations) > cl.A0
    assert truth <= grown.tokens_seen < truth + accumulations[-1] * cl.MICRO


# ---------------------------------------------------------------------------- Lightning
def _lightning_run(controller: BatchSizeController | None, trainer_kwargs: dict) -> tuple[object, list[int]]:
    import lightning.pytorch as pl
    import torch
    from cbs_tracker.integrations.lightning import CBSCallback

    from tests.lightning_workers import Recorder, Regression, regression_data

    cbs = CBSCallback(controller=controller)
    recorder = Recorder(cbs)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2,
                         callbacks=[cbs, recorder], **trainer_kwargs)
    # sigma=2: a noise scale well above the starting batch of 8 samples, so that the budget grows it
    trainer.fit(Regression(), torch.utils.data.DataLoader(regression_data(600, sigma=2.0), batch_size=4))
    return cbs, [row["record"]["accumulation_steps"] for row in recorder.rows]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(("trainer_kwargs", "samples"), [
    ({"max_steps": 150}, 150 * 8),  # 150 steps of 2 batches of 4 samples, within the first epoch
    ({"max_epochs": 2}, 2 * 600),
    ({"max_steps": 100, "max_epochs": 3}, 100 * 8),
    # 75 batches an epoch: 38 steps, the last of one batch; 150 steps are 3 epochs and 36 steps
    ({"max_steps": 150, "limit_train_batches": 75}, (3 * 75 + 36 * 2) * 4),
])
def test_lightning_gives_the_trainers_length_to_the_efficiency_budget(trainer_kwargs, samples):
    pytest.importorskip("lightning")
    constant, _ = _lightning_run(None, trainer_kwargs)
    truth = constant.session.units_seen
    assert truth == samples
    controller = _short_run_controller()
    grown, accumulations = _lightning_run(controller, trainer_kwargs)
    assert controller.total_tokens == truth
    assert max(accumulations) > 2
    assert truth <= grown.session.units_seen < truth + accumulations[-1] * 4


# ---------------------------------------------------------------------------- Hugging Face Trainer
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize(("rows", "args", "samples"), [
    (600, {"max_steps": 150}, 150 * 4),  # 150 steps of 2 microbatches of 2 samples
    # 301 microbatches an epoch: 151 steps, the last of one microbatch
    (602, {"num_train_epochs": 2}, 2 * 602),
    (602, {"max_steps": 200}, (301 + 49 * 2) * 2),
])
def test_hf_trainer_gives_max_steps_at_the_starting_accumulation_to_the_efficiency_budget(tmp_path, rows, args,
                                                                                          samples):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from cbs_tracker.integrations.transformers import CBSTrainer

    from tests.hf_workers import Regression, regression_data, training_args

    def run(controller: BatchSizeController | None) -> CBSTrainer:
        trainer = CBSTrainer(model=Regression(), args=training_args(str(tmp_path), **args), unit="samples",
                             train_dataset=regression_data(rows, sigma=2.0), controller=controller)
        trainer.train()
        return trainer

    truth = run(None).session.units_seen
    assert truth == samples
    controller = _short_run_controller()
    grown = run(controller)
    assert controller.total_tokens == truth
    assert grown.applied_changes  # it grew
    assert truth <= grown.session.units_seen < truth + grown.session.last_record.global_batch


# ---------------------------------------------------------------------------- OLMo-core
def test_olmo_core_gives_max_duration_in_tokens_to_the_efficiency_budget(tmp_path):
    """``max_duration=Duration.tokens(T)``: OLMo-core stops on the first step that reaches ``T`` tokens, so
    the constant run trains ``ceil(T / global_batch_size)`` steps; the callback's units are the tokens the loss
    counts (15 of each 16-token sequence), so the length is those steps times the starting step's units."""
    pytest.importorskip("olmo_core")
    from cbs_tracker.integrations.olmo_core import CBSOlmoCallback

    from tests import olmo_workers as ow

    tokens = 2 * ow.SEQ * 300 + 10  # 300 steps of 2 sequences and 10 tokens: the constant run takes 301 steps

    def run(controller: BatchSizeController | None, name: str) -> CBSOlmoCallback:
        cbs = CBSOlmoCallback(controller=controller)
        trainer = ow.build_trainer(str(tmp_path), callbacks={"cbs": cbs}, sequences=2, tokens=tokens,
                                   save_folder=str(tmp_path / name), scheduler=None)
        trainer.fit()
        return cbs

    truth = run(None, "constant").session.units_seen
    assert truth == 301 * 2 * ow.LOSS_TOKENS
    controller = _short_run_controller()
    grown = run(controller, "grown")
    assert controller.total_tokens == truth
    assert grown.applied_changes  # it grew
    assert truth <= grown.session.units_seen < truth + grown.session.last_record.global_batch
