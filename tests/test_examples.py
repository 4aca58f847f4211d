"""Smoke tests: the main job, the plain-loop example, and the README's promises."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_main_job_runs_and_prints_the_noise_scale(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "cbs_tracker.cli", "demo", "--tokens", "6e4", "--max-bytes", "300000", "--print-every", "20"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    # without a terminal: a plain progress line every 20 steps
    rows = re.findall(r"step +(\d+) +([\d.]+[kM])/60k tokens +loss ([\d.]+) +noise scale ([\d,]+|-) .* tok/s", out)
    assert [int(r[0]) for r in rows][:3] == [20, 40, 60], out
    measured = [float(r[3].replace(",", "")) for r in rows if r[3] != "-"]
    assert measured and all(m > 0 for m in measured)
    assert re.search(r"done: \d+ optimizer steps, [\d,]+ tokens", out)
    # 60k tokens are too few to grow: the demo says why, with the numbers
    # 60k tokens: either the default's hold read a plateau a quarter in, or the rule never reached its threshold
    assert re.search(r"no batch change: (a doubling needs the critical batch .* at 1,126 tokens or more|the default's "
                     r"hold on a loss plateau held growth for the run \(the loss fell -?[\d.]+ nats per e-fold)", out), out
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the run ends with the picture's path, which exists
    assert out.strip().splitlines()[-1] == f"picture of the run: {tmp_path / 'demo.png'}"


def test_demo_progress_line_and_change_line_on_a_terminal():
    import io

    from cbs_tracker.commands.demo import Progress
    from cbs_tracker.core.record import StepRecord

    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    progress = Progress(1.2e6, 50, stream=out)
    rec = StepRecord(step=7, tokens_seen=6e5, unit="tokens", global_batch=1024.0, micro_batch=256.0,
                     accumulation_steps=4, dp_degree=1, noise_scale=2455.0, noise_scale_low=1867.0,
                     noise_scale_high=4060.0)
    progress.update(rec, 2.5)
    progress.say("step 7, 600k tokens: global batch 512 -> 1,024 tokens (grow)")
    text = out.getvalue()
    assert text.startswith("\r[##########----------]  50% 600k/1.20M tokens  loss 2.500  noise scale 2,455 "
                           "(1,867-4,060)  batch 1,024"), text
    # the live line is cleared before a line that stays
    assert "\r\x1b[Kstep 7, 600k tokens: global batch 512 -> 1,024 tokens (grow)\n" in text


def test_plain_loop_example_doubles_writes_logs_and_a_png(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "plain_loop.py"), "--quick"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    assert "-> accumulation 2 -> 4" in out, out
    png = tmp_path / "schedule.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from cbs_tracker.commands.plot import read_cbs_scalars

    runs = read_cbs_scalars(tmp_path / "runs" / "plain_loop")
    tags = next(iter(runs.values()))
    steps, accum = tags["cbs/accumulation_steps"]
    _, batch = tags["cbs/global_batch_tokens"]
    # the logged global batch is what the loop consumed: 256-token microbatches x accumulation
    assert all(b == 256 * a for a, b in zip(accum, batch))
    assert max(accum) >= 4


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    blocks = re.findall(r"\*\*Run the tests\*\*.*?```bash\n(.*?)\n```", readme, re.S)
    assert len(blocks) == 1
    steps = [s.strip() for s in blocks[0].split("&&")]
    ci_lines = [line.strip() for line in ci.splitlines() if line.strip() and not line.startswith("#")]
    for s in steps:
        assert s in ci_lines, f"README step {s!r} is not a line of .ci/run"
    # and what CI runs after installing (the lint, then the tests) is the README's, in order
    ran = [line for line in ci_lines if line.startswith("python -m ")]
    assert ran == [s for s in steps if s.startswith("python -m ")]
    assert ran[:2] == ["python -m ruff check .", "python -m ruff check --select C901 cbs_tracker integrations"]


@pytest.mark.parametrize("command", ["demo", "plot", "plan", "nqm"])
def test_every_cli_command_the_readme_names_exists(command):
    out = subprocess.run(
        [sys.executable, "-m", "cbs_tracker.cli", command, "--help"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "usage" in out.stdout.lower()


def test_demo_picture_draws_the_loss_of_each_run_against_tokens(tmp_path):
    """The demo's picture: the schedule on top, below it each run's training and validation loss
    against tokens (the tracker's, and the constant batch's with ``--compare``)."""
    from cbs_tracker.commands.demo import LossTrace, draw
    from tests.test_tb import synthetic_run

    records = synthetic_run()
    tracked, constant = LossTrace("tracker"), LossTrace("constant 512")
    for trace, batch in ((tracked, 1024.0), (constant, 512.0)):
        for i in range(1, 9):
            trace.tokens.append(i * batch)
            trace.batch.append(batch)
            trace.train.append(3.0 - 0.1 * i)
        trace.val_tokens, trace.val = [4 * batch, 8 * batch], [2.7, 2.3]
    # per token: the first half of the tracker's 8,192 tokens holds 4 steps of 1,024 tokens
    x, y = tracked.smoothed(bins=2)
    assert x == [2048.0, 6144.0] and y == pytest.approx([2.75, 2.35])
    path = tmp_path / "demo.png"
    assert draw(records, str(path), losses=[tracked, constant]) == f"picture of the run: {path}"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    import matplotlib.figure

    saved = {}
    original = matplotlib.figure.Figure.savefig
    try:
        matplotlib.figure.Figure.savefig = lambda fig, *a, **k: saved.setdefault("fig", fig)
        draw(records, str(path), losses=[tracked, constant])
    finally:
        matplotlib.figure.Figure.savefig = original
    top, bottom = saved["fig"].axes
    labels = [line.get_label() for line in bottom.get_lines()]
    assert labels == ["tracker: training loss", "tracker: validation loss",
                      "constant 512: training loss", "constant 512: validation loss"]
    assert "loss" in bottom.get_ylabel() and "tokens" in bottom.get_xlabel()
    assert any("noise scale" in line.get_label() for line in top.get_lines())
