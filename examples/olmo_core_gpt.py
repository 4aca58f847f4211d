"""OLMo-core's smallest model on the standard library, ``CBSOlmoCallback`` growing its batch as it trains.

OLMo-core's ``Trainer`` trains ``olmo2_1M`` (vocabulary 256: one token per byte) on the
embedded corpus written as a token file; the callback measures the noise scale of every
step across the data-parallel ranks, doubles ``global_batch_size`` when the controller
decides so (the LR's base times sqrt(2) per doubling, the cosine schedule counted in
tokens) and checkpoints its state with the trainer's. Rank 0 prints what was measured.

    pip install -e ".[olmo]"
    python examples/olmo_core_gpt.py
    torchrun --standalone --nproc_per_node=2 examples/olmo_core_gpt.py --dp ddp    # or --dp fsdp (gloo on CPUs)

Both start from the same global batch (2 microbatches of 2 sequences: one process accumulates
two, two ranks run one each), so they see the same data and grow at about the same step; the
default budget (150k tokens) shows a doubling in a minute or two on two CPU cores. A run that
OLMo-core stops early (SIGTERM from a ``timeout``, Ctrl-C) saves its checkpoint and returns
normally: the last line then says how much of the budget ran, and the same command resumes it.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
import torch
import torch.distributed as dist

from cbs_tracker import BatchSizeController, CBSOlmoCallback
from cbs_tracker.demo.corpus import load_corpus


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=150_000, help="training budget in tokens, all ranks (default 150k)")
    p.add_argument("--seq-len", type=int, default=64, help="context length (default 64)")
    p.add_argument("--micro-sequences", type=int, default=2, help="sequences per microbatch per rank (default 2)")
    p.add_argument("--accumulation", type=int, default=None,
                   help="starting microbatches per step and rank (default: 2 in all, i.e. 2 on one process, 1 on two ranks)")
    p.add_argument("--lr", type=float, default=4e-3, help="AdamW peak learning rate (default 4e-3)")
    p.add_argument("--dp", choices=["ddp", "fsdp"], default="ddp", help="data parallelism under torchrun")
    p.add_argument("--warmup-steps", type=int, default=20, help="controller: no change before this step")
    p.add_argument("--hold-on-plateau", type=lambda v: None if v == "none" else float(v), default=0.15,
                   help="controller: hold growth on a loss plateau (BatchSizeController(hold_on_plateau=...)); "
                        "default 0.15, the library's; 'none': off")
    p.add_argument("--work-dir", default=None, help="token file and checkpoints (default: a temporary folder)")
    return p


def main() -> None:
    args = parser().parse_args()
    from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.optim import AdamWConfig, CosWithWarmup
    from olmo_core.train import Duration, TrainerConfig
    from olmo_core.train.callbacks import CheckpointerCallback
    from olmo_core.train.train_module import TransformerTrainModuleConfig
    from olmo_core.train.train_module.transformer.config import TransformerDataParallelConfig
    from olmo_core.utils import seed_all

    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    world = dist.get_world_size() if distributed else 1
    accumulation = args.accumulation if args.accumulation is not None else max(1, 2 // world)
    if accumulation < 1 or accumulation * world < 2:
        raise SystemExit(f"--accumulation={accumulation}: need at least 1 per rank and 2 microbatches in all "
                         f"(here {world} rank(s)) to measure the noise scale")
    rank = dist.get_rank() if distributed else 0
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() \
        else torch.device("cpu")
    work = args.work_dir or os.path.join(tempfile.gettempdir(), "cbs_olmo_core_example")
    os.makedirs(work, exist_ok=True)
    path = os.path.join(work, "corpus.npy")
    if rank == 0 and not os.path.exists(path):  # the corpus's bytes, the token file OLMo-core reads
        data = load_corpus().train
        tokens = np.memmap(path + ".tmp", dtype=np.uint8, mode="w+", shape=data.shape)
        tokens[:] = data
        tokens.flush()
        os.replace(path + ".tmp", path)
    if distributed:
        dist.barrier()

    seq = args.seq_len
    dataset = NumpyFSLDatasetConfig(paths=[path], sequence_length=seq, work_dir=work,
                                    tokenizer=TokenizerConfig(vocab_size=256, eos_token_id=0, pad_token_id=1)).build()
    seed_all(0)
    model = TransformerConfig.olmo2_1M(vocab_size=256).build(init_device="cpu")
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=args.micro_sequences * seq, max_sequence_length=seq,
        optim=AdamWConfig(lr=args.lr), max_grad_norm=1.0,
        scheduler=CosWithWarmup(warmup=args.tokens // 20, units="tokens"),  # on the data, whatever the batch
        dp_config=TransformerDataParallelConfig(name=args.dp) if distributed else None,
    ).build(model, device=device)
    loader = NumpyDataLoaderConfig(
        global_batch_size=accumulation * args.micro_sequences * seq * world, seed=0, work_dir=work,
    ).build(dataset, dp_process_group=module.dp_process_group)
    cbs = CBSOlmoCallback(controller=BatchSizeController(warmup_steps=args.warmup_steps, patience=8,
                                                          hold_on_plateau=args.hold_on_plateau))
    trainer = TrainerConfig(
        # one folder per setting: the same command resumes its own run, another budget or plateau hold starts afresh
        save_folder=os.path.join(work, f"run{world}{'-' + args.dp if distributed else ''}-{args.tokens}"
                                       + ("" if args.hold_on_plateau is None else f"-plateau{args.hold_on_plateau:g}")),
        max_duration=Duration.tokens(args.tokens),
        metrics_collect_interval=10, save_overwrite=True,
        callbacks={"cbs": cbs, "checkpointer": CheckpointerCallback(save_interval=10_000, save_async=False)},
    ).build(module, loader)
    trainer.fit()
    record = cbs.last_record
    if rank == 0 and record is None:
        print(f"nothing left to train: {trainer.save_folder} holds a run that finished its {args.tokens:,d} tokens "
              "(pass another --work-dir or --tokens to train again)")
    elif rank == 0:
        noise = "-" if record.noise_scale is None else f"{record.noise_scale:,.0f}"
        print(f"{record.step} steps, {record.tokens_seen:,.0f} loss tokens on {world} rank(s); noise scale "
              f"{noise} tokens; global batch {trainer.data_loader.global_batch_size:,d} tokens; batch changes "
              f"(step, tokens): {cbs.applied_changes}; LR coupling x{record.lr_coupling:.3g}")
        seen = trainer.global_train_tokens_seen
        print(f"OLMo-core trained {seen:,d} of the {args.tokens:,d}-token budget"
              + ("" if seen >= args.tokens else f": stopped {args.tokens - seen:,d} tokens short (canceled: "
                 f"{getattr(trainer, '_cancel_reason', None) or 'see the warning above'}); the same command resumes it"))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
