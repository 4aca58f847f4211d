"""``cbs-tracker demo``: the main job. A small byte-level GPT on the standard library's ``.py`` files.

Trains the ~0.45M-parameter GPT of :mod:`cbs_tracker.demo.gpt` on the running
Python's own standard library (no download) with a plain PyTorch loop driven by
:class:`~cbs_tracker.CBSTracker` and the default
:class:`~cbs_tracker.BatchSizeController`, and prints the measured noise scale,
the critical batch and the global batch as it goes. About a minute on one CPU
thread with the defaults.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from cbs_tracker.commands import positive_int
from cbs_tracker.demo.corpus import SequenceStream, evaluate, load_corpus
from cbs_tracker.demo.gpt import GPT, GPTConfig, make_adamw
from cbs_tracker.integrations.plain import CBSTracker
from cbs_tracker.policy.controller import BatchSizeController


def format_interval(low: float | None, high: float | None) -> str:
    """``"low-high"`` of the noise scale's 90% interval for the table (``"-"`` when none).

    Args:
        low: lower end, or ``None`` before a measurement.
        high: upper end; ``inf`` while ``|G|^2`` is not distinguishable from 0.

    Returns:
        E.g. ``"1,210-1,530"``, ``">=900"`` when unbounded above, ``"-"`` when none.
    """
    if low is None or high is None:
        return "-"
    if math.isinf(high):
        return f">={low:,.0f}"
    return f"{low:,.0f}-{high:,.0f}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cbs-tracker demo", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=float, default=1.2e6, help="training budget in tokens (default 1.2M)")
    p.add_argument("--micro-sequences", type=positive_int, default=2, help="sequences per microbatch (default 2)")
    p.add_argument("--seq-len", type=positive_int, default=128, help="context length (default 128)")
    p.add_argument("--accumulation", type=positive_int, default=2, help="starting accumulation steps (default 2)")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (default 2e-3)")
    p.add_argument("--max-bytes", type=int, default=None, help="use only the first N bytes of the corpus")
    p.add_argument("--observe-only", action="store_true", help="measure, never change the batch")
    p.add_argument("--logdir", default=None, help="also write TensorBoard logs here (needs tensorboard)")
    p.add_argument("--print-every", type=positive_int, default=25, help="print a line every N optimizer steps")
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    corpus = load_corpus(args.max_bytes)
    model = GPT(GPTConfig(context_length=args.seq_len))
    optimizer = make_adamw(model, lr=args.lr, weight_decay=0.1)
    stream = SequenceStream(corpus.train, seq_len=args.seq_len, seed=args.seed)
    micro_tokens = args.micro_sequences * args.seq_len
    logger = None
    if args.logdir:
        from cbs_tracker.integrations.tensorboard import TensorBoardLogger

        logger = TensorBoardLogger(args.logdir)
    controller = BatchSizeController(observe_only=args.observe_only)
    tracker = CBSTracker(
        model, optimizer, accumulation_steps=args.accumulation, controller=controller, logger=logger
    )
    print(
        f"cbs-tracker demo: GPT {model.num_parameters() / 1e6:.2f}M params on {corpus.num_files} stdlib files "
        f"({corpus.num_bytes / 1e6:.1f} MB), microbatch {micro_tokens} tokens, budget {args.tokens / 1e6:.2f}M tokens"
    )
    print(
        f"{'step':>6} {'tokens':>9} {'loss':>6} {'noise_scale':>11} {'90% interval':>15} {'critical':>9} "
        f"{'global_batch':>12} {'A':>3}"
    )
    start = time.perf_counter()
    last_loss = math.nan
    while tracker.tokens_seen < args.tokens:
        total = 0.0
        for _ in range(tracker.accumulation_steps):
            x, y = stream.next_batch(args.micro_sequences)
            with tracker.microbatch(labels=y):
                _, loss = model(x, y)
                (loss / tracker.accumulation_steps).backward()
            total += float(loss.detach())
        last_loss = total / tracker.accumulation_steps
        record = tracker.step()  # after backward, before clipping
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        changed = record.next_accumulation_steps != record.accumulation_steps
        if record.step % args.print_every == 0 or changed:
            ns = "-" if record.noise_scale is None else f"{record.noise_scale:,.0f}"
            interval = format_interval(record.noise_scale_low, record.noise_scale_high)
            cb = "-" if record.critical_batch is None else f"{record.critical_batch:,.0f}"
            note = f"  -> A={record.next_accumulation_steps}" if changed else ""
            print(
                f"{record.step:>6} {record.tokens_seen:>9,.0f} {last_loss:>6.3f} {ns:>11} {interval:>15} {cb:>9} "
                f"{record.global_batch:>12,.0f} {record.accumulation_steps:>3}{note}",
                flush=True,
            )
    val = evaluate(model, corpus.val, seq_len=args.seq_len, num_sequences=128)
    elapsed = time.perf_counter() - start
    ns = tracker.noise_scale
    print(
        f"done: {tracker.steps} steps, {tracker.tokens_seen:,.0f} tokens in {elapsed:.0f}s "
        f"({tracker.tokens_seen / elapsed:,.0f} tokens/s); val loss {val:.3f} nats/byte; "
        f"noise scale {'-' if ns is None else f'{ns:,.0f}'} tokens; final global batch "
        f"{tracker.accumulation_steps * micro_tokens:,} tokens"
    )
    if logger is not None:
        logger.close()
    return 0
