"""LitGPT's own ``fit()`` (``litgpt/pretrain.py``), run on a tiny GPT with the guide's Fabric lines, or without.

LitGPT is not installed for this: its ``fit()`` and ``get_lr()`` are read from a copy of
``litgpt/pretrain.py`` given on the command line and run as LitGPT wrote them, with the objects they
call from elsewhere in LitGPT stood in for (the model, ``chunked_cross_entropy``, ``CycleIterator``,
``validate``, ``TrainArgs``/``EvalArgs``, throughput and FLOP counting; a save is a no-op). The
model is this package's byte-level demo GPT (2 layers, width 64, dropout 0) behind LitGPT's call
``model(input_ids) -> logits``; the data are fixed 65-byte windows of the standard library
(``cbs_tracker.demo.corpus``) in one order, so a run with growth and the constant run see the same
microbatches. ``--tracker`` edits ``fit()``'s source with the guide's lines (docs/guide.md,
"Lightning Fabric and Hugging Face Accelerate loops"; each edit must match exactly once, and
``--show-diff`` prints them); without it ``fit()`` is LitGPT's. The trace is the one
``trace.py`` writes, for ``compare.py``.

    git -C litgpt show 26857050fe3ff627cd714fe92f5838f51a3d5efa:litgpt/pretrain.py > runs/pretrain.py
    python benchmarks/clients/litgpt_fit.py runs/pretrain.py runs/litgpt_constant.json
    python benchmarks/clients/litgpt_fit.py runs/pretrain.py runs/litgpt_tracker.json --tracker
    python benchmarks/clients/compare.py runs/litgpt_constant.json runs/litgpt_tracker.json
"""

from __future__ import annotations

import argparse
import ast
import difflib
import hashlib
import json
import math
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

# The guide's lines, as edits of LitGPT's fit(): (LitGPT's text, what replaces it).
GUIDE_EDITS = [
    # the tracker on what fabric.setup returned
    ('    model = state["model"]\n    optimizer = state["optimizer"]\n',
     '    model = state["model"]\n    optimizer = state["optimizer"]\n'
     '    tracker = CBSTracker(model, optimizer, accumulation_steps=train.gradient_accumulation_iters(devices, '
     'num_nodes), controller=BatchSizeController())\n'),
    # the loop: windows of the tracker's length, stopped on max_iters microbatches
    ('    for train_data in train_iterator:\n        if state["iter_num"] >= max_iters:\n            break\n',
     '    while not tracker.done(microbatches=max_iters):\n      for _ in range(tracker.accumulation_steps):\n'
     '        train_data = next(train_iterator)\n'),
    # iter_num's clock is tracker.microbatches_seen; the LR goes through tracker.set_lr
    ('        lr = get_lr(optimizer.defaults["lr"], state["iter_num"], warmup_iters, max_iters, train.min_lr)\n'
     '        for param_group in optimizer.param_groups:\n            param_group["lr"] = lr\n',
     '        lr = get_lr(optimizer.defaults["lr"], tracker.microbatches_seen, warmup_iters, max_iters, train.min_lr)\n'
     '        tracker.set_lr(lr)\n'),
    # tracker.microbatch in place of fabric.no_backward_sync, the loss over the window's length
    ('        is_accumulating = state["iter_num"] % train.gradient_accumulation_iters(devices, num_nodes) != 0\n'
     '        with fabric.no_backward_sync(model, enabled=is_accumulating):\n',
     '        is_accumulating = _ < tracker.accumulation_steps - 1\n'
     '        with tracker.microbatch(labels=targets):\n'),
    ('            fabric.backward(loss / train.gradient_accumulation_iters(devices, num_nodes))\n',
     '            fabric.backward(loss / tracker.accumulation_steps)\n            tracker.observe_loss(loss)\n'),
    # tracker.step() before clipping
    ('        if not is_accumulating:\n            fabric.clip_gradients(',
     '        if not is_accumulating:\n            tracker.step()\n            fabric.clip_gradients('),
]


def _source(path: Path, name: str) -> str:
    text = path.read_text(encoding="utf-8")
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(text, node) + "\n"
    raise SystemExit(f"{path}: no function {name}()")


