"""Does the reported noise scale describe the current weights? The demo GPT against frozen truths.

Trains the demo GPT with the demo's settings (AdamW at a constant 2e-3, 256-token
microbatches, accumulation 2, clipping at 1.0, observe only) and, at each
checkpoint, measures the noise scale *frozen at the same weights*: a copy of the
model, learning rate 0, ``--frozen-steps`` steps of ``K = 8`` microbatches of 256
tokens from a separate stream, the small and big squared norms averaged flat
over the steps, then the usual two-batch-size algebra. The frozen value's
standard error comes from the spread of its steps (delta method for a ratio).

The training run records every step's own ``|G|^2`` and ``tr(Sigma)`` estimates
and sizes; since the run only observes, its trajectory does not depend on the
estimator, so each estimator is replayed on the recorded steps and read at the
checkpoints.

    python benchmarks/tracking.py [--seeds 0 1] [--tokens 1.6e6] [--frozen-steps 192] [--json]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from cbs_tracker.integrations.plain import CBSTracker

from cbs_tracker.core.estimator import NoiseScaleEstimator
from cbs_tracker.demo.corpus import SequenceStream, load_corpus
from cbs_tracker.demo.gpt import GPT, GPTConfig, make_adamw
from cbs_tracker.policy.controller import BatchSizeController

CHECKPOINTS = (0.1e6, 0.2e6, 0.4e6, 0.8e6, 1.6e6)
SEQ_LEN = 128
MICRO_SEQUENCES = 2
ACCUMULATION = 2
LR = 2e-3
FROZEN_K = 8
# the frozen measurement's stream: a seed the training stream of any seed < 1000 never uses
FROZEN_STREAM_SEED_OFFSET = 1000


@dataclass(frozen=True)
class FrozenMeasurement:
    """The noise scale of fixed weights from many steps of ``k`` microbatches.

    Attributes:
        tokens: tokens the run had seen when the weights were copied.
        noise_scale: ``mean(t_s) / mean(g_s)`` over the steps, in tokens.
        stderr: its standard error (delta method over the i.i.d. steps).
        grad_sq_norm: ``mean(g_s)``.
        trace_cov: ``mean(t_s)``.
        steps: steps measured.
    """

    tokens: float
    noise_scale: float
    stderr: float
    grad_sq_norm: float
    trace_cov: float
    steps: int


@dataclass
class Trace:
    """One training run: every step's own estimates and the frozen truths.

    Attributes:
        seed: the run's seed.
        tokens: tokens seen after each step.
        grad_sq: each step's own ``|G|^2`` estimate.
        trace: each step's own ``tr(Sigma)`` estimate (tokens).
        small_batch: ``B_small`` of each step (tokens).
        big_batch: ``B_big`` of each step (tokens).
        frozen: the frozen measurements at the checkpoints.
        seconds: wall-clock of the run.
    """

    seed: int
    tokens: list[float] = field(default_factory=list)
    grad_sq: list[float] = field(default_factory=list)
    trace: list[float] = field(default_factory=list)
    small_batch: list[float] = field(default_factory=list)
    big_batch: list[float] = field(default_factory=list)
    frozen: list[FrozenMeasurement] = field(default_factory=list)
    seconds: float = 0.0


def _flat_grad(model: torch.nn.Module, loss: torch.Tensor) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params)
    return torch.cat([g.reshape(-1).double() for g in grads])


def frozen_noise_scale(
    model: torch.nn.Module, stream: SequenceStream, *, steps: int, k: int = FROZEN_K,
    micro_sequences: int = MICRO_SEQUENCES, tokens: float = 0.0,
) -> FrozenMeasurement:
    """Measure the noise scale of ``model``'s current weights without changing them.

    Each step draws ``k`` microbatches of ``micro_sequences`` sequences, takes each one's
    mean-loss gradient ``g_k`` (float64), and forms that step's unbiased estimates from
    ``mean |g_k|^2`` and ``|mean g_k|^2`` (McCandlish et al. 2018, App. A).

    Args:
        model: the model; its weights are not modified (gradients go through ``autograd.grad``).
        stream: where the microbatches come from (advanced).
        steps: steps to average (``>= 2``).
        k: microbatches per step (``>= 2``).
        micro_sequences: sequences per microbatch.
        tokens: recorded as :attr:`FrozenMeasurement.tokens`.

    Returns:
        The measurement with its standard error.
    """
    b = float(micro_sequences * stream.seq_len)
    gs, ts = [], []
    for _ in range(steps):
        total = None
        small = 0.0
        for _ in range(k):
            x, y = stream.next_batch(micro_sequences)
            _, loss = model(x, y)
            g = _flat_grad(model, loss)
            small += float(g @ g) / k
            total = g if total is None else total + g
        big = float(total @ total) / (k * k)
        gs.append((k * big - small) / (k - 1))
        ts.append((small - big) / (1.0 / b - 1.0 / (k * b)))
    n = len(gs)
    mg, mt = sum(gs) / n, sum(ts) / n
    vg = sum((x - mg) ** 2 for x in gs) / (n - 1) / n
    vt = sum((x - mt) ** 2 for x in ts) / (n - 1) / n
    cgt = sum((x - mg) * (y - mt) for x, y in zip(gs, ts)) / (n - 1) / n
    ratio = mt / mg
    rel_var = vt / mt**2 + vg / mg**2 - 2 * cgt / (mt * mg)
    return FrozenMeasurement(tokens, ratio, abs(ratio) * math.sqrt(max(rel_var, 0.0)), mg, mt, n)


def run(
    seed: int, *, tokens: float, checkpoints: Sequence[float], frozen_steps: int,
    max_bytes: int | None = None, log: Callable[[str], None] = lambda _: None,
) -> Trace:
    """Train the demo GPT observe-only, recording each step and measuring frozen at the checkpoints."""
    torch.manual_seed(seed)
    corpus = load_corpus(max_bytes)
    model = GPT(GPTConfig(context_length=SEQ_LEN))
    optimizer = make_adamw(model, lr=LR, weight_decay=0.1)
    stream = SequenceStream(corpus.train, seq_len=SEQ_LEN, seed=seed)
    frozen_stream = SequenceStream(corpus.train, seq_len=SEQ_LEN, seed=seed + FROZEN_STREAM_SEED_OFFSET)
    tracker = CBSTracker(
        model, optimizer, accumulation_steps=ACCUMULATION,
        controller=BatchSizeController(observe_only=True),
    )
    out = Trace(seed=seed)
    pending = sorted(c for c in checkpoints if c <= tokens)
    start = time.perf_counter()
    while tracker.tokens_seen < tokens:
        for _ in range(tracker.accumulation_steps):
            x, y = stream.next_batch(MICRO_SEQUENCES)
            with tracker.microbatch(labels=y):
                _, loss = model(x, y)
                (loss / tracker.accumulation_steps).backward()
        record = tracker.step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if record.step_grad_sq_norm is not None and record.step_trace_cov is not None:
            k = record.accumulation_steps * record.dp_degree
            out.tokens.append(record.tokens_seen)
            out.grad_sq.append(record.step_grad_sq_norm)
            out.trace.append(record.step_trace_cov)
            out.small_batch.append(record.micro_batch)
            out.big_batch.append(record.micro_batch * k)
        while pending and tracker.tokens_seen >= pending[0]:
            frozen = frozen_noise_scale(
                copy.deepcopy(model), frozen_stream, steps=frozen_steps, tokens=tracker.tokens_seen
            )
            out.frozen.append(frozen)
            log(f"seed {seed}: {tracker.tokens_seen:,.0f} tokens, frozen noise scale "
                f"{frozen.noise_scale:,.0f} +- {frozen.stderr:,.0f}")
            pending.pop(0)
    tracker.remove_hooks()
    out.seconds = time.perf_counter() - start
    return out


@dataclass(frozen=True)
class Reading:
    """An estimator's report next to the frozen truth at one checkpoint."""

    tokens: float
    reported: float | None
    low: float | None
    high: float | None
    frozen: float
    frozen_stderr: float

    @property
    def ratio(self) -> float | None:
        return None if self.reported is None else self.reported / self.frozen


