"""CBSTrainer in real ``transformers.Trainer`` runs: exact windows, analytic truth, LR in tokens, resume, logs."""

from __future__ import annotations

import math
import os
import re
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import accelerate  # noqa: F401,E402  (the [test] extra installs both; a missing one must fail, not skip)
import pytest
import torch
import transformers  # noqa: F401,E402
from cbs_tracker.integrations.transformers import STATE_FILE, CBSTrainer  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback  # noqa: E402

from cbs_tracker import BatchSizeController, CBSTracker, NoiseScaleEstimator  # noqa: E402
from tests.hf_workers import (  # noqa: E402
    Pairs,
    PlanController,
    Regression,
    ddp_worker,
    regression_data,
    training_args,
    window_checker,
)
from tests.spawning import spawn  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*growth is capped.*"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


class Records(TrainerCallback):
    """The tracker's record of every optimizer step (read right after the step)."""

    def __init__(self) -> None:
        self.trainer: CBSTrainer | None = None
        self.rows = []

    def on_step_end(self, args, state, control, **kwargs):
        self.rows.append(self.trainer.last_record)


def make(model, args, data, *, callbacks=(), **kw) -> tuple[CBSTrainer, Records]:
    rec = Records()
    trainer = CBSTrainer(model=model, args=args, train_dataset=data, callbacks=[rec, *callbacks], **kw)
    rec.trainer = trainer
    return trainer, rec


# ---------------------------------------------------------------------------- exact windows
# 28 samples in microbatches of 2: 14 per epoch, A0 = 2. The plan decides A=4 at step 3
# (after 6 microbatches: 6 % 4 != 0, so one more window of 2, applied at microbatch 8),
# A=8 at step 5 (microbatch 12: not aligned; the last window of epoch 0 keeps A=4 and is
# short, 2 of 4), applied at the start of epoch 1, whose last window is short too (6 of 8).
PLAN = {3: 4, 5: 8}
EXPECTED_WINDOWS = [2, 2, 2, 2, 4, 2, 8, 6]
EXPECTED_SETTING = [2, 2, 2, 2, 4, 4, 8, 8]
EXPECTED_APPLIED = [(4, 0, 8, 4), (6, 1, 0, 8)]


def _start_indices(windows: list[int], per_epoch: int) -> list[int]:
    starts, pos = [], 0
    for k in windows:
        starts.append(pos % per_epoch)
        pos += k
    return starts


def test_every_window_gradient_is_the_mean_of_exactly_its_microbatches(tmp_path):
    data = regression_data(28)
    model = Regression(seed=0)
    ref: list = []
    check = window_checker(model, ref)
    trainer, rec = make(model, training_args(str(tmp_path), num_train_epochs=2), data, callbacks=[check],
                        unit="samples", controller=PlanController(PLAN), lr_coupling="keep")
    ref.append(trainer)
    trainer.train()

    rows = check.rows
    assert [r["microbatches"] for r in rows] == EXPECTED_WINDOWS
    assert [r["setting"] for r in rows] == EXPECTED_SETTING
    assert trainer.applied_changes == EXPECTED_APPLIED
    for r, start in zip(rows, _start_indices(EXPECTED_WINDOWS, 14)):
        # contiguous windows in data order, each starting where the previous one ended
        torch.testing.assert_close(r["first_x"], data.x[2 * start : 2 * start + 2])
        # one float32 summation order against another; a stale or mis-scaled microbatch is O(1)
        torch.testing.assert_close(r["got"], r["mean"], rtol=1e-5, atol=1e-6)
        assert r["record"].global_batch == 2 * r["microbatches"]
    assert rec.rows[-1].tokens_seen == 2 * 28
    assert trainer.args.gradient_accumulation_steps == 2  # the caller's arguments are left as given


