"""``CBSOlmoCallback`` in OLMo-core's real ``Trainer`` on the CPU (one process, and two gloo ranks with DDP and FSDP).

One run of ``olmo2_1M`` on the embedded corpus grows its batch from 4 to 8 sequences by a
``BatchSchedule`` and records every step (batch, starting weights, gradient, LR). It is held
against truths that can disagree: a float64 recomputation of each step's gradient and of the
microbatch norms the callback measured; the plain loop's ``CBSTracker`` on the same data and
weights; a run resumed from a checkpoint taken after the growth; OLMo-core's own
``BatchSizeSchedulerCallback`` given the same plan; and the same run on two ranks.

Tolerances: the float64 checks compare float32 training numbers (relative rounding ~1e-6 per
operation, a few hundred terms) with 1e-4; a missing microbatch, a wrong divisor or a stale LR
moves them by 10% or more. Runs that should be the same computation compare exactly or to 1e-6.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("olmo_core", reason="needs ai2-olmo-core (the [olmo] extra)")

from tests import olmo_workers as ow  # noqa: E402
from tests.spawning import spawn  # noqa: E402

STEPS = 10
GROW_AT = 6  # the schedule's mark: the tokens of 6 steps of 4 sequences; step 7 runs 8 sequences
MARKS = [(GROW_AT * 4 * ow.LOSS_TOKENS, 8 * ow.LOSS_TOKENS)]


def _schedule() -> Any:
    from cbs_tracker import BatchSchedule

    return BatchSchedule(MARKS, microbatch=ow.LOSS_TOKENS)


def _tracked(cbs: Any) -> list[Any]:
    """The callback's ``(record, stats)`` of every step."""
    out: list[Any] = []
    finish = cbs.session.finish_step

    def keep(stats: Any, *args: Any, **kwargs: Any) -> Any:
        record = finish(stats, *args, **kwargs)
        out.append((record, stats))
        return record

    cbs.session.finish_step = keep
    return out


