"""Training throughput of one global batch split into microbatch x accumulation, side by side.

For a fixed global batch it times whole optimizer steps (forward + backward of every
microbatch, clipping, AdamW) at each microbatch size, once as a plain loop and once
through ``CBSTracker.windows()`` with ``max_microbatch`` (observe only, so the layout
stays put). Layouts are interleaved round by round, so the machine's noise hits them
alike; it prints tokens per second (median over rounds) and each layout's time per
token relative to the smallest microbatch.

    python benchmarks/layout_throughput.py [--global-tokens 4096 --micro-tokens 256 512 1024 2048] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from cbs_tracker.integrations.plain import CBSTracker

from cbs_tracker.core.loop import microbatch_layout
from cbs_tracker.demo.corpus import SequenceStream, load_corpus
from cbs_tracker.demo.gpt import GPT, GPTConfig, make_adamw
from cbs_tracker.policy.controller import BatchSizeController


def _plain_step(model: Any, optimizer: Any, batches: Any, micro_seqs: int, accumulation: int) -> None:
    for _ in range(accumulation):
        x, y = batches(micro_seqs)
        _, loss = model(x, y)
        (loss / accumulation).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="demo", choices=["demo", "10m"])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-tokens", type=int, default=4096)
    parser.add_argument("--micro-tokens", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--loader-tokens", type=int, default=256, help="tokens per loader batch (tracker runs)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps timed per layout and round")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    for name in ("global_tokens", "loader_tokens"):
        if getattr(args, name) % args.seq_len:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be a multiple of --seq-len={args.seq_len}")
    level = args.global_tokens // args.loader_tokens
    for m in args.micro_tokens:
        group = m // args.loader_tokens
        if m % args.loader_tokens or microbatch_layout(level, group, 1) != group:
            parser.error(f"--micro-tokens {m}: the tracker cannot run it; it must be a power-of-two multiple of "
                         f"--loader-tokens={args.loader_tokens} that divides --global-tokens={args.global_tokens} "
                         f"at least twice (the tracker keeps K >= 2 on one process)")

    torch.set_num_threads(args.threads)
    corpus = load_corpus(max_bytes=4_000_000)
    stream = SequenceStream(corpus.train, seq_len=args.seq_len, seed=0)
    config = GPTConfig.preset(args.preset, context_length=max(args.seq_len, 128))
    loader_seqs = args.loader_tokens // args.seq_len

    layouts: list[tuple[str, int]] = [(kind, m) for m in args.micro_tokens for kind in ("plain", "tracker")]
    state: dict[tuple[str, int], Any] = {}
    for kind, m in layouts:
        torch.manual_seed(0)
        model = GPT(config)
        optimizer = make_adamw(model, lr=1e-4, weight_decay=0.1)
        entry: dict[str, Any] = {"model": model, "optimizer": optimizer, "times": []}
        if kind == "tracker":
            tracker = CBSTracker(
                model, optimizer, accumulation_steps=args.global_tokens // args.loader_tokens,
                controller=BatchSizeController(observe_only=True),
                max_microbatch=m // args.seq_len,
            )
            entry["tracker"] = tracker
            entry["windows"] = tracker.windows(iter(lambda: stream.next_batch(loader_seqs), None))
        state[(kind, m)] = entry

    def run(kind: str, m: int, steps: int) -> float:
        entry = state[(kind, m)]
        model, optimizer = entry["model"], entry["optimizer"]
        start = time.perf_counter()
        for _ in range(steps):
            if kind == "plain":
                _plain_step(model, optimizer, stream.next_batch, m // args.seq_len, args.global_tokens // m)
                continue
            tracker = entry["tracker"]
            for x, y in next(entry["windows"]):
                with tracker.microbatch(labels=y):
                    _, loss = model(x, y)
                    (loss / tracker.accumulation_steps).backward()
            tracker.step()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return (time.perf_counter() - start) / steps

    for kind, m in layouts:  # warm-up: allocator, first layouts
        run(kind, m, 2)
    for r in range(args.rounds):
        order = layouts if r % 2 == 0 else layouts[::-1]
        for kind, m in order:
            state[(kind, m)]["times"].append(run(kind, m, args.steps))
    ran: dict[int, tuple[int, int]] = {}  # what the tracker really ran: (microbatch tokens, accumulation)
    for kind, m in layouts:
        if kind == "tracker":
            tracker = state[(kind, m)]["tracker"]
            ran[m] = (tracker.microbatch_batches * args.loader_tokens, tracker.accumulation_steps)
            if ran[m] != (m, args.global_tokens // m):
                raise RuntimeError(f"the tracker ran {ran[m]} (microbatch tokens, accumulation), asked for {m}")

    base = {kind: statistics.median(state[(kind, args.micro_tokens[0])]["times"]) for kind in ("plain", "tracker")}
    rows = []
    print(f"{args.preset}, global batch {args.global_tokens} tokens, {args.threads} thread(s), "
          f"{args.rounds} rounds x {args.steps} steps (median step time)")
    print(f"{'microbatch':>10} {'A':>4} {'plain tok/s':>12} {'vs smallest':>11} {'tracker tok/s':>14} "
          f"{'vs smallest':>11} {'tracker/plain':>13}")
    for m in args.micro_tokens:
        plain = statistics.median(state[("plain", m)]["times"])
        tracked = statistics.median(state[("tracker", m)]["times"])
        row = {
            "micro_tokens": m, "accumulation": args.global_tokens // m,
            "tracker_micro_tokens": ran[m][0], "tracker_accumulation": ran[m][1],
            "plain_tokens_per_s": args.global_tokens / plain, "tracker_tokens_per_s": args.global_tokens / tracked,
            "plain_time_vs_smallest": plain / base["plain"], "tracker_time_vs_smallest": tracked / base["tracker"],
            "tracker_over_plain": tracked / plain,
        }
        rows.append(row)
        print(f"{m:>10} {row['accumulation']:>4} {row['plain_tokens_per_s']:>12,.0f} "
              f"{row['plain_time_vs_smallest']:>11.3f} {row['tracker_tokens_per_s']:>14,.0f} "
              f"{row['tracker_time_vs_smallest']:>11.3f} {row['tracker_over_plain']:>13.3f}")
    if args.json:
        print(json.dumps({"preset": args.preset, "global_tokens": args.global_tokens, "threads": args.threads,
                          "rounds": args.rounds, "steps": args.steps, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