def _edit(fit: str, hold_on_plateau: float | None | str = "default") -> str:
    """``fit`` with the guide's lines; ``hold_on_plateau`` other than ``"default"`` is passed to the controller."""
    edits = list(GUIDE_EDITS)
    if hold_on_plateau != "default":
        edits = [(old, new.replace("BatchSizeController()", f"BatchSizeController(hold_on_plateau={hold_on_plateau})"))
                 for old, new in edits]
    for old, new in edits:
        if fit.count(old) != 1:
            raise SystemExit(f"LitGPT's fit() has changed: {old!r} occurs {fit.count(old)} times (once expected)")
        fit = fit.replace(old, new)
    # the body of the old for loop moves into the window loop: indent it two more spaces
    head = "      for _ in range(tracker.accumulation_steps):\n"
    start = fit.index(head) + len(head)
    end = fit.index("\n    # Final validation")
    body = "".join(("  " + line) if line.strip() else line for line in fit[start:end].splitlines(True))
    return fit[:start] + body + fit[end:]


class LitModel(torch.nn.Module):
    """The demo GPT called as LitGPT calls its GPT: ``model(input_ids) -> logits``."""

    def __init__(self, seq_len: int) -> None:
        super().__init__()
        from cbs_tracker.demo.gpt import GPT, GPTConfig

        torch.manual_seed(0)
        self.config = GPTConfig(context_length=seq_len, n_layer=2, d_model=64, n_head=2)
        self.gpt = GPT(self.config)
        self.max_seq_length = seq_len

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.gpt(input_ids)[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pretrain", type=Path, help="a copy of LitGPT's litgpt/pretrain.py")
    p.add_argument("trace", type=Path)
    p.add_argument("--tracker", action="store_true", help="fit() with the guide's lines")
    p.add_argument("--show-diff", action="store_true")
    p.add_argument("--hold-on-plateau", type=lambda v: None if v == "none" else float(v), default=argparse.SUPPRESS,
                   help="with --tracker: BatchSizeController(hold_on_plateau=X) in place of the default (0.15); "
                        "'none': the kappa rule alone")
    p.add_argument("--max-tokens", type=int, default=600_000, help="TrainArgs.max_tokens")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=8, help="micro batch x 2: gradient accumulation 2")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    args = p.parse_args()

    import lightning as L

    from cbs_tracker import BatchSizeController, CBSTracker
    from cbs_tracker.demo.corpus import SequenceStream, load_corpus

    fit = _source(args.pretrain, "fit")
    if args.tracker:
        edited = _edit(fit, getattr(args, "hold_on_plateau", "default"))
        if args.show_diff:
            sys.stdout.writelines(difflib.unified_diff(fit.splitlines(True), edited.splitlines(True),
                                                       "fit() (LitGPT)", "fit() (the guide's lines)"))
        fit = edited

    # ---- data: fixed windows of seq_len + 1 bytes, one order for every run
    corpus = load_corpus(max_bytes=2_000_000)
    per_step = args.micro_batch_size
    count = args.max_tokens // args.seq_len + 64 * per_step
    starts = SequenceStream(corpus.train, seq_len=args.seq_len, seed=0).starts(0, count)
    data = torch.as_tensor(corpus.train.astype("int64"))
    windows = torch.stack([data[int(s): int(s) + args.seq_len + 1] for s in starts])
    train_dataloader = torch.utils.data.DataLoader(windows, batch_size=per_step, shuffle=False)
    val = torch.as_tensor(corpus.val[: 64 * (args.seq_len + 1)].astype("int64")).view(64, args.seq_len + 1)

    # ---- the objects fit() calls from elsewhere in LitGPT
    def chunked_cross_entropy(logits, targets, chunk_size=128):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    class CycleIterator:
        def __init__(self, iterable):
            self.iterable, self.epoch, self._it = iterable, 0, None

        def __iter__(self):
            return self

        def __next__(self):
            if self._it is None:
                self._it = iter(self.iterable)
            try:
                return next(self._it)
            except StopIteration:
                self._it, self.epoch = iter(self.iterable), self.epoch + 1
                return next(self._it)

    class RunningMean:
        def __init__(self, window, sync_on_compute=False):
            self.values, self.window = [], window

        def to(self, _device):
            return self

        def update(self, value):
            self.values = (self.values + [float(value)])[-self.window:]

        def compute(self):
            return torch.tensor(sum(self.values) / max(1, len(self.values)))

    def validate(fabric, model, val_dataloader, max_iters, verbose=True):
        model.eval()
        with torch.no_grad():
            loss = chunked_cross_entropy(model(val[:, :-1]), val[:, 1:])
        model.train()
        return loss

    class ThroughputMonitor:
        def __init__(self, *a, **k):
            pass

        def update(self, **k):
            pass

        def compute(self):
            return {}

    accumulation = args.global_batch_size // args.micro_batch_size
    train = SimpleNamespace(
        max_tokens=args.max_tokens, micro_batch_size=args.micro_batch_size, log_interval=10**9, max_norm=1.0,
        min_lr=args.lr / 10, save_interval=None, lr_warmup_steps=30,
        gradient_accumulation_iters=lambda devices, num_nodes=1: accumulation,
        warmup_iters=lambda devices, num_nodes, max_iters, loader: 30 * accumulation,  # lr_warmup_steps x accumulation
    )
    eval_args = SimpleNamespace(initial_validation=False, interval=10**9, max_iters=1, final_validation=True)
    namespace = dict(
        L=L, torch=torch, nn=torch.nn, math=math, time=time, timedelta=timedelta, Path=Path,
        DataLoader=torch.utils.data.DataLoader, TrainArgs=object, EvalArgs=object,
        GPT=lambda config: LitModel(args.seq_len), measure_flops=lambda *a, **k: 0.0,
        ThroughputMonitor=ThroughputMonitor, RunningMean=RunningMean, CycleIterator=CycleIterator,
        chunked_cross_entropy=chunked_cross_entropy, validate=validate,
        save_checkpoint=lambda *a, **k: None, CBSTracker=CBSTracker,
        BatchSizeController=lambda **k: controllers.append(BatchSizeController(**k)) or controllers[-1],
    )
    controllers: list = []  # the controller fit() builds, for the plateau verdict in the trace
    exec(compile(_source(args.pretrain, "get_lr"), str(args.pretrain), "exec"), namespace)
    exec(compile(fit, str(args.pretrain), "exec"), namespace)

    # ---- the trace: each microbatch's tokens and a hash, each optimizer step's data and LR
    state = {"steps": [], "micro": [], "tokens": 0, "window": [], "window_tokens": 0}
    chunked = namespace["chunked_cross_entropy"]

    def traced_loss(logits, targets, chunk_size=128):
        if torch.is_grad_enabled():
            digest = hashlib.sha1(targets.numpy().tobytes()).hexdigest()[:12]
            state["micro"].append(digest)
            state["window"].append(digest)
            state["window_tokens"] += targets.numel()
            state["tokens"] += targets.numel()
        return chunked(logits, targets, chunk_size)

    namespace["chunked_cross_entropy"] = traced_loss

    def on_step(optimizer, _a, _k):
        state["steps"].append({"before": state["tokens"] - state["window_tokens"], "micro": len(state["window"]),
                               "tokens": state["window_tokens"], "lr": optimizer.param_groups[0]["lr"]})
        state["window"], state["window_tokens"] = [], 0

    register_optimizer_step_pre_hook(on_step)

    fabric = L.Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    model = LitModel(args.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model, optimizer = fabric.setup(model, optimizer)
    fit_state = {"model": model, "optimizer": optimizer, "iter_num": 0, "step_count": 0}
    namespace["fit"](fabric, 1, fit_state, train_dataloader, None, Path("."), None, train, eval_args)

    plateau = None
    if controllers and controllers[0].plateau.active:
        p_ = controllers[0].plateau
        plateau = {"held": p_.held, "verdict_slope": p_.verdict_slope, "verdict_tokens": p_.verdict_tokens,
                   "total_tokens": controllers[0].total_tokens}
        print(f"hold_on_plateau: {plateau}")
    args.trace.parent.mkdir(parents=True, exist_ok=True)
    args.trace.write_text(json.dumps({"script": "litgpt fit()", "args": sys.argv[1:], "steps": state["steps"],
                                      "micro": state["micro"], "tokens": state["tokens"],
                                      "unstepped": len(state["window"]), "plateau": plateau}))
    print(f"{args.trace}: {len(state['steps'])} optimizer steps, {len(state['micro'])} microbatches, "
          f"{state['tokens']:,} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