@pytest.fixture(scope="module")
def grown(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from cbs_tracker import CBSOlmoCallback

    work = str(tmp_path_factory.mktemp("olmo"))
    cbs = CBSOlmoCallback(controller=_schedule())
    rec = ow.recorder()
    trainer = ow.build_trainer(work, callbacks={"cbs": cbs, "rec": rec}, steps=STEPS, save_interval=8)
    tracked = _tracked(cbs)
    trainer.fit()
    params = {n: p.detach().clone() for n, p in trainer.train_module.model.named_parameters()}
    return {"work": work, "cbs": cbs, "steps": rec.steps, "tracked": tracked, "params": params}


def _model64(weights: dict[str, torch.Tensor]) -> Any:
    from olmo_core.nn.transformer import TransformerConfig

    model = TransformerConfig.olmo2_1M(vocab_size=256).build(init_device="cpu")
    model.load_state_dict(weights)
    return model.double()


def _grads64(model: Any, input_ids: torch.Tensor, divisor: float) -> dict[str, torch.Tensor]:
    from olmo_core.data.utils import get_labels

    model.zero_grad(set_to_none=True)
    labels = get_labels({"input_ids": input_ids})
    out = model(input_ids, labels=labels, loss_reduction="sum", loss_div_factor=torch.tensor(divisor),
                ignore_index=-100)
    out.loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _sq(grads: dict[str, torch.Tensor]) -> float:
    return float(sum((g.double() ** 2).sum() for g in grads.values()))


def test_each_step_gradient_and_norms_match_a_float64_recomputation(grown):
    """Each step's gradient is the token mean over every microbatch that ran; the measured norms are the float64 ones."""
    checked = 0
    for step, (_record, stats) in zip(grown["steps"], grown["tracked"]):
        ids = step["input_ids"]
        model = _model64(step["weights"])
        whole = _grads64(model, ids, ids.shape[0] * ow.LOSS_TOKENS)
        diff = math.sqrt(sum(float(((whole[n] - step["grad"][n].double()) ** 2).sum()) for n in whole))
        assert diff <= 1e-4 * math.sqrt(_sq(whole)), (step["step"], diff)
        micro = [_sq(_grads64(model, ids[i:i + 1], ow.LOSS_TOKENS)) for i in range(ids.shape[0])]
        assert stats.num_microbatches == ids.shape[0] == step["global_batch"] // ow.SEQ
        assert stats.small_sq_norm == pytest.approx(sum(micro) / len(micro), rel=1e-4)
        assert stats.big_sq_norm == pytest.approx(_sq(whole), rel=1e-4)
        assert stats.units == ids.shape[0] * ow.LOSS_TOKENS
        checked += 1
    assert checked == STEPS


def test_the_batch_grows_at_the_plan_and_the_lr_follows_sqrt(grown):
    batches = [s["global_batch"] for s in grown["steps"]]
    assert batches == [4 * ow.SEQ] * GROW_AT + [8 * ow.SEQ] * (STEPS - GROW_AT)
    assert grown["cbs"].applied_changes == [(GROW_AT, 8 * ow.SEQ)]
    records = [r for r, _ in grown["tracked"]]
    assert [r.lr_coupling for r in records] == [1.0] * GROW_AT + [math.sqrt(2)] * (STEPS - GROW_AT)
    for r in records:  # the LR the step used is the schedule's (timed in tokens) times the coupling
        assert r.lr == pytest.approx(r.scheduled_lr * r.lr_coupling, rel=1e-12)
    assert records[-1].noise_scale is not None and records[-1].noise_scale > 0


def test_noise_scale_equals_the_plain_loops_on_the_same_data(grown):
    """``CBSTracker`` on the same model, weights and microbatches reports the same noise scale at every step."""
    from olmo_core.data.utils import get_labels

    from cbs_tracker import CBSTracker

    model = _model64(grown["steps"][0]["weights"]).float()
    opt = torch.optim.AdamW(model.parameters(), lr=ow.LR)
    tracker = CBSTracker(model, opt, accumulation_steps=4, loss_normalization="window", controller=_schedule())
    compared = 0
    for step, (record, _) in zip(grown["steps"], grown["tracked"]):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(step["weights"][n])
        ids = step["input_ids"]
        assert tracker.accumulation_steps == ids.shape[0]  # the plain loop grows at the same step
        for i in range(tracker.accumulation_steps):
            labels = get_labels({"input_ids": ids[i:i + 1]})
            with tracker.microbatch(labels=labels):
                out = model(ids[i:i + 1], labels=labels, loss_reduction="sum",
                            loss_div_factor=torch.tensor(float(ids.shape[0] * ow.LOSS_TOKENS)), ignore_index=-100)
                out.loss.backward()
        plain = tracker.step()
        opt.zero_grad(set_to_none=True)
        assert plain.global_batch == record.global_batch
        for field in ("noise_scale", "grad_sq_norm", "trace_cov", "step_grad_sq_norm", "step_trace_cov"):
            theirs, ours = getattr(plain, field), getattr(record, field)
            assert (theirs is None) == (ours is None), (step["step"], field)
            assert theirs is None or theirs == pytest.approx(ours, rel=1e-5), (step["step"], field)
        compared += record.step_trace_cov is not None
    assert compared >= STEPS - 2


def test_a_checkpoint_after_growth_resumes_at_the_grown_batch_with_the_same_lr_and_steps(grown, tmp_path, caplog):
    """Also: after the load the callback logs one line with the batch, the accumulation and the LR it restored
    (OLMo-core's own line gives the position in batches of the size the loader was built with)."""
    import logging

    from cbs_tracker import CBSOlmoCallback

    ckpt = Path(grown["work"]) / "run" / "step8"
    assert ckpt.is_dir()
    cbs = CBSOlmoCallback(controller=_schedule())
    rec = ow.recorder()
    trainer = ow.build_trainer(grown["work"], callbacks={"cbs": cbs, "rec": rec}, steps=STEPS,
                               save_folder=str(tmp_path / "resumed"), load_path=str(ckpt))
    tracked = _tracked(cbs)
    with caplog.at_level(logging.INFO, logger="cbs_tracker"):
        trainer.fit()
    restored = [r.getMessage() for r in caplog.records if "restored at step" in r.getMessage()]
    assert len(restored) == 1, restored
    ref = grown["tracked"][8][0]  # the uninterrupted run's step 9: its batch, accumulation and LR
    assert ref.global_batch == 8 * ow.LOSS_TOKENS and ref.accumulation_steps == 8
    assert (f"restored at step 8 ({GROW_AT * 4 * ow.SEQ + 2 * 8 * ow.SEQ:,d} tokens): global_batch_size "
            f"{8 * ow.SEQ} tokens, 8 microbatches per rank on 1 rank(s) (starting 4)") in restored[0]
    assert f"LR {ref.lr:.4g} for the next step (the schedule's x{math.sqrt(2):.4g} for the batch)" in restored[0]
    assert [s["step"] for s in rec.steps] == [9, 10]
    for mine, ref in zip(rec.steps, grown["steps"][8:]):
        assert mine["global_batch"] == ref["global_batch"] == 8 * ow.SEQ
        assert torch.equal(mine["input_ids"], ref["input_ids"])
        assert mine["lr"] == ref["lr"]
    for (mine, _), (ref, _) in zip(tracked, grown["tracked"][8:]):
        assert (mine.step, mine.tokens_seen, mine.lr_coupling) == (ref.step, ref.tokens_seen, ref.lr_coupling)
        for field in ("noise_scale", "grad_sq_norm", "trace_cov", "step_trace_cov"):
            a, b = getattr(mine, field), getattr(ref, field)
            assert (a is None and b is None) or a == pytest.approx(b, rel=1e-6), field
        assert mine.trace_cov is not None
    for n, p in trainer.train_module.model.named_parameters():
        torch.testing.assert_close(p.detach(), grown["params"][n], rtol=1e-6, atol=1e-7)


def test_the_same_plan_in_olmo_cores_batch_size_scheduler_runs_the_same_batches_and_lr(grown, tmp_path):
    from olmo_core.train import Duration
    from olmo_core.train.callbacks import BatchSizeSchedulerCallback

    theirs = BatchSizeSchedulerCallback(batch_sizes=[4 * ow.SEQ, 8 * ow.SEQ],
                                        schedule=[Duration.steps(0), Duration.steps(GROW_AT)])
    rec = ow.recorder()
    trainer = ow.build_trainer(grown["work"], callbacks={"bss": theirs, "rec": rec}, steps=STEPS,
                               save_folder=str(tmp_path / "theirs"))
    trainer.fit()
    assert len(rec.steps) == STEPS
    for mine, ref in zip(grown["steps"], rec.steps):
        assert mine["global_batch"] == ref["global_batch"], mine["step"]
        assert torch.equal(mine["input_ids"], ref["input_ids"])
        assert mine["lr"] == pytest.approx(ref["lr"], rel=1e-12), mine["step"]


def test_growth_neither_skips_nor_repeats_data(grown, tmp_path):
    """The grown run's sequences, in order, are the constant-batch run's on the same tokens."""
    rec = ow.recorder()
    constant = GROW_AT + 2 * (STEPS - GROW_AT)  # steps of 4 sequences holding the grown run's 56
    trainer = ow.build_trainer(grown["work"], callbacks={"rec": rec}, steps=constant,
                               save_folder=str(tmp_path / "constant"))
    trainer.fit()
    ours = torch.cat([s["input_ids"] for s in grown["steps"]])
    theirs = torch.cat([s["input_ids"] for s in rec.steps])
    assert ours.shape == theirs.shape == (GROW_AT * 4 + (STEPS - GROW_AT) * 8, ow.SEQ)
    assert torch.equal(ours, theirs)
    assert grown["tracked"][-1][0].tokens_seen == theirs.numel() * ow.LOSS_TOKENS / ow.SEQ


def test_a_run_stopped_short_of_its_budget_warns_once_saying_how_much(tmp_path, caplog):
    """SIGTERM (a ``timeout``, a preemption): OLMo-core cancels at its next check and ``fit()`` returns normally.

    The truths: the tokens of the batches that ran (as recorded), and the same plan run to its end.
    """
    import logging
    import signal

    from olmo_core.train.callbacks import Callback

    from cbs_tracker import CBSOlmoCallback

    class Terminate(Callback):
        def post_step(self) -> None:
            if self.trainer.global_step == GROW_AT + 1:
                os.kill(os.getpid(), signal.SIGTERM)

    planned = GROW_AT * 4 * ow.SEQ + (STEPS - GROW_AT) * 8 * ow.SEQ  # the grown plan's tokens in 10 steps
    runs = {}
    for name, extra in (("stopped", {"term": Terminate()}), ("whole", {})):
        cbs, rec = CBSOlmoCallback(controller=_schedule()), ow.recorder()
        trainer = ow.build_trainer(str(tmp_path), callbacks={"cbs": cbs, "rec": rec, **extra}, tokens=planned,
                                   save_folder=str(tmp_path / name))
        trainer.cancel_check_interval = 4
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="cbs_tracker"):
            trainer.fit()
        runs[name] = (trainer, cbs, rec, [r.getMessage() for r in caplog.records if "planned" in r.getMessage()])
    trainer, cbs, rec, warned = runs["whole"]
    assert trainer.global_train_tokens_seen == sum(s["input_ids"].numel() for s in rec.steps) == planned
    assert len(rec.steps) == STEPS and warned == []
    trainer, cbs, rec, warned = runs["stopped"]
    ran = sum(s["input_ids"].numel() for s in rec.steps)  # the tokens of the batches that ran
    assert len(rec.steps) == 8 and trainer.global_train_tokens_seen == ran == GROW_AT * 4 * ow.SEQ + 2 * 8 * ow.SEQ
    assert cbs.last_record.tokens_seen == ran * ow.LOSS_TOKENS / ow.SEQ
    assert len(warned) == 1, warned
    assert f"step 8 after {ran:,d} of its planned {planned:,d} tokens" in warned[0]
    assert f"{planned - ran:,d} tokens short" in warned[0] and "SIGTERM" in warned[0]
    assert f"{ran * ow.LOSS_TOKENS / ow.SEQ:,.0f} loss tokens" in warned[0]


