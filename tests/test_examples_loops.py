"""The Lightning Fabric (LitGPT shape) and Accelerate (``run_clm_no_trainer`` shape) examples, as the README runs them.

Each runs ``--quick`` on the demo corpus in a subprocess, its loop the README's: the batch grows,
the run ends at the first window boundary at or after the constant-batch run's data (LitGPT's
``max_iters`` microbatches; ``run_clm``'s ``max_train_steps`` steps) on the schedule's last LR,
and the checkpoint it saves resumes the tracker where it stopped. The loops' gradients, syncs and
noise scale are tested against references in ``tests/test_fabric.py`` and
``tests/test_accelerate.py``.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUDGET = 1.5e5  # --quick's token budget
# The examples on two ranks run only with CBS_ALL_TESTS=1: CI on two cores stays under its 15 minutes, and
# two ranks of Fabric and Accelerate are checked against truths in test_fabric.py and test_accelerate.py.
RANKS = [1, 2] if os.environ.get("CBS_ALL_TESTS") == "1" else [1]


def _run(args: list[str], cwd: Path) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _changes(out: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in re.findall(r"-> accumulation (\d+) -> (\d+)", out)]


@pytest.mark.parametrize("devices", RANKS)
def test_fabric_example_grows_the_batch_and_resumes(tmp_path, devices):
    pytest.importorskip("lightning")
    script = str(ROOT / "examples" / "fabric_gpt.py")
    out = _run([sys.executable, script, "--quick", "--devices", str(devices)], tmp_path)
    changes = _changes(out)
    assert changes and changes[0] == (2, 4), out  # the batch grew
    steps, tokens, lr, accumulation = re.search(
        r"done: (\d+) steps, ([\d,]+) tokens in .* last scheduled lr ([\d.e-]+), .* accumulation (\d+) per rank",
        out).groups()
    tokens = int(tokens.replace(",", ""))
    max_iters = int(BUDGET // (256 * devices))  # LitGPT's: microbatches per rank
    constant = math.ceil(max_iters / 2) * 2 * 256 * devices  # the constant run's data (windows of 2)
    largest = 256 * devices * int(accumulation)  # the last window's tokens
    assert constant <= tokens < constant + largest, out
    assert float(lr) == pytest.approx(2e-4)  # LitGPT's min_lr: the schedule ended with the data
    assert int(accumulation) == changes[-1][1]
    if devices == 1:  # fabric.load puts the tracker back where fabric.save left it
        again = _run([sys.executable, script, "--quick", "--resume", "out/fabric_gpt/last.ckpt", "--out", "again"],
                     tmp_path)
        assert f"resumed at step {steps}, {tokens:,} tokens, accumulation {accumulation}" in again, again


@pytest.mark.parametrize("processes", RANKS)
def test_accelerate_example_grows_the_batch_and_saves_its_state(tmp_path, processes):
    pytest.importorskip("accelerate")
    script = str(ROOT / "examples" / "accelerate_gpt.py")
    launch = [sys.executable] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    out = _run([*launch, script, "--quick"], tmp_path)
    assert f"accelerate_gpt: {processes} process(es)" in out, out
    changes = _changes(out)
    assert changes and changes[0] == (2, 4), out
    constant = int(re.search(r"(\d+) constant-batch steps", out).group(1))
    steps, at_start, tokens, accumulation = re.search(
        r"done: (\d+) optimizer steps \(([\d.]+) at the starting batch\), ([\d,]+) tokens, .* accumulation (\d+);",
        out).groups()
    assert constant <= float(at_start) < constant + int(accumulation) // 2, out  # ends within the last window
    assert int(tokens.replace(",", "")) == float(at_start) * 512 * processes
    assert int(steps) < constant  # fewer optimizer steps than the constant run on the same data
    last_lr = float(re.search(r"last scheduled lr ([\d.e-]+),", out).group(1))
    assert last_lr < 1e-3 * 2e-3  # the cosine's end (a stop on optimizer steps would have gone on past it)
    if processes > 1:
        return
    again = _run([sys.executable, script, "--quick", "--resume_from_checkpoint", f"out/accelerate_gpt/step_{steps}",
                  "--output_dir", "again"], tmp_path)
    assert f"resumed at step {steps}, {int(tokens.replace(',', '')):,} tokens, accumulation {accumulation}" in again, again
