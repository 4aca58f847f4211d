"""A Lightning Fabric pretraining loop in LitGPT's ``pretrain.py`` shape, the tracker growing the batch.

LitGPT's loop counts microbatches (``iter_num``) and accumulates while
``iter_num % gradient_accumulation_iters != 0`` inside ``fabric.no_backward_sync``. Here
``CBSTracker`` sets each window's length instead: ``tracker.microbatch`` replaces
``fabric.no_backward_sync`` (the tracker applies ``no_sync`` to the DDP module inside
Fabric's wrapper), ``fabric.backward(loss / tracker.accumulation_steps)``, then
``tracker.step()`` before ``fabric.clip_gradients``. LitGPT's ``get_lr`` (warm-up + cosine)
and its ``max_iters`` count microbatches per rank, as its ``iter_num`` does: the clock is
``tracker.microbatches_seen`` (the same data at any batch size), the LR is set through
``tracker.set_lr``, which multiplies in the batch coupling, and the loop stops at
``tracker.done(microbatches=max_iters)``. ``fabric.save`` and ``fabric.load`` carry the
tracker and the data stream with the model and optimizer. ``--constant`` runs it without growth.

    python examples/fabric_gpt.py --quick                      # one CPU process, about a minute
    python examples/fabric_gpt.py --devices 2 --quick          # two DDP ranks (Fabric launches them; gloo on CPU)
    python examples/fabric_gpt.py --quick --resume out/fabric_gpt/last.ckpt
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from cbs_tracker import BatchSizeController, CBSTracker
from cbs_tracker.demo.corpus import SequenceStream, evaluate, load_corpus
from cbs_tracker.demo.gpt import GPT, GPTConfig, make_adamw


def get_lr(learning_rate: float, it: int, warmup_iters: int, max_iters: int, min_lr: float) -> float:
    """LitGPT's schedule: linear warm-up, then cosine to ``min_lr`` (``it``: microbatches per rank, its ``iter_num``)."""
    if it < warmup_iters:
        return learning_rate * it / warmup_iters
    if it > max_iters:
        return min_lr
    ratio = (it - warmup_iters) / max(1, max_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=1, help="Fabric devices (DDP ranks when > 1; default 1)")
    p.add_argument("--precision", default="32-true", help="Fabric precision (default 32-true; bf16-mixed works on CPU)")
    p.add_argument("--tokens", type=float, default=1.2e6, help="token budget, all ranks (default 1.2M)")
    p.add_argument("--micro-sequences", type=int, default=2, help="sequences per microbatch per rank (default 2)")
    p.add_argument("--seq-len", type=int, default=128, help="context length (default 128)")
    p.add_argument("--accumulation", type=int, default=2, help="starting accumulation per rank (default 2)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    p.add_argument("--quick", action="store_true", help="a 150k-token budget and a fast controller")
    p.add_argument("--constant", action="store_true", help="no growth: the constant-batch run of the same loop")
    p.add_argument("--out", default="out/fabric_gpt", help="where last.ckpt is saved at the end")
    p.add_argument("--resume", default=None, help="a checkpoint of this script to continue from")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    import lightning as L

    args = parser().parse_args(argv)
    torch.set_num_threads(1)
    strategy = "ddp" if args.devices > 1 else "auto"
    fabric = L.Fabric(accelerator="cpu" if not torch.cuda.is_available() else "auto", devices=args.devices,
                      strategy=strategy, precision=args.precision)
    fabric.launch()
    fabric.seed_everything(args.seed)  # the same initial weights on every rank

    corpus = load_corpus(max_bytes=2_000_000 if args.quick else None)
    with fabric.init_module():
        model = GPT(GPTConfig(context_length=args.seq_len))
    optimizer = make_adamw(model, lr=args.lr, weight_decay=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    if args.quick:  # short warm-up and cool-down so that a few hundred steps show a change
        controller = None if args.constant else BatchSizeController(warmup_steps=20, warmup_tokens=0, cooldown_tokens=0, patience=4,
                                         window=8, kappa=2.0, hold_on_plateau=None)  # no hold on a loss plateau
        budget = min(args.tokens, 1.5e5)
    else:
        controller = None if args.constant else BatchSizeController()
        budget = args.tokens
    tracker = CBSTracker(model, optimizer, accumulation_steps=args.accumulation, controller=controller)
    stream = SequenceStream(corpus.train, seq_len=args.seq_len, seed=args.seed)
    state = {"model": model, "optimizer": optimizer, "tracker": tracker, "stream": stream}
    if args.resume:
        fabric.load(args.resume, state)
        fabric.print(f"resumed at step {tracker.steps}, {tracker.tokens_seen:,.0f} tokens, "
                     f"accumulation {tracker.accumulation_steps}")

    micro_tokens = args.micro_sequences * args.seq_len
    max_iters = int(budget // (micro_tokens * fabric.world_size))  # microbatches per rank, as LitGPT counts them
    warmup_iters = max(1, max_iters // 20)
    fabric.print(f"fabric_gpt: {fabric.world_size} rank(s), {args.precision}, microbatch {micro_tokens} tokens/rank, "
                 f"starting global batch {micro_tokens * fabric.world_size * args.accumulation:,} tokens")
    start = time.perf_counter()
    record = None
    while not tracker.done(microbatches=max_iters):  # LitGPT's iter_num >= max_iters, on the data
        for _ in range(tracker.accumulation_steps):  # the tracker decides the window's length
            tracker.set_lr(get_lr(args.lr, tracker.microbatches_seen, warmup_iters, max_iters, 0.1 * args.lr))
            input_ids, targets = stream.next_batch(args.micro_sequences, rank=fabric.global_rank,
                                                   world_size=fabric.world_size)
            input_ids, targets = fabric.to_device((input_ids, targets))
            with tracker.microbatch(labels=targets):  # no_sync on all but the last microbatch
                _, loss = model(input_ids, targets)
                fabric.backward(loss / tracker.accumulation_steps)
                tracker.observe_loss(loss)  # for the default's hold on a loss plateau
        record = tracker.step()  # the synced gradient, before clipping
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        if record.next_accumulation_steps != record.accumulation_steps:
            fabric.print(
                f"step {record.step}: tokens {record.tokens_seen:,.0f}, noise scale {record.noise_scale:,.0f} tokens "
                f"-> accumulation {record.accumulation_steps} -> {record.next_accumulation_steps} (global batch "
                f"{record.global_batch:,.0f} -> "
                f"{record.global_batch * record.next_accumulation_steps / record.accumulation_steps:,.0f} tokens)"
            )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    fabric.save(Path(args.out) / "last.ckpt", state)
    val = evaluate(model.module if hasattr(model, "module") else model, corpus.val, seq_len=args.seq_len,
                   num_sequences=64) if fabric.global_rank == 0 else math.nan
    ns = tracker.noise_scale
    last_lr = "-" if record is None else f"{record.scheduled_lr:.3g}"
    fabric.print(f"done: {tracker.steps} steps, {tracker.tokens_seen:,.0f} tokens in {time.perf_counter() - start:.0f}s, "
                 f"last scheduled lr {last_lr}, "
                 f"val loss {val:.3f} nats/byte, noise scale {'-' if ns is None else f'{ns:,.0f}'} tokens, "
                 f"accumulation {tracker.accumulation_steps} per rank; saved {Path(args.out) / 'last.ckpt'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