def replay(trace: Trace, make_estimator: Callable[[], object] = NoiseScaleEstimator, *,
           measure_every: int = 1) -> list[Reading]:
    """Feed the recorded steps to a fresh estimator and read it at each frozen checkpoint.

    ``measure_every=n`` feeds one step in ``n`` (the first, then every ``n``-th), as a
    tracker with that measuring cadence would see the run.
    """
    est = make_estimator()
    readings = []
    marks = {f.tokens: f for f in trace.frozen}
    for i, units in enumerate(trace.tokens):
        if i % measure_every == 0:
            b, bb = trace.small_batch[i], trace.big_batch[i]
            g, t = trace.grad_sq[i], trace.trace[i]
            est.update(g + t / b, g + t / bb, b, bb, units=bb)  # type: ignore[attr-defined]
        if units in marks:
            f = marks[units]
            interval = est.noise_scale_interval  # type: ignore[attr-defined]
            low, high = interval if interval is not None else (None, None)
            readings.append(Reading(units, est.noise_scale, low, high, f.noise_scale, f.stderr))  # type: ignore[attr-defined]
    return readings


def load_trace(data: dict) -> Trace:
    """A :class:`Trace` from its JSON form."""
    frozen = [FrozenMeasurement(**f) for f in data.pop("frozen")]
    return Trace(**data, frozen=frozen)


