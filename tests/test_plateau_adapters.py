"""``hold_on_plateau`` in Lightning and the Hugging Face Trainer: the adapters give the controller each step's
mean microbatch loss, undoing the framework's division by the accumulation; checked against the losses the
model itself computed, microbatch by microbatch."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from cbs_tracker import BatchSizeController, CBSCallback
from tests import hf_workers, lightning_workers

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
    pytest.mark.filterwarnings("ignore:.*litlogger.*"),
    pytest.mark.filterwarnings("ignore:.*isinstance.*treespec.*"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def held_controller() -> BatchSizeController:
    """Collects every step's loss for the whole run (its verdict lies past the run's end)."""
    return BatchSizeController(total_tokens=1e9, hold_on_plateau=0.15)


def check_points(ctrl: BatchSizeController, microbatch_losses: list[float], accumulation: int) -> None:
    """The controller's points are the windows' means of the model's own losses (the second half of them)."""
    means = [sum(microbatch_losses[i:i + accumulation]) / accumulation
             for i in range(0, len(microbatch_losses), accumulation)]
    slope = ctrl.plateau.slope
    assert slope.seen == len(means)
    got = [y for _, y in slope.points]
    assert len(got) >= 8
    assert got == pytest.approx(means[-len(got):], rel=1e-6)
    tokens = [t for t, _ in slope.points]
    assert all(b > a for a, b in zip(tokens, tokens[1:]))


class LossLog(lightning_workers.Regression):
    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss))
        return loss


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_lightning_gives_each_steps_mean_microbatch_loss(precision):
    """Under fp16 with a GradScaler Lightning's ``on_before_backward`` sees the loss times the scale (2**11
    here): the callback divides it out."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    module = LossLog()
    ctrl = held_controller()
    kwargs = {"precision": precision} if precision == "32-true" else {
        "plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**11))]}
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, max_epochs=1,
                         accumulate_grad_batches=2, callbacks=[CBSCallback(controller=ctrl)], **kwargs)
    data = torch.utils.data.DataLoader(lightning_workers.regression_data(96), batch_size=2, shuffle=False)
    trainer.fit(module, data)
    check_points(ctrl, module.losses, 2)


class ItemsRegression(hf_workers.Regression):
    """The Trainer's regression with a loss summed over the window's samples and divided by their number
    (``num_items_in_batch``), as causal LMs do; each microbatch's own mean is kept in ``losses``."""

    def __init__(self, by_items: bool) -> None:
        super().__init__(seed=0)
        self.by_items = self.accepts_loss_kwargs = by_items
        self.losses: list[float] = []

    def forward(self, x, labels, num_items_in_batch=None, **kwargs):
        per_sample = 0.5 * (self.net(x).squeeze(-1) - labels).pow(2)
        if self.training:
            self.losses.append(float(per_sample.mean()))
        if self.by_items and num_items_in_batch is not None:
            return {"loss": per_sample.sum() / num_items_in_batch}
        return {"loss": per_sample.mean()}


@pytest.mark.parametrize("by_items", [False, True], ids=["mean-loss", "loss-over-the-windows-items"])
def test_the_hugging_face_trainer_gives_each_steps_mean_microbatch_loss(tmp_path, by_items):
    """95 samples in microbatches of 2: the last window's second has one sample, so that a loss over the
    window's items is not its microbatch's mean times the window's length."""
    from cbs_tracker.integrations.transformers import CBSTrainer

    model = ItemsRegression(by_items)
    ctrl = held_controller()
    trainer = CBSTrainer(model=model, args=hf_workers.training_args(str(tmp_path)),
                         train_dataset=hf_workers.regression_data(95), unit="samples", controller=ctrl)
    trainer.train()
    assert trainer.model_accepts_loss_kwargs == by_items
    check_points(ctrl, model.losses, 2)


def test_olmo_core_gives_each_steps_mean_cross_entropy(tmp_path):
    """OLMo-core's ``olmo2_1M`` (four one-sequence microbatches a step, loss summed and divided by the batch's
    tokens): the controller's points are each step's mean over its microbatches of their mean cross-entropy,
    recomputed in float64 from the weights the step started from."""
    pytest.importorskip("olmo_core", reason="needs ai2-olmo-core (the [olmo] extra)")
    from olmo_core.data.utils import get_labels
    from olmo_core.nn.transformer import TransformerConfig

    from cbs_tracker import CBSOlmoCallback
    from tests import olmo_workers

    ctrl = held_controller()
    rec = olmo_workers.recorder()
    trainer = olmo_workers.build_trainer(str(tmp_path), callbacks={"cbs": CBSOlmoCallback(controller=ctrl), "rec": rec},
                                         steps=16)
    trainer.fit()
    slope = ctrl.plateau.slope
    assert slope.seen == len(rec.steps) == 16
    assert ctrl.model_parameters == TransformerConfig.olmo2_1M(vocab_size=256).num_params  # from its config
    model = TransformerConfig.olmo2_1M(vocab_size=256).build(init_device="cpu").double()
    truth = []
    for step in rec.steps[-len(slope.points):]:
        model.load_state_dict(step["weights"])
        ids = step["input_ids"]
        with torch.no_grad():
            means = [float(model(ids[i:i + 1], labels=get_labels({"input_ids": ids[i:i + 1]}),
                                 loss_reduction="mean").ce_loss) for i in range(ids.shape[0])]
        truth.append(sum(means) / len(means))
    assert len(truth) >= 8
    assert [y for _, y in slope.points] == pytest.approx(truth, rel=1e-4)


