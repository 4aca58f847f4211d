"""OLMo-core runs for ``tests/test_olmo_core.py``: the real ``Trainer`` on the CPU, one process or spawned gloo ranks.

The model is OLMo-core's smallest (``olmo2_1M``, vocabulary 256) on the embedded corpus
(bytes of the standard library as a ``uint8`` token file). One microbatch is one sequence
of ``SEQ`` tokens on each rank, so the microbatches of a step are the same sequences at any
number of ranks (OLMo-core hands each rank a slice of the same global batch): a run on two
ranks and one on one process measure the same per-microbatch gradients.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

SEQ = 16
#: tokens the loss counts per sequence (the last label of each sequence is ignored)
LOSS_TOKENS = SEQ - 1
LR = 3e-3


def token_file(work: str) -> str:
    """The embedded corpus's first bytes as the token file OLMo-core's numpy dataset reads (uint8: vocabulary 256)."""
    path = os.path.join(work, "corpus.npy")
    if not os.path.exists(path):
        from cbs_tracker.demo.corpus import load_corpus

        data = load_corpus(max_bytes=64 * 1024).train
        tmp = f"{path}.{os.getpid()}.tmp"  # ranks may write it at once: each its own, then one atomic rename
        mm = np.memmap(tmp, dtype=np.uint8, mode="w+", shape=data.shape)
        mm[:] = data
        mm.flush()
        del mm
        os.replace(tmp, path)
    return path


def build_trainer(
    work: str,
    *,
    callbacks: dict[str, Any],
    sequences: int = 4,
    steps: int | None = None,
    tokens: int | None = None,
    dp: str | None = None,
    save_folder: str | None = None,
    load_path: str | None = None,
    save_interval: int = 1000,
    scheduler: Any = "cos",
) -> Any:
    """A ``Trainer`` of ``olmo2_1M`` with a global batch of ``sequences`` sequences, one per microbatch and rank."""
    from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.optim import AdamWConfig, CosWithWarmup
    from olmo_core.train import Duration, TrainerConfig
    from olmo_core.train.callbacks import CheckpointerCallback
    from olmo_core.train.train_module import TransformerTrainModuleConfig
    from olmo_core.train.train_module.transformer.config import TransformerDataParallelConfig
    from olmo_core.utils import seed_all

    tokenizer = TokenizerConfig(vocab_size=256, eos_token_id=0, pad_token_id=1)
    dataset = NumpyFSLDatasetConfig(paths=[token_file(work)], sequence_length=SEQ, tokenizer=tokenizer,
                                    work_dir=os.path.join(work, "dataset")).build()
    seed_all(0)
    model = TransformerConfig.olmo2_1M(vocab_size=256).build(init_device="cpu")
    if scheduler == "cos":
        scheduler = CosWithWarmup(warmup=4 * SEQ * sequences, units="tokens", t_max=40 * SEQ * sequences)
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=SEQ, max_sequence_length=SEQ, optim=AdamWConfig(lr=LR), scheduler=scheduler,
        max_grad_norm=1.0, dp_config=None if dp is None else TransformerDataParallelConfig(name=dp),
    ).build(model, device=torch.device("cpu"))
    loader = NumpyDataLoaderConfig(global_batch_size=sequences * SEQ, seed=0, work_dir=os.path.join(work, "dataset")
                                   ).build(dataset, dp_process_group=module.dp_process_group)
    duration = Duration.steps(steps) if steps is not None else Duration.tokens(int(tokens))  # type: ignore[arg-type]
    callbacks = dict(callbacks)
    callbacks.setdefault("checkpointer", CheckpointerCallback(save_interval=save_interval, save_async=False))
    return TrainerConfig(
        save_folder=save_folder or os.path.join(work, "run"), max_duration=duration, metrics_collect_interval=1,
        load_path=load_path, callbacks=callbacks, save_overwrite=True,
    ).build(module, loader)


def recorder() -> Any:
    """A callback keeping each step's batch, starting weights, gradient (before clipping), LR and batch size."""
    from olmo_core.train.callbacks import Callback

    class Recorder(Callback):
        priority = -10  # after the tracker's callback

        def __init__(self) -> None:
            self.steps: list[dict[str, Any]] = []

        def pre_step(self, batch: dict[str, Any]) -> None:
            model = self.trainer.train_module.model
            self.steps.append({
                "step": int(self.trainer.global_step),
                "input_ids": batch["input_ids"].clone(),
                "weights": {k: _full(v).detach().clone() for k, v in model.state_dict().items()},
                "global_batch": int(self.trainer.data_loader.global_batch_size),
            })

        def pre_optim_step(self) -> None:
            model = self.trainer.train_module.model
            self.steps[-1]["grad"] = {n: _full(p.grad).detach().clone() for n, p in model.named_parameters()}

        def post_train_batch(self) -> None:
            self.steps[-1]["lr"] = float(self.trainer.train_module.optim.param_groups[0]["lr"])

    return Recorder()


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def record_row(rec: Any) -> dict[str, Any]:
    return {k: getattr(rec, k) for k in ("step", "tokens_seen", "global_batch", "accumulation_steps", "noise_scale",
                                         "grad_sq_norm", "trace_cov", "lr", "lr_coupling")}


