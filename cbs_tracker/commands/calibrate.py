"""``cbs-tracker calibrate``: measure the critical batch of the demo GPT by branches, and ``kappa``.

Trains the demo GPT at a constant batch (512 tokens: 256-token microbatches, A = 2, AdamW,
a cosine schedule in tokens) with an observe-only tracker, and at each token mark runs
:func:`cbs_tracker.measure_critical_batch`: short branches at 1/2 .. 8 times the batch,
LR x sqrt(k), replicated over data orders, with an LR control. Prints the table (tokens,
critical batch interval, the tracker's ``B_simple``, the frozen raw and Adam-preconditioned
noise scales, ``kappa``, the branches' cost) and draws the branches' losses. About six
minutes on one CPU thread with the defaults.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cbs_tracker.commands import positive_int


@dataclass(frozen=True)
class GPTCalibration:
    """What defines a calibration run of a demo GPT (sizes in tokens)."""

    marks: tuple[float, ...]
    run_tokens: float
    branch_tokens: float
    seq_len: int = 128
    n_layer: int = 2
    d_model: int = 128
    n_head: int = 4
    micro_sequences: int = 2
    accumulation: int = 2
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_tokens: float = 200_000
    weight_decay: float = 0.1
    clip: float = 1.0
    replicates: int = 2
    multiples: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, 8.0)
    epsilon: float = 0.01
    eval_sequences: int = 256
    max_bytes: int | None = None
    seed: int = 0
    corpus: str = "code"  # "code": load_corpus(max_bytes); "docs": load_docstrings()
    cooldowns: tuple[float, ...] = (0.0,)  # one measurement per value at each mark, from the same state
    cooldown_shape: str = "sqrt"
    control: bool = True  # the LR control branch at the run's batch
    frozen_microbatches: int = 32  # microbatch gradients of the frozen noise scale at each mark


#: the branches' data streams: seeds that no training stream of a seed below 1000 uses
BRANCH_STREAM_SEED = 50_000


def cosine_lr(c: GPTCalibration) -> Callable[[float], float]:
    """The run's learning rate against tokens: linear warm-up, cosine to ``min_lr_ratio`` at ``run_tokens``."""
    def lr(tokens: float) -> float:
        if tokens < c.warmup_tokens:
            return c.lr * tokens / c.warmup_tokens
        span = max(c.run_tokens - c.warmup_tokens, 1.0)
        progress = min(max((tokens - c.warmup_tokens) / span, 0.0), 1.0)
        low = c.min_lr_ratio * c.lr
        return low + (c.lr - low) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr


def calibrate_gpt(c: GPTCalibration, *, log: Callable[[str], None] = print,
                  on_point: Callable[[Any], None] | None = None, frozen_only: bool = False) -> Any:
    """Train the demo GPT at a constant batch to each mark and calibrate there; returns the
    :class:`~cbs_tracker.calibrate.Calibration` (``on_point`` is called after each point).

    ``frozen_only``: measure only the frozen noise scales at the marks (the same microbatches a
    calibration's frozen measurement takes); returns a list of ``(tokens, FrozenNoiseScale)``."""
    import torch

    from cbs_tracker.calibrate import Calibration, frozen_noise_scale, measure_critical_batch
    from cbs_tracker.calibrate.branches import branch_copy
    from cbs_tracker.demo.corpus import SequenceStream, evaluate, load_corpus, load_docstrings
    from cbs_tracker.demo.gpt import GPT, GPTConfig, make_adamw
    from cbs_tracker.integrations.plain import CBSTracker
    from cbs_tracker.policy.controller import BatchSizeController

    if c.corpus not in ("code", "docs"):
        raise ValueError(f"GPTCalibration(corpus={c.corpus!r}): expected 'code' or 'docs'")
    corpus = load_corpus(c.max_bytes) if c.corpus == "code" else load_docstrings()
    micro_tokens = c.micro_sequences * c.seq_len
    start = micro_tokens * c.accumulation
    torch.manual_seed(c.seed)
    model = GPT(GPTConfig(context_length=c.seq_len, n_layer=c.n_layer, d_model=c.d_model, n_head=c.n_head))
    optimizer = make_adamw(model, c.lr, c.weight_decay)
    lr_of = cosine_lr(c)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: lr_of((e + 1) * start) / c.lr)
    tracker = CBSTracker(model, optimizer, accumulation_steps=c.accumulation, lr_scheduler=scheduler,
                         controller=BatchSizeController(observe_only=True))
    stream = SequenceStream(corpus.train, seq_len=c.seq_len, seed=c.seed)

    def data(replicate: int) -> Iterator[Any]:
        s = SequenceStream(corpus.train, seq_len=c.seq_len, seed=BRANCH_STREAM_SEED + 1000 * c.seed + replicate)
        return iter(lambda: s.next_batch(c.micro_sequences), None)

    calibration = Calibration()
    frozen: list[Any] = []
    pending = sorted(c.marks)
    while pending:
        for _ in range(tracker.accumulation_steps):
            x, y = stream.next_batch(c.micro_sequences)
            with tracker.microbatch(labels=y):
                (model(x, y)[1] / tracker.accumulation_steps).backward()
        record = tracker.step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), c.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if record.tokens_seen < pending[0]:
            continue
        pending.pop(0)
        ns = "-" if record.noise_scale is None else f"{record.noise_scale:,.0f}"
        if frozen_only:
            copy_model, copy_opt = branch_copy(model, optimizer, None)
            frozen.append((record.tokens_seen, frozen_noise_scale(
                copy_model, copy_opt, loss_fn=lambda m, b: m(*b)[1], microbatches=iter(data(c.replicates)),
                microbatch_size=micro_tokens, count=c.frozen_microbatches)))
            log(f"{record.tokens_seen:,.0f} tokens: frozen {frozen[-1][1]}")
            continue
        for cooldown in c.cooldowns:
            log(f"{record.tokens_seen:,.0f} tokens, batch {start:,}, B_simple {ns}: branching"
                + (f" (LR cooled over the last {cooldown:.0%} of each branch)" if cooldown else ""))
            point = measure_critical_batch(
                model, optimizer, tracker=tracker, loss_fn=lambda m, b: m(*b)[1], data=data,
                evaluate=lambda m: evaluate(m, corpus.val, seq_len=c.seq_len, num_sequences=c.eval_sequences),
                microbatch_size=micro_tokens, branch_tokens=c.branch_tokens, multiples=c.multiples,
                replicates=c.replicates, epsilon=c.epsilon, lr_schedule=lr_of, clip_grad_norm=c.clip,
                fuse_microbatches=max(1, 2048 // micro_tokens), seed=c.seed, log=log, cooldown=cooldown,
                cooldown_shape=c.cooldown_shape, control=c.control, frozen_microbatches=c.frozen_microbatches if cooldown == c.cooldowns[0] else 0)
            calibration.points.append(point)
            log(f"  {point.total_branch_tokens:,.0f} branch tokens ({point.total_branch_tokens / c.run_tokens:.0%} "
                f"of a {c.run_tokens:,.0f}-token run), {point.seconds:.0f} s")
        if on_point is not None:
            on_point(calibration)
    return frozen if frozen_only else calibration


def plot_branches(calibration: Any, path: str | Path, *, unit: str = "tokens") -> None:
    """One panel per point: each batch's mean held-out loss with its standard error, the control,
    the tolerance above the best, and the measured critical batch. Needs matplotlib."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    points = calibration.points
    fig = Figure(figsize=(3.6 * max(1, len(points)), 3.4), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, max(1, len(points)), squeeze=False)[0]
    for ax, p in zip(axes, points):
        xs = [b.batch for b in p.branches]
        ys = [b.mean for b in p.branches]
        es = [b.stderr or 0.0 for b in p.branches]
        ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label="branches")
        if p.control is not None:
            ax.errorbar([p.control.batch], [p.control.mean], yerr=[p.control.stderr or 0.0], marker="s",
                        linestyle="none", color="C3", capsize=3, label=f"control (LR x {p.control.lr_factor:.2g})")
        best = min(ys)
        ax.axhspan(best, best + p.critical.epsilon, color="C2", alpha=0.15, label=f"within {p.critical.epsilon:g}")
        ax.axvline(p.critical.low, color="C2", linestyle="--", label="critical batch")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"branch batch ({unit})")
        ax.set_title(f"at {p.tokens:,.0f} {unit}: [{p.critical.low:,.0f}, "
                     f"{'inf' if p.critical.lower_bound_only else format(p.critical.high, ',.0f')})", fontsize=9)
    axes[0].set_ylabel("held-out loss after the branch (nats)")
    axes[0].legend(fontsize=7)
    fig.savefig(str(path), dpi=110)


def _marks(text: str) -> tuple[float, ...]:
    try:
        marks = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--marks {text!r}: expected comma-separated token counts") from None
    if not marks or any(not (m > 0 and math.isfinite(m)) for m in marks):
        raise argparse.ArgumentTypeError(f"--marks {text!r}: every mark must be a number of tokens > 0")
    return marks


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cbs-tracker calibrate", description=__doc__.splitlines()[0])
    p.add_argument("--marks", type=_marks, default=(150_000, 300_000),
                   help="token counts at which to branch (default 150000,300000)")
    p.add_argument("--run-tokens", type=float, default=1.2e6,
                   help="the run's length: the cosine schedule ends there (default 1.2M)")
    p.add_argument("--branch-tokens", type=float, default=65_536, help="tokens per branch (default 65536)")
    p.add_argument("--replicates", type=positive_int, default=2, help="branches per batch (default 2)")
    p.add_argument("--epsilon", type=float, default=0.01, help="loss tolerance in nats (default 0.01)")
    p.add_argument("--multiples", type=lambda s: tuple(float(x) for x in s.split(",")), default=(0.5, 1, 2, 4, 8),
                   help="batch multiples (default 0.5,1,2,4,8)")
    p.add_argument("--out", default="calibration", help="directory for calibration.json and calibration.png")
    p.add_argument("--no-plot", action="store_true", help="do not draw the picture")
    p.add_argument("--quick", action="store_true", help="a tiny model and corpus (seconds; for a smoke test)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cooldown", type=float, default=0.0,
                   help="anneal each branch's LR to zero over this last fraction of it (1-sqrt) before the "
                        "evaluation (default 0: none; 0.5 compares the batches with their gradient noise removed)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not 0.0 <= args.cooldown <= 1.0:
        parser.error(f"--cooldown={args.cooldown!r}: a fraction of the branch in [0, 1]")
    import torch

    torch.set_num_threads(args.threads)
    c = GPTCalibration(marks=args.marks, run_tokens=args.run_tokens, branch_tokens=args.branch_tokens,
                       replicates=args.replicates, epsilon=args.epsilon, multiples=tuple(args.multiples),
                       seed=args.seed, cooldowns=(args.cooldown,))
    if args.quick:
        c = GPTCalibration(marks=tuple(m for m in args.marks if m < 20_000) or (4096, 8192), run_tokens=32_768,
                           branch_tokens=min(args.branch_tokens, 2048), seq_len=32, n_layer=1, d_model=32, n_head=2,
                           warmup_tokens=2048, replicates=args.replicates, epsilon=args.epsilon,
                           multiples=tuple(args.multiples), eval_sequences=16, max_bytes=1 << 20, seed=args.seed,
                           cooldowns=(args.cooldown,))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save(calibration: Any) -> None:
        (out / "calibration.json").write_text(calibration.to_json())

    calibration = calibrate_gpt(c, on_point=save)
    print()
    print(calibration.table())
    schedule = calibration.kappa_schedule()
    print(f"\nkappa for the controller: BatchSizeController(kappa={schedule.points!r})")
    print(f"the OLMo recipe as token marks (double where the critical batch passes 2B): "
          f"{calibration.batch_schedule(c.micro_sequences * c.seq_len * c.accumulation)}")
    print(f"wrote {out / 'calibration.json'}")
    if not args.no_plot:
        try:
            plot_branches(calibration, out / "calibration.png")
        except ImportError:
            print("matplotlib is not installed (pip install 'cbs-tracker[plot]'): no picture drawn")
        else:
            print(f"wrote {out / 'calibration.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["GPTCalibration", "calibrate_gpt", "cosine_lr", "main", "plot_branches"]
