"""A tiny GPT-2 trained from scratch with ``CBSTrainer``: the Hugging Face Trainer whose batch grows with the noise scale.

A 2-layer ``GPT2LMHeadModel`` built from a config (no download) learns the bytes of the
standard library's ``.py`` files, starting at 2 accumulation steps of 2 sequences of 128
bytes; the tracker doubles ``gradient_accumulation_steps`` at aligned microbatches, keeps
the cosine schedule on its token timing and logs ``cbs/*`` to TensorBoard.

    python examples/hf_trainer.py [--quick] [--out runs/hf_trainer]     # about a minute on CPU
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np
import torch
from cbs_tracker.integrations.transformers import CBSTrainer
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from cbs_tracker import BatchSizeController
from cbs_tracker.demo.corpus import SequenceStream, load_corpus, windows

SEQ_LEN = 128
MICRO_SEQUENCES = 2


class Rows(torch.utils.data.Dataset):
    """``input_ids``/``labels`` rows: the first ``n`` training windows of a :class:`SequenceStream`."""

    def __init__(self, data: np.ndarray, n: int, seed: int = 0) -> None:
        self.ids, _ = windows(data, SequenceStream(data, seq_len=SEQ_LEN, seed=seed).starts(0, n), SEQ_LEN)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}  # GPT-2 shifts the labels itself


class PrintChanges(TrainerCallback):
    """Prints a line whenever the tracker decides a new accumulation (it takes effect at an aligned microbatch)."""

    def __init__(self) -> None:
        self.trainer: CBSTrainer | None = None
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        r = self.trainer.last_record
        old, new = r.accumulation_steps, r.next_accumulation_steps
        if self.trainer.session.changed_this_step and state.is_world_process_zero:
            ns = "-" if r.noise_scale is None else f"{r.noise_scale:,.0f}"
            print(
                f"[{time.perf_counter() - self.start:5.1f}s] step {r.step}: tokens seen {r.tokens_seen:,.0f}, noise "
                f"scale {ns} tokens -> gradient_accumulation_steps {old} -> {new} (global batch "
                f"{r.global_batch:,.0f} -> {r.global_batch * new / old:,.0f} tokens)",
                flush=True,
            )


@torch.no_grad()
def validation_loss(model: GPT2LMHeadModel, val: np.ndarray, num_sequences: int = 64) -> float:
    model.eval()
    starts = np.linspace(0, val.size - SEQ_LEN - 2, num_sequences).astype(np.int64)
    x, _ = windows(val, starts, SEQ_LEN)
    return float(model(input_ids=x, labels=x).loss)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=float, default=6e5, help="token budget over both epochs (default 600k)")
    p.add_argument("--out", default="runs/hf_trainer", help="output folder (TensorBoard logs in OUT/runs)")
    p.add_argument("--quick", action="store_true", help="a 100k-token smoke run with fast controller settings")
    p.add_argument("--constant", action="store_true", help="measure only: keep the starting batch (for comparison)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("transformers").setLevel(logging.ERROR)

    corpus = load_corpus(max_bytes=2_000_000 if args.quick else None)
    budget = 1e5 if args.quick else args.tokens
    micro = 1 if args.quick else MICRO_SEQUENCES  # quick: start at 254 tokens, below the noise scale early on
    per_epoch = max(micro, int(budget // SEQ_LEN) // 2)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=SEQ_LEN, n_embd=64, n_layer=2, n_head=4,
                                       bos_token_id=0, eos_token_id=0))
    training = TrainingArguments(
        output_dir=args.out, report_to="tensorboard", logging_steps=10,
        per_device_train_batch_size=micro, gradient_accumulation_steps=2, num_train_epochs=2,
        learning_rate=2e-3, weight_decay=0.1, adam_beta2=0.95, lr_scheduler_type="cosine", warmup_steps=20,
        max_grad_norm=1.0, save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
    )
    # fast settings so a few hundred steps show a change (the defaults wait for 100 steps)
    controller = None if args.constant else BatchSizeController(
        warmup_steps=20, warmup_tokens=0, cooldown_tokens=0, patience=4, window=8, kappa=2.0,
        hold_on_plateau=None)  # and no hold on a loss plateau (read a quarter into the run)
    printer = PrintChanges()
    trainer = CBSTrainer(model=model, args=training, train_dataset=Rows(corpus.train, per_epoch),
                         controller=controller, callbacks=[printer])  # unit: loss-contributing tokens
    printer.trainer = trainer
    start = time.perf_counter()
    trainer.train()
    r = trainer.last_record
    sched = trainer.lr_scheduler
    ns = trainer.noise_scale
    print(
        f"done: {r.step} optimizer steps, {r.tokens_seen:,.0f} tokens in {time.perf_counter() - start:.0f}s, val loss "
        f"{validation_loss(model, corpus.val):.3f} nats/byte, noise scale {'-' if ns is None else f'{ns:,.0f}'} "
        f"tokens, gradient_accumulation_steps {trainer.accumulation_steps} (global batch "
        f"{trainer.accumulation_steps * micro * (SEQ_LEN - 1):,} tokens); LR schedule at {sched.last_epoch} of {trainer.state.max_steps} starting-batch steps, "
        f"lr {sched.get_last_lr()[0]:.2e}; logs in {args.out}/runs",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