def _fmt(v: float | None) -> str:
    return "-" if v is None else (">inf" if math.isinf(v) else f"{v:,.0f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--tokens", type=float, default=CHECKPOINTS[-1])
    p.add_argument("--checkpoints", type=float, nargs="+", default=list(CHECKPOINTS))
    p.add_argument("--frozen-steps", type=int, default=192, help="frozen steps per checkpoint (default 192)")
    p.add_argument("--max-bytes", type=int, default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--save-trace", default=None, help="write the recorded runs to this JSON file")
    p.add_argument("--load-trace", default=None, help="replay runs recorded with --save-trace (no training)")
    p.add_argument("--measure-every", type=int, nargs="+", default=[1],
                   help="replay with these measuring cadences (one step in n fed to the estimator)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.load_trace:
        with open(args.load_trace) as fh:
            traces = [load_trace(d) for d in json.load(fh)]
    else:
        traces = [
            run(s, tokens=args.tokens, checkpoints=args.checkpoints, frozen_steps=args.frozen_steps,
                max_bytes=args.max_bytes, log=lambda m: print(m, file=sys.stderr, flush=True))
            for s in args.seeds
        ]
    if args.save_trace:
        with open(args.save_trace, "w") as fh:
            json.dump([asdict(t) for t in traces], fh)
    rows = []
    for every in args.measure_every:
        print(f"measure_every={every}")
        print(f"{'seed':>4} {'tokens':>10} {'reported':>9} {'90% interval':>16} {'frozen':>8} {'+-se':>6} {'ratio':>6}")
        mine = []
        for trace in traces:
            for r in replay(trace, measure_every=every):
                mine.append({"measure_every": every, "seed": trace.seed, **asdict(r), "ratio": r.ratio})
                interval = f"{_fmt(r.low)}-{_fmt(r.high)}"
                ratio = "-" if r.ratio is None else f"{r.ratio:.2f}"
                print(f"{trace.seed:>4} {r.tokens:>10,.0f} {_fmt(r.reported):>9} {interval:>16} "
                      f"{r.frozen:>8,.0f} {r.frozen_stderr:>6,.0f} {ratio:>6}")
        ratios = [r["ratio"] for r in mine if r["ratio"] is not None]
        if ratios:
            print(f"reported / frozen: min {min(ratios):.2f}, max {max(ratios):.2f} "
                  f"({sum(0.75 <= x <= 1.33 for x in ratios)}/{len(mine)} checkpoints in [0.75, 1.33])")
        rows += mine
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