# ---------------------------------------------------------------------------- ranks
def run_ranks(rank: int, world: int, init_file: str, out_dir: str, names: list[str], backend: str = "gloo") -> None:
    """Spawn target: each scenario of ``names`` on ``world`` ranks of ``backend`` (``"gloo"``, or a string per
    device as OLMo-core's ``prepare_training_environment`` gives it: ``"cpu:gloo"``), one JSON file per rank."""
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world))
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        import olmo_core.distributed.parallel as parallel

        for name in names:
            parallel._WORLD_MESH = None  # OLMo-core builds one world mesh per process; each scenario its own
            payload = SCENARIOS[name](rank, out_dir)
            path = Path(out_dir) / f"{name}.rank{rank}.json"
            path.write_text(json.dumps(payload))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _growing(rank: int, out_dir: str, dp: str) -> dict[str, Any]:
    from cbs_tracker import BatchSchedule, CBSOlmoCallback

    work = os.path.join(out_dir, dp)
    os.makedirs(work, exist_ok=True)
    cbs = CBSOlmoCallback(controller=BatchSchedule([(6 * 4 * LOSS_TOKENS, 8 * LOSS_TOKENS)], microbatch=LOSS_TOKENS))
    rec = recorder()
    trainer = build_trainer(work, callbacks={"cbs": cbs, "rec": rec}, steps=10, dp=dp)
    records = []
    finish = cbs.session.finish_step  # type: ignore[union-attr]

    def keep(*args: Any, **kwargs: Any) -> Any:
        out = finish(*args, **kwargs)
        records.append(record_row(out))
        return out

    cbs.session.finish_step = keep  # type: ignore[union-attr,method-assign]
    trainer.fit()
    params = [_full(p).detach().double().flatten().tolist() for p in trainer.train_module.model.parameters()]
    return {
        "records": records,
        "changes": cbs.applied_changes,
        "lr": [s["lr"] for s in rec.steps],
        "global_batch": [s["global_batch"] for s in rec.steps],
        "grad_sq": [float(sum((g.double() ** 2).sum() for g in s["grad"].values())) for s in rec.steps],
        "params": params if rank == 0 or dp == "ddp" else None,
        "local_params": [float((p.to_local() if hasattr(p, "to_local") else p).double().sum())
                         for p in trainer.train_module.model.parameters()],
    }


def _async_on_gloo(rank: int, out_dir: str) -> dict[str, Any]:
    from olmo_core.train.callbacks import CheckpointerCallback

    from cbs_tracker import CBSOlmoCallback

    work = os.path.join(out_dir, "async")
    os.makedirs(work, exist_ok=True)
    try:
        build_trainer(work, callbacks={"cbs": CBSOlmoCallback(), "checkpointer": CheckpointerCallback()},
                      steps=2, dp="ddp")
    except RuntimeError as err:
        return {"error": str(err)}
    return {"error": None}


def _stopped_and_resumed(rank: int, out_dir: str) -> dict[str, Any]:
    """The guide's lines on the backend the ranks were started with: an asynchronous checkpointer refused; a run
    stopped by SIGTERM after its growth, resumed by the same command; the same run uninterrupted."""
    import logging
    import signal

    from olmo_core.train.callbacks import Callback, CheckpointerCallback

    from cbs_tracker import BatchSchedule, CBSOlmoCallback

    def schedule() -> Any:
        return BatchSchedule([(6 * 4 * LOSS_TOKENS, 8 * LOSS_TOKENS)], microbatch=LOSS_TOKENS)

    class Terminate(Callback):
        def post_step(self) -> None:
            if self.trainer.global_step == 7 and not getattr(self, "sent", False):
                self.sent = True
                os.kill(os.getpid(), signal.SIGTERM)  # torchrun forwards a SIGTERM to every worker

    class Lines(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.INFO)
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    work = os.path.join(out_dir, "stopped")
    os.makedirs(work, exist_ok=True)
    tokens = 6 * 4 * SEQ + 6 * 8 * SEQ  # 12 steps: 6 of 4 sequences, 6 of 8
    out: dict[str, Any] = {"backend": str(dist.get_backend())}
    try:
        build_trainer(work, callbacks={"cbs": CBSOlmoCallback(), "checkpointer": CheckpointerCallback()},
                      tokens=tokens, dp="ddp", save_folder=os.path.join(work, "refused"))
        out["refused"] = None
    except RuntimeError as err:
        out["refused"] = str(err)
    runs: dict[str, Any] = {}
    for name, extra, folder in (("stopped", {"term": Terminate()}, "run"), ("resumed", {}, "run"),
                                ("whole", {}, "whole")):
        import olmo_core.distributed.parallel as parallel

        parallel._WORLD_MESH = None
        cbs, rec = CBSOlmoCallback(controller=schedule()), recorder()
        trainer = build_trainer(work, callbacks={"cbs": cbs, "rec": rec, **extra}, tokens=tokens, dp="ddp",
                                save_folder=os.path.join(work, folder))
        trainer.cancel_check_interval = 4
        lines = Lines()
        logging.getLogger("cbs_tracker").addHandler(lines)
        level = logging.getLogger("cbs_tracker").level
        logging.getLogger("cbs_tracker").setLevel(logging.INFO)
        try:
            trainer.fit()
        finally:
            logging.getLogger("cbs_tracker").removeHandler(lines)
            logging.getLogger("cbs_tracker").setLevel(level)
        runs[name] = {
            "steps": [s["step"] for s in rec.steps],
            "global_batch": [s["global_batch"] for s in rec.steps],
            "lr": [s["lr"] for s in rec.steps],
            "input_ids": [s["input_ids"].tolist() for s in rec.steps],
            "canceled": bool(trainer.is_canceled),
            "tokens": int(trainer.global_train_tokens_seen),
            "restored": [m for m in lines.lines if "restored at step" in m],
        }
    out["runs"] = runs
    return out


SCENARIOS = {
    "ddp": lambda rank, out: _growing(rank, out, "ddp"),
    "fsdp": lambda rank, out: _growing(rank, out, "fsdp"),
    "async_gloo": _async_on_gloo,
    "stopped_resumed": _stopped_and_resumed,
}