def test_an_accelerate_loop_gives_each_steps_mean_microbatch_loss_with_the_guides_line():
    """Accelerate's loop as the guide writes it (``tracker.accumulate``, ``accelerator.backward(loss)``), with
    ``tracker.observe_loss(loss)`` after each backward: the points are the windows' means of the losses
    the loop computed (``accelerator.backward`` divides the gradient, not the loss it was given)."""
    from cbs_tracker.integrations.accelerate import AcceleratorTracker

    from tests import accelerate_workers as aw
    from tests import dist_workers as dw

    acc = aw.make_accelerator(1, gradient_accumulation_steps=2)
    net = dw.make_model(torch.float64)
    model, optimizer = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.05))
    ctrl = held_controller()
    tracker = AcceleratorTracker(acc, model, optimizer, controller=ctrl, unit="samples")
    losses = []
    while not tracker.done(steps=40):
        for _ in range(tracker.accumulation_steps):
            x, y = aw.data(tracker.microbatches_seen, 0)
            with tracker.accumulate(size=len(y)):
                loss = aw.loss_of(model(x), y)
                acc.backward(loss)
                tracker.observe_loss(loss)
                losses.append(float(loss))
                if acc.sync_gradients:
                    tracker.step()
                optimizer.step()
                optimizer.zero_grad()
    check_points(ctrl, losses, 2)


def test_a_shared_weight_counts_once():
    """A language model whose output layer shares the embedding's weight (as GPT-2's does): 11 x 5 + 5 x 5 + 5
    parameters, the shared 11 x 5 once."""
    from cbs_tracker import CBSTracker

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.mix = torch.nn.Embedding(11, 5), torch.nn.Linear(5, 5)
            self.head = torch.nn.Linear(5, 11, bias=False)
            self.head.weight = self.emb.weight

    model, ctrl = Tied(), held_controller()
    CBSTracker(model, torch.optim.SGD(model.parameters(), lr=0.1), controller=ctrl, unit="tokens").remove_hooks()
    assert ctrl.model_parameters == 11 * 5 + 5 * 5 + 5


@pytest.mark.parametrize("unit", ["tokens", "samples"])
@pytest.mark.parametrize("adapter", ["lightning", "hf-trainer", "accelerate"])
def test_each_adapter_gives_the_models_parameter_count_and_its_unit(tmp_path, adapter, unit):
    """``plateau_tokens_per_parameter`` reads the model's size, which each adapter counts on the model it tracks
    (checked against the layers' shapes: ``Linear(8, 1)``, 9 parameters; the distributed workers' two layers,
    6 x 8 + 8 + 8 + 1), and the run's unit: in samples there are no tokens per parameter to read."""
    ctrl = held_controller()
    if adapter == "lightning":
        trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, max_steps=2,
                             accumulate_grad_batches=2, callbacks=[CBSCallback(controller=ctrl, unit=unit)])
        trainer.fit(lightning_workers.Regression(),
                    torch.utils.data.DataLoader(lightning_workers.regression_data(16), batch_size=2))
        whole = lightning_workers.D_IN + 1
    elif adapter == "hf-trainer":
        from cbs_tracker.integrations.transformers import CBSTrainer

        trainer = CBSTrainer(model=hf_workers.Regression(), args=hf_workers.training_args(str(tmp_path), max_steps=2),
                             train_dataset=hf_workers.regression_data(16), unit=unit, controller=ctrl)
        trainer.train()
        whole = hf_workers.D_IN + 1
    else:
        from cbs_tracker.integrations.accelerate import AcceleratorTracker

        from tests import accelerate_workers as aw
        from tests import dist_workers as dw

        acc = aw.make_accelerator(1, gradient_accumulation_steps=2)
        net = dw.make_model(torch.float64)
        model, optimizer = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.05))
        AcceleratorTracker(acc, model, optimizer, controller=ctrl, unit=unit)
        whole = dw.D_IN * dw.HIDDEN + dw.HIDDEN + dw.HIDDEN + 1
    assert ctrl.model_parameters == whole and ctrl.plateau.in_samples == (unit == "samples")


@pytest.mark.parametrize("unit", ["tokens", "samples"])
def test_the_trackers_unit_turns_the_default_hold_on_in_tokens_and_off_in_samples(unit):
    from cbs_tracker import CBSTracker

    model = torch.nn.Linear(8, 1)
    default = BatchSizeController()
    CBSTracker(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2, controller=default, unit=unit)
    assert default.plateau.active is (unit == "tokens") and default.model_parameters == 9
