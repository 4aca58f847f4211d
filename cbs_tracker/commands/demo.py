"""``cbs-tracker demo``: the main job. A small byte-level GPT on the standard library's ``.py`` files.

Trains the ~0.45M-parameter GPT of :mod:`cbs_tracker.demo.gpt` on the running
Python's own standard library (no download) with a plain PyTorch loop driven by
:class:`~cbs_tracker.CBSTracker` and the default
:class:`~cbs_tracker.BatchSizeController`, and prints the measured noise scale,
the critical batch and the global batch as it goes (a live line on a terminal),
says why at each batch change, and draws the run at the end: the noise scale, the critical
batch and the global batch against tokens, and below them the training and validation loss
against tokens. ``--compare`` also trains the constant starting batch on the same data and
draws its loss beside the tracker's. About three minutes on one CPU thread with the defaults
(twice that with ``--compare``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

from cbs_tracker.commands import positive_int
from cbs_tracker.demo.corpus import SequenceStream, evaluate, load_corpus
from cbs_tracker.demo.gpt import GPT, GPTConfig, make_adamw
from cbs_tracker.integrations.plain import CBSTracker
from cbs_tracker.policy.controller import BatchSizeController


def format_interval(low: float | None, high: float | None) -> str:
    """``"low-high"`` of the noise scale's 90% interval for the table (``"-"`` when none).

    Args:
        low: lower end, or ``None`` before a measurement.
        high: upper end; ``inf`` while ``|G|^2`` is not distinguishable from 0.

    Returns:
        E.g. ``"1,210-1,530"``, ``">=900"`` when unbounded above, ``"-"`` when none.
    """
    if low is None or high is None:
        return "-"
    if math.isinf(high):
        return f">={low:,.0f}"
    return f"{low:,.0f}-{high:,.0f}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cbs-tracker demo", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=float, default=1.2e6, help="training budget in tokens (default 1.2M)")
    p.add_argument("--micro-sequences", type=positive_int, default=2, help="sequences per microbatch (default 2)")
    p.add_argument("--seq-len", type=positive_int, default=128, help="context length (default 128)")
    p.add_argument("--accumulation", type=positive_int, default=2, help="starting accumulation steps (default 2)")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (default 2e-3)")
    p.add_argument("--max-bytes", type=int, default=None, help="use only the first N bytes of the corpus")
    p.add_argument("--observe-only", action="store_true", help="measure, never change the batch")
    p.add_argument("--max-microbatch", type=positive_int, default=None,
                   help="grow the microbatch first, up to this many sequences (default: grow the accumulation only)")
    p.add_argument("--logdir", default=None, help="also write TensorBoard logs here (needs tensorboard)")
    p.add_argument("--print-every", type=positive_int, default=50,
                   help="without a terminal, print a line every N optimizer steps (default 50)")
    p.add_argument("--plot", default="demo.png",
                   help="picture of the run written at the end (default demo.png; needs matplotlib)")
    p.add_argument("--no-plot", action="store_true", help="do not draw the picture")
    p.add_argument("--compare", action="store_true",
                   help="also train the constant starting batch on the same data and draw its loss (twice the time)")
    p.add_argument("--evals", type=positive_int, default=12,
                   help="validation losses measured along the run, evenly spaced in tokens (default 12)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--seed", type=int, default=0)
    return p


def _short(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


class Progress:
    """One live line on a terminal (a bar), a plain line every ``every`` steps elsewhere."""

    def __init__(self, budget: float, every: int, stream=None) -> None:
        self.budget, self.every = budget, every
        self.stream = stream if stream is not None else sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()
        self._live = False

    def line(self, record, loss: float) -> str:
        rate = record.tokens_seen / max(time.perf_counter() - self.start, 1e-9)
        ns = "-" if record.noise_scale is None else f"{record.noise_scale:,.0f}"
        interval = format_interval(record.noise_scale_low, record.noise_scale_high)
        return (f"{_short(record.tokens_seen)}/{_short(self.budget)} tokens  loss {loss:.3f}  noise scale {ns} "
                f"({interval})  batch {record.global_batch:,.0f}  {rate:,.0f} tok/s")

    def update(self, record, loss: float) -> None:
        if self.tty:
            frac = min(1.0, record.tokens_seen / self.budget)
            bar = "#" * int(20 * frac) + "-" * (20 - int(20 * frac))
            self.stream.write(f"\r[{bar}] {frac:4.0%} {self.line(record, loss)}\x1b[K")
            self.stream.flush()
            self._live = True
        elif record.step % self.every == 0:
            print(f"step {record.step:>5}  {self.line(record, loss)}", file=self.stream, flush=True)

    def say(self, text: str) -> None:
        """A line that stays (the live line, if any, is redrawn after it)."""
        if self._live:
            self.stream.write("\r\x1b[K")
            self._live = False
        print(text, file=self.stream, flush=True)


def _change_reason(tracker) -> str:
    decision = getattr(tracker.session, "last_decision", None)
    reason = getattr(decision, "reason", "") or ""
    return f" ({reason})" if reason else ""


def _runs_from_records(records) -> dict:
    """The records as ``cbs-tracker plot`` reads them from TensorBoard: ``{tag: (steps, values)}``."""
    import numpy as np

    from cbs_tracker.core.tags import record_scalars

    series: dict[str, tuple[list[int], list[float]]] = {}
    for r in records:
        for tag, value in record_scalars(r).items():
            steps, values = series.setdefault(tag, ([], []))
            steps.append(r.step)
            values.append(value)
    return {"demo": {t: (np.asarray(s), np.asarray(v, dtype=np.float64)) for t, (s, v) in series.items()}}


class LossTrace:
    """A run's loss against tokens: each optimizer step's mean training loss and the validation losses."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.tokens: list[float] = []  # tokens seen after each optimizer step
        self.batch: list[float] = []  # tokens in that step
        self.train: list[float] = []  # the step's mean microbatch loss
        self.val_tokens: list[float] = []
        self.val: list[float] = []

    def smoothed(self, bins: int = 48) -> tuple[list[float], list[float]]:
        """The training loss averaged per token over ``bins`` equal spans of tokens: ``(centres, losses)``."""
        if not self.tokens:
            return [], []
        end = self.tokens[-1]
        sums, weights = [0.0] * bins, [0.0] * bins
        for t, b, loss in zip(self.tokens, self.batch, self.train, strict=True):
            i = min(bins - 1, int(bins * (t - 0.5 * b) / end))
            sums[i] += loss * b
            weights[i] += b
        keep = [i for i in range(bins) if weights[i] > 0]
        return [(i + 0.5) * end / bins for i in keep], [sums[i] / weights[i] for i in keep]


