"""Communication the tracker adds per optimizer step, counted under DDP and FSDP2 (gloo, CPU).

Wraps every collective of ``torch.distributed`` to count calls and bytes, in the same
loop with and without the tracker; the difference must equal what ``tracker.step()``
issued. DDP's own gradient all-reduce runs in C++ and is not counted; FSDP2's is.

    python benchmarks/comm.py [--world 2] [--accumulation 4] [--steps 4] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PREFIXES = ("all_", "reduce", "broadcast", "gather", "scatter", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv")


class CollectiveCounter:
    """Counts calls and tensor bytes of ``torch.distributed`` collectives (re-entrant calls once)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.bytes = 0
        self._depth = 0
        self._originals: list[tuple[Any, str, Any]] = []

    def install(self) -> None:
        mods = [dist, dist.distributed_c10d]
        names = sorted(
            n for n in dir(dist)
            if n.startswith(PREFIXES) and callable(getattr(dist, n)) and not isinstance(getattr(dist, n), type)
        )
        for mod in mods:
            for name in names:
                fn = getattr(mod, name, None)
                if fn is None or not callable(fn) or isinstance(fn, type):
                    continue
                self._originals.append((mod, name, fn))
                setattr(mod, name, self._wrap(name, fn))

    def uninstall(self) -> None:
        for mod, name, fn in reversed(self._originals):
            setattr(mod, name, fn)
        self._originals.clear()

    def _wrap(self, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                self.calls[name] += 1
                self.bytes += _tensor_bytes(args) + _tensor_bytes(tuple(kwargs.values()))
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return wrapper

    def snapshot(self) -> tuple[Counter[str], int]:
        return Counter(self.calls), self.bytes


def _tensor_bytes(values: tuple[Any, ...]) -> int:
    total = 0
    for v in values:
        if isinstance(v, torch.Tensor):
            t = v.to_local() if hasattr(v, "to_local") else v
            total += t.numel() * t.element_size()
        elif isinstance(v, (list, tuple)):
            total += _tensor_bytes(tuple(v))
    return total


def _diff(after: tuple[Counter[str], int], before: tuple[Counter[str], int]) -> tuple[Counter[str], int]:
    calls = Counter(after[0])
    calls.subtract(before[0])
    return Counter({k: v for k, v in calls.items() if v}), after[1] - before[1]


def _build(kind: str, world: int) -> tuple[Any, Any]:
    from torch.distributed.fsdp import fully_shard

    from cbs_tracker.demo.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(context_length=64))
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def _run(kind: str, with_tracker: bool, args: argparse.Namespace, counter: CollectiveCounter) -> dict[str, Any]:
    from cbs_tracker.integrations.fsdp import FSDPTracker
    from cbs_tracker.integrations.plain import CBSTracker

    from cbs_tracker.demo.corpus import SequenceStream, load_corpus

    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = _build(kind, world)
    stream = SequenceStream(load_corpus(2_000_000).train, seq_len=64, seed=0)
    acc = args.accumulation
    tracker = None
    if with_tracker:
        if kind == "ddp":
            tracker = CBSTracker(model, opt, accumulation_steps=acc)
        else:
            tracker = FSDPTracker(model, opt, accumulation_steps=acc, gradient_sync="every" if kind == "fsdp_every" else "last")
    per_step, in_step = [], []
    for step in range(args.steps + 1):  # step 0 warms up (lazy init, first all-gathers)
        start = counter.snapshot()
        for j in range(acc):
            x, y = stream.next_batch(1, rank=rank, world_size=world)
            last = j == acc - 1
            if tracker is not None:
                ctx = tracker.microbatch(labels=y)
            elif kind == "ddp" and not last:
                ctx = model.no_sync()
            else:
                if kind == "fsdp_last":
                    model.set_requires_gradient_sync(last)
                ctx = _null()
            with ctx:
                _, loss = model(x, y)
                (loss / acc).backward()
        if tracker is not None:
            before_step = counter.snapshot()
            tracker.step()
            inside = _diff(counter.snapshot(), before_step)
        else:
            inside = (Counter(), 0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step > 0:
            per_step.append(_diff(counter.snapshot(), start))
            in_step.append(inside)
    return {"per_step": per_step, "in_step": in_step}


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _summary(runs: list[tuple[Counter[str], int]]) -> dict[str, Any]:
    counts = [sum(c.values()) for c, _ in runs]
    nbytes = [b for _, b in runs]
    names: Counter[str] = Counter()
    for c, _ in runs:
        names.update(c)
    return {
        "collectives": min(counts) if min(counts) == max(counts) else [min(counts), max(counts)],
        "bytes": min(nbytes) if min(nbytes) == max(nbytes) else [min(nbytes), max(nbytes)],
        "by_name": {k: v / len(runs) for k, v in sorted(names.items())},
    }


def worker(rank: int, world: int, init_file: str, out: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    counter = CollectiveCounter()
    counter.install()
    results = {}
    try:
        for kind in ("ddp", "fsdp_last", "fsdp_every"):
            with_t = _run(kind, True, args, counter)
            without = _run(kind, False, args, counter)
            added = [_diff(w, wo) for w, wo in zip(with_t["per_step"], without["per_step"], strict=True)]
            results[kind] = {
                "tracker_step": _summary(with_t["in_step"]),
                "added": _summary(added),
                "with_tracker": _summary(with_t["per_step"]),
                "without_tracker": _summary(without["per_step"]),
            }
    finally:
        counter.uninstall()
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def _fmt(summary: dict[str, Any]) -> str:
    calls, nbytes = summary["collectives"], summary["bytes"]
    size = f"{nbytes} B" if isinstance(nbytes, int) and nbytes < 10_000 else f"{_mean(nbytes) / 1e6:.2f} MB"
    return f"{calls} call{'s' if calls != 1 else ''}, {size}"


def _mean(x: int | list[int]) -> float:
    return float(x) if isinstance(x, int) else sum(x) / len(x)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--accumulation", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--json", action="store_true", help="print the results as JSON on the last line")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "comm.json")
        mp.spawn(worker, args=(args.world, str(Path(tmp) / "pg"), out, args), nprocs=args.world, join=True)
        results = json.loads(Path(out).read_text())
    print(f"collectives per optimizer step, {args.world} gloo ranks, {args.accumulation} microbatches/rank "
          f"(python-visible torch.distributed calls; DDP's reducer all-reduce is C++ and not counted)")
    print(f"{'setup':<11} {'tracker.step()':>16} {'added (with - without)':>23} {'run without tracker':>28}")
    for kind, r in results.items():
        ts, ad, wo = r["tracker_step"], r["added"], r["without_tracker"]
        print(f"{kind:<11} {_fmt(ts):>16} {_fmt(ad):>23} {_fmt(wo):>28}")
        print(f"{'':<11} tracker.step() calls: {ts['by_name']}")
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
