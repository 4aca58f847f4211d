"""The critical batch measured by branches at checkpoints of the proof setting, and kappa from it.

Trains the proof's constant 512-token run (256-token microbatches, A = 2, AdamW, the
cosine schedule in tokens) with an observe-only tracker, and at each checkpoint calls
:func:`cbs_tracker.measure_critical_batch`: branches at 1/2 .. 8 x 512 tokens, LR x sqrt(k)
on the schedule's own timing, two replicates over data orders, a control at 512 with the
largest branch's LR, every branch on the same held-out set. The run continues unchanged
after each calibration (the branches never touch it). Writes ``<out>/calibration_<setting>_seed<s>.json``
after every point.

    python examples/calibrate_proof.py --out runs/calib                        # the proof setting, seed 0
    python examples/calibrate_proof.py --setting deep --out runs/calib         # a second setting
    python examples/calibrate_proof.py --setting quick --out /tmp/calib        # smoke test (seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpt_proof as base  # noqa: E402

#: the second setting: a narrower, twice as deep GPT at half the context (64 tokens, 4-sequence
#: microbatches: the same 256-token microbatch), about the same cost per token on a CPU
DEEP = replace(base.FULL, name="deep", seq_len=64, n_layer=4, d_model=96, n_head=3, tracker_micro_sequences=4)
SETTINGS = {"full": base.FULL, "deep": DEEP, "quick": base.QUICK}
CHECKPOINTS = {"full": (250_000, 500_000, 1_000_000, 2_000_000), "deep": (250_000, 500_000, 1_000_000, 2_000_000),
               "quick": (8192, 16384)}
BRANCH_TOKENS = {"full": 262_144, "deep": 262_144, "quick": 4096}
#: branch data streams: seeds no training stream of a seed < 1000 uses
BRANCH_STREAM_SEED = 50_000


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setting", choices=sorted(SETTINGS), default="full")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--replicates", type=int, default=2)
    p.add_argument("--branch-tokens", type=int, default=None)
    p.add_argument("--checkpoints", type=str, default=None, help="comma-separated token marks")
    args = p.parse_args(argv)

    import torch

    from cbs_tracker import BatchSizeController, CBSTracker
    from cbs_tracker.core.calibrate import Calibration, measure_critical_batch
    from cbs_tracker.demo.corpus import SequenceStream, evaluate, load_corpus
    from cbs_tracker.demo.gpt import GPT, GPTConfig, make_adamw

    setting = SETTINGS[args.setting]
    marks = ([int(float(x)) for x in args.checkpoints.split(",")] if args.checkpoints
             else list(CHECKPOINTS[args.setting]))
    branch_tokens = args.branch_tokens or BRANCH_TOKENS[args.setting]
    torch.set_num_threads(1)
    corpus = load_corpus(setting.corpus_max_bytes)
    micro_seqs = setting.tracker_micro_sequences
    micro_tokens = micro_seqs * setting.seq_len
    start = 512 if args.setting != "quick" else setting.tracker_start_tokens
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(context_length=setting.seq_len, n_layer=setting.n_layer, d_model=setting.d_model,
                          n_head=setting.n_head))
    optimizer = make_adamw(model, setting.lr, setting.weight_decay)
    for group in optimizer.param_groups:
        group["lr"] = setting.lr

    def lr_of(tokens: float) -> float:
        return base.lr_at(setting, "cosine", tokens)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: lr_of((e + 1) * start) / setting.lr)
    tracker = CBSTracker(model, optimizer, accumulation_steps=start // micro_tokens,
                         controller=BatchSizeController(observe_only=True), lr_scheduler=scheduler)
    stream = SequenceStream(corpus.train, seq_len=setting.seq_len, seed=args.seed)

    def loss_fn(m: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return m(*batch)[1]

    def data(replicate: int):
        s = SequenceStream(corpus.train, seq_len=setting.seq_len,
                           seed=BRANCH_STREAM_SEED + 1000 * args.seed + replicate)
        return iter(lambda: s.next_batch(micro_seqs), None)

    def held_out(m: torch.nn.Module) -> float:
        return evaluate(m, corpus.val, seq_len=setting.seq_len, num_sequences=setting.eval_sequences)

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"calibration_{setting.name}_seed{args.seed}.json"
    calibration = Calibration()
    record = None
    pending = sorted(marks)
    while pending:
        for _ in range(tracker.accumulation_steps):
            x, y = stream.next_batch(micro_seqs)
            with tracker.microbatch(labels=y):
                _, loss = model(x, y)
                (loss / tracker.accumulation_steps).backward()
        record = tracker.step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), setting.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if record.tokens_seen >= pending[0]:
            pending.pop(0)
            print(f"{record.tokens_seen:,.0f} tokens: B_simple {record.noise_scale:,.0f}; branching", flush=True)
            point = measure_critical_batch(
                model, optimizer, tracker=tracker, loss_fn=loss_fn, data=data, evaluate=held_out,
                microbatch_size=micro_tokens, branch_tokens=branch_tokens, replicates=args.replicates,
                lr_schedule=lr_of, clip_grad_norm=setting.clip, fuse_microbatches=max(1, 2048 // micro_tokens),
                log=lambda line: print(line, flush=True))
            calibration.points.append(point)
            print(calibration.table(), flush=True)
            path.write_text(json.dumps({
                "setting": setting.name, "setting_key": setting.key(), "seed": args.seed, "start_batch": start,
                "branch_tokens": branch_tokens, "replicates": args.replicates, "run_tokens": setting.budget_tokens,
                "library_commit": base._library_commit(), "points": json.loads(calibration.to_json()),
            }, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
