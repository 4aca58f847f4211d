"""What interleaving runs step by step costs the run being timed (``gpt_proof_lr.py --runs a+b``).

The wall-clock proof advances several runs in one process, one optimizer step at a time,
and times each run's own steps. A switch leaves the next step's caches cold (another
model's weights and optimizer state were just used), which would charge a run with many
small steps more than one with few large ones. This times one demo-GPT run's steps
(constant 512 at 2 x 256 tokens, the proof's layout) alone and with ``--others`` runs
stepping between its steps, in alternating rounds, and prints the ratio of its own time.

    python benchmarks/interleave_cost.py [--others 4 --rounds 8 --steps 40] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from cbs_tracker.demo.corpus import SequenceStream, load_corpus
from cbs_tracker.demo.gpt import GPT, GPTConfig, make_adamw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--others", type=int, default=4, help="runs stepping between the timed run's steps")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per round and mode")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-sequences", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.others < 1 or args.rounds < 1 or args.steps < 1:
        parser.error(f"--others={args.others}, --rounds={args.rounds} and --steps={args.steps} must be >= 1")

    torch.set_num_threads(1)
    corpus = load_corpus(max_bytes=4_000_000)

    def make(seed: int) -> tuple[Any, Any, SequenceStream]:
        torch.manual_seed(seed)
        model = GPT(GPTConfig(context_length=args.seq_len))
        return model, make_adamw(model, 1e-4, 0.1), SequenceStream(corpus.train, seq_len=args.seq_len, seed=seed)

    def step(run: tuple[Any, Any, SequenceStream]) -> float:
        model, optimizer, stream = run
        start = time.perf_counter()
        for _ in range(args.accumulation):
            x, y = stream.next_batch(args.micro_sequences)
            _, loss = model(x, y)
            (loss / args.accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    timed, others = make(0), [make(seed) for seed in range(1, args.others + 1)]
    for run in (timed, *others):
        for _ in range(3):
            step(run)
    alone: list[float] = []
    interleaved: list[float] = []
    for r in range(args.rounds):
        for mode in (("alone", "interleaved") if r % 2 == 0 else ("interleaved", "alone")):
            own = 0.0
            for _ in range(args.steps):
                own += step(timed)
                if mode == "interleaved":
                    for run in others:
                        step(run)
            (alone if mode == "alone" else interleaved).append(own / args.steps)
    ratios = [i / a for i, a in zip(interleaved, alone)]
    result = {"others": args.others, "rounds": args.rounds, "steps": args.steps,
              "alone_step_s": statistics.median(alone), "interleaved_step_s": statistics.median(interleaved),
              "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
    print(f"one run's own step time, interleaved with {args.others} others / alone: median "
          f"{result['ratio_median']:.3f} over {args.rounds} rounds (range {result['ratio_min']:.3f}-"
          f"{result['ratio_max']:.3f}); alone {result['alone_step_s'] * 1e3:.1f} ms per step")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
