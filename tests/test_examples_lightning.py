"""Smoke test of examples/lightning_gpt.py: a shortened run doubles the batch and logs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _read_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(log_dir), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}


def test_lightning_gpt_quick_doubles_the_batch_and_logs_tokens(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "lightning_gpt.py"), "--quick", "--logdir", "runs"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    # the change is announced by the callback and seen by the next batch
    assert re.search(r"CBSCallback step \d+: accumulate_grad_batches 2 -> 4", out), out
    assert re.search(r"accumulate_grad_batches 2 -> 4 \(global batch 512 -> 1,024 tokens\)", out), out
    assert re.search(r"done in \d+s: \d+ optimizer steps, [\d,]+ tokens, val loss [\d.]+ nats/byte", out), out

    scalars = _read_scalars(tmp_path / "runs" / "version_0")
    accum, batch = scalars["cbs/accumulation_steps"], scalars["cbs/global_batch_tokens"]
    # every label is a real byte: the counted tokens are 128 per sequence, 2 sequences per
    # microbatch, times the microbatches of the window (a short last window has fewer)
    assert all(batch[s] == 256 * accum[s] or batch[s] == 128 * (2 * accum[s] - 1) for s in batch)
    assert max(accum.values()) >= 4 and min(accum.values()) <= 2
    assert all(v > 0 for v in scalars["cbs/noise_scale"].values())
    assert "cbs_tokens/global_batch_tokens" in scalars


def test_lightning_gpt_runs_under_ddp_with_two_cpu_processes(tmp_path):
    # strategy="ddp" relaunches the script itself for rank 1, so it runs as a subprocess here
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "lightning_gpt.py"), "--quick", "--tokens", "4e4",
         "--devices", "2", "--strategy", "ddp", "--logdir", "runs"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "distributed_backend=gloo" in out and re.search(r"done in \d+s", out), out
    scalars = _read_scalars(tmp_path / "runs" / "version_0")
    assert set(scalars["cbs/dp_degree"].values()) == {2.0}
    accum, batch = scalars["cbs/accumulation_steps"], scalars["cbs/global_batch_tokens"]
    # both ranks' tokens: 2 ranks x 256 tokens x the microbatches of the window (the
    # DistributedSampler pads the ranks to full 2-sequence batches; a short window has K < A)
    assert all(batch[s] == 2 * 256 * accum[s] for s in batch)
    assert all(v > 0 for v in scalars["cbs/noise_scale"].values())
