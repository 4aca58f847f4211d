"""What the tracker costs: step time and peak memory with and without it, side by side.

Step time: the same model, data and optimizer alternate steps without and with an
observe-only tracker in one process; the median ratio is printed. Beside them run the
same steps with only the memory traffic any exact per-microbatch measurement needs
("norms only": one fused norm over the gradient after each microbatch and one over
the step's gradient, ``K + 1`` passes, no tracker), so the tracker's own cost can be
told from that floor. Peak memory: two fresh child processes (peak RSS on CPU,
``max_memory_allocated`` on CUDA), compared with the size of one copy of the gradients.

    python benchmarks/overhead.py [--json]     # 10m-preset GPT by default
    python benchmarks/overhead.py --device cuda --preset gpt2-small --json   # GPT-2 small: 1,024 context,
        # 8 x 1,024 = 8,192 tokens per microbatch, 4 microbatches, bf16 autocast, fused AdamW on CUDA
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cbs_tracker import BatchSizeController, CBSTracker
from cbs_tracker.core.collector import GradStatsCollector, HostCopy, LabelCount, count_labels
from cbs_tracker.demo.corpus import SequenceStream, load_corpus
from cbs_tracker.demo.gpt import GPT, GPTConfig, make_adamw

#: per preset, what the run takes unless told: sequence length, sequences per microbatch, microbatches
#: per step, autocast dtype ("fp32": none). GPT-2's sizes run as they are trained: bf16 autocast, a
#: microbatch of 8 x 1,024 = 8,192 tokens (--micro-sequences 16 for 16k), and fused AdamW on CUDA.
PRESET_RUNS = {
    "gpt2-small": {"seq_len": 1024, "micro_sequences": 8, "accumulation": 4, "dtype": "bf16"},
    "gpt2-medium": {"seq_len": 1024, "micro_sequences": 8, "accumulation": 4, "dtype": "bf16"},
}
_DEFAULT_RUN = {"seq_len": 256, "micro_sequences": 8, "accumulation": 2, "dtype": "fp32"}


def resolve_run(args) -> None:
    """Fill what the command line left unset from the preset's run (``PRESET_RUNS``), and the optimizer:
    fused AdamW with ``--fused-adamw auto`` on CUDA for the GPT-2 presets."""
    run = PRESET_RUNS.get(args.preset, _DEFAULT_RUN)
    for key, value in run.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    fused = getattr(args, "fused_adamw", "auto")
    args.fused = fused == "on" or (fused == "auto" and args.device.startswith("cuda") and args.preset in PRESET_RUNS)
    if args.fused and not args.device.startswith("cuda"):
        raise SystemExit(f"overhead.py: --fused-adamw on needs --device cuda, not {args.device!r}")


def _autocast(args):
    """bf16 autocast around the forward (``--dtype bf16``), else nothing."""
    if getattr(args, "dtype", "fp32") == "bf16":
        return torch.autocast(device_type=torch.device(args.device).type, dtype=torch.bfloat16)
    return _null()


def _loss(model, x, y, args):
    with _autocast(args):
        _, loss = model(x, y)
    return loss


def _setup(args):
    torch.manual_seed(0)
    config = GPTConfig.preset(args.preset, context_length=args.seq_len)
    model = GPT(config).to(args.device)
    optimizer = make_adamw(model, lr=1e-3, weight_decay=0.1)
    if getattr(args, "fused", False):
        optimizer = torch.optim.AdamW(optimizer.param_groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)
    corpus = load_corpus(max_bytes=4_000_000)
    stream = SequenceStream(corpus.train, seq_len=args.seq_len, seed=0)
    return model, optimizer, stream


def _norm_pass(params) -> torch.Tensor:
    """One fused pass over the gradients now in ``.grad``: their squared norm (the "norms only" floor)."""
    grads = [p.grad for p in params if p.grad is not None]
    v = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))
    return torch.dot(v, v)


def _step(model, optimizer, stream, args, tracker=None, phase=None, cpu_times=None, norms_only=False,
          tracker_clip=False):
    """One optimizer step of ``args.accumulation`` microbatches; returns seconds.

    ``phase(name)`` (op counting) is called before the microbatches (``"micro"``)
    and before the optimizer-step part (``"step"``); ``cpu_times`` gets the
    process CPU seconds (less sensitive than wall time to other jobs on the machine).
    """
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    c0 = time.process_time()
    batches = [stream.next_batch(args.micro_sequences) for _ in range(args.accumulation)]
    batches = [(x.to(args.device), y.to(args.device)) for x, y in batches]
    if phase is not None:
        phase("micro")
    for x, y in batches:
        ctx = _open(tracker, y, args) if tracker is not None else _null()
        with ctx:
            loss = _loss(model, x, y, args)
            (loss / args.accumulation).backward()
        if norms_only:
            _norm_pass(model.parameters())
    if phase is not None:
        phase("step")
    if tracker is not None:
        tracker.step()
    if norms_only:
        _norm_pass(model.parameters())
    if tracker_clip:
        tracker.clip_grad_norm_(1.0)  # reuses the step's norm
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    if cpu_times is not None:
        cpu_times.append(time.process_time() - c0)
    return time.perf_counter() - t0


def _by_labels(args) -> bool:
    return getattr(args, "sizes", "labels") == "labels"


def _open(tracker, y: torch.Tensor, args):
    """``tracker.microbatch(...)`` as the loop passes its size: ``labels=`` (counted by the tracker) or, with
    ``--sizes numbers``, the tokens as a host number (this stream's labels have none ignored: their size)."""
    return tracker.microbatch(labels=y) if _by_labels(args) else tracker.microbatch(size=y.numel())


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _make_tracker(model, optimizer, args):
    every = getattr(args, "measure_every", "1")
    every = every if every == "auto" else int(every)
    return CBSTracker(
        model,
        optimizer,
        accumulation_steps=args.accumulation,
        controller=BatchSizeController(observe_only=True),
        measure_every=every,
    )


# operators that only make a new tensor header (no kernel on any device)
_METADATA_OPS = frozenset({
    "detach", "alias", "view", "_unsafe_view", "select", "slice", "unsqueeze", "squeeze", "expand", "as_strided",
    "t", "transpose", "permute", "reshape", "lift_fresh", "promote_types", "result_type",
})


class _OpCounter(TorchDispatchMode):
    """Counts aten operators by phase (``"setup"``, ``"micro"``, ``"step"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "setup"
        self.counts: dict[str, Counter] = {"setup": Counter(), "micro": Counter(), "step": Counter()}

    def set_phase(self, name: str) -> None:
        self.phase = name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[self.phase][str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def count_ops(model, optimizer, stream, args, tracker, *, device_path: bool = False) -> dict:
    """Operators the tracker adds per microbatch and per optimizer step (one counted step each).

    Both variants run one untimed step first (optimizer state exists, the tracker's
    path is warm), then one step under the counter. On a CPU the window's sums are
    host floats; ``device_path=True`` counts the tensor path an accelerator takes instead.
    """
    if device_path:
        original = GradStatsCollector.host_window_sums
        GradStatsCollector.host_window_sums = lambda self: None
        GradStatsCollector.read_each_on_cpu = False
        try:
            return count_ops(model, optimizer, stream, args, tracker)
        finally:
            GradStatsCollector.host_window_sums = original
            GradStatsCollector.read_each_on_cpu = True
    counted = {}
    for variant in ("plain", "tracker"):
        use = tracker if variant == "tracker" else None
        if use is not None:
            tracker._register_hooks()
        _step(model, optimizer, stream, args, use)
        counter = _OpCounter()
        with counter:
            _step(model, optimizer, stream, args, use, phase=counter.set_phase)
        if use is not None:
            tracker.remove_hooks()
        counted[variant] = counter.counts
    added = {}
    for ph in ("micro", "step"):
        diff = counted["tracker"][ph].copy()
        diff.subtract(counted["plain"][ph])
        total = sum(diff.values())
        added[ph] = {"total": total, "by_op": {k: v for k, v in diff.most_common() if v}}
    for ph in ("micro", "step"):
        added[ph]["metadata"] = sum(v for k, v in added[ph]["by_op"].items() if k in _METADATA_OPS)
    per_micro = added["micro"]["total"] / args.accumulation
    return {"ops_added_per_microbatch": per_micro, "ops_added_per_step": added["step"]["total"],
            "metadata_ops_added_per_step_total": added["micro"]["metadata"] + added["step"]["metadata"],
            "ops_added_per_step_total": added["micro"]["total"] + added["step"]["total"],
            "micro_ops": dict(added["micro"]["by_op"]), "step_ops": dict(added["step"]["by_op"]),
            "plain_ops_per_step": sum(counted["plain"]["micro"].values()) + sum(counted["plain"]["step"].values())}


def attribute(model, optimizer, stream, args, tracker) -> dict:
    """The tracker's own time per step, timed directly inside the loop, and the norm passes' floor.

    A step-time ratio is the difference of two noisy numbers; here each piece of
    tracker work is timed where it runs: ``microbatch()`` entry and exit (the first
    microbatch's norm from ``.grad`` included), the hooks' filing and bucket norms
    during backward, and ``step()``. Plain steps alternate with tracked ones; in the
    plain steps the ``K + 1`` fused norm passes of the floor are timed the same way.
    Returns medians in seconds and their fractions of the median plain step.
    """
    inside = [0.0]
    originals = {name: getattr(GradStatsCollector, name) for name in ("_file", "_backward_end")}

    def timed(fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                inside[0] += time.perf_counter() - t
        return wrapper

    plain, norms, own, own_measured, own_unmeasured, counters = [], [], [], [], [], []
    # the backward passes' time less the hook work timed inside them: what a tracked step adds there
    # is autograd's calls into the tracker's hooks, which no timer of the tracker can see
    backward_plain, backward_tracked = [], []

    def norms_pass():
        _norm_pass(model.parameters())

    floor_counter = _CounterFloor()  # (one for the run, as a tracker is)
    left_off = _hooks_off(tracker)
    for name, fn in originals.items():
        setattr(GradStatsCollector, name, timed(fn))
    try:
        for i in range(2 * args.attribution_steps + 2):
            tracked = i % 2 == 1
            if tracked:
                _hooks_back(tracker, left_off)
            batches = [stream.next_batch(args.micro_sequences) for _ in range(args.accumulation)]
            batches = [(x.to(args.device), y.to(args.device)) for x, y in batches]
            _sync(args)
            t0 = time.perf_counter()
            outside = floor = backward = counted = 0.0
            inside[0] = 0.0
            for x, y in batches:
                a = time.perf_counter()
                if tracked:
                    ctx = _open(tracker, y, args)
                    ctx.__enter__()
                    outside += time.perf_counter() - a
                else:
                    floor_counter.enter(y if _by_labels(args) else y.numel())
                    counted += time.perf_counter() - a
                loss = _loss(model, x, y, args)
                b = time.perf_counter()
                (loss / args.accumulation).backward()
                _sync(args)  # (the backward's kernels are not charged to the first timed work after it)
                backward += time.perf_counter() - b
                if tracked:
                    outside += _timed(args, lambda c=ctx: c.__exit__(None, None, None))
                else:
                    counted += _timed(args, floor_counter.exit)
                    floor += _timed(args, norms_pass)
            if tracked:
                outside += _timed(args, tracker.step)
            else:
                counted += _timed(args, floor_counter.step)
                floor += _timed(args, norms_pass)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _sync(args)
            total = time.perf_counter() - t0
            if tracked:
                left_off = _hooks_off(tracker)
            if i < 2:  # one untimed step of each first
                continue
            if tracked:
                own.append(outside + inside[0])
                (own_measured if tracker.last_record.measured else own_unmeasured).append(outside + inside[0])
                if tracker.last_record.measured:
                    backward_tracked.append(backward - inside[0])
            else:
                plain.append(total - floor - counted)
                norms.append(floor)
                counters.append(counted)
                backward_plain.append(backward)
    finally:
        for name, fn in originals.items():
            setattr(GradStatsCollector, name, fn)
    step = statistics.median(plain)
    out = {"plain_step_s": step, "tracker_s": statistics.median(own), "norm_passes_s": statistics.median(norms),
           "tracker_fraction": statistics.median(own) / step, "norm_passes_fraction": statistics.median(norms) / step,
           "counter_floor_s": statistics.median(counters), "counter_floor_fraction": statistics.median(counters) / step}
    if len(backward_tracked) >= 8:  # (a cadence that measures few windows leaves too few to tell)
        out["hook_calls_s"] = statistics.median(backward_tracked) - statistics.median(backward_plain)
        out["hook_calls_fraction"] = out["hook_calls_s"] / step
    for name, values in (("measured", own_measured), ("unmeasured", own_unmeasured)):
        if values:
            out[f"tracker_{name}_s"] = statistics.median(values)
            out[f"tracker_{name}_fraction"] = statistics.median(values) / step
    return out


class _CounterFloor:
    """What a window that measures nothing needs at the least, timed where the tracker's work runs: a count of
    microbatches, the tokens of ``labels=`` counted at the step as the tracker counts them there, and a count
    of steps. No tracker: the floor its unmeasured window is held against. On the CPU each label tensor is read
    as it is (int64 labels: one ``min()`` above the ignore index while the last ones counted had none ignored,
    the count then being their size; else the labels not ignored); on an accelerator all are counted on the
    device and copied to the host without a wait, read at the next step (as the tracker's window not measured
    takes them; :attr:`tokens` waits for the last copy)."""

    def __init__(self, ignore_index: int = -100) -> None:
        self.ignore_index = ignore_index
        self.labels: list[torch.Tensor] = []
        self.microbatches = self._tokens = self.steps = 0
        self.dense = True  # the last labels counted had none ignored
        self._copies: list[HostCopy] = []  # the steps' counts on their way to the host, oldest first

    @property
    def tokens(self) -> int:
        self._take()
        return self._tokens

    @tokens.setter
    def tokens(self, value: int) -> None:
        self._tokens = value

    def _take(self, ready_only: bool = False) -> None:
        copies = self._copies
        while copies and (not ready_only or copies[0].ready()):
            self._tokens += int(sum(copies.pop(0).sizes()))

    def enter(self, labels: torch.Tensor | int) -> None:
        if isinstance(labels, torch.Tensor):
            self.labels.append(labels)
        else:  # a size given as a number: nothing to count
            self.tokens += labels

    def exit(self) -> None:
        self.microbatches += 1

    def step(self) -> None:
        ignore = self.ignore_index
        if all(y.is_cpu for y in self.labels):
            for y in self.labels:
                n = y.numel()
                if self.dense and n and y.dtype is torch.int64 and int(y.min()) > ignore:
                    self.tokens += n
                else:
                    counted = int(y.ne(ignore).count_nonzero())
                    self.dense = counted == n
                    self.tokens += counted
        elif self.labels:
            self._take(ready_only=True)
            items = [LabelCount(y, ignore) for y in self.labels]
            self._copies.append(HostCopy(count_labels(items), [None] * len(items)))
        self.labels.clear()
        self.steps += 1


def _hooks_off(tracker) -> bool:
    """Take the tracker's hooks off the parameters for untracked steps (as the tracker itself does in a window
    it does not measure); returns whether the tracker had left them off after its last window."""
    if tracker.collector.num_hooks == 0:
        tracker._register_hooks()
    left_off = tracker.collector._detached is not None
    tracker.collector._detach_hooks()
    return left_off


def _hooks_back(tracker, left_off: bool) -> None:
    """Before a tracked step: the hooks as the tracker left them (a run of tracked steps puts them back only
    when a window is measured; re-registering them every time would charge their removal to the next window)."""
    if not left_off:
        tracker.collector._attach_hooks()


def _timed(args, work) -> float:
    """Seconds ``work()`` takes, the device synchronised after it."""
    a = time.perf_counter()
    work()
    _sync(args)
    return time.perf_counter() - a


def _sync(args) -> None:
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()


def _memory_child(args) -> int:
    """Run a few steps in this fresh process and print the peak memory in bytes."""
    model, optimizer, stream = _setup(args)
    tracker = _make_tracker(model, optimizer, args) if args.child == "tracker" else None
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.memory_steps):
        _step(model, optimizer, stream, args, tracker)
    if args.device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    print(peak)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="10m", choices=["demo", "10m", "gpt2-small", "gpt2-medium"],
                   help="GPT preset (default '10m', ~10.8M parameters; 'gpt2-small' 124M, 'gpt2-medium' 355M)")
    p.add_argument("--seq-len", type=int, default=None, help="default 256 (GPT-2 presets: 1,024)")
    p.add_argument("--micro-sequences", type=int, default=None,
                   help="sequences per microbatch (default 8: 8 x 256 = 2,048 tokens; GPT-2 presets 8 x 1,024)")
    p.add_argument("--accumulation", type=int, default=None, help="microbatches per step (default 2; GPT-2 presets 4)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None,
                   help="bf16: the forward under bf16 autocast (default fp32; GPT-2 presets bf16)")
    p.add_argument("--fused-adamw", choices=["auto", "on", "off"], default="auto",
                   help="fused AdamW ('auto': on CUDA with the GPT-2 presets)")
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds (each: steps without, steps with)")
    p.add_argument("--steps-per-round", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each variant first")
    p.add_argument("--memory-steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="print a JSON object as the last line")
    p.add_argument("--count-ops-only", action="store_true", help="only count the operators the tracker adds")
    p.add_argument("--attribution-steps", type=int, default=60,
                   help="tracked and plain steps (each) for the direct timing of the tracker's own work")
    p.add_argument("--tracker-clip", action="store_true",
                   help="also time the loop clipping with tracker.clip_grad_norm_ (reuses the step's norm)")
    p.add_argument("--measure-every", default="1",
                   help="the tracker's measure_every: an integer n (one window in n measured) or 'auto'")
    p.add_argument("--sizes", choices=["labels", "numbers"], default="labels",
                   help="how the loop gives each microbatch's size: labels= (the tracker counts the tokens) or "
                        "size= a host number")
    p.add_argument("--child", choices=["plain", "tracker"], help=argparse.SUPPRESS)
    args = p.parse_args()
    resolve_run(args)
    torch.set_num_threads(args.threads)
    if args.child:
        return _memory_child(args)

    model, optimizer, stream = _setup(args)
    n_params = sum(p.numel() for p in model.parameters())
    tokens = args.micro_sequences * args.seq_len
    print(f"model: {n_params / 1e6:.1f}M parameters ({args.preset}), microbatch {tokens} tokens, accumulation "
          f"{args.accumulation}, {args.dtype}{', fused AdamW' if args.fused else ''}, {args.threads} thread(s), "
          f"device {args.device}, sizes as {args.sizes}")
    tracker = _make_tracker(model, optimizer, args)
    tracker.remove_hooks()
    ops = count_ops(model, optimizer, stream, args, tracker)
    print(f"operators added: {ops['ops_added_per_microbatch']:g} per microbatch, {ops['ops_added_per_step']} in the "
          f"optimizer-step part; {ops['ops_added_per_step_total']} per optimizer step in all "
          f"(the untracked step runs {ops['plain_ops_per_step']}); "
          f"{ops['metadata_ops_added_per_step_total']} of those per step only make tensor headers (no kernel); "
          f"{len([p for p in model.parameters() if p.requires_grad])} parameter tensors")
    print(f"  per microbatch ({args.accumulation} microbatches): {ops['micro_ops']}")
    print(f"  optimizer-step part: {ops['step_ops']}")
    if not args.device.startswith("cuda"):
        dev = count_ops(model, optimizer, stream, args, tracker, device_path=True)
        ops["ops_added_per_step_device_path"] = dev["ops_added_per_step_total"]
        print(f"  on an accelerator (the window's numbers copied to the host at once): "
              f"{dev['ops_added_per_step_total']} per optimizer "
              f"step (optimizer-step part: {dev['step_ops']})")
    if args.count_ops_only:
        if args.json:
            print(json.dumps({k: v for k, v in ops.items() if not k.endswith("_ops")}))
        return 0
    for _ in range(args.warmup):
        _step(model, optimizer, stream, args)
    per = args.steps_per_round
    if args.measure_every != "1":
        # the cadence settles on its own steps first ("auto" times measured and plain windows), then
        # every round runs whole cycles of it, so each round holds its share of measured windows
        tracker._register_hooks()
        for _ in range(40 if args.measure_every == "auto" else 0):
            _step(model, optimizer, stream, args, tracker)
        cadence = tracker.session.cadence
        per = max(per, cadence.every)
        per = -(-per // cadence.every) * cadence.every
        chosen = (f"; the cadence read: measuring adds {cadence.overhead:.2%} to a step (step clock), an unmeasured "
                  f"window's own work {cadence.floor:.3%} (timed directly)" if cadence.overhead is not None else "")
        print(f"measure_every={args.measure_every}: one window in {cadence.every} measured{chosen}; "
              f"{per} steps per round")
    variants = ["plain", "tracker", "norms_only"] + (["tracker_clip"] if args.tracker_clip else [])
    times: dict[str, list[float]] = {v: [] for v in variants}
    cpu = {v: [] for v in variants}
    unmeasured: list[float] = []  # the tracked steps whose window was not measured
    left_off = _hooks_off(tracker)
    for r in range(args.rounds + 1):
        # rotate (and reverse every other round) the order inside a round, so drift favours no variant
        shift = r % len(variants)
        order = variants[shift:] + variants[:shift]
        if r % 2:
            order = order[::-1]
        for variant in order:
            tracked = variant.startswith("tracker")
            if tracked:
                _hooks_back(tracker, left_off)
            for _ in range(per):
                cpu_t: list[float] = []
                t = _step(model, optimizer, stream, args, tracker if tracked else None, cpu_times=cpu_t,
                          norms_only=variant == "norms_only", tracker_clip=variant == "tracker_clip")
                if r > 0:  # round 0 warms every path up
                    times[variant].append(t)
                    cpu[variant] += cpu_t
                    if variant == "tracker" and not tracker.last_record.measured:
                        unmeasured.append(t)
            if tracked:
                left_off = _hooks_off(tracker)
    paired = [statistics.fmean(times["tracker"][i:i + per]) / statistics.fmean(times["plain"][i:i + per])
              for i in range(0, len(times["plain"]), per)]
    q = statistics.quantiles(paired, n=4) if len(paired) > 1 else [paired[0]] * 3
    plain_times, tracked_times = times["plain"], times["tracker"]
    med_plain = statistics.median(plain_times)
    med_tracked = statistics.median(tracked_times)
    ratio = med_tracked / med_plain
    print(f"step time: without {med_plain * 1e3:.1f} ms, with tracker {med_tracked * 1e3:.1f} ms "
          f"(median of {len(plain_times)} each), ratio {ratio:.4f}; per-round paired ratios: median {q[1]:.4f}, "
          f"quartiles {q[0]:.4f}-{q[2]:.4f} (the machine's noise)")
    ratios = {v: statistics.median(times[v]) / med_plain for v in variants}
    floor = ratios["norms_only"]
    print(f"norms only (K+1 fused norm passes, no tracker): ratio {floor:.4f}; the tracker beyond that floor: "
          f"{ratio / floor:.4f}")
    if args.tracker_clip:
        print(f"with tracker.clip_grad_norm_ (the step's norm reused, one pass fewer): ratio {ratios['tracker_clip']:.4f}")
    cpu_ratio = statistics.median(cpu["tracker"]) / statistics.median(cpu["plain"])
    print(f"process CPU time per step: ratio {cpu_ratio:.4f} (medians)")
    if unmeasured:
        print(f"unmeasured windows on the step clock: median {statistics.median(unmeasured) * 1e3:.2f} ms over "
              f"{len(unmeasured)} steps, {statistics.median(unmeasured) / med_plain - 1:+.2%} of the plain step")
    att = attribute(model, optimizer, stream, args, tracker)
    print(f"timed directly ({args.attribution_steps} steps each): the tracker's own work {att['tracker_s'] * 1e6:.0f} us "
          f"per step = {att['tracker_fraction']:.2%} of the {att['plain_step_s'] * 1e3:.1f} ms plain step; "
          f"the K+1 norm passes alone {att['norm_passes_s'] * 1e6:.0f} us = {att['norm_passes_fraction']:.2%} (medians)")
    if "tracker_unmeasured_s" in att:
        print(f"  an unmeasured window's own cost (timed directly): {att['tracker_unmeasured_s'] * 1e6:.0f} us = "
              f"{att['tracker_unmeasured_fraction']:.2%} of the plain step; the floor of one (a count of microbatches "
              f"and steps{', the tokens of labels=' if _by_labels(args) else ''}, no tracker; timed the same way): "
              f"{att['counter_floor_s'] * 1e6:.0f} us "
              f"= {att['counter_floor_fraction']:.2%}")
    if "tracker_measured_s" in att:
        rest = att["tracker_measured_s"] - att["norm_passes_s"]
        print(f"  a measured window: the tracker's own work {att['tracker_measured_s'] * 1e6:.0f} us = the K+1 norm "
              f"passes {att['norm_passes_s'] * 1e6:.0f} us ({att['norm_passes_fraction']:.2%}) + everything else "
              f"{rest * 1e6:.0f} us ({rest / att['plain_step_s']:.2%} of the plain step); on the step clock the "
              f"tracker beyond the norm passes: {ratio / floor - 1:+.2%}")
    if "hook_calls_s" in att:
        print(f"  not in that split: autograd's calls into the tracker's hooks during a measured window's backward "
              f"passes, {att['hook_calls_s'] * 1e6:.0f} us ({att['hook_calls_fraction']:.2%} of the plain step; "
              "the backward's median less the hook work timed in it, minus the plain backward's median)")

    peaks = {}
    for variant in ("plain", "tracker"):
        cmd = [sys.executable, __file__, "--child", variant, *_forward(args)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        peaks[variant] = int(out)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    mem_ratio = peaks["tracker"] / peaks["plain"]
    extra = peaks["tracker"] - peaks["plain"]
    print(f"peak memory: without {peaks['plain'] / 2**20:.0f} MiB, with tracker {peaks['tracker'] / 2**20:.0f} MiB, "
          f"ratio {mem_ratio:.4f}; difference {extra / 2**20:+.1f} MiB vs one gradient copy {grad_bytes / 2**20:.1f} MiB")
    if args.json:
        extra_ratios = {"norms_only_ratio": round(floor, 4), "beyond_norms_ratio": round(ratio / floor, 4),
                        "tracker_fraction_timed": round(att["tracker_fraction"], 4),
                        "unmeasured_fraction_timed": round(att["tracker_unmeasured_fraction"], 5)
                        if "tracker_unmeasured_fraction" in att else None,
                        "unmeasured_floor_fraction_timed": round(att["counter_floor_fraction"], 5),
                        "unmeasured_fraction_step_clock": round(statistics.median(unmeasured) / med_plain - 1, 5)
                        if unmeasured else None,
                        "measured_beyond_norms_fraction_timed": round(
                            (att["tracker_measured_s"] - att["norm_passes_s"]) / att["plain_step_s"], 5)
                        if "tracker_measured_s" in att else None,
                        "norm_passes_fraction_timed": round(att["norm_passes_fraction"], 4),
                        "hook_calls_fraction": round(att["hook_calls_fraction"], 5) if "hook_calls_fraction" in att
                        else None}
        if args.tracker_clip:
            extra_ratios["tracker_clip_ratio"] = round(ratios["tracker_clip"], 4)
        print(json.dumps({"preset": args.preset, "parameters": n_params, "tokens_per_microbatch": tokens,
                          "accumulation": args.accumulation, "dtype": args.dtype, "fused_adamw": args.fused,
                          "device": args.device, "measure_every": args.measure_every, "sizes": args.sizes,
                          "measured_one_in": tracker.session.cadence.every,
                          "step_time_ratio": round(ratio, 4), "paired_ratio_median": round(q[1], 4),
                          "paired_ratio_quartiles": [round(q[0], 4), round(q[2], 4)], **extra_ratios,
                          "cpu_time_ratio": round(cpu_ratio, 4), "peak_memory_ratio": round(mem_ratio, 4),
                          "extra_memory_mib": round(extra / 2**20, 3), "gradient_copy_mib": round(grad_bytes / 2**20, 3),
                          "ops_added_per_microbatch": ops["ops_added_per_microbatch"],
                          "ops_added_per_step": ops["ops_added_per_step_total"],
                          "ops_added_per_step_device_path": ops.get("ops_added_per_step_device_path")}))
    return 0


def _forward(args) -> list[str]:
    return ["--preset", args.preset, "--seq-len", str(args.seq_len), "--micro-sequences", str(args.micro_sequences),
            "--accumulation", str(args.accumulation), "--memory-steps", str(args.memory_steps),
            "--threads", str(args.threads), "--device", args.device, "--measure-every", args.measure_every,
            "--sizes", args.sizes, "--dtype", args.dtype, "--fused-adamw", "on" if args.fused else "off"]


if __name__ == "__main__":
    raise SystemExit(main())
