"""The README's operator counts against ``benchmarks/overhead.py``'s counter, rerun here.

The counts are deterministic (a ``TorchDispatchMode`` sees every aten call of one
tracked and one untracked step), so they are compared exactly: a change of the
collector or the reduction that adds or removes operators fails here until the
README says so. They do not depend on the tokens per microbatch, so the 10.8M
model is counted with one sequence per microbatch.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "docs" / "results.md").read_text()  # the result tables live there


def _overhead_module():
    spec = importlib.util.spec_from_file_location("cbs_overhead_benchmark", ROOT / "benchmarks" / "overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _readme_counts(label: str) -> tuple[float, int, int]:
    m = re.search(
        re.escape(label) + r"[^*]*\*\*([\d.]+) per microbatch\*\*[^*]*\*\*(\d+) per optimizer step\*\* on a CPU[^*]*"
        r"\*\*(\d+)\*\* on an accelerator",
        README,
    )
    assert m, f"the README's operator counts for {label!r} moved"
    return float(m.group(1)), int(m.group(2)), int(m.group(3))


@pytest.mark.parametrize(
    "label, preset, seq_len, micro",
    [("demo model (0.45M, 28 tensors)", "demo", 128, 2), ("10.8M GPT (76 tensors)", "10m", 256, 1)],
)
def test_readme_operator_counts_are_what_the_counter_sees(label, preset, seq_len, micro):
    bench = _overhead_module()
    args = argparse.Namespace(preset=preset, seq_len=seq_len, micro_sequences=micro, accumulation=2, device="cpu")
    model, optimizer, stream = bench._setup(args)
    tracker = bench._make_tracker(model, optimizer, args)
    tracker.remove_hooks()
    host = bench.count_ops(model, optimizer, stream, args, tracker)
    device = bench.count_ops(model, optimizer, stream, args, tracker, device_path=True)
    per_micro, per_step, per_step_device = _readme_counts(label)
    assert host["ops_added_per_microbatch"] == per_micro
    assert host["ops_added_per_step_total"] == per_step
    assert device["ops_added_per_step_total"] == per_step_device
    # per bucket, not per parameter tensor: far fewer norms than tensors, in every microbatch
    assert host["micro_ops"]["_foreach_norm"] < len(list(model.parameters()))


def test_the_unmeasured_windows_floor_counts_the_tokens_the_tracker_counts():
    """The benchmark's floor of an unmeasured window does the counting the window needs: its token count is the
    labels not ignored (a floor that counted less would be a smaller workload, not the floor)."""
    bench = _overhead_module()
    g = torch.Generator().manual_seed(0)
    floor = bench._CounterFloor()
    truth = 0
    for step in range(6):
        for _ in range(2):
            y = torch.randint(0, 50, (2, 16), generator=g)
            if step % 2:  # every other step, some labels ignored
                y[0, :5] = -100
            truth += int((y != -100).sum())
            floor.enter(y)
            floor.exit()
        floor.enter(7)  # a size given as a number (--sizes numbers)
        floor.exit()
        truth += 7
        floor.step()
    assert (floor.microbatches, floor.steps, floor.tokens) == (18, 6, truth)
    assert truth < 12 * 32 + 6 * 7


def test_the_unmeasured_windows_floor_reads_the_host_no_more_often_than_the_tracker():
    """The floor is a floor: on the CPU it takes the tracker's reads (one ``min()`` per label tensor while none
    was ignored, a count otherwise); off the CPU all labels in one read, as the tracker's window not measured
    reads them. Counted with the operator counter, CPU tensors standing in for the device."""
    bench = _overhead_module()
    g = torch.Generator().manual_seed(1)
    labels = [torch.randint(0, 50, (2, 16), generator=g) for _ in range(4)]
    floor = bench._CounterFloor()
    for y in labels:
        floor.enter(y)
    counter = bench._OpCounter()
    with counter:
        floor.step()
    assert counter.counts["setup"]["_local_scalar_dense"] == 4  # one read per label tensor on the CPU
    assert counter.counts["setup"]["min"] == 4 and not counter.counts["setup"]["ne"]

    class OffCpu(torch.Tensor):  # a label tensor that says it is not on the CPU
        @property
        def is_cpu(self):
            return False

    floor = bench._CounterFloor()
    for y in labels:
        floor.enter(y.as_subclass(OffCpu))
    counter = bench._OpCounter()
    with counter:
        floor.step()
    assert floor.tokens == sum(y.numel() for y in labels)
    reads = counter.counts["setup"]["_local_scalar_dense"] + counter.counts["setup"]["_to_copy"]
    assert reads <= 1 and not counter.counts["setup"]["min"]


def test_gpt2_presets_run_as_gpt2_is_trained_and_the_benchmark_path_runs_in_bf16():
    """``--preset gpt2-small``/``gpt2-medium``: context 1,024, 8 x 1,024 tokens per microbatch, bf16 autocast,
    fused AdamW on CUDA only (and refused elsewhere); the benchmark's step, tracked with a cadence, runs under
    bf16 autocast on a small preset here (the GPT-2 sizes themselves run on a GPU: scripts/gpu_overhead.sh)."""
    bench = _overhead_module()
    for preset in ("gpt2-small", "gpt2-medium"):
        for device, fused in (("cpu", False), ("cuda", True)):
            args = argparse.Namespace(preset=preset, device=device, seq_len=None, micro_sequences=None,
                                      accumulation=None, dtype=None, fused_adamw="auto")
            bench.resolve_run(args)
            assert (args.seq_len, args.micro_sequences * args.seq_len, args.dtype, args.fused) == (
                1024, 8192, "bf16", fused)
    args = argparse.Namespace(preset="10m", device="cpu", seq_len=None, micro_sequences=None, accumulation=None,
                              dtype=None, fused_adamw="auto")
    bench.resolve_run(args)
    assert (args.seq_len, args.micro_sequences, args.accumulation, args.dtype, args.fused) == (256, 8, 2, "fp32", False)
    with pytest.raises(SystemExit, match="--fused-adamw on needs --device cuda"):
        bench.resolve_run(argparse.Namespace(preset="gpt2-small", device="cpu", seq_len=None, micro_sequences=None,
                                             accumulation=None, dtype=None, fused_adamw="on"))
    args = argparse.Namespace(preset="demo", device="cpu", seq_len=32, micro_sequences=2, accumulation=2,
                              dtype="bf16", fused_adamw="auto", measure_every="2", sizes="labels")
    bench.resolve_run(args)
    model, optimizer, stream = bench._setup(args)
    tracker = bench._make_tracker(model, optimizer, args)
    seen = []
    for _ in range(3):
        bench._step(model, optimizer, stream, args, tracker)
        seen.append(tracker.last_record.measured)
    assert seen == [True, False, True]
    assert tracker.tokens_seen == 3 * 2 * 2 * 32
    assert all(p.dtype is torch.float32 for p in model.parameters())  # autocast: the weights stay fp32
