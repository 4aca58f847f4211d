"""A Hugging Face Accelerate loop in the shape of transformers' ``run_clm_no_trainer.py``, the batch growing.

The script's loop is kept: ``accelerator.prepare(model, optimizer, train_dataloader,
lr_scheduler)``, epochs over the prepared ``DataLoader``, ``accelerator.backward(loss)``,
``optimizer.step()`` / ``lr_scheduler.step()`` / ``optimizer.zero_grad()`` on every batch
(Accelerate steps only where it syncs), ``completed_steps`` and ``max_train_steps``,
``accelerator.save_state``. Two lines change: ``tracker.accumulate(...)`` replaces
``accelerator.accumulate(model)`` (it keeps Accelerate's counter and
``gradient_accumulation_steps`` on the tracker's window), and ``tracker.step()`` runs where
Accelerate syncs, before clipping. The run ends where a constant-batch run would
(``tracker.starting_batch_steps``, the same data), and the prepared scheduler stays on its
timing in tokens. The model is the package's small byte-level GPT on the standard library.

    python examples/accelerate_gpt.py --quick                                      # one CPU process
    torchrun --standalone --nproc_per_node=2 examples/accelerate_gpt.py --quick    # two processes (gloo on CPU)
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from cbs_tracker import BatchSizeController
from cbs_tracker.demo.corpus import SequenceStream, evaluate, load_corpus
from cbs_tracker.demo.gpt import GPT, GPTConfig, make_adamw


class Blocks(Dataset):
    """``run_clm``'s grouped texts: fixed blocks of ``seq_len + 1`` bytes, as ``input_ids`` and ``labels``."""

    def __init__(self, data, seq_len: int, count: int, seed: int) -> None:
        self.data, self.seq_len = data, seq_len
        self.starts = SequenceStream(data, seq_len=seq_len, seed=seed).starts(0, count)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = int(self.starts[i])
        block = torch.as_tensor(self.data[s : s + self.seq_len + 1].astype("int64"))
        return {"input_ids": block[:-1], "labels": block[1:]}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--per_device_train_batch_size", type=int, default=2, help="sequences per microbatch (default 2)")
    p.add_argument("--gradient_accumulation_steps", type=int, default=2, help="starting accumulation (default 2)")
    p.add_argument("--block_size", type=int, default=128, help="context length (default 128)")
    p.add_argument("--learning_rate", type=float, default=2e-3)
    p.add_argument("--num_warmup_steps", type=int, default=None, help="default: 5%% of max_train_steps")
    p.add_argument("--max_train_steps", type=int, default=None,
                   help="optimizer steps of the constant-batch run (default: the token budget's)")
    p.add_argument("--tokens", type=float, default=1.2e6, help="token budget, all processes (default 1.2M)")
    p.add_argument("--mixed_precision", default="no", choices=["no", "bf16"])
    p.add_argument("--quick", action="store_true", help="a 150k-token budget and a fast controller")
    p.add_argument("--output_dir", default="out/accelerate_gpt", help="where accelerator.save_state writes")
    p.add_argument("--resume_from_checkpoint", default=None, help="a state folder this script saved")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from cbs_tracker.integrations.accelerate import AcceleratorTracker

    args = parser().parse_args(argv)
    torch.set_num_threads(1)
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                              mixed_precision=args.mixed_precision, cpu=not torch.cuda.is_available())
    set_seed(args.seed)
    corpus = load_corpus(max_bytes=2_000_000 if args.quick else None)
    budget = min(args.tokens, 1.5e5) if args.quick else args.tokens
    micro_tokens = args.per_device_train_batch_size * args.block_size
    starting_batch = micro_tokens * accelerator.num_processes * args.gradient_accumulation_steps
    max_train_steps = args.max_train_steps or int(budget // starting_batch)
    sequences = max_train_steps * starting_batch // args.block_size
    train_dataloader = DataLoader(Blocks(corpus.train, args.block_size, sequences, args.seed),
                                  shuffle=True, batch_size=args.per_device_train_batch_size)

    model = GPT(GPTConfig(context_length=args.block_size))
    optimizer = make_adamw(model, lr=args.learning_rate, weight_decay=0.1)
    warmup = args.num_warmup_steps if args.num_warmup_steps is not None else max(1, max_train_steps // 20)

    def cosine(step: int) -> float:  # transformers' get_cosine_schedule_with_warmup, in scheduler steps
        total = max_train_steps * accelerator.num_processes  # as run_clm sizes it: num_processes calls per step
        if step < warmup * accelerator.num_processes:
            return step / (warmup * accelerator.num_processes)
        ratio = (step - warmup * accelerator.num_processes) / max(1, total - warmup * accelerator.num_processes)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))))

    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine)
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler
    )
    if args.quick:  # short warm-up and cool-down so that a few hundred steps show a change
        controller = BatchSizeController(warmup_steps=20, warmup_tokens=0, cooldown_tokens=0, patience=4,
                                         window=8, kappa=2.0)
    else:
        controller = BatchSizeController()
    tracker = AcceleratorTracker(accelerator, model, optimizer, lr_scheduler=lr_scheduler, controller=controller)
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)  # the tracker is registered for checkpointing
        accelerator.print(f"resumed at step {tracker.steps}, {tracker.tokens_seen:,.0f} tokens, "
                          f"accumulation {tracker.accumulation_steps}")

    accelerator.print(f"accelerate_gpt: {accelerator.num_processes} process(es), {accelerator.distributed_type}, "
                      f"starting global batch {starting_batch:,} tokens, {max_train_steps} constant-batch steps")
    completed_steps = tracker.steps
    done = tracker.starting_batch_steps >= max_train_steps
    epoch = 0
    while not done:
        model.train()
        for batch in train_dataloader:
            with tracker.accumulate(labels=batch["labels"]):  # replaces accelerator.accumulate(model)
                _, loss = model(batch["input_ids"], batch["labels"])
                accelerator.backward(loss)  # divided by the window's accumulation
                if accelerator.sync_gradients:  # the window's last microbatch
                    record = tracker.step()
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed_steps += 1
                if record.next_accumulation_steps != record.accumulation_steps:
                    accelerator.print(
                        f"step {record.step}: tokens {record.tokens_seen:,.0f}, noise scale "
                        f"{record.noise_scale:,.0f} tokens -> accumulation {record.accumulation_steps} -> "
                        f"{record.next_accumulation_steps} (global batch {record.global_batch:,.0f} -> "
                        f"{record.global_batch * record.next_accumulation_steps / record.accumulation_steps:,.0f} "
                        "tokens)"
                    )
                if tracker.starting_batch_steps >= max_train_steps:  # the data of max_train_steps constant steps
                    done = True
                    break
        epoch += 1
    accelerator.wait_for_everyone()
    accelerator.save_state(str(Path(args.output_dir) / f"step_{completed_steps}"))
    val = math.nan
    if accelerator.is_main_process:
        val = evaluate(accelerator.unwrap_model(model), corpus.val, seq_len=args.block_size, num_sequences=64)
    ns = tracker.noise_scale
    accelerator.print(f"done: {completed_steps} optimizer steps ({tracker.starting_batch_steps:g} at the starting "
                      f"batch), {tracker.tokens_seen:,.0f} tokens, {epoch} epoch(s), val loss {val:.3f} nats/byte, "
                      f"noise scale {'-' if ns is None else f'{ns:,.0f}'} tokens, accumulation "
                      f"{tracker.accumulation_steps}; state saved to {Path(args.output_dir) / f'step_{completed_steps}'}")
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
