"""A Lightning GPT whose batch grows as the measured noise scale grows (``CBSCallback``).

The small byte-level GPT on the standard library's ``.py`` files starts at a 512-token
global batch (``accumulate_grad_batches=2``); ``CBSCallback`` with the default
controller doubles the accumulation mid-epoch, from the next window on. Logs go to
Lightning's ``TensorBoardLogger`` (``cbs/*`` against steps, ``cbs_tokens/*`` against tokens).

    python examples/lightning_gpt.py [--quick] [--devices 2 --strategy ddp]   # logs in runs/lightning_gpt
"""

from __future__ import annotations

import argparse
import time

import lightning.pytorch as pl
import numpy as np
import torch
from cbs_tracker.integrations.lightning import label_tokens
from lightning.pytorch.loggers import TensorBoardLogger

from cbs_tracker import BatchSizeController, CBSCallback, CBSDataLoader
from cbs_tracker.demo.corpus import SequenceStream, evaluate, load_corpus, windows
from cbs_tracker.demo.gpt import GPT, GPTConfig, make_adamw

SEQ_LEN = 128
MICRO_SEQUENCES = 2  # 256 tokens per microbatch


class Windows(torch.utils.data.Dataset):
    """The first ``n`` training windows of a :class:`SequenceStream` (map-style, so epochs end)."""

    def __init__(self, data: np.ndarray, n: int, seed: int = 0) -> None:
        self.data = data
        self.starts = SequenceStream(data, seq_len=SEQ_LEN, seed=seed).starts(0, n)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = windows(self.data, self.starts[i : i + 1], SEQ_LEN)
        return x[0], y[0]


class LitGPT(pl.LightningModule):
    """``GPT`` from :mod:`cbs_tracker.demo.gpt`, AdamW at a constant learning rate, gradients clipped at 1."""

    def __init__(self, lr: float = 2e-3) -> None:
        super().__init__()
        self.model = GPT(GPTConfig(context_length=SEQ_LEN))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self.model(x, y)  # mean over the microbatch's tokens (the assumed normalisation)
        self.log("train_loss", loss, prog_bar=True, batch_size=x.shape[0])
        return loss

    def configure_optimizers(self):
        return make_adamw(self.model, lr=self.lr, weight_decay=0.1)


class PrintChanges(pl.Callback):
    """Prints a line whenever the accumulation changes, and the tokens it took."""

    def __init__(self, cbs: CBSCallback) -> None:
        self.cbs = cbs
        self.accumulation: int | None = None
        self.start = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        a = self.cbs.window_accumulation or trainer.accumulate_grad_batches  # the window's, not Lightning's per batch
        if self.accumulation is not None and a != self.accumulation and trainer.is_global_zero:
            r = self.cbs.last_record
            ns = "-" if r.noise_scale is None else f"{r.noise_scale:,.0f}"
            print(
                f"[{time.perf_counter() - self.start:5.1f}s] epoch {trainer.current_epoch} batch {batch_idx}, "
                f"after step {r.step}: tokens seen {r.tokens_seen:,.0f}, noise scale {ns} tokens -> "
                f"accumulate_grad_batches {self.accumulation} -> {a} (global batch "
                f"{r.global_batch:,.0f} -> {r.global_batch * a / self.accumulation:,.0f} tokens)",
                flush=True,
            )
        self.accumulation = a


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=float, default=1.2e6, help="token budget (default 1.2M)")
    p.add_argument("--epochs", type=int, default=2, help="the budget is split into this many epochs")
    p.add_argument("--logdir", default="runs/lightning_gpt")
    p.add_argument("--precision", default="32-true", help="Trainer precision, e.g. bf16-mixed")
    p.add_argument("--devices", type=int, default=1, help="CPU processes")
    p.add_argument("--strategy", default="auto", help="e.g. ddp or ddp_spawn with --devices 2")
    p.add_argument("--progress-bar", action="store_true", help="show Lightning's progress bar")
    p.add_argument("--log-every-n-steps", type=int, default=10, help="log every this many steps")
    p.add_argument("--quick", action="store_true", help="tiny budget and fast controller settings")
    p.add_argument("--max-microbatch", type=int, default=None,
                   help="grow the microbatch first, up to this many sequences (a CBSDataLoader feeds the Trainer)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)

    corpus = load_corpus(max_bytes=2_000_000 if args.quick else None)
    if args.quick:
        # short warm-up and cool-down so that a few hundred steps show a change
        controller = BatchSizeController(
            warmup_steps=20, warmup_tokens=0, cooldown_tokens=0, patience=4, window=8, kappa=4.0,
            hold_on_plateau=None,  # no hold on a loss plateau (read a quarter into the run)
        )
        budget = min(args.tokens, 1.5e5)
    else:
        controller = "auto"  # BatchSizeController() with its defaults
        budget = args.tokens
    sequences = int(budget // SEQ_LEN)
    per_epoch = max(MICRO_SEQUENCES, sequences // args.epochs)
    loader_class = torch.utils.data.DataLoader if args.max_microbatch is None else CBSDataLoader
    data = loader_class(Windows(corpus.train, per_epoch), batch_size=MICRO_SEQUENCES)

    cbs = CBSCallback(controller=controller, batch_size_fn=label_tokens(),  # unit: tokens
                      max_microbatch=args.max_microbatch)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=args.strategy,
        precision=args.precision,
        max_epochs=args.epochs,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,  # clipped after CBSCallback read the unclipped norm
        callbacks=[cbs, PrintChanges(cbs)],
        logger=TensorBoardLogger(args.logdir, name="", version=None),
        log_every_n_steps=args.log_every_n_steps,
        enable_checkpointing=False,
        enable_progress_bar=args.progress_bar,
        enable_model_summary=False,
    )
    module = LitGPT()
    start = time.perf_counter()
    trainer.fit(module, data)
    if trainer.is_global_zero and args.strategy != "ddp_spawn":
        # (with ddp_spawn the parent's callback holds no state: the workers measured)
        val = evaluate(module.model, corpus.val, seq_len=SEQ_LEN, num_sequences=64)
        ns = cbs.noise_scale
        a = trainer.accumulate_grad_batches
        micro = MICRO_SEQUENCES * (1 if cbs.session is None else cbs.session.micro_group)
        print(
            f"done in {time.perf_counter() - start:.0f}s: {cbs.steps} optimizer steps, {cbs.tokens_seen:,.0f} "
            f"tokens, val loss {val:.3f} nats/byte, noise scale {'-' if ns is None else f'{ns:,.0f}'} tokens, "
            f"accumulate_grad_batches {a} x {micro} sequences (global batch "
            f"{a * micro * SEQ_LEN * trainer.world_size:,} tokens), logs in {trainer.logger.log_dir}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