# ---------------------------------------------------------------------------- errors
def _build_error(tmp_path: Path, **kwargs: Any) -> str:
    with pytest.raises((RuntimeError, ValueError, TypeError)) as info:
        ow.build_trainer(str(tmp_path), steps=2, **kwargs)
    return str(info.value)


def test_configuration_errors_name_what_to_change(tmp_path):
    from olmo_core.optim import CosWithWarmup
    from olmo_core.train import Duration
    from olmo_core.train.callbacks import BatchSizeSchedulerCallback

    from cbs_tracker import BatchSchedule, CBSOlmoCallback

    theirs = BatchSizeSchedulerCallback(batch_sizes=[4 * ow.SEQ, 8 * ow.SEQ],
                                        schedule=[Duration.steps(0), Duration.steps(2)])
    message = _build_error(tmp_path, callbacks={"cbs": CBSOlmoCallback(), "bss": theirs})
    assert "BatchSizeSchedulerCallback" in message and "callbacks['bss']" in message and "BatchSchedule" in message
    # a plan OLMo-core cannot reach by whole factors: 4 -> 6 sequences
    plan = BatchSchedule([(100, 6 * ow.LOSS_TOKENS)], microbatch=ow.LOSS_TOKENS)
    message = _build_error(tmp_path, callbacks={"cbs": CBSOlmoCallback(controller=plan)})
    assert "from 4 to 6 microbatches" in message and "whole factors" in message
    message = _build_error(tmp_path, callbacks={"cbs": CBSOlmoCallback()},
                           scheduler=CosWithWarmup(warmup=2))
    assert "units='steps'" in message and "units='tokens'" in message
    with pytest.raises(ValueError, match=r"lr_coupling='sideways'.*'auto', 'keep', 'sqrt', 'linear'"):
        CBSOlmoCallback(lr_coupling="sideways")


