"""FSDP2 step time with and without the tracker on CPU (gloo ranks, interleaved, median).

Two identical FSDP2 GPTs per rank, one driven by an observe-only ``FSDPTracker``, one by
the same loop without it; steps alternate (order flipped every pair) so machine noise
hits both alike, and the median step-time ratio is printed (``--control``: A/A run).

    python benchmarks/fsdp_overhead.py [--preset 10m --micro-sequences 8 --seq-len 256] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _model(args: argparse.Namespace) -> tuple[Any, Any, int]:
    from torch.distributed.fsdp import fully_shard

    from cbs_tracker.demo.gpt import GPT, GPTConfig, make_adamw

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(args.preset, context_length=args.seq_len))
    num_params = model.num_parameters()  # before sharding (a DTensor's numel is the global one)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, make_adamw(model, lr=1e-3, weight_decay=0.1), num_params


def _step(model: Any, opt: Any, batches: list[Any], acc: int, tracker: Any = None) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    for j, (x, y) in enumerate(batches):
        if tracker is not None:
            ctx = tracker.microbatch(labels=y)
        else:
            model.set_requires_gradient_sync(j == acc - 1)
            ctx = _null()
        with ctx:
            _, loss = model(x, y)
            (loss / acc).backward()
    if tracker is not None:
        tracker.step()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    dist.barrier()
    return time.perf_counter() - t0


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def worker(rank: int, world: int, init_file: str, out: str, args: argparse.Namespace) -> None:
    from cbs_tracker.integrations.fsdp import FSDPTracker

    from cbs_tracker.demo.corpus import SequenceStream, load_corpus
    from cbs_tracker.policy.controller import BatchSizeController

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        plain, plain_opt, num_params = _model(args)
        tracked, tracked_opt, _ = _model(args)
        tracker = None
        if not args.control:
            tracker = FSDPTracker(tracked, tracked_opt, accumulation_steps=args.accumulation,
                                  controller=BatchSizeController(observe_only=True))
        stream = SequenceStream(load_corpus(4_000_000).train, seq_len=args.seq_len, seed=0)
        times: dict[str, list[float]] = {"with": [], "without": []}
        for i in range(args.warmup + args.pairs):
            batches = [stream.next_batch(args.micro_sequences, rank=rank, world_size=world)
                       for _ in range(args.accumulation)]
            order = ("with", "without") if i % 2 == 0 else ("without", "with")
            for which in order:
                if which == "with":
                    t = _step(tracked, tracked_opt, batches, args.accumulation, tracker)
                else:
                    t = _step(plain, plain_opt, batches, args.accumulation)
                if i >= args.warmup:
                    times[which].append(t)
        if rank == 0:
            Path(out).write_text(json.dumps({"times": times, "params": num_params,
                                             "noise_scale": None if tracker is None else tracker.noise_scale}))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--preset", choices=["demo", "10m"], default="demo")
    p.add_argument("--micro-sequences", type=int, default=4, help="sequences per microbatch per rank")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--pairs", type=int, default=20, help="timed (with, without) pairs")
    p.add_argument("--warmup", type=int, default=3, help="untimed pairs first")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--control", action="store_true",
                   help="A/A control: the 'with' model runs without a tracker (shows the noise floor)")
    p.add_argument("--json", action="store_true", help="print the results as JSON on the last line")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "overhead.json")
        mp.spawn(worker, args=(args.world, str(Path(tmp) / "pg"), out, args), nprocs=args.world, join=True)
        res = json.loads(Path(out).read_text())
    with_t, without = res["times"]["with"], res["times"]["without"]
    ratio = statistics.median(with_t) / statistics.median(without)
    pair_ratio = statistics.median(a / b for a, b in zip(with_t, without, strict=True))
    tokens = args.micro_sequences * args.seq_len
    print(f"FSDP2 on {args.world} gloo ranks x {args.threads} thread(s), GPT {res['params'] / 1e6:.2f}M params, "
          f"{tokens} tokens/microbatch/rank, {args.accumulation} microbatches, {args.pairs} timed pairs"
          + (" [A/A CONTROL: no tracker on either model]" if args.control else ""))
    print(f"median step: without tracker {statistics.median(without) * 1e3:.1f} ms, "
          f"with tracker {statistics.median(with_t) * 1e3:.1f} ms")
    print(f"step-time ratio (median with / median without): {ratio:.3f}; median of per-pair ratios: {pair_ratio:.3f}")
    if args.json:
        print(json.dumps({"step_time_ratio": ratio, "pair_ratio_median": pair_ratio,
                          "median_step_s_with": statistics.median(with_t),
                          "median_step_s_without": statistics.median(without)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
