"""Elastic DDP under torchrun: nodes leave or join, the run resumes from its own checkpoint at the new size.

Start the same command on every node (here two agents on one machine stand for two nodes):

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=1:2 --nproc-per-node=1 \\
        --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 --rdzv-id=job1 --max-restarts=3 \\
        --rdzv-conf=is_host=1 examples/elastic_ddp.py --backend gloo --checkpoint-dir ckpt
        # is_host=0 on the other nodes; HOST is 127.0.0.1 when all agents run on one machine

Rank 0 saves model, optimizer, scheduler, tracker and stream every ``--checkpoint-every`` steps to
``--checkpoint-dir`` (a folder every node sees), logs a JSON line per step to ``--log-file``; each start
resumes from the newest, where ``CBSTracker.load_state_dict`` keeps the global batch at the new world
size (``A * D / D'`` per rank). docs/guide.md ("Elastic torchrun"): the agents, the environment variable,
a resume by hand, why workers leave with ``os._exit``."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from cbs_tracker.integrations.plain import CBSTracker

from cbs_tracker.demo.corpus import SequenceStream, load_corpus
from cbs_tracker.demo.gpt import GPT, GPTConfig, make_adamw
from cbs_tracker.demo.launch import join_torchrun
from cbs_tracker.policy.controller import BatchSizeController

CHECKPOINT = re.compile(r"ckpt-(\d+)\.pt")
D_MODEL, N_LAYER, MAX_BYTES = 32, 1, 1_000_000  # the demo GPT and the corpus bytes it reads
LR_WARMUP, CONTROLLER_WARMUP, PATIENCE, MAX_BATCH_SEQUENCES = 10, 8, 2, 64  # in optimizer steps; sequences


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None, help="default: nccl with CUDA, else gloo")
    p.add_argument("--checkpoint-dir", required=True, help="where checkpoints are written and resumed from")
    p.add_argument("--checkpoint-every", type=int, default=10, help="save every N optimizer steps (default 10)")
    p.add_argument("--keep", type=int, default=2, help="checkpoints kept (default 2; 0 keeps all)")
    p.add_argument("--resume-from", default=None, help="start from this checkpoint if --checkpoint-dir has none")
    p.add_argument("--log-file", default=None, help="JSON lines by rank 0 (default: CHECKPOINT_DIR/train.jsonl)")
    p.add_argument("--total-steps", type=int, default=300, help="budget and LR schedule, in starting-batch steps")
    p.add_argument("--batch-sequences", type=int, default=8, help="starting global batch, in sequences")
    p.add_argument("--micro-sequences", type=int, default=2, help="sequences per microbatch per rank (default 2)")
    p.add_argument("--seq-len", type=int, default=32, help="context length (default 32)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate at the starting batch")
    p.add_argument("--print-every", type=int, default=25, help="print a line every N optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    return p


def checkpoints(directory: Path) -> list[Path]:
    """The complete checkpoints in ``directory``, oldest first (temporary files are not listed)."""
    found = [(int(m.group(1)), p) for p in directory.glob("ckpt-*.pt") if (m := CHECKPOINT.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def save_checkpoint(directory: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write ``state`` to ``ckpt-STEP.pt`` through a temporary file and a rename; keep the newest ``keep``."""
    path = directory / f"ckpt-{step:06d}.pt"
    torch.save(state, tmp := path.with_name(path.name + ".tmp"))
    os.replace(tmp, path)  # atomic: a reader sees the old set of files or the new one
    for old in checkpoints(directory)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return path


def lr_factor(step: int, total_steps: int) -> float:
    """Linear warm-up, then cosine to 10% of the peak, in optimizer steps at the starting batch."""
    progress = min(1.0, max(0, step - LR_WARMUP) / max(1, total_steps - LR_WARMUP))
    return (step + 1) / LR_WARMUP if step < LR_WARMUP else 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    torch.set_num_threads(1)
    rank, world, device = join_torchrun(args.backend, timeout_s=60)
    hook = sys.excepthook  # torch's (it prefixes the rank); an error, e.g. a lost peer's, then leaves as below
    sys.excepthook = lambda *error: (hook(*error), os._exit(1))
    if rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0":
        print("elastic_ddp: a node that joins later will time out (torch 2.13): start every agent with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", flush=True)
    train(args, rank, world, device)
    dist.barrier()  # every rank past its last collective before any leaves
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    return 0