def draw(records, path: str, losses: list[LossTrace] | None = None) -> str:
    """Write the run's picture; returns what happened, in words.

    Top: the noise scale with its 90% interval, the critical batch and the global batch against tokens
    (``cbs-tracker plot``'s picture). Below, with ``losses``: each run's training loss (averaged per
    token over spans of the run) and validation loss against tokens.
    """
    try:
        from cbs_tracker.commands.plot import draw_schedule

        if not losses:
            fig = draw_schedule(_runs_from_records(records), title="cbs-tracker demo")
        else:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure

            fig = Figure(figsize=(9.0, 8.0), layout="constrained")
            FigureCanvasAgg(fig)
            top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
            draw_schedule(_runs_from_records(records), title="cbs-tracker demo", ax=top)
            top.set_xlabel("")
            for i, trace in enumerate(losses):
                color = f"C{i}"
                x, y = trace.smoothed()
                bottom.plot(x, y, color=color, lw=1.0, alpha=0.6, label=f"{trace.label}: training loss")
                bottom.plot(trace.val_tokens, trace.val, color=color, lw=1.8, marker="o", ms=3.5,
                            label=f"{trace.label}: validation loss")
            vals = [v for trace in losses for v in trace.val]
            if vals:  # the first steps' loss (several nats above the rest) would flatten the curves
                lo = min(vals + [v for trace in losses for v in trace.smoothed()[1]])
                hi = max(vals)
                bottom.set_ylim(lo - 0.05 * (hi - lo + 0.1), hi + 0.3 * (hi - lo + 0.1))
            bottom.set_xlabel("tokens seen")
            bottom.set_ylabel("loss (nats/byte)")
            bottom.grid(True, alpha=0.3)
            bottom.legend(fontsize=8, loc="upper right")
    except ImportError:
        return "no picture: matplotlib is not installed (pip install 'cbs-tracker[plot]')"
    fig.savefig(path, dpi=110)
    return f"picture of the run: {os.path.abspath(path)}"


