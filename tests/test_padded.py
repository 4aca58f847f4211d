"""Padded microbatches under a token-normalised loss: the noise scale against its analytic value.

Each microbatch holds two rows of 1-64 valid tokens (the rest labelled -100), so the
microbatches' token counts differ by up to 60x. Under the Hugging Face ``Trainer``'s
normalisation (each microbatch's summed token loss over the window's tokens) a
microbatch's gradient reaches the hooks weighted by its share of the window; measured as
if every microbatch had the same weight, this setting reads about 1.5x the truth.
"""

from __future__ import annotations

import math
import socket
import types

import pytest
import torch

from cbs_tracker import NoiseScaleEstimator
from tests.padded_workers import (
    PaddedTokens,
    TokenRegression,
    ddp_worker,
    plain_run,
    setting,
    truth,
)
from tests.spawning import spawn

STEPS, ACCUMULATION, ROWS = 2500, 4, 2
#: steps of the Trainer and Lightning runs, compared step for step with the plain loop's first ones
SHORT = 300


def _flat() -> NoiseScaleEstimator:
    return NoiseScaleEstimator(horizon_steps=1e9, min_steps=10)  # a plain mean of the per-step estimates


def _data(steps: int, *, seed: int = 1, valid: tuple[int, int] = (1, 64)) -> PaddedTokens:
    w_star, _ = setting()
    return PaddedTokens(steps * ACCUMULATION * ROWS, length=64, valid=valid, w_star=w_star, sigma=0.5, seed=seed)


def _rel_se(records) -> float:
    """Relative standard error of the flat ratio of means, from the run's own per-step estimates."""
    gs = torch.tensor([r.step_grad_sq_norm for r in records], dtype=torch.float64)
    ts = torch.tensor([r.step_trace_cov for r in records], dtype=torch.float64)
    ratio = ts.mean() / gs.mean()
    return float(((ts - ratio * gs) / gs.mean()).std() / math.sqrt(len(records)) / ratio)


@pytest.fixture(scope="module")
def window_run():
    w_star, delta = setting()
    return plain_run(_data(STEPS), w_star + delta, normalization="window", accumulation=ACCUMULATION,
                     rows_per_micro=ROWS, steps=STEPS, estimator=_flat())


def test_plain_loop_with_window_normalised_loss_matches_the_analytic_noise_scale(window_run):
    _, delta = setting()
    # the 5% tolerance is at least 3.5 standard errors of this run's own per-step estimates
    assert 3.5 * _rel_se(window_run["records"]) < 0.05
    assert window_run["noise_scale"] == pytest.approx(truth(delta, 0.5), rel=0.05)
    # the tracker only reads: every window's gradient is the mean over the window's tokens
    assert window_run["worst_grad_error"] < 1e-5


def test_the_same_loss_measured_as_equal_weights_is_visibly_wrong():
    """The mistake this guards against (one window-level factor for every microbatch) reads far off."""
    w_star, delta = setting()
    run = plain_run(_data(400), w_star + delta, normalization="window", accumulation=ACCUMULATION,
                    rows_per_micro=ROWS, steps=400, estimator=_flat(), measured_as="mean")
    assert run["noise_scale"] > 1.25 * truth(delta, 0.5)


def test_equal_microbatches_give_the_same_numbers_in_every_normalisation():
    w_star, delta = setting()
    data = _data(60, valid=(64, 64))
    runs = {n: plain_run(data, w_star + delta, normalization=n, accumulation=ACCUMULATION, rows_per_micro=ROWS,
                         steps=60, estimator=_flat())["records"] for n in ("mean", "window")}
    assert runs["mean"][-1].noise_scale is not None
    for a, b in zip(runs["mean"], runs["window"], strict=True):
        for field in ("noise_scale", "step_grad_sq_norm", "step_trace_cov", "global_batch"):
            x, y = getattr(a, field), getattr(b, field)
            assert (x is None) == (y is None), field
            if x is not None:
                assert x == pytest.approx(y, rel=1e-9), field


def _same_records(got, want) -> None:
    assert len(got) == SHORT
    for a, b in zip(got, want[:SHORT]):
        assert (a.step, a.tokens_seen, a.global_batch) == (b.step, b.tokens_seen, b.global_batch)
        for field in ("noise_scale", "step_grad_sq_norm", "step_trace_cov"):
            x, y = getattr(a, field), getattr(b, field)
            assert (x is None) == (y is None), field
            if x is not None:
                assert x == pytest.approx(y, rel=1e-5, abs=1e-9), field


