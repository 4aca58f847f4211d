"""CBSCallback in real Lightning Trainers: exact window gradients, resume, ddp_spawn, TensorBoard, refusals."""

from __future__ import annotations

import json
import math

import lightning.pytorch as pl
import pytest
import torch
from cbs_tracker.integrations.lightning import label_tokens, leading_dim
from cbs_tracker.integrations.tensorboard import TAGS
from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import SingleDeviceStrategy

from cbs_tracker import BatchSizeController, CBSCallback, NoiseScaleEstimator
from tests.lightning_workers import (
    GradCheck,
    InterleavedBatches,
    PlanController,
    RankSlice,
    Recorder,
    Regression,
    ToyLM,
    regression_data,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
    pytest.mark.filterwarnings("ignore:.*litlogger.*"),
    pytest.mark.filterwarnings("ignore:.*isinstance.*treespec.*"),
]


def make_trainer(**kw) -> pl.Trainer:
    defaults = dict(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    defaults.update(kw)
    return pl.Trainer(**defaults)


def loader(ds, batch_size=2, **kw):
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=False, **kw)


def fast_estimator() -> NoiseScaleEstimator:
    # short memory so a test of a few dozen steps sees the estimate move (and decisions on
    # the median rule alone: these tests are about the callback's mechanics)
    from tests.estimators import NoIntervalEstimator

    return NoIntervalEstimator(horizon_steps=5, min_steps=3)


def small_controller(**kw) -> BatchSizeController:
    # kappa=2: the regression's noise scale sits near the batch, and these tests need doublings
    kw.setdefault("kappa", 2.0)
    kw.setdefault("hold_on_plateau", None)  # no hold on a loss plateau: the doublings come from the first steps
    return BatchSizeController(warmup_steps=5, warmup_tokens=0, patience=3, window=4, cooldown_tokens=0, **kw)


# ---------------------------------------------------------------------------- exact windows
# A0 = 2; the plan decides A=4 at step 2 (after batch 3), A=8 at step 4 (after batch 11) and
# A=16 at step 6 (after batch 7 of epoch 1); each runs from the next window on, as in the plain
# loop, also where it does not divide the position in the epoch (12 for 8, 8 for 16).
# limit_train_batches=19 makes the last window of each epoch short (7 and 11 batches).
PLAN = {2: 4, 4: 8, 6: 16}
EXPECTED_MICRO = [2, 2, 4, 4, 7, 8, 11]
EXPECTED_A = [2, 2, 4, 4, 8, 8, 16]


def _precision_kwargs(precision: str) -> dict:
    if precision == "16-mixed":
        # Trainer(precision="16-mixed") on CPU silently becomes bf16-mixed in Lightning 2.6;
        # the plugin with a CPU GradScaler really runs fp16 autocast with loss scaling. A
        # small growth_interval changes the scale between windows and, once the scale is
        # large, makes the fp16 output gradient overflow (a skipped, non-finite step).
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**11, growth_interval=1)
        return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    return {"precision": precision}