def _train(args, corpus, *, controller, logger, progress, trace: LossTrace, say_changes: bool):
    """One run of the demo GPT on the demo stream; returns ``(model, tracker, records, last record, loss)``.

    Every run built here starts from the same weights and reads the same sequences in the same order.
    """
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(context_length=args.seq_len))
    optimizer = make_adamw(model, lr=args.lr, weight_decay=0.1)
    stream = SequenceStream(corpus.train, seq_len=args.seq_len, seed=args.seed)
    micro_tokens = args.micro_sequences * args.seq_len
    tracker = CBSTracker(
        model, optimizer, accumulation_steps=args.accumulation, controller=controller, logger=logger,
        max_microbatch=args.max_microbatch if controller is not None else None,
    )
    eval_every = args.tokens / args.evals
    next_eval = eval_every
    records = []
    record = None
    last_loss = math.nan
    batches = iter(lambda: stream.next_batch(args.micro_sequences), None)  # an endless loader
    for window in tracker.windows(batches):
        if tracker.tokens_seen >= args.tokens:
            break
        total = 0.0
        for x, y in window:
            with tracker.microbatch(labels=y):
                _, loss = model(x, y)
                (loss / tracker.accumulation_steps).backward()
            tracker.observe_loss(loss)  # the default's hold on a loss plateau reads it
            total += float(loss.detach())
        last_loss = total / len(window)
        record = tracker.step()  # after backward, before clipping
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        records.append(record)
        trace.tokens.append(record.tokens_seen)
        trace.batch.append(record.global_batch)
        trace.train.append(last_loss)
        if record.tokens_seen >= next_eval and record.tokens_seen < args.tokens:
            trace.val_tokens.append(record.tokens_seen)
            trace.val.append(evaluate(model, corpus.val, seq_len=args.seq_len, num_sequences=128))
            while next_eval <= record.tokens_seen:
                next_eval += eval_every
        progress.update(record, last_loss)
        if say_changes and record.next_accumulation_steps != record.accumulation_steps:
            new = record.next_accumulation_steps * micro_tokens
            layout = f"; {tracker.accumulation_steps} x {tracker.microbatch_batches * micro_tokens:,}-token microbatches"
            progress.say(
                f"step {record.step}, {_short(record.tokens_seen)} tokens: global batch "
                f"{record.global_batch:,.0f} -> {new:,} tokens{_change_reason(tracker)}"
                + (layout if args.max_microbatch else "")
            )
    val = evaluate(model, corpus.val, seq_len=args.seq_len, num_sequences=128)
    trace.val_tokens.append(tracker.tokens_seen)
    trace.val.append(val)
    return model, tracker, records, record, last_loss, val


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    corpus = load_corpus(args.max_bytes)
    micro_tokens = args.micro_sequences * args.seq_len
    logger = None
    if args.logdir:
        from cbs_tracker.integrations.tensorboard import TensorBoardLogger

        logger = TensorBoardLogger(args.logdir)
    controller = BatchSizeController(observe_only=args.observe_only, total_tokens=args.tokens)  # the run's length
    start_batch = args.accumulation * micro_tokens
    params = GPT(GPTConfig(context_length=args.seq_len)).num_parameters()
    print(
        f"cbs-tracker demo: GPT {params / 1e6:.2f}M params on {corpus.num_files} stdlib files "
        f"({corpus.num_bytes / 1e6:.1f} MB); batch starts at {start_batch:,} tokens ({args.accumulation} x "
        f"{micro_tokens}); budget {args.tokens / 1e6:.2f}M tokens"
    )
    progress = Progress(args.tokens, args.print_every)
    tracked = LossTrace("tracker")
    model, tracker, records, record, last_loss, val = _train(
        args, corpus, controller=controller, logger=logger, progress=progress, trace=tracked, say_changes=True)
    changes = sum(r.next_accumulation_steps != r.accumulation_steps for r in records)
    elapsed = time.perf_counter() - progress.start
    progress.say(progress.line(record, last_loss))
    ns = tracker.noise_scale
    final = tracker.accumulation_steps * tracker.microbatch_batches * micro_tokens
    print(
        f"done: {tracker.steps} optimizer steps, {tracker.tokens_seen:,.0f} tokens in {elapsed:.0f}s "
        f"({tracker.tokens_seen / elapsed:,.0f} tokens/s); val loss {val:.3f} nats/byte; "
        f"noise scale {'-' if ns is None else f'{ns:,.0f}'} tokens "
        f"(90% interval {format_interval(*(tracker.noise_scale_interval or (None, None)))}); "
        f"global batch {start_batch:,} -> {final:,} tokens"
    )
    if changes == 0:
        if args.observe_only:
            print("no batch change: --observe-only")
        elif controller.plateau.held:
            print(f"no batch change: the default's hold on a loss plateau held growth for the run (the loss fell "
                  f"{controller.plateau.verdict_slope:.3f} nats per e-fold of tokens at "
                  f"{controller.plateau.verdict_tokens / args.tokens:.2g} of the run, below "
                  f"{controller.plateau.below:g}; hold_on_plateau=None grows on the noise scale alone)")
        else:
            need = 2 * start_batch * (1 + controller.margin)
            have = "not measured yet" if ns is None else f"{controller.kappa:g} x {ns:,.0f} = {controller.kappa * ns:,.0f}"
            print(f"no batch change: a doubling needs the critical batch (kappa x the measured noise scale, and kappa "
                  f"x the lower end of its 90% interval) at {need:,.0f} tokens or more for {controller.patience} "
                  f"measurements in a row, after a warm-up; at the end it was {have} tokens. A longer run "
                  f"(--tokens) lets the noise scale rise")
    traces = [tracked]
    if args.compare:
        constant = LossTrace(f"constant {start_batch:,}")
        print(f"the constant batch of {start_batch:,} tokens on the same data, for comparison:")
        progress = Progress(args.tokens, args.print_every)
        _, const_tracker, _, const_record, const_loss, const_val = _train(
            args, corpus, controller=None, logger=None, progress=progress, trace=constant, say_changes=False)
        progress.say(progress.line(const_record, const_loss))
        fewer = 1 - tracker.steps / const_tracker.steps
        print(
            f"constant batch {start_batch:,}: {const_tracker.steps} optimizer steps, val loss {const_val:.3f} "
            f"nats/byte; the tracker: {tracker.steps} steps ({fewer:.0%} fewer), val loss {val:.3f} "
            f"({val - const_val:+.3f})"
        )
        traces.append(constant)
    if not args.no_plot:
        print(draw(records, args.plot, losses=traces))
    if logger is not None:
        logger.close()
    return 0