def test_two_gloo_processes_step_alike_on_exact_windows(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # 56 samples: 28 per rank, the windows of the single-process test on each rank
    spawn(ddp_worker, args=(2, port, str(tmp_path), 56, PLAN), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    r0, r1 = ranks[0]["rows"], ranks[1]["rows"]
    assert [r["microbatches"] for r in r0] == [r["microbatches"] for r in r1] == EXPECTED_WINDOWS
    assert ranks[0]["applied"] == ranks[1]["applied"] == EXPECTED_APPLIED
    for a, b in zip(r0, r1):
        torch.testing.assert_close(a["params"], b["params"], rtol=0, atol=0)
        torch.testing.assert_close(a["got"], b["got"], rtol=0, atol=0)
        # DDP's average of the two ranks' windows: the mean over all 2K microbatches
        torch.testing.assert_close(a["got"], (a["mean"] + b["mean"]) / 2, rtol=1e-5, atol=1e-6)
        assert a["record"] == b["record"]
        assert a["record"]["dp_degree"] == 2
        assert a["record"]["global_batch"] == 2 * 2 * a["microbatches"]


# ---------------------------------------------------------------------------- analytic truth
def test_frozen_regression_matches_the_analytic_noise_scale_and_the_plain_loop():
    d, sigma, accumulation, micro, steps = 8, 0.5, 4, 16, 1300
    g = torch.Generator().manual_seed(0)
    w_star = torch.randn(d, generator=g)
    delta = 0.3 * torch.randn(d, generator=g)
    dd = float(delta.pow(2).sum())
    truth = (d * (dd + sigma**2) + dd) / dd
    data = regression_data(steps * accumulation * micro, seed=1, sigma=sigma, w_star=w_star)

    flat = dict(horizon_steps=1e9, min_steps=10)  # a plain mean of the per-step estimates
    model = Regression(d, weight=w_star + delta)
    args = training_args("unused", per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
                         learning_rate=0.0, save_strategy="no")
    trainer, rec = make(model, args, data, unit="samples", controller=None, estimator=NoiseScaleEstimator(**flat))
    trainer.train()

    ref_model = Regression(d, weight=w_star + delta)
    tracker = CBSTracker(ref_model, accumulation_steps=accumulation, unit="samples",
                         estimator=NoiseScaleEstimator(**flat))
    plain = []
    for s in range(steps):
        for k in range(accumulation):
            i = (s * accumulation + k) * micro
            x, y = data.x[i : i + micro], data.y[i : i + micro]
            with tracker.microbatch(size=micro):
                (ref_model.loss(x, y) / accumulation).backward()
        plain.append(tracker.step())
        ref_model.zero_grad(set_to_none=True)

    assert len(rec.rows) == len(plain) == steps
    for got, want in zip(rec.rows, plain):
        assert (got.step, got.tokens_seen, got.global_batch, got.accumulation_steps) == (
            want.step, want.tokens_seen, want.global_batch, want.accumulation_steps)
        for field in ("noise_scale", "grad_sq_norm", "trace_cov", "step_grad_sq_norm", "step_trace_cov"):
            a, b = getattr(got, field), getattr(want, field)
            assert (a is None) == (b is None), field
            if a is not None:
                assert a == pytest.approx(b, rel=1e-5, abs=1e-9), field

    # the 5% tolerance is at least 3.5 standard errors of this run's own per-step estimates
    gs = torch.tensor([r.step_grad_sq_norm for r in rec.rows], dtype=torch.float64)
    ts = torch.tensor([r.step_trace_cov for r in rec.rows], dtype=torch.float64)
    ratio = ts.mean() / gs.mean()
    rel_se = float(((ts - ratio * gs) / gs.mean()).std() / math.sqrt(steps) / ratio)
    assert 3.5 * rel_se < 0.05, rel_se
    assert trainer.noise_scale == pytest.approx(truth, rel=0.05)


# ---------------------------------------------------------------------------- schedule in tokens
def _lr_run(tmp_path, name, controller, **kw):
    args = training_args(str(tmp_path / name), optim="adamw_torch", learning_rate=1e-2,
                         lr_scheduler_type="linear", warmup_steps=3, **kw)
    trainer, rec = make(Regression(seed=0), args, regression_data(64), unit="samples", controller=controller)
    trainer.train()
    return trainer, rec.rows


def test_lr_follows_the_constant_run_at_the_same_tokens_and_the_schedule_finishes(tmp_path):
    const, c_rows = _lr_run(tmp_path, "const", None)
    # the constant run against the schedule written out (linear, 3 warm-up steps, 16 steps in all)
    assert [r.lr for r in c_rows] == pytest.approx(
        [1e-2 * (s / 3 if s < 3 else (16 - s) / (16 - 3)) for s in range(16)], rel=1e-12
    )
    grow, g_rows = _lr_run(tmp_path, "grow", PlanController({3: 4, 6: 8}))
    assert [r.accumulation_steps for r in g_rows] == [2, 2, 2, 2, 4, 4, 8, 8]
    # the LR each step used is the constant run's at the tokens where the step starts, times sqrt(A/A0)
    lr_at = {r.tokens_seen - r.global_batch: r.lr for r in c_rows}
    for r in g_rows:
        assert r.lr == pytest.approx(lr_at[r.tokens_seen - r.global_batch] * math.sqrt(r.accumulation_steps / 2),
                                     rel=1e-12)
    assert g_rows[-1].tokens_seen == c_rows[-1].tokens_seen == 64
    assert len(g_rows) == 8 and len(c_rows) == 16
    for trainer in (const, grow):  # the scheduler ran to its end: linear decay reached 0
        assert trainer.lr_scheduler.last_epoch == 16
        assert trainer.lr_scheduler.get_last_lr()[0] == 0.0


def test_max_steps_ends_at_the_same_tokens_with_growth(tmp_path):
    # 13 starting-batch steps: after 8 steps at up to A=8 the run has 1 step left and cuts
    # its last window to A0 instead of passing the budget
    _, c_rows = _lr_run(tmp_path, "const", None, max_steps=13)
    grow, g_rows = _lr_run(tmp_path, "grow", PlanController({3: 4, 6: 8}), max_steps=13)
    assert g_rows[-1].tokens_seen == c_rows[-1].tokens_seen == 13 * 4
    assert [r.global_batch for r in g_rows] == [4, 4, 4, 4, 8, 8, 16, 2 * 2]
    assert grow.session.starting_batch_steps == 13


# ---------------------------------------------------------------------------- resume
def _resume_args(out, **kw):
    return training_args(out, optim="adamw_torch", learning_rate=1e-2, lr_scheduler_type="cosine",
                         num_train_epochs=2, **kw)


def _controller():
    return BatchSizeController(warmup_steps=4, warmup_tokens=0, patience=2, window=3, cooldown_tokens=0, kappa=4.0,
                               feedback_guard=False, hold_on_plateau=None)


def test_resume_mid_run_gives_the_same_schedule_as_an_uninterrupted_run(tmp_path):
    data = regression_data(96, seed=2)
    full, full_rec = make(Regression(seed=0), _resume_args(str(tmp_path / "a"), save_strategy="steps", save_steps=1),
                          data, unit="samples", controller=_controller(),
                          estimator=NoiseScaleEstimator(horizon_steps=4, min_steps=2))
    full.train()
    rows = full_rec.rows
    changes = [r.step for r in rows if r.next_accumulation_steps != r.accumulation_steps]
    assert changes, "the run was meant to grow"
    # resume after the first change took effect, mid-epoch
    resume_at = next(r.step for r in rows if r.step > changes[0] and r.accumulation_steps > 2
                     and r.tokens_seen % 96 not in (0,))
    part, part_rec = make(Regression(seed=5), _resume_args(str(tmp_path / "b")), data, unit="samples",
                          controller=_controller(), estimator=NoiseScaleEstimator(horizon_steps=4, min_steps=2))
    part.train(resume_from_checkpoint=str(tmp_path / "a" / f"checkpoint-{resume_at}"))
    tail = rows[resume_at:]
    assert [r.step for r in part_rec.rows] == [r.step for r in tail]
    for got, want in zip(part_rec.rows, tail):
        assert got == want
    for a, b in zip(part.model.parameters(), full.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_resume_is_refused_where_it_cannot_be_exact(tmp_path):
    data = regression_data(16)
    plain = Trainer(model=Regression(), args=training_args(str(tmp_path / "p"), save_strategy="steps", save_steps=2),
                    train_dataset=data)
    plain.train()
    trainer, _ = make(Regression(), training_args(str(tmp_path / "q")), data, unit="samples")
    with pytest.raises(RuntimeError, match=f"has no {STATE_FILE}"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "p" / "checkpoint-2"))

    first, _ = make(Regression(), training_args(str(tmp_path / "r"), save_strategy="steps", save_steps=2), data,
                    unit="samples", controller=None)
    first.train()
    other, _ = make(Regression(), training_args(str(tmp_path / "s"), gradient_accumulation_steps=4), data,
                    unit="samples", controller=None)
    with pytest.raises(ValueError, match="started at gradient_accumulation_steps=2"):
        other.train(resume_from_checkpoint=str(tmp_path / "r" / "checkpoint-2"))


# ---------------------------------------------------------------------------- GPT-2 and its loss normalisation
T = 8


class Rows(torch.utils.data.Dataset):
    """Token rows; the last two labels of every row are ignored (-100), so every microbatch has equal units."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (n, T), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[-2:] = -100
        return {"input_ids": self.ids[i], "labels": labels}


def _tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=T, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def test_gpt2_units_and_norms_follow_the_loss_the_model_really_computes(tmp_path):
    data = Rows(8)
    model = _tiny_gpt2()
    seen_items = []
    args = training_args(str(tmp_path), optim="sgd", learning_rate=0.0, max_steps=2, report_to="tensorboard",
                         logging_steps=1)
    trainer, rec = make(model, args, data, controller=None, estimator=NoiseScaleEstimator(min_steps=1))
    original = CBSTrainer.get_batch_samples

    def spy(self, it, n, device):
        batches, items = original(self, it, n, device)
        seen_items.append(float(items))
        return batches, items

    trainer.get_batch_samples = spy.__get__(trainer)
    trainer.train()

    # the Trainer divides each row's loss sum by the T - 2 labels it counts; the shifted loss sums T - 3 terms
    assert seen_items == [2 * 2 * (T - 2)] * 2
    assert [r.global_batch for r in rec.rows] == [2 * 2 * (T - 3)] * 2
    # independent reference for the second window: per-microbatch mean-loss gradients (lr=0: same weights)
    grads = []
    for i in (2, 3):
        batch = {k: torch.stack([data[j][k] for j in (2 * i, 2 * i + 1)]) for k in ("input_ids", "labels")}
        model.zero_grad()
        model(**batch).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    stacked = torch.stack(grads).double()
    stats = trainer.session.last_stats
    assert stats.small_sq_norm == pytest.approx(float(stacked.pow(2).sum(1).mean()), rel=1e-5)
    assert stats.big_sq_norm == pytest.approx(float(stacked.mean(0).pow(2).sum()), rel=1e-5)

    from tensorboard.backend.event_processing import event_accumulator

    (log_dir,) = {p.parent for p in tmp_path.glob("runs/*/events.out.tfevents.*")}
    acc = event_accumulator.EventAccumulator(str(log_dir), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("cbs/trace_cov", "cbs/tokens_seen", "cbs/global_batch_tokens", "cbs/accumulation_steps",
                "cbs_tokens/global_batch_tokens", "train/loss"):
        assert tag in tags, (tag, sorted(tags))
    seen = {e.step: e.value for e in acc.Scalars("cbs/tokens_seen")}
    assert seen == {1: 20.0, 2: 40.0}


# ---------------------------------------------------------------------------- refusals
def test_configurations_that_cannot_be_exact_are_refused(tmp_path):
    data = regression_data(8)
    with pytest.raises(RuntimeError, match="train_sampling_strategy='group_by_length'"):
        CBSTrainer(model=Regression(), args=training_args(str(tmp_path), train_sampling_strategy="group_by_length"),
                   train_dataset=data)
    # measuring only is fine with such a sampler
    CBSTrainer(model=Regression(), args=training_args(str(tmp_path), train_sampling_strategy="group_by_length"),
               train_dataset=data, observe_only=True)
    with pytest.raises(ValueError, match="shrinking is not supported"):
        CBSTrainer(model=Regression(), args=training_args(str(tmp_path)), train_dataset=data,
                   controller=BatchSizeController(allow_shrink=True))
    trainer = CBSTrainer(model=Regression(), args=training_args(str(tmp_path)), train_dataset=data)
    for flag, name in (("is_deepspeed_enabled", "DeepSpeed"), ("is_fsdp_enabled", "FSDP")):
        setattr(trainer, flag, True)
        with pytest.raises(RuntimeError, match=f"cannot be used with {name}"):
            trainer._check_configuration()
        setattr(trainer, flag, False)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(unit="bytes"), ValueError, "unit='bytes'"),
        (dict(controller="grow"), ValueError, "controller='grow'"),
        (dict(observe_only=1), TypeError, "observe_only=1"),
        (dict(batch_size_fn=3), TypeError, "batch_size_fn=3"),
        (dict(preconditioner="sgd"), ValueError, "preconditioner='sgd'"),
        (dict(lr_coupling="cubic"), ValueError, "lr_coupling='cubic'"),
        (dict(ignore_index=None), TypeError, "ignore_index=None"),
    ],
)
def test_bad_arguments_are_refused(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=re.escape(match)):
        CBSTrainer(model=Regression(), args=training_args(str(tmp_path)), train_dataset=regression_data(4), **kwargs)


def test_float_labels_are_counted_and_the_default_hold_says_what_it_reads(tmp_path):
    """A regression's targets under the default unit='tokens' are counted as before, and the default hold, whose
    threshold reads a language model's loss per token, says so once; with the hold set explicitly, nothing."""
    def said(**kw):
        trainer = CBSTrainer(model=Regression(), args=training_args(str(tmp_path)), train_dataset=regression_data(8),
                             **kw)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
        return [str(w.message) for w in caught if "not token ids" in str(w.message)], trainer

    messages, trainer = said()
    assert len(messages) == 1 and "CBSTrainer(unit='tokens')" in messages[0] and "hold_on_plateau=None" in messages[0]
    assert trainer.tokens_seen == 8  # each float target counted, as before
    assert said(controller=BatchSizeController(hold_on_plateau=None))[0] == []


def test_batch_size_fn_counts_the_units(tmp_path):
    data = Pairs(torch.randn(8, 8), torch.randn(8))
    trainer = CBSTrainer(model=Regression(), args=training_args(str(tmp_path)), train_dataset=data,
                         batch_size_fn=lambda inputs: inputs["x"].shape[0] * 1.0, unit="samples")
    trainer.train()
    assert trainer.tokens_seen == 8


# ---------------------------------------------------------------------------- the example
def test_hf_trainer_example_quick_run_grows_and_prints_what_it_measured(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_trainer.py"), "--quick", "--out", "run"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(r"gradient_accumulation_steps 2 -> 4", out), out
    assert re.search(r"done: \d+ optimizer steps, [\d,]+ tokens .* noise scale [\d,]+ tokens", out), out


# ---------------------------------------------------------------------------- versions and refusals
def test_a_transformers_release_outside_the_tested_ones_warns_once(tmp_path, monkeypatch):
    import cbs_tracker.integrations.transformers as cbs_hf

    assert cbs_hf.check_transformers_version("5.24.0") is None
    assert cbs_hf.check_transformers_version("5.24.3+local") is None
    message = cbs_hf.check_transformers_version("5.26.1")
    assert "5.24" in message and "5.26.1" in message
    monkeypatch.setattr(cbs_hf, "_VERSION_WARNED", False)
    assert cbs_hf.installed_transformers() == transformers.__version__
    monkeypatch.setattr(cbs_hf, "installed_transformers", lambda: "5.26.1")
    args = training_args(str(tmp_path / "v"))
    with pytest.warns(UserWarning, match=r"tested with transformers 5\.24; this is 5\.26\.1"):
        make(Regression(seed=0), args, regression_data(8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second trainer of the process does not warn again
        make(Regression(seed=0), args, regression_data(8))
    monkeypatch.setattr(cbs_hf, "_VERSION_WARNED", False)
    monkeypatch.setattr(cbs_hf, "installed_transformers", lambda: "5.24.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the tested release: no warning
        make(Regression(seed=0), args, regression_data(8))


def test_deepspeed_is_refused_with_the_reason(tmp_path):
    args = training_args(str(tmp_path / "ds"))
    args.deepspeed = "ds_config.json"  # TrainingArguments would need the deepspeed package to take it
    with pytest.raises(ValueError, match=r"deepspeed='ds_config.json'.*DeepSpeed is not supported.*partitions"):
        CBSTrainer(model=Regression(seed=0), args=args, train_dataset=regression_data(8))