def train(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> None:
    """The run from its newest checkpoint (or from scratch) to the end of the budget."""
    ckpt_dir = Path(args.checkpoint_dir)
    log_path = Path(args.log_file) if args.log_file else ckpt_dir / "train.jsonl"
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        for stale in ckpt_dir.glob("ckpt-*.pt.tmp"):  # a write that a lost node left unfinished
            stale.unlink(missing_ok=True)
    found = checkpoints(ckpt_dir) if rank == 0 else []
    chosen = [str(found[-1]) if found else args.resume_from]
    dist.broadcast_object_list(chosen, src=0)  # rank 0's choice: every rank resumes from the same checkpoint
    resume = chosen[0]
    ckpt = torch.load(resume, map_location="cpu", weights_only=True) if resume else None

    if ckpt is None and args.batch_sequences % (args.micro_sequences * world):
        raise SystemExit(f"--batch-sequences {args.batch_sequences} is not a multiple of "
                         f"--micro-sequences x world size = {args.micro_sequences * world}")
    torch.manual_seed(args.seed)  # same initial weights on every rank (DDP also broadcasts them)
    corpus = load_corpus(MAX_BYTES)
    model = GPT(GPTConfig(context_length=args.seq_len, d_model=D_MODEL, n_layer=N_LAYER, n_head=2))
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
    model.to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = make_adamw(ddp.module, lr=args.lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, args.total_steps))
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
    controller = BatchSizeController(warmup_steps=CONTROLLER_WARMUP, warmup_tokens=0, cooldown_tokens=0, patience=PATIENCE,
                                     window=4, kappa=2.0, max_batch=MAX_BATCH_SEQUENCES * args.seq_len, hold_on_plateau=None)
    # a fresh run starts at --batch-sequences globally; a resumed one at the checkpoint's global batch
    accumulation = max(1, args.batch_sequences // (args.micro_sequences * world))
    tracker = CBSTracker(ddp, optimizer, accumulation_steps=accumulation,
                         controller=controller, lr_scheduler=scheduler)
    stream = SequenceStream(corpus.train, seq_len=args.seq_len, seed=args.seed)
    if ckpt is not None:
        tracker.load_state_dict(ckpt["tracker"])  # converts the accumulation to this world size
        stream.load_state_dict(ckpt["stream"])
    log = open(log_path, "a", buffering=1) if rank == 0 else None  # noqa: SIM115 (closed at the end)
    if log is not None and log.tell() > 0 and not log_path.read_bytes().endswith(b"\n"):
        log.write("\n")  # a rank 0 lost mid-line: end that line, so this run's lines stay whole

    def emit(**fields: Any) -> None:
        if log is not None:
            log.write(json.dumps(fields) + "\n")

    batch = tracker.accumulation_steps * args.micro_sequences * args.seq_len * world
    emit(event="start", world_size=world, restart=restart, resumed_from=resume, step=tracker.steps,
         tokens_seen=tracker.tokens_seen, accumulation=tracker.accumulation_steps, global_batch=batch)
    if rank == 0:
        print(f"elastic_ddp: {world} ranks, restart {restart}, from {resume or 'scratch'}, global batch {batch:,}", flush=True)

    def state() -> dict[str, Any]:
        return {"step": tracker.steps, "world_size": world, "model": ddp.module.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "tracker": tracker.state_dict(), "stream": stream.state_dict()}

    start = time.perf_counter()
    record = None
    while tracker.starting_batch_steps < args.total_steps:
        total = 0.0
        for _ in range(tracker.accumulation_steps):
            x, y = stream.next_batch(args.micro_sequences, rank=rank, world_size=world)
            x, y = x.to(device), y.to(device)
            with tracker.microbatch(labels=y):  # DDP no_sync on all but the last
                _, loss = ddp(x, y)
                (loss / tracker.accumulation_steps).backward()
            total += float(loss.detach())
        record = tracker.step()
        tracker.clip_grad_norm_(1.0)
        lr = optimizer.param_groups[0]["lr"]  # the learning rate this optimizer step uses
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        emit(event="step", step=record.step, tokens_seen=record.tokens_seen, global_batch=record.global_batch,
             accumulation=record.accumulation_steps, next_accumulation=record.next_accumulation_steps,
             world_size=world, lr=lr, rank0_loss=total / record.accumulation_steps, position=stream.position,
             noise_scale=record.noise_scale, starting_batch_steps=tracker.starting_batch_steps)
        if record.step % args.checkpoint_every == 0:
            if rank == 0:
                path = save_checkpoint(ckpt_dir, record.step, state(), args.keep)
                emit(event="checkpoint", step=record.step, path=str(path))
            dist.barrier()  # nobody runs ahead of a checkpoint that a restart may need
        changed = record.next_accumulation_steps != record.accumulation_steps
        if rank == 0 and (record.step % args.print_every == 0 or changed):
            print(f"step {record.step:>5} tokens {record.tokens_seen:>9,.0f} loss {total / record.accumulation_steps:.3f}"
                  f" noise scale {record.noise_scale or 0:>7,.0f} global batch {record.global_batch:>6,.0f} lr {lr:.2e}"
                  f" A={record.accumulation_steps}" + (f" -> {record.next_accumulation_steps}" if changed else ""), flush=True)
    if rank == 0 and (record is None or record.step % args.checkpoint_every != 0):
        path = save_checkpoint(ckpt_dir, tracker.steps, state(), args.keep)
        emit(event="checkpoint", step=tracker.steps, path=str(path))
    emit(event="done", step=tracker.steps, tokens_seen=tracker.tokens_seen, world_size=world,
         accumulation=tracker.accumulation_steps, noise_scale=tracker.noise_scale)
    if rank == 0:
        print(f"done: {tracker.steps} steps, {tracker.tokens_seen:,.0f} tokens in {time.perf_counter() - start:.0f}s "
              f"on {world} ranks, A={tracker.accumulation_steps}", flush=True)
        log.close()


if __name__ == "__main__":
    os._exit(main())  # past the interpreter's teardown, where gloo's leftover threads can abort a finished run
