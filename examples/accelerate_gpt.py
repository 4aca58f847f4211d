"""A Hugging Face Accelerate loop in the shape of transformers' ``run_clm_no_trainer.py``, the batch growing.

The script's loop is kept: ``accelerator.prepare(model, optimizer, train_dataloader,
lr_scheduler)``, epochs over the prepared ``DataLoader``, ``accelerator.backward(loss)``,
``optimizer.step()`` / ``lr_scheduler.step()`` / ``optimizer.zero_grad()`` on every batch
(Accelerate steps only where it syncs), ``completed_steps`` and ``max_train_steps``,
``accelerator.save_state``. The README's lines change it: ``tracker.accumulate(labels=
batch["labels"][..., 1:])`` replaces ``accelerator.accumulate(model)`` (it keeps Accelerate's
counter and ``gradient_accumulation_steps`` on the tracker's window; the labels the shifted loss
counts), ``tracker.step()`` runs where Accelerate syncs, before clipping, the stop is
``tracker.done(max_train_steps)`` (the data of the constant-batch run, not its optimizer steps)
and a resume starts the data at ``divmod(tracker.resume_position(), len(train_dataloader))``.
The prepared scheduler stays on its timing in tokens. The model is the package's small
byte-level GPT on the standard library, called the Hugging Face way (``model(**batch).loss``,
the labels shifted inside). ``--constant`` runs the same loop without growth.

    python examples/accelerate_gpt.py --quick                                      # one CPU process
    torchrun --standalone --nproc_per_node=2 examples/accelerate_gpt.py --quick    # two processes (gloo on CPU)
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from cbs_tracker import BatchSizeController
from cbs_tracker.demo.corpus import SequenceStream, evaluate, load_corpus
from cbs_tracker.demo.gpt import GPT, GPTConfig, make_adamw


class CausalLM(torch.nn.Module):
    """The GPT called as a Hugging Face causal LM: ``model(input_ids=..., labels=...).loss``, labels shifted inside."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        _, loss = self.gpt(input_ids[:, :-1], labels[:, 1:])
        return SimpleNamespace(loss=loss)


class Blocks(Dataset):
    """``run_clm``'s grouped texts: fixed blocks of ``seq_len + 1`` bytes, as ``input_ids`` and ``labels`` (equal)."""

    def __init__(self, data, seq_len: int, count: int, seed: int) -> None:
        self.data, self.seq_len = data, seq_len
        self.starts = SequenceStream(data, seq_len=seq_len, seed=seed).starts(0, count)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = int(self.starts[i])
        block = torch.as_tensor(self.data[s : s + self.seq_len + 1].astype("int64"))
        return {"input_ids": block, "labels": block}


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
    p.add_argument("--constant", action="store_true", help="no growth: the constant-batch run of the same loop")
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
    sequences = 2 * max_train_steps * starting_batch // args.block_size  # a corpus larger than the budget
    train_dataloader = DataLoader(Blocks(corpus.train, args.block_size, sequences, args.seed),
                                  shuffle=True, batch_size=args.per_device_train_batch_size)

    model = CausalLM(GPT(GPTConfig(context_length=args.block_size)))
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
    if args.constant:
        controller = None
    elif args.quick:  # short warm-up and cool-down so that a few hundred steps show a change
        controller = BatchSizeController(warmup_steps=20, warmup_tokens=0, cooldown_tokens=0, patience=4,
                                         window=8, kappa=2.0, hold_on_plateau=None)  # no hold on a loss plateau
    else:
        controller = BatchSizeController()
    tracker = AcceleratorTracker(accelerator, model, optimizer, lr_scheduler=lr_scheduler, controller=controller)
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    num_train_epochs = math.ceil(max_train_steps / num_update_steps_per_epoch)
    starting_epoch, resume_step = 0, None
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)  # the tracker is registered for checkpointing
        starting_epoch, resume_step = divmod(tracker.resume_position(), len(train_dataloader))
        accelerator.print(f"resumed at step {tracker.steps}, {tracker.tokens_seen:,.0f} tokens, "
                          f"accumulation {tracker.accumulation_steps}")

    accelerator.print(f"accelerate_gpt: {accelerator.num_processes} process(es), {accelerator.distributed_type}, "
                      f"starting global batch {starting_batch:,} tokens, {max_train_steps} constant-batch steps")
    completed_steps = tracker.steps
    record = None
    for epoch in range(starting_epoch, num_train_epochs):
        model.train()
        if epoch == starting_epoch and resume_step is not None:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for batch in active_dataloader:
            with tracker.accumulate(labels=batch["labels"][..., 1:]):  # replaces accelerator.accumulate(model)
                outputs = model(**batch)
                accelerator.backward(outputs.loss)  # divided by the window's accumulation
                tracker.observe_loss(outputs.loss)  # for the default's hold on a loss plateau
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
            if tracker.done(max_train_steps):  # replaces completed_steps >= max_train_steps: the same data
                break
    accelerator.wait_for_everyone()
    accelerator.save_state(str(Path(args.output_dir) / f"step_{completed_steps}"))
    val = math.nan
    if accelerator.is_main_process:
        val = evaluate(accelerator.unwrap_model(model).gpt, corpus.val, seq_len=args.block_size, num_sequences=64)
    ns = tracker.noise_scale
    last_lr = "-" if record is None else f"{record.scheduled_lr:.3g}"
    accelerator.print(f"done: {completed_steps} optimizer steps ({tracker.starting_batch_steps:g} at the starting "
                      f"batch), {tracker.tokens_seen:,.0f} tokens, {epoch + 1} epoch(s), last scheduled lr {last_lr}, "
                      f"val loss {val:.3f} nats/byte, "
                      f"noise scale {'-' if ns is None else f'{ns:,.0f}'} tokens, accumulation "
                      f"{tracker.accumulation_steps}; state saved to {Path(args.output_dir) / f'step_{completed_steps}'}")
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