def test_an_optimizer_the_coupling_does_not_know_is_refused(tmp_path, monkeypatch):
    import olmo_core.optim as oo

    from cbs_tracker import CBSOlmoCallback

    class Sophia(torch.optim.Optimizer):  # an optimizer of a kind lr_coupling='auto' has no rule for
        def __init__(self, params: Any, lr: float = 1e-3) -> None:
            super().__init__(params, {"lr": lr})

    monkeypatch.setattr(oo.AdamWConfig, "optimizer", classmethod(lambda cls: Sophia))
    monkeypatch.setattr(oo.AdamWConfig, "build", lambda self, model, strict=True: Sophia(model.parameters()))
    message = _build_error(tmp_path, callbacks={"cbs": CBSOlmoCallback()})
    assert "Sophia" in message and "lr_coupling='sqrt'" in message
    ow.build_trainer(str(tmp_path), steps=2, callbacks={"cbs": CBSOlmoCallback(lr_coupling="sqrt")})


# ---------------------------------------------------------------------------- two ranks
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("olmo2")
    names = ["ddp", "fsdp", "async_gloo"]
    spawn(ow.run_ranks, args=(2, str(tmp / "pg"), str(tmp), names), nprocs=2, join=True)
    return {n: [json.loads((tmp / f"{n}.rank{r}.json").read_text()) for r in range(2)] for n in names}