@pytest.mark.parametrize(
    ("precision", "rescale"),
    [("32-true", False), ("32-true", True), ("16-mixed", False), ("16-mixed", True), ("bf16-mixed", True)],
)
def test_every_window_gradient_equals_the_autograd_mean_across_changes(precision, rescale):
    # lr_coupling="keep": the trajectory (and the fp16 overflow it provokes) as planned
    cbs = CBSCallback(controller=PlanController(PLAN), rescale_short_window=rescale, estimator=fast_estimator(),
                      lr_coupling="keep")
    check = GradCheck(cbs)
    trainer = make_trainer(
        max_epochs=2, limit_train_batches=19, accumulate_grad_batches=2,
        callbacks=[cbs, check], **_precision_kwargs(precision),
    )
    trainer.fit(Regression(lr=0.05), loader(regression_data(80)))

    rows = check.rows
    assert [r["microbatches"] for r in rows] == EXPECTED_MICRO
    assert [r["lightning_accumulation"] for r in rows] == EXPECTED_A
    assert [r["cbs_k"] for r in rows] == EXPECTED_MICRO
    assert cbs.applied_changes == [(2, 3, 4), (4, 11, 8), (6, 7, 16)]
    assert trainer.accumulate_grad_batches == 16

    checked_full = checked_short = 0
    for i, r in enumerate(rows):
        if not r["finite"]:
            # AMP overflow: Lightning counts the step, the scaler skips it, the callback drops it
            assert r["dropped"], f"step {i + 1}: non-finite gradients must be dropped"
            continue
        assert not r["dropped"]
        k, a = r["microbatches"], r["lightning_accumulation"]
        # Lightning divides a short window's K losses by the full A (issue #19987)
        expected = r["mean"] if (k == a or rescale) else r["mean"] * (k / a)
        # Same weights, same autocast, the 1/A and loss-scale factors are powers of two
        # (exact): only the float32 summation order differs (~1e-7 relative). A stale
        # gradient or a wrong 1/A in a window would be an O(1) error.
        torch.testing.assert_close(r["got"], expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))
        # the callback's norms, on the mean-loss scale, against the autograd reference
        assert r["cbs_small"] == pytest.approx(r["ref_small"], rel=1e-5)
        assert r["cbs_big"] == pytest.approx(r["ref_big"], rel=1e-5)
        checked_full += k == a
        checked_short += k < a
    assert checked_full >= 4 and checked_short >= 1
    if precision == "16-mixed":
        assert any(not r["finite"] for r in rows), "the fp16 run was meant to overflow at least once"


