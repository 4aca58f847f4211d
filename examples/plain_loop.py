"""A plain PyTorch loop that grows its batch as the measured noise scale grows.

The small byte-level GPT on the standard library's ``.py`` files starts at a 512-token
global batch (2 microbatches of 256 tokens); the default ``BatchSizeController``
doubles the accumulation as the critical batch rises. Writes TensorBoard logs to
``runs/plain_loop`` and draws ``schedule.png``; about a minute on one CPU thread.

    python examples/plain_loop.py [--quick]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from cbs_tracker import BatchSizeController, CBSTracker, TensorBoardLogger
from cbs_tracker.demo.corpus import SequenceStream, evaluate, load_corpus
from cbs_tracker.demo.gpt import GPT, GPTConfig, make_adamw


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=float, default=1.2e6, help="token budget (default 1.2M)")
    p.add_argument("--logdir", default="runs/plain_loop")
    p.add_argument("--plot", default="schedule.png", help="PNG of the schedule ('' to skip)")
    p.add_argument("--quick", action="store_true", help="tiny budget and fast controller settings")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)

    seq_len, micro_sequences = 128, 2  # 256 tokens per microbatch
    corpus = load_corpus(max_bytes=2_000_000 if args.quick else None)
    model = GPT(GPTConfig(context_length=seq_len))
    optimizer = make_adamw(model, lr=2e-3, weight_decay=0.1)
    stream = SequenceStream(corpus.train, seq_len=seq_len, seed=0)
    if args.quick:
        # short warm-up and cool-down so that a few hundred steps show a change
        controller = BatchSizeController(
            warmup_steps=20, warmup_tokens=0, cooldown_tokens=0, patience=4, window=8, kappa=2.0,
            hold_on_plateau=None,  # no hold on a loss plateau (read a quarter into the run)
        )
        budget = min(args.tokens, 1.5e5)
    else:
        controller = BatchSizeController(total_tokens=args.tokens)  # the defaults, with the run's length
        budget = args.tokens

    with TensorBoardLogger(args.logdir) as logger:
        tracker = CBSTracker(model, optimizer, accumulation_steps=2, controller=controller, logger=logger)
        while tracker.tokens_seen < budget:
            for _ in range(tracker.accumulation_steps):  # the tracker decides the window's length
                x, y = stream.next_batch(micro_sequences)
                with tracker.microbatch(labels=y):
                    _, loss = model(x, y)
                    (loss / tracker.accumulation_steps).backward()
                tracker.observe_loss(loss)  # for the default's hold on a loss plateau
            record = tracker.step()  # before clipping: the norm is read unclipped
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if record.next_accumulation_steps != record.accumulation_steps:
                print(
                    f"step {record.step}: tokens {record.tokens_seen:,.0f}, noise scale {record.noise_scale:,.0f} "
                    f"tokens -> accumulation {record.accumulation_steps} -> {record.next_accumulation_steps} "
                    f"(global batch {record.global_batch:,.0f} -> "
                    f"{record.global_batch * record.next_accumulation_steps / record.accumulation_steps:,.0f} tokens)",
                    flush=True,
                )
    val = evaluate(model, corpus.val, seq_len=seq_len, num_sequences=64)
    ns = tracker.noise_scale
    print(
        f"done: {tracker.steps} steps, {tracker.tokens_seen:,.0f} tokens, val loss {val:.3f} nats/byte, "
        f"noise scale {'-' if ns is None else f'{ns:,.0f}'} tokens, accumulation {tracker.accumulation_steps}"
    )
    if args.plot:
        from cbs_tracker.commands.plot import main as plot_main

        plot_main([args.logdir, "-o", args.plot])
        print(f"schedule drawn to {Path(args.plot).resolve()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