@pytest.mark.parametrize("dp", ["ddp", "fsdp"])
def test_two_ranks_grow_alike_and_measure_what_one_process_measures(two_ranks, grown, dp):
    ranks = two_ranks[dp]
    assert ranks[0]["records"] == ranks[1]["records"]  # every rank decides and logs the same
    assert ranks[0]["changes"] == ranks[1]["changes"] == [[GROW_AT, 8 * ow.SEQ]]
    assert ranks[0]["global_batch"] == [4 * ow.SEQ] * GROW_AT + [8 * ow.SEQ] * (STEPS - GROW_AT)
    one = [r for r, _ in grown["tracked"]]
    assert len(ranks[0]["records"]) == len(one) == STEPS
    for row, ref in zip(ranks[0]["records"], one):
        assert row["accumulation_steps"] * 2 == ref.accumulation_steps
        assert row["global_batch"] == ref.global_batch and row["tokens_seen"] == ref.tokens_seen
        assert row["lr"] == pytest.approx(ref.lr, rel=1e-6)
        for field in ("noise_scale", "grad_sq_norm", "trace_cov"):
            a, b = row[field], getattr(ref, field)
            assert (a is None and b is None) or a == pytest.approx(b, rel=1e-3), (row["step"], field)
    assert ranks[0]["records"][-1]["noise_scale"] is not None
    for mine, ref in zip(ranks[0]["grad_sq"], grown["steps"]):
        assert mine == pytest.approx(_sq(ref["grad"]), rel=1e-4)
    final = torch.cat([p.flatten() for p in grown["params"].values()]).double()
    params = torch.tensor([x for p in ranks[0]["params"] for x in p], dtype=torch.float64)
    torch.testing.assert_close(params, final, rtol=0, atol=1e-4)
    if dp == "ddp":  # the replicas are identical
        assert ranks[0]["params"] == ranks[1]["params"]


def test_an_async_checkpointer_on_gloo_is_refused_before_it_hangs(two_ranks):
    for rank in two_ranks["async_gloo"]:
        assert rank["error"] is not None and "save_async=False" in rank["error"], rank


