"""DDP under torchrun: the small GPT on the standard library, the tracker growing the batch.

Every rank trains the same GPT in ``DistributedDataParallel`` on its slice of each global
batch; ``CBSTracker`` applies ``no_sync`` to all but the last microbatch and adds one
``all_reduce`` per step, and the controller (identical on every rank) doubles the
accumulation. Rank 0 prints what was measured.

    torchrun --standalone --nproc_per_node=2 examples/torchrun_ddp.py --backend gloo   # nccl on GPUs
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.distributed as dist
from cbs_tracker.integrations.plain import CBSTracker

from cbs_tracker.demo.corpus import SequenceStream, evaluate, load_corpus
from cbs_tracker.demo.gpt import GPT, GPTConfig, make_adamw
from cbs_tracker.demo.launch import join_torchrun
from cbs_tracker.policy.controller import BatchSizeController


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                   help="process-group backend (default: nccl with CUDA, else gloo)")
    p.add_argument("--tokens", type=float, default=0.6e6, help="training budget in tokens, all ranks (default 0.6M)")
    p.add_argument("--steps", type=int, default=None, help="stop after this many optimizer steps (CI smoke runs)")
    p.add_argument("--micro-sequences", type=int, default=2, help="sequences per microbatch per rank (default 2)")
    p.add_argument("--seq-len", type=int, default=128, help="context length (default 128)")
    p.add_argument("--accumulation", type=int, default=2, help="starting accumulation steps per rank (default 2)")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (default 2e-3)")
    p.add_argument("--warmup-steps", type=int, default=100, help="controller: no change before this step")
    p.add_argument("--patience", type=int, default=16, help="controller: measurements a change must hold for")
    p.add_argument("--max-bytes", type=int, default=None, help="use only the first N bytes of the corpus")
    p.add_argument("--print-every", type=int, default=25, help="print a line every N optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    torch.set_num_threads(1)
    rank, world, device = join_torchrun(args.backend)
    torch.manual_seed(args.seed)  # same initial weights on every rank (DDP also broadcasts them)
    corpus = load_corpus(args.max_bytes)
    model = GPT(GPTConfig(context_length=args.seq_len)).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = make_adamw(ddp.module, lr=args.lr, weight_decay=0.1)
    # short demo runs: no hold on a loss plateau (the default; it reads the loss a quarter into a known run length)
    controller = BatchSizeController(warmup_steps=args.warmup_steps, patience=args.patience, hold_on_plateau=None)
    tracker = CBSTracker(ddp, optimizer, accumulation_steps=args.accumulation, controller=controller)
    stream = SequenceStream(corpus.train, seq_len=args.seq_len, seed=args.seed)
    micro_tokens = args.micro_sequences * args.seq_len
    if rank == 0:
        print(f"torchrun_ddp: {world} ranks ({dist.get_backend()}), GPT {model.num_parameters() / 1e6:.2f}M params, "
              f"microbatch {micro_tokens} tokens/rank, starting global batch "
              f"{micro_tokens * world * args.accumulation:,} tokens", flush=True)
        print(f"{'step':>6} {'tokens':>10} {'loss':>6} {'noise_scale':>11} {'critical':>9} {'global_batch':>12} {'A':>3}")
    start = time.perf_counter()
    while tracker.tokens_seen < args.tokens and (args.steps is None or tracker.steps < args.steps):
        total = 0.0
        for _ in range(tracker.accumulation_steps):
            x, y = stream.next_batch(args.micro_sequences, rank=rank, world_size=world)
            x, y = x.to(device), y.to(device)
            with tracker.microbatch(labels=y):  # DDP no_sync on all but the last
                _, loss = ddp(x, y)
                (loss / tracker.accumulation_steps).backward()
            total += float(loss.detach())
        record = tracker.step()  # synced gradients, before clipping
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        changed = record.next_accumulation_steps != record.accumulation_steps
        if rank == 0 and (record.step % args.print_every == 0 or changed or record.step == args.steps):
            ns = "-" if record.noise_scale is None else f"{record.noise_scale:,.0f}"
            cb = "-" if record.critical_batch is None else f"{record.critical_batch:,.0f}"
            note = f"  -> A={record.next_accumulation_steps}" if changed else ""
            print(f"{record.step:>6} {record.tokens_seen:>10,.0f} {total / record.accumulation_steps:>6.3f} "
                  f"{ns:>11} {cb:>9} {record.global_batch:>12,.0f} {record.accumulation_steps:>3}{note}", flush=True)
    val = evaluate(ddp.module, corpus.val, seq_len=args.seq_len, num_sequences=64) if rank == 0 else math.nan
    elapsed = time.perf_counter() - start
    if rank == 0:
        ns = tracker.noise_scale
        print(f"done: {tracker.steps} steps, {tracker.tokens_seen:,.0f} tokens in {elapsed:.0f}s; "
              f"val loss {val:.3f} nats/byte; noise scale {'-' if ns is None else f'{ns:,.0f}'} tokens; "
              f"global batch {tracker.accumulation_steps * micro_tokens * world:,} tokens "
              f"(A={tracker.accumulation_steps}, D={tracker.dp_degree})", flush=True)
        # full precision, for comparison with a single-process run on the same data
        print(f"measured: noise_scale={record.noise_scale!r} grad_sq_norm={record.grad_sq_norm!r} "
              f"trace_cov={record.trace_cov!r} val_loss={val!r}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
