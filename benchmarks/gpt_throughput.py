"""Training throughput of the demo GPT on the standard-library corpus.

Times forward + backward + AdamW step at one microbatch per step and prints tokens per
second, the median over timed steps after a warm-up.

    python benchmarks/gpt_throughput.py [--preset 10m --micro-sequences 8 --seq-len 256] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from cbs_tracker.demo.corpus import SequenceStream, load_corpus
from cbs_tracker.demo.gpt import GPT, GPTConfig, make_adamw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="demo", choices=["demo", "10m"])
    parser.add_argument("--micro-sequences", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    corpus = load_corpus(max_bytes=4_000_000)
    stream = SequenceStream(corpus.train, seq_len=args.seq_len, seed=0)
    config = GPTConfig.preset(args.preset, context_length=max(args.seq_len, 128))
    device = torch.device(args.device)
    model = GPT(config).to(device)
    optimizer = make_adamw(model, lr=2e-3, weight_decay=0.1)
    tokens = args.micro_sequences * args.seq_len

    times: list[float] = []
    for step in range(args.warmup + args.steps):
        x, y = stream.next_batch(args.micro_sequences)
        x, y = x.to(device), y.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)

    median = statistics.median(times)
    result = {
        "preset": args.preset,
        "parameters": model.num_parameters(),
        "tokens_per_microbatch": tokens,
        "threads": args.threads,
        "median_step_s": median,
        "tokens_per_s": tokens / median,
        "final_loss": loss.item(),
    }
    print(
        f"{args.preset}: {result['parameters']:,} parameters, {tokens} tokens/microbatch, "
        f"{args.threads} thread(s): median step {median * 1e3:.1f} ms -> "
        f"{result['tokens_per_s']:,.0f} tokens/s"
    )
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