def test_growth_under_a_duration_in_steps_warns_once_that_the_run_trains_more_tokens(tmp_path, caplog):
    """A plan of optimizer steps runs past its data once steps hold more tokens; a plan in tokens does not."""
    import logging

    from cbs_tracker import CBSOlmoCallback

    warned = {}
    for name, kwargs in (("steps", {"steps": STEPS}), ("tokens", {"tokens": STEPS * 4 * ow.SEQ})):
        rec = ow.recorder()
        trainer = ow.build_trainer(str(tmp_path), callbacks={"cbs": CBSOlmoCallback(controller=_schedule()),
                                                             "rec": rec}, save_folder=str(tmp_path / name), **kwargs)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="cbs_tracker"):
            trainer.fit()
        trained = sum(s["input_ids"].numel() for s in rec.steps)
        warned[name] = ([r.getMessage() for r in caplog.records if "counts optimizer steps" in r.getMessage()],
                        trained)
    messages, trained = warned["steps"]
    assert trained > STEPS * 4 * ow.SEQ  # the truth: more tokens than the plan's steps at the starting batch
    assert len(messages) == 1 and "Duration.tokens" in messages[0] and "2x the starting batch" in messages[0]
    messages, trained = warned["tokens"]
    assert messages == [] and trained == STEPS * 4 * ow.SEQ


# ---------------------------------------------------------------------------- the asynchronous checkpoint
@pytest.mark.parametrize("backend", ["gloo", "cpu:gloo", "cpu:gloo,cuda:nccl", "cuda:nccl,cpu:gloo"])
def test_an_async_checkpointer_is_refused_on_each_backend_string_that_puts_the_cpu_on_gloo(monkeypatch, backend):
    """OLMo-core's ``prepare_training_environment`` names a backend per device (``"cpu:gloo,cuda:nccl"`` by
    default, ``"cpu:gloo"`` on a CPU-only machine); ``get_backend()`` returns that string, not ``"gloo"``."""
    from types import SimpleNamespace

    import cbs_tracker.integrations.olmo_core as oc
    from olmo_core.train.callbacks import CheckpointerCallback

    from cbs_tracker import CBSOlmoCallback

    monkeypatch.setattr(oc.cbs_dist, "is_distributed", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *a, **k: backend)
    cbs = CBSOlmoCallback()
    on_cpu = SimpleNamespace(device=torch.device("cpu"))
    for save_async in (None, True):
        trainer = SimpleNamespace(callbacks={"ckpt": CheckpointerCallback(save_async=save_async)})
        with pytest.raises(RuntimeError, match=rf"callbacks\['ckpt'\].*save_async={save_async}.*{backend!r}.*"
                           r"save_async=False"):
            cbs._check_async_checkpoint(trainer, on_cpu)
    cbs._check_async_checkpoint(SimpleNamespace(callbacks={"ckpt": CheckpointerCallback(save_async=False)}), on_cpu)
    on_cuda = SimpleNamespace(device=torch.device("cuda", 0))
    trainer = SimpleNamespace(callbacks={"ckpt": CheckpointerCallback()})
    if backend == "cpu:gloo,cuda:nccl" or backend == "cuda:nccl,cpu:gloo":  # CUDA tensors go through NCCL
        cbs._check_async_checkpoint(trainer, on_cuda)
    elif backend == "gloo":  # gloo for every device
        with pytest.raises(RuntimeError, match="save_async=False"):
            cbs._check_async_checkpoint(trainer, on_cuda)


def test_the_backend_of_each_device_is_read_from_the_string():
    from cbs_tracker.integrations.olmo_core import _backend_for

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [_backend_for(b, cpu) for b in ("gloo", "cpu:gloo", "cpu:gloo,cuda:nccl", "nccl", "cuda:nccl")] == [
        "gloo", "gloo", "gloo", "nccl", ""]
    assert [_backend_for(b, cuda) for b in ("gloo", "cpu:gloo", "cpu:gloo,cuda:nccl", "nccl")] == [
        "gloo", "", "nccl", "nccl"]


