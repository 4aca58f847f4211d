"""The torchrun examples run shortened on CPU with gloo (2 ranks), as CI runs them.

``python -m torch.distributed.run`` is ``torchrun`` (same entry point, no PATH
lookup). Each run is ~10 s, mostly starting the ranks. DDP and FSDP2 start from
the same weights and see the same data, so their measured noise scale and
validation loss agree (up to float32 reduction order and print rounding): a
cross-check that the FSDP2 adapter measures what the DDP path measures.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
SHORT = [
    "--backend", "gloo", "--steps", "12", "--micro-sequences", "1", "--seq-len", "64",
    "--max-bytes", "2000000", "--print-every", "4",
]
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
    return {"val": float(match["val"]), "noise_scale": float(match["ns"].replace(",", ""))}


@pytest.fixture(scope="module")
def ddp_run() -> dict[str, float]:
    return _torchrun("torchrun_ddp.py")


def test_torchrun_ddp_example(ddp_run):
    assert ddp_run["noise_scale"] > 0


def test_torchrun_fsdp_example_matches_ddp(ddp_run):
    fsdp = _torchrun("torchrun_fsdp.py")  # gradient sync on the last microbatch only
    assert abs(fsdp["noise_scale"] - ddp_run["noise_scale"]) <= 0.02 * ddp_run["noise_scale"] + 1
    assert abs(fsdp["val"] - ddp_run["val"]) <= 0.002


def test_torchrun_fsdp_example_bf16_every_microbatch():
    run = _torchrun("torchrun_fsdp.py", "--bf16", "--gradient-sync", "every")
    assert run["noise_scale"] > 0


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