def test_fused_optimizer_with_fp16_is_unscaled_by_the_callback():
    """Lightning leaves unscaling to fused optimizers' step(); the callback unscales so the norm is right."""

    class Fused(Regression):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01, fused=True)

    cbs = CBSCallback(controller=None, estimator=fast_estimator())
    check = GradCheck(cbs)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
    trainer = make_trainer(max_steps=6, accumulate_grad_batches=2, callbacks=[cbs, check],
                           plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    trainer.fit(Fused(), loader(regression_data(64)))
    assert trainer.optimizers[0]._step_supports_amp_scaling  # the case Lightning does not unscale
    for r in check.rows:
        assert r["finite"] and not r["dropped"]
        torch.testing.assert_close(r["got"], r["mean"], rtol=1e-5, atol=1e-6 * float(r["mean"].abs().max()))
        assert r["cbs_small"] == pytest.approx(r["ref_small"], rel=1e-5)
        assert r["cbs_big"] == pytest.approx(r["ref_big"], rel=1e-5)


def test_non_finite_steps_leave_the_estimate_untouched():
    cbs = CBSCallback(controller=None, estimator=fast_estimator())
    rec = Recorder(cbs)
    # a scale of 2**40 overflows fp16 at once; the scaler halves it after each skipped step
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, growth_interval=10_000)
    trainer = make_trainer(max_steps=40, accumulate_grad_batches=2, callbacks=[cbs, rec],
                           plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    trainer.fit(Regression(lr=0.0), loader(regression_data(400)))
    dropped = [r["record"]["dropped"] for r in rec.rows]
    assert dropped[0] and sum(dropped) >= 20 and not dropped[-1]
    assert cbs.estimator.steps == dropped.count(False)
    assert cbs.steps == trainer.global_step == 40
    assert math.isfinite(cbs.noise_scale) and cbs.noise_scale > 0


def test_frozen_regression_estimate_matches_the_plain_loop_tracker_on_the_same_batches():
    """Lightning's 1/A division undone: the callback equals CBSTracker fed the same microbatches."""
    from cbs_tracker import CBSTracker

    ds = regression_data(256, seed=3)
    cbs = CBSCallback(controller=None, estimator=NoiseScaleEstimator(min_steps=3))
    model = Regression(lr=0.0)
    trainer = make_trainer(max_epochs=1, accumulate_grad_batches=4, callbacks=[cbs])
    trainer.fit(model, loader(ds, batch_size=4))

    ref_model = Regression(lr=0.0)
    tracker = CBSTracker(ref_model.net, accumulation_steps=4, unit="samples",
                         estimator=NoiseScaleEstimator(min_steps=3))
    batches = list(loader(ds, batch_size=4))
    for w in range(len(batches) // 4):
        for x, y in batches[4 * w : 4 * w + 4]:
            with tracker.microbatch(size=x.shape[0]):
                (ref_model.loss((x, y)) / 4).backward()
        tracker.step()
        ref_model.net.zero_grad()
    assert cbs.steps == tracker.steps == 16
    assert tracker.noise_scale is not None  # None == pytest.approx(None) would hold
    assert cbs.noise_scale == pytest.approx(tracker.noise_scale, rel=1e-6)
    assert cbs.tokens_seen == tracker.tokens_seen == 256


def test_adam_preconditioner_is_really_used():
    """preconditioner='adam' measures g / (sqrt(v_hat) + eps): checked against that formula by hand."""
    cbs = CBSCallback(controller=None, preconditioner="adam", estimator=fast_estimator())
    check = GradCheck(cbs)

    class Precondition(pl.Callback):
        # the reference norms again, on Adam-preconditioned per-microbatch gradients
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            row = check.rows[-1]
            params = list(pl_module.net.parameters())
            if not optimizer.state:
                row["pre_small"] = row["pre_big"] = None
                return
            denom = torch.cat([
                (optimizer.state[p]["exp_avg_sq"] / (1 - 0.999 ** float(optimizer.state[p]["step"]))).sqrt().flatten() + 1e-8
                for p in params
            ])
            per_micro = torch.stack(row.pop("per_micro")) / denom
            row["pre_small"] = float(per_micro.double().pow(2).sum(1).mean())
            row["pre_big"] = float(per_micro.mean(0).double().pow(2).sum())

    class KeepPerMicro(GradCheck):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            names = [n for n, _ in pl_module.net.named_parameters()]
            per = []
            for batch in self.window:
                params = {n: p.detach().clone().requires_grad_(True) for n, p in pl_module.net.named_parameters()}
                g = torch.autograd.grad(pl_module.loss(batch, params), [params[n] for n in names])
                per.append(torch.cat([t.flatten() for t in g]))
            super().on_before_optimizer_step(trainer, pl_module, optimizer)
            self.rows[-1]["per_micro"] = per

    check = KeepPerMicro(cbs)
    trainer = make_trainer(max_steps=12, accumulate_grad_batches=4, callbacks=[cbs, check, Precondition()])
    trainer.fit(Regression(lr=0.01, optimizer="adam"), loader(regression_data(256)))
    rows = check.rows
    # step 1: Adam has no second moments yet, the step is not measurable
    assert rows[0]["pre_small"] is None and rows[0]["dropped"]
    for r in rows[1:]:
        assert not r["dropped"]
        assert r["cbs_small"] == pytest.approx(r["pre_small"], rel=1e-4)
        assert r["cbs_big"] == pytest.approx(r["pre_big"], rel=1e-4)
        assert r["cbs_small"] != pytest.approx(r["ref_small"], rel=1e-2)  # not the raw gradients
    assert cbs.estimator.steps == 11


def test_accumulation_changed_by_someone_else_inside_a_window_is_overridden_and_said():
    class Meddler(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 4:
                trainer.accumulate_grad_batches = 4  # inside the window [4, 5]

    cbs = CBSCallback(controller=None, estimator=fast_estimator())
    rec = Recorder(cbs)
    check = GradCheck(cbs)
    trainer = make_trainer(max_steps=5, accumulate_grad_batches=2, callbacks=[cbs, rec, check, Meddler()])
    with pytest.warns(UserWarning, match=r"accumulate_grad_batches was set to 4 by something else \(the callback "
                      r"left 2\).*the change is not applied"):
        trainer.fit(Regression(), loader(regression_data(64)))
    # every window stays whole, its gradient the mean of its two microbatches, and measured
    assert [r["microbatches"] for r in rec.rows] == [2] * 5
    assert [r["record"]["dropped"] for r in rec.rows] == [False] * 5
    for r in check.rows:
        torch.testing.assert_close(r["got"], r["mean"], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- resume
def _read_tb(log_dir) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(log_dir), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}


def test_resume_between_two_doublings_gives_the_same_schedule_and_noise_scale(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger

    def make_cb():
        return CBSCallback(controller=small_controller(), estimator=fast_estimator(), log_every_n_steps=1)

    ds = regression_data(512)
    full_cb = make_cb()
    full_rec = Recorder(full_cb)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{epoch}", every_n_epochs=1, save_top_k=-1,
                           save_on_train_epoch_end=True)
    full_log = TensorBoardLogger(tmp_path, name="full", version=0)
    trainer = make_trainer(max_epochs=3, accumulate_grad_batches=2, callbacks=[full_cb, full_rec, ckpt],
                           enable_checkpointing=True, logger=full_log)
    trainer.fit(Regression(lr=0.05), loader(ds, 4))

    # a new Trainer, module and callback (same configuration), resumed from the end of epoch 0;
    # accumulate_grad_batches=2 as at the start: the checkpoint must restore the grown value
    resumed_cb = make_cb()
    resumed_rec = Recorder(resumed_cb)
    resumed_log = TensorBoardLogger(tmp_path, name="resumed", version=0)
    trainer2 = make_trainer(max_epochs=3, accumulate_grad_batches=2, callbacks=[resumed_cb, resumed_rec],
                            logger=resumed_log)
    trainer2.fit(Regression(lr=0.05), loader(ds, 4), ckpt_path=str(tmp_path / "ckpt" / "epoch=0.ckpt"))

    changes = full_cb.applied_changes
    epoch0_steps = max(r["record"]["step"] for r in full_rec.rows if r["epoch"] == 0)
    # the checkpoint at the end of epoch 0 lies between two doublings
    assert any(step <= epoch0_steps for step, _, _ in changes)
    assert any(step > epoch0_steps for step, _, _ in changes)
    assert resumed_rec.rows[0]["lightning_accumulation"] > 2

    after = [r for r in full_rec.rows if r["epoch"] >= 1]
    assert len(resumed_rec.rows) == len(after) > 0
    for a, b in zip(after, resumed_rec.rows):
        ra, rb = a["record"], b["record"]
        assert (rb["step"], b["microbatches"], b["lightning_accumulation"], rb["global_batch"]) == (
            ra["step"], a["microbatches"], a["lightning_accumulation"], ra["global_batch"])
        assert rb["tokens_seen"] == ra["tokens_seen"]
        if ra["noise_scale"] is None:
            assert rb["noise_scale"] is None
        else:
            # same weights, optimizer, data order and estimator state: float-identical arithmetic
            assert rb["noise_scale"] == pytest.approx(ra["noise_scale"], rel=1e-9)
    assert [c for c in changes if c[0] > epoch0_steps] == resumed_cb.applied_changes
    assert trainer2.accumulate_grad_batches == trainer.accumulate_grad_batches
    assert resumed_cb.controller.state_dict() == full_cb.controller.state_dict()

    # the logged values (TensorBoard event files read back) agree step by step after the checkpoint
    full_tb, resumed_tb = _read_tb(full_log.log_dir), _read_tb(resumed_log.log_dir)
    for tag in ("cbs/noise_scale", "cbs/accumulation_steps", "cbs/global_batch_samples", "cbs/samples_seen"):
        tail = {s: v for s, v in full_tb[tag].items() if s > epoch0_steps}
        assert tail and resumed_tb[tag] == tail, tag


def test_resume_restores_accumulation_before_the_first_batch_and_a_pending_change(tmp_path):
    plan = {2: 4, 4: 8, 5: 16}  # 16 decided at the last step of epoch 0: pending in its checkpoint

    def make_cb():
        return CBSCallback(controller=PlanController(plan), estimator=fast_estimator())

    seen_at_start = []

    class FirstBatch(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if not seen_at_start:
                seen_at_start.append(trainer.accumulate_grad_batches)

    ds = regression_data(80)
    full_cb = make_cb()
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", every_n_epochs=1, save_top_k=-1,
                           save_on_train_epoch_end=True)
    trainer = make_trainer(max_epochs=2, limit_train_batches=19, accumulate_grad_batches=2,
                           callbacks=[full_cb, ckpt], enable_checkpointing=True)
    trainer.fit(Regression(), loader(ds))
    state = torch.load(tmp_path / "epoch=0.ckpt", weights_only=False)["callbacks"]["CBSCallback"]
    # saved at the end of epoch 0: A=8 in force, A=16 decided at its last step and pending
    assert state["accumulation_steps"] == 8 and state["pending_accumulation_steps"] == 16

    resumed = make_cb()
    rec = Recorder(resumed)
    trainer2 = make_trainer(max_epochs=2, limit_train_batches=19, accumulate_grad_batches=2,
                            callbacks=[resumed, rec, FirstBatch()])
    trainer2.fit(Regression(), loader(ds), ckpt_path=str(tmp_path / "epoch=0.ckpt"))
    assert seen_at_start == [16]
    assert [r["microbatches"] for r in rec.rows] == [16, 3]  # epoch 1 of 19 batches at 16
    assert [r["record"]["step"] for r in rec.rows] == [6, 7]


# ---------------------------------------------------------------------------- ddp_spawn
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_ddp_spawn_two_ranks_decide_alike_and_match_one_process(tmp_path):
    n, b = 512, 4

    def make_cb():
        # feedback_guard=False: keep growing, to compare more than one decision
        return CBSCallback(controller=small_controller(feedback_guard=False), estimator=fast_estimator())

    ddp_dir = tmp_path / "ddp"
    ddp_dir.mkdir()
    cb = make_cb()
    trainer = make_trainer(strategy="ddp_spawn", devices=2, max_epochs=2, accumulate_grad_batches=2,
                           use_distributed_sampler=False, callbacks=[cb, Recorder(cb, out_dir=str(ddp_dir))])
    trainer.fit(Regression(lr=0.05), loader(regression_data(n), b, sampler=RankSlice(n, 2)))
    ranks = [json.loads((ddp_dir / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["world_size"] == 2
    # identical decisions and numbers on both ranks (they come from all-reduced values only)
    assert ranks[0]["applied"] == ranks[1]["applied"] and len(ranks[0]["applied"]) >= 2
    assert [r["record"] for r in ranks[0]["rows"]] == [r["record"] for r in ranks[1]["rows"]]

    single_cb = make_cb()
    single = Recorder(single_cb)
    data = torch.utils.data.DataLoader(regression_data(n), batch_sampler=InterleavedBatches(n, b, 2))
    trainer1 = make_trainer(max_epochs=2, accumulate_grad_batches=4, callbacks=[single_cb, single])
    trainer1.fit(Regression(lr=0.05), data)

    rows_ddp, rows_one = ranks[0]["rows"], single.rows
    assert len(rows_ddp) == len(rows_one)
    measured = 0
    for a, c in zip(rows_ddp, rows_one):
        ra, rc = a["record"], c["record"]
        assert ra["dp_degree"] == 2 and rc["dp_degree"] == 1
        assert ra["global_batch"] == rc["global_batch"] == c["samples"]
        assert ra["tokens_seen"] == rc["tokens_seen"]
        assert a["lightning_accumulation"] * 2 == c["lightning_accumulation"]
        if rc["noise_scale"] is None:
            assert ra["noise_scale"] is None
            continue
        # DDP averages float32 gradients in another order than one process sums them:
        # ~1e-7 relative on the norms, amplified by 1/(1 - |G_big|^2/|G_small|^2) <= ~10 here
        assert ra["noise_scale"] == pytest.approx(rc["noise_scale"], rel=1e-4)
        measured += 1
    assert measured >= 20
    # the doublings land on the same optimizer steps (global batch in samples)
    assert [s for s, _, _ in ranks[0]["applied"]] == [s for s, _, _ in single_cb.applied_changes]


# ---------------------------------------------------------------------------- logging
def test_tensorboard_event_file_has_the_documented_tags(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing import event_accumulator

    # the library's estimator (its interval is logged too) and planned doublings
    cbs = CBSCallback(controller=PlanController({6: 4, 14: 8}),
                      estimator=NoiseScaleEstimator(horizon_steps=5, min_steps=3), log_every_n_steps=1)
    rec = Recorder(cbs)
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    trainer = make_trainer(max_epochs=2, accumulate_grad_batches=2, callbacks=[cbs, rec], logger=logger,
                           enable_progress_bar=True)
    trainer.fit(Regression(lr=0.05), loader(regression_data(512), 4))
    logger.finalize("success")

    acc = event_accumulator.EventAccumulator(logger.log_dir, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    scalars = {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}
    expected = {spec.tag.format(unit="samples") for spec in TAGS}
    assert expected <= set(scalars), sorted(expected - set(scalars))

    steps = len(rec.rows)
    gb = scalars["cbs/global_batch_samples"]
    assert sorted(gb) == list(range(1, steps + 1))
    for row in rec.rows:
        step = row["record"]["step"]
        assert gb[step] == row["samples"]  # the counted samples of that window
        assert scalars["cbs/accumulation_steps"][step] == row["microbatches"]
    seen = scalars["cbs/samples_seen"]
    assert seen[steps] == sum(r["samples"] for r in rec.rows) == 2 * 512
    assert set(scalars["cbs/dp_degree"].values()) == {1.0}
    ns = [v for v in scalars["cbs/noise_scale"].values()]
    assert all(math.isfinite(v) and v >= 0 for v in ns) and max(ns) > 0
    assert all(v > 0 for v in scalars["cbs/micro_batch_samples"].values())
    # the schedule against samples seen: x = cumulative samples
    assert sorted(scalars["cbs_samples/global_batch_samples"]) == sorted(int(v) for v in seen.values())
    assert scalars["cbs/lr"][1] == pytest.approx(0.05)
    # grown at least once, and the logged global batch shows it
    assert max(gb.values()) >= 2 * min(gb.values())
    # progress bar
    assert "cbs/noise_scale" in trainer.progress_bar_metrics
    assert "cbs/global_batch_samples" in trainer.progress_bar_metrics


def test_tokens_are_counted_from_labels_and_logged_in_tokens(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 16, (64, 6), generator=g)
    y = torch.randint(0, 16, (64, 6), generator=g)
    y[torch.rand(64, 6, generator=g) < 0.3] = -100  # padding / ignored labels
    ds = torch.utils.data.TensorDataset(x, y)
    cbs = CBSCallback(controller=None, batch_size_fn=label_tokens(), log_every_n_steps=1)
    assert cbs.unit == "tokens"
    rec = Recorder(cbs)
    logger = CSVLogger(tmp_path, name="csv", version=0)
    trainer = make_trainer(max_epochs=1, accumulate_grad_batches=2, callbacks=[cbs, rec], logger=logger)
    trainer.fit(ToyLM(), loader(ds, 4))
    counted = (y != -100).view(8, 8 * 6).sum(1).tolist()  # 8 windows of 2 x 4 sequences
    assert [r["record"]["global_batch"] for r in rec.rows] == counted
    assert rec.rows[0]["record"]["unit"] == "tokens"
    text = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text()
    assert "cbs/global_batch_tokens" in text and "cbs/tokens_seen" in text


def test_the_callback_stores_nothing_under_log():
    cbs = CBSCallback()
    assert "log" not in vars(cbs) and "log" not in vars(CBSCallback)


# ---------------------------------------------------------------------------- defaults
def test_defaults_work_on_a_typical_module():
    cbs = CBSCallback()
    assert isinstance(cbs.controller, BatchSizeController) and cbs.unit == "samples"
    trainer = make_trainer(max_steps=30, accumulate_grad_batches=2, callbacks=[cbs])
    trainer.fit(Regression(), loader(regression_data(256), 4))
    assert cbs.steps == 30 and cbs.last_record.global_batch == 8
    assert trainer.accumulate_grad_batches == 2  # the default controller waits 100 steps
    assert CBSCallback(observe_only=True).controller.observe_only


def test_single_microbatch_warns_once_and_measures_nothing():
    cbs = CBSCallback()
    trainer = make_trainer(max_steps=5, callbacks=[cbs])
    with pytest.warns(UserWarning, match=r"single microbatch \(Trainer\(accumulate_grad_batches=1\)"):
        trainer.fit(Regression(), loader(regression_data(64), 4))
    assert cbs.estimator.steps == 0 and cbs.noise_scale is None


def test_leading_dim_and_label_tokens():
    assert leading_dim(torch.zeros(5, 3)) == 5
    assert leading_dim((torch.zeros(()), [torch.zeros(7, 2)])) == 7
    assert leading_dim({"input_ids": torch.zeros(3, 9)}) == 3
    with pytest.raises(ValueError, match=r"found no tensor with a leading \(batch\) dimension in the batch \(a str\)"):
        leading_dim("abc")
    count = label_tokens("labels", ignore_index=0)
    assert int(count({"labels": torch.tensor([[0, 1, 2], [3, 0, 0]])})) == 3
    with pytest.raises(TypeError, match=r"label_tokens\(key=1.5\)"):
        label_tokens(1.5)
    with pytest.raises(TypeError, match=r"batch\[-1\] is a list, not a tensor of labels"):
        label_tokens()((torch.zeros(2), [1, 2]))


@pytest.mark.parametrize("coupling, factor", [("linear", lambda r: r), ("sqrt", math.sqrt), ("keep", lambda r: 1.0)])
def test_lr_coupling_is_applied_when_the_new_accumulation_takes_effect(coupling, factor):
    lrs = []

    class LR(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            lrs.append((cbs.window_accumulation, optimizer.param_groups[0]["lr"]))

    cbs = CBSCallback(controller=PlanController(PLAN), lr_coupling=coupling)
    trainer = make_trainer(max_epochs=2, limit_train_batches=19, accumulate_grad_batches=2, callbacks=[cbs, LR()])
    trainer.fit(Regression(lr=0.05), loader(regression_data(80)))
    # from the first window that uses the new accumulation on: LR = 0.05 * factor(A / A0)
    assert [a for a, _ in lrs] == EXPECTED_A
    assert [lr for _, lr in lrs] == pytest.approx([0.05 * factor(a / 2) for a, _ in lrs], rel=1e-12)
    # the coupling is saved with the state
    assert cbs.state_dict()["lr_coupling"] == pytest.approx(factor(8.0))


# ---------------------------------------------------------------------------- refusals
def test_manual_optimization_is_refused():
    trainer = make_trainer(max_steps=2, callbacks=[CBSCallback()])
    with pytest.raises(RuntimeError, match=r"CBSCallback needs automatic optimization: with `automatic_optimization = False`"):
        trainer.fit(Regression(manual=True), loader(regression_data(16)))


def test_gradient_accumulation_scheduler_is_refused():
    trainer = make_trainer(max_steps=2, callbacks=[CBSCallback(), GradientAccumulationScheduler({0: 2})])
    with pytest.raises(RuntimeError, match=r"cannot be used with GradientAccumulationScheduler in the same Trainer"):
        trainer.fit(Regression(), loader(regression_data(16)))


class _AccumulatingStrategy(SingleDeviceStrategy):
    """Stands in for DeepSpeed: a strategy that accumulates gradients itself."""

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True


def test_strategy_that_accumulates_itself_is_refused():
    trainer = make_trainer(max_steps=2, strategy=_AccumulatingStrategy(device=torch.device("cpu")),
                           callbacks=[CBSCallback()])
    with pytest.raises(RuntimeError, match=r"cannot be used with _AccumulatingStrategy: that strategy accumulates gradients itself"):
        trainer.fit(Regression(), loader(regression_data(16)))


def test_fsdp_is_refused():
    # Lightning 2.6 runs FSDPStrategy on GPUs only; a stand-in with its name pins the message
    fake = type("FSDPStrategy", (SingleDeviceStrategy,), {})
    trainer = make_trainer(max_steps=2, strategy=fake(device=torch.device("cpu")), callbacks=[CBSCallback()])
    with pytest.raises(RuntimeError, match=r"CBSCallback does not support FSDPStrategy yet") as err:
        trainer.fit(Regression(), loader(regression_data(16)))
    # it names the adapter that measures FSDP2 (the plain-loop CBSTracker refuses it), importable as written
    assert "from cbs_tracker.integrations.fsdp import FSDPTracker" in str(err.value)
    assert "CBSTracker" not in str(err.value).replace("FSDPTracker", "")
    from cbs_tracker.integrations.fsdp import FSDPTracker  # noqa: F401


def test_bad_batch_size_fn_result_is_refused():
    trainer = make_trainer(max_steps=2, accumulate_grad_batches=2, callbacks=[CBSCallback(batch_size_fn=lambda b: "x")])
    with pytest.raises(ValueError, match=r"CBSCallback\(batch_size_fn=...\) returned 'x' for batch 0: expected a number >= 0"):
        trainer.fit(Regression(), loader(regression_data(16)))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"controller": "always"}, ValueError, r"CBSCallback\(controller='always'\): expected 'auto', None, a BatchSizeController or a BatchSchedule"),
        ({"controller": object()}, TypeError, r"CBSCallback\(controller=object\): expected 'auto', None, a BatchSizeController or a BatchSchedule"),
        ({"controller": BatchSizeController(), "observe_only": True}, ValueError,
         r"observe_only=True\): pass BatchSizeController\(observe_only=True\)"),
        ({"observe_only": 1}, TypeError, r"CBSCallback\(observe_only=1\): expected True or False"),
        ({"batch_size_fn": 3}, TypeError, r"CBSCallback\(batch_size_fn=3\): expected a function"),
        ({"unit": "bytes"}, ValueError, r"CBSCallback\(unit='bytes'\): must be 'tokens', 'samples' or None"),
        ({"rescale_short_window": "yes"}, TypeError, r"CBSCallback\(rescale_short_window='yes'\): expected True or False"),
        ({"preconditioner": "sgd"}, ValueError, r"CBSCallback\(preconditioner='sgd'\): must be None or 'adam'"),
        ({"estimator": 3}, TypeError, r"CBSCallback\(estimator=int\): expected a NoiseScaleEstimator or None"),
        ({"log_every_n_steps": 0}, ValueError, r"CBSCallback\(log_every_n_steps=0\): must be an integer >= 1 or None"),
        ({"prog_bar": None}, TypeError, r"CBSCallback\(prog_bar=None\): expected True or False"),
        ({"cap_lr_at_peak": "yes"}, TypeError, r"CBSCallback\(cap_lr_at_peak='yes'\): expected True, False or None"),
        ({"retime_schedulers": None}, TypeError, r"CBSCallback\(retime_schedulers=None\): expected True or False"),
        ({"name": 3}, TypeError, r"CBSCallback\(name=3\): expected a str or None"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        CBSCallback(**kwargs)


def test_state_dict_errors_and_dp_degree_mismatch():
    cbs = CBSCallback(controller=None)
    state = cbs.state_dict()
    assert set(state) >= {"version", "step", "tokens_seen", "accumulation_steps", "pending_accumulation_steps",
                          "dp_degree", "estimator", "controller"}
    with pytest.raises(KeyError, match=r"CBSCallback.load_state_dict: missing keys \['estimator'\]"):
        CBSCallback().load_state_dict({k: v for k, v in state.items() if k != "estimator"})
    with pytest.raises(ValueError, match=r"state version 99 is newer than 2"):
        CBSCallback().load_state_dict({**state, "version": 99})
    with pytest.raises(ValueError, match=r"the checkpoint counts samples but this callback counts tokens"):
        CBSCallback(unit="tokens").load_state_dict(state)
    # a newer checkpoint's extra keys are tolerated
    CBSCallback(controller=None).load_state_dict({**state, "something_new": 1})

    # another data-parallel degree converts at fit: 4 microbatches on each of 2 ranks are 8 on this one
    cbs = CBSCallback(controller=None)
    cbs.load_state_dict({**state, "dp_degree": 2, "accumulation_steps": 4})
    trainer = make_trainer(max_steps=2, accumulate_grad_batches=2, callbacks=[cbs])
    trainer.fit(Regression(), loader(regression_data(64)))
    assert cbs.session is not None and cbs.session.dp_degree == 1
    assert cbs.session.last_record.accumulation_steps == 8 and trainer.accumulate_grad_batches == 8


def test_state_key_distinguishes_named_instances():
    assert CBSCallback().state_key == "CBSCallback"
    assert CBSCallback(name="a").state_key == "CBSCallback{'name': 'a'}"