def test_the_noise_scale_and_the_batch_show_on_olmo_cores_console(tmp_path, caplog):
    """OLMo-core's ``ConsoleLoggerCallback`` prints only the metrics it names: the callback adds its main ones,
    and leaves a console logger that already names ``cbs/...`` metrics as it is."""
    import logging

    from cbs_tracker.integrations.olmo_core import CONSOLE_METRICS
    from olmo_core.train.callbacks import ConsoleLoggerCallback

    from cbs_tracker import CBSOlmoCallback

    trainer = ow.build_trainer(str(tmp_path), callbacks={"cbs": CBSOlmoCallback(controller=None)}, steps=10,
                               save_folder=str(tmp_path / "run"))
    with caplog.at_level(logging.INFO, logger="olmo_core"):
        trainer.fit()
    printed = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("olmo_core.train.callbacks"))
    assert f"cbs/global_batch_tokens={4 * ow.LOSS_TOKENS}.00" in printed and "cbs/noise_scale=" in printed, printed
    assert "cbs/accumulation_steps=4.000" in printed and "cbs/noise_scale_low=" in printed
    mine = ConsoleLoggerCallback(metrics=["train/CE loss", "cbs/*"])
    trainer = ow.build_trainer(str(tmp_path), callbacks={"cbs": CBSOlmoCallback(controller=None), "console": mine},
                               steps=1, save_folder=str(tmp_path / "run2"))
    assert mine.metrics == ["train/CE loss", "cbs/*"] and not set(CONSOLE_METRICS) & set(mine.metrics)


def test_two_cpu_gloo_ranks_stopped_by_sigterm_after_growth_resume_at_the_grown_batch_and_lr(tmp_path):
    """OLMo-core's own backend string on a CPU machine (``prepare_training_environment(backend="cpu:gloo")``),
    with the guide's two lines. The truth: the same run uninterrupted, step for step."""
    spawn(ow.run_ranks, args=(2, str(tmp_path / "pg"), str(tmp_path), ["stopped_resumed"], "cpu:gloo"),
          nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"stopped_resumed.rank{r}.json").read_text()) for r in range(2)]
    for rank in ranks:
        assert rank["backend"] == "cpu:gloo"
        assert rank["refused"] is not None and "'cpu:gloo'" in rank["refused"] and "save_async=False" in rank["refused"]
        stopped, resumed, whole = (rank["runs"][n] for n in ("stopped", "resumed", "whole"))
        # SIGTERM after step 7; the cancel is checked at step 8 (asynchronously: it may stop after step 9)
        n = len(stopped["steps"])
        assert stopped["canceled"] and stopped["steps"] == list(range(1, n + 1)) and 8 <= n <= 10
        assert not resumed["canceled"] and resumed["steps"] == list(range(n + 1, 13))
        assert whole["steps"] == list(range(1, 13)) and whole["global_batch"][6:] == [8 * ow.SEQ] * 6
        assert stopped["global_batch"] == whole["global_batch"][:n]
        assert resumed["global_batch"] == whole["global_batch"][n:] == [8 * ow.SEQ] * (12 - n)  # the grown batch
        assert resumed["input_ids"] == whole["input_ids"][n:]  # the same data, neither skipped nor repeated
        assert resumed["lr"] == pytest.approx(whole["lr"][n:], rel=1e-6)  # the grown LR (x sqrt 2) on the schedule
        assert resumed["tokens"] == whole["tokens"]
        assert len(resumed["restored"]) == 1 and f"global_batch_size {8 * ow.SEQ} tokens" in resumed["restored"][0]
        assert "4 microbatches per rank on 2 rank(s) (starting 2)" in resumed["restored"][0]
    for name in ("stopped", "resumed", "whole"):  # the ranks ran the same steps, batches and LR
        assert all(ranks[0]["runs"][name][k] == ranks[1]["runs"][name][k] for k in ("steps", "global_batch", "lr"))


# ---------------------------------------------------------------------------- the example
def test_the_olmo_core_example_runs_its_budget_and_reports_the_noise_scale(tmp_path):
    """``examples/olmo_core_gpt.py`` on one process, a small budget (about 20 seconds): its smoke test."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, str(root / "examples" / "olmo_core_gpt.py"), "--tokens", "6000", "--warmup-steps", "5",
         "--work-dir", str(tmp_path / "work")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OLMo-core trained" in out.stdout, out.stdout
    assert "noise scale" in out.stdout and "noise scale None" not in out.stdout, out.stdout