def test_hf_trainer_with_num_items_in_batch_gives_the_plain_loop_records(window_run):
    """``CBSTrainer`` follows the Trainer's ``num_items_in_batch`` on its own: the plain loop's numbers step
    for step, so over the plain loop's whole run it would read what the plain loop reads (within 5%)."""
    pytest.importorskip("transformers")
    from cbs_tracker.integrations.transformers import CBSTrainer
    from transformers import TrainerCallback

    from tests.hf_workers import training_args

    class Records(TrainerCallback):
        rows: list = []

        def on_step_end(self, args, state, control, **kwargs):
            self.rows.append(trainer.last_record)

    w_star, delta = setting()
    model = TokenRegression(w_star + delta)
    args = training_args("unused", per_device_train_batch_size=ROWS, gradient_accumulation_steps=ACCUMULATION,
                         learning_rate=0.0, save_strategy="no", max_steps=SHORT)
    rec = Records()
    trainer = CBSTrainer(model=model, args=args, train_dataset=_data(STEPS), unit="tokens", controller=None,
                         estimator=_flat(), callbacks=[rec])
    assert trainer.model_accepts_loss_kwargs  # the Trainer normalises by num_items_in_batch here
    trainer.train()
    _same_records(rec.rows, window_run["records"])


def test_lightning_with_window_normalised_loss_gives_the_plain_loop_records(window_run, tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from cbs_tracker import CBSCallback, label_tokens

    w_star, delta = setting()
    data = _data(STEPS)

    rows = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = TokenRegression(w_star + delta)

        def training_step(self, batch, batch_idx):
            # the window's tokens, known before its first backward (the rows are fixed in advance)
            start = (batch_idx // ACCUMULATION) * ACCUMULATION * ROWS
            window_tokens = (data.labels[start : start + ACCUMULATION * ROWS] != -100).sum()
            return self.model(batch["x"], batch["labels"], num_items_in_batch=window_tokens)["loss"]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if (batch_idx + 1) % ACCUMULATION == 0:
                rows.append(cbs.last_record)

    cbs = CBSCallback(controller=None, batch_size_fn=label_tokens("labels"), unit="tokens",
                      loss_normalization="window", estimator=_flat(), prog_bar=False)
    trainer = pl.Trainer(max_steps=SHORT, accumulate_grad_batches=ACCUMULATION, callbacks=[cbs], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu", default_root_dir=str(tmp_path))
    loader = torch.utils.data.DataLoader(data, batch_size=ROWS, shuffle=False)
    trainer.fit(Module(), loader)
    _same_records(rows, window_run["records"])


def test_two_gloo_ranks_with_different_token_counts():
    """Rank 0 holds rows of 8-32 tokens, rank 1 of 24-64: per-rank and group-wide normalisations."""
    steps, normalizations = 1000, ("window", "group")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        spawn(ddp_worker, args=(2, port, out, dict(
            rows=steps * ACCUMULATION * ROWS, steps=steps, accumulation=ACCUMULATION, rows_per_micro=ROWS,
            valid=[(8, 32), (24, 64)], normalizations=normalizations)),
                                    nprocs=2, join=True)
        ranks = [torch.load(f"{out}/rank{r}.pt", weights_only=False) for r in range(2)]
    _, delta = setting()
    want = truth(delta, 0.5)
    for normalization in normalizations:
        a, b = ranks[0][normalization], ranks[1][normalization]
        assert a["records"] == b["records"], normalization  # every rank reports the same numbers
        assert a["worst_grad_error"] < 1e-5 and b["worst_grad_error"] < 1e-5, normalization
        records = [types.SimpleNamespace(**r) for r in a["records"]]
        assert 3.5 * _rel_se(records) < 0.05, normalization
        assert a["noise_scale"] == pytest.approx(want, rel=0.05), normalization


def test_an_unknown_normalisation_is_refused_with_what_is_allowed():
    from cbs_tracker import CBSCallback, CBSTracker

    with pytest.raises(ValueError, match=r"CBSTracker\(loss_normalization='tokens'\): must be one of"):
        CBSTracker(TokenRegression(torch.zeros(2)), loss_normalization="tokens")
    with pytest.raises(ValueError, match=r"CBSCallback\(loss_normalization='sum'\): must be one of"):
        CBSCallback(loss_normalization="sum")
