"""The torchrun examples run shortened on CPU with gloo (2 ranks), as CI runs them.

``python -m torch.distributed.run`` is ``torchrun`` (same entry point, no PATH
lookup). Each run is ~10 s, mostly starting the ranks. Each run is compared with
:func:`tests.example_reference.torchrun_reference`: one process, the same
weights and sequences, every microbatch gradient materialised. The controller
stays in its warm-up (12 steps), so the accumulation is fixed and only the
measurement and the training are compared.

Tolerances. In float32 the runs differ from the reference only in the order of
sums (per-rank partial gradients, the all-reduce or reduce-scatter, the norms).
A float32 sum of ``n`` terms in blocked or pairwise order carries a relative
error of about ``log2(n)`` rounding units (``2**-24`` each); the estimates then
divide differences of norms, which multiplies that error by
``|G_small|^2 / (|G_small|^2 - |G_big|^2)`` (read off the reference run); the
twelve optimizer steps, which carry the weights along, get a factor 4 of
margin. That is ~1e-5 here, while a missing ``A`` or ``D`` factor, a
double-counted or skipped microbatch moves the numbers by 25% or more.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cbs_tracker.demo.gpt import GPT, GPTConfig
from tests.example_reference import torchrun_reference

ROOT = Path(__file__).resolve().parents[1]
SETTING = {"steps": 12, "micro_sequences": 1, "seq_len": 64, "accumulation": 2, "world": 2, "max_bytes": 2_000_000}
SHORT = [
    "--backend", "gloo", "--steps", "12", "--micro-sequences", "1", "--seq-len", "64",
    "--max-bytes", "2000000", "--print-every", "4",
]
MEASURED = re.compile(
    r"measured: noise_scale=(?P<noise_scale>\S+) grad_sq_norm=(?P<grad_sq_norm>\S+) "
    r"trace_cov=(?P<trace_cov>\S+) val_loss=(?P<val>\S+)"
)
DONE = re.compile(
    r"done: 12 steps, 3,072 tokens in \d+s; val loss (?P<val>[\d.]+) nats/byte; noise scale (?P<ns>[\d,]+) tokens; "
    r"global batch 256 tokens \(A=2, D=2\)"
)

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)


def _torchrun(script: str, *extra: str) -> dict[str, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "examples" / script), *SHORT, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    match = DONE.search(proc.stdout)
    assert match, proc.stdout[-3000:]
    assert proc.stdout.count("done:") == 1  # rank 0 prints, rank 1 does not
    full = MEASURED.search(proc.stdout)
    assert full, proc.stdout[-3000:]
    got = {k: float(v) for k, v in full.groupdict().items()}
    # the summary line is the same run, rounded
    assert f"{got['noise_scale']:,.0f}" == match["ns"] and f"{got['val']:.3f}" == match["val"]
    return got


def _float32_rtol(ref: dict[str, float]) -> float:
    """Reduction-order error of float32 norms, amplified by the estimate's cancellation (module docstring)."""
    n = GPT(GPTConfig(context_length=SETTING["seq_len"])).num_parameters()
    b_small = SETTING["micro_sequences"] * SETTING["seq_len"]
    b_big = b_small * SETTING["accumulation"] * SETTING["world"]
    small = ref["grad_sq_norm"] + ref["trace_cov"] / b_small  # E|G_small|^2 and E|G_big|^2 of the reference
    big = ref["grad_sq_norm"] + ref["trace_cov"] / b_big
    return 4 * math.log2(n) * 2.0**-24 * small / (small - big)


def _assert_matches(run: dict[str, float], ref: dict[str, float], rtol: float) -> None:
    for key in ("noise_scale", "grad_sq_norm", "trace_cov", "val"):
        torch.testing.assert_close(run[key], ref[key], rtol=rtol, atol=0.0, msg=lambda m, k=key: f"{k}: {m}")


@pytest.fixture(scope="module")
def reference() -> dict[str, float]:
    with _one_thread():
        return torchrun_reference(**SETTING)


@contextlib.contextmanager
def _one_thread():
    """The references run on one thread like the examples' ranks; the setting is restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_torchrun_ddp_example_matches_the_single_process_reference(reference):
    _assert_matches(_torchrun("torchrun_ddp.py"), reference, _float32_rtol(reference))


def test_torchrun_fsdp_example_matches_the_single_process_reference(reference):
    # gradient sync on the last microbatch only
    _assert_matches(_torchrun("torchrun_fsdp.py"), reference, _float32_rtol(reference))


def test_torchrun_fsdp_example_bf16_every_microbatch_matches_a_bf16_reference():
    """bf16 parameters, float32 reduction, a reduce-scatter every microbatch.

    The reference computes each gradient with a bf16 copy of the float32 weights.
    The float32 reorderings of the run (gradient clipping's global norm, the
    reduce-scatter) put a few weights on the other side of a bf16 rounding
    boundary, and those weights then differ by one bf16 step, ``2**-8`` relative
    (8 significand bits); so the runs agree to that, not to float32's precision.
    Computing in bf16 at all moves the measurement by about as much (compare the
    float32 reference), a wrong factor by 25% or more.
    """
    with _one_thread():
        ref = torchrun_reference(**SETTING, bf16=True)
    _assert_matches(_torchrun("torchrun_fsdp.py", "--bf16", "--gradient-sync", "every"), ref, 2.0**-8)


def test_gpu_check_says_when_it_skips():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present: scripts/gpu_check.sh runs the NCCL checks instead of skipping")
    script = str(ROOT / "scripts" / "gpu_check.sh")
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("GPU_CHECK_BACKEND", None)
    proc = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "SKIPPED: no CUDA GPU visible" in proc.stdout, proc.stdout + proc.stderr
    assert "the NCCL checks did NOT run" in proc.stdout
    strict = subprocess.run(["bash", script, "--require-gpu"], env=env, capture_output=True, text=True, timeout=120)
    assert strict.returncode == 2
