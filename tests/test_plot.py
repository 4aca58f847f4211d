"""``cbs-tracker plot``: reading cbs/ tags back from event files, finding batch changes, drawing the PNG."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from cbs_tracker.integrations.tensorboard import TensorBoardLogger
from torch.utils.tensorboard import SummaryWriter

from cbs_tracker import cli
from cbs_tracker.commands import plot
from cbs_tracker.commands.plot import (
    BatchChange,
    change_indices,
    draw_schedule,
    find_batch_changes,
    read_cbs_scalars,
    run_unit,
)
from cbs_tracker.core.record import StepRecord

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# Run A: two doublings (A = 1 -> 2 -> 4 at DP = 2); 4096 tokens per microbatch.
ACCUM_A = [1, 1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 4]
# Run B: one doubling (A = 2 -> 4 at DP = 1), then the short last window of an
# epoch (A = 1), more full windows, and a short last window to end the run.
ACCUM_B = [2, 2, 2, 4, 4, 4, 1, 4, 4, 3]


def make_run(accum, *, dp, micro=4096.0, unit="tokens", start_step=1, noise0=1000.0):
    records = []
    seen = 0.0
    for i, a in enumerate(accum):
        gb = micro * dp * a
        seen += gb
        step = i + 1
        records.append(
            StepRecord(
                step=step,
                tokens_seen=seen,
                unit=unit,
                global_batch=gb,
                micro_batch=micro,
                accumulation_steps=a,
                dp_degree=dp,
                grad_sq_norm=0.5,
                trace_cov=noise0 * step / 2,
                noise_scale=noise0 * step if step >= 2 else None,
                noise_scale_low=0.8 * noise0 * step if step >= 2 else None,
                noise_scale_high=(math.inf if step == 3 else 1.25 * noise0 * step) if step >= 2 else None,
                critical_batch=noise0 * step if step >= 3 else None,
                lr=1e-3,
            )
        )
    return [r for r in records if r.step >= start_step]


def write(log_dir, records):
    with TensorBoardLogger(log_dir) as logger:
        for r in records:
            logger.log(r)


@pytest.fixture
def two_runs(tmp_path):
    write(tmp_path / "runA", make_run(ACCUM_A, dp=2))
    write(tmp_path / "sub" / "runB", make_run(ACCUM_B, dp=1, noise0=3000.0))
    return tmp_path


def test_read_runs_and_values(two_runs):
    runs = read_cbs_scalars(two_runs)
    assert sorted(runs) == ["runA", "sub/runB"]
    steps, seen = runs["runA"]["cbs/tokens_seen"]
    assert steps.dtype == np.int64
    assert steps.tolist() == list(range(1, 13))
    assert seen.tolist() == np.cumsum([4096.0 * 2 * a for a in ACCUM_A]).tolist()
    steps, ns = runs["sub/runB"]["cbs/noise_scale"]
    assert steps.tolist() == list(range(2, 11))
    assert ns.tolist() == [3000.0 * s for s in range(2, 11)]
    assert "cbs_tokens/global_batch_tokens" in runs["runA"]
    assert run_unit(runs["runA"]) == "tokens"


def test_batch_changes_of_a_run(two_runs):
    runs = read_cbs_scalars(two_runs)
    # Run A doubles before steps 5 and 9: after 4 steps of 8192 tokens, and
    # after 4 more of 16384.
    assert find_batch_changes(runs["runA"]) == [
        BatchChange(step=5, seen=32768.0, old_microbatches=2, new_microbatches=4),
        BatchChange(step=9, seen=98304.0, old_microbatches=4, new_microbatches=8),
    ]
    # Run B doubles before step 4 (3 steps of 8192 tokens); the short windows
    # at steps 7 and 10 are not changes.
    changes_b = find_batch_changes(runs["sub/runB"])
    assert changes_b == [BatchChange(step=4, seen=24576.0, old_microbatches=2, new_microbatches=4)]
    assert changes_b[0].factor == 2.0


def test_change_after_a_short_window_keeps_the_old_level(tmp_path):
    # A = 2, 2, 1 (short last window of an epoch), then 4 from the next epoch on.
    write(tmp_path, make_run([2, 2, 1, 4, 4], dp=1))
    (change,) = find_batch_changes(read_cbs_scalars(tmp_path)["."])
    assert change == BatchChange(step=4, seen=4096.0 * 5, old_microbatches=2, new_microbatches=4)


@pytest.mark.parametrize(
    ("levels", "expected"),
    [
        ([], []),
        ([1], []),
        ([1, 1, 2, 2], [2]),
        ([1, 2], []),  # a differing last entry is a short window, not a change
        ([4, 4, 2, 8, 8], [3]),  # short window, then the doubling
        ([4, 4, 2, 4, 4], []),  # short window inside a level
        ([2, 2, 1, 1], [2]),  # halving (shrinking enabled)
        ([1, 1, 2, 2, 4, 4, 8, 8], [2, 4, 6]),
    ],
)
def test_change_indices(levels, expected):
    assert change_indices(levels) == expected


def test_resumed_run_last_value_wins(tmp_path):
    # A crash after step 8 and a resume from step 4 write steps 5..8 twice,
    # into a second event file of the same folder.
    first = make_run(ACCUM_A[:8], dp=2, noise0=1000.0)
    second = make_run(ACCUM_A, dp=2, noise0=2000.0, start_step=5)
    write(tmp_path / "w1", first)
    write(tmp_path / "w2", second)
    # Put both files in one folder, named so that file-name order is write order.
    (f1,) = os.listdir(tmp_path / "w1")
    (f2,) = os.listdir(tmp_path / "w2")
    os.rename(tmp_path / "w1" / f1, tmp_path / "events.out.tfevents.0000000001.a")
    os.rename(tmp_path / "w2" / f2, tmp_path / "events.out.tfevents.0000000002.b")
    os.rmdir(tmp_path / "w1")
    os.rmdir(tmp_path / "w2")
    runs = read_cbs_scalars(tmp_path)
    steps, ns = runs["."]["cbs/noise_scale"]
    assert steps.tolist() == list(range(2, 13))
    assert ns.tolist() == [1000.0 * s for s in range(2, 5)] + [2000.0 * s for s in range(5, 13)]


def test_plot_writes_png_with_one_line_per_change(two_runs, tmp_path, capsys):
    out = tmp_path / "figs" / "schedule.png"
    assert plot.main([str(two_runs), "-o", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC
    # At this size a blank figure is 4.5 kB and one empty axes 13 kB; the curves add more.
    assert len(data) > 20_000, len(data)
    assert capsys.readouterr().out == f"wrote {out}: 2 run(s), 3 batch change(s)\n"

    fig = draw_schedule(read_cbs_scalars(two_runs))
    (ax,) = fig.axes
    marks = [line for line in ax.get_lines() if line.get_gid() == "batch-change"]
    assert sorted(line.get_xdata()[0] for line in marks) == [24576.0, 32768.0, 98304.0]
    assert ax.get_yscale() == "log"
    assert ax.get_xlabel() == "tokens seen"


def test_noise_scale_interval_is_drawn_as_a_band(tmp_path):
    write(tmp_path, make_run([1, 1, 1, 1, 2, 2], dp=1, noise0=1000.0))
    run = read_cbs_scalars(tmp_path)["."]
    seen = dict(zip(*(a.tolist() for a in run["cbs/tokens_seen"]), strict=True))
    x, low, high = plot.noise_scale_band(run, seen)
    assert x.tolist() == [seen[s] for s in range(2, 7)]
    # step 3's upper end is infinite: a gap, not a made-up bound
    assert np.isnan(low[1]) and np.isnan(high[1])
    keep = [0, 2, 3, 4]
    assert low[keep].tolist() == pytest.approx([800.0 * s for s in (2, 4, 5, 6)], rel=1e-6)
    assert high[keep].tolist() == pytest.approx([1250.0 * s for s in (2, 4, 5, 6)], rel=1e-6)
    (ax,) = draw_schedule({".": run}).axes
    (band,) = [c for c in ax.collections if c.get_gid() == "noise-scale-band"]
    ys = np.concatenate([p.vertices[:, 1] for p in band.get_paths()])
    assert ys.min() == pytest.approx(1600.0, rel=1e-6) and ys.max() == pytest.approx(7500.0, rel=1e-6)
    # a run logged without the interval draws no band
    assert plot.noise_scale_band({k: v for k, v in run.items() if "low" not in k}, seen) is None


def test_plot_through_console_dispatcher(two_runs, tmp_path):
    out = tmp_path / "s.png"
    assert cli.main(["plot", str(two_runs / "runA"), "-o", str(out), "--log-x", "--title", "A"]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_samples_unit_and_single_event_file(tmp_path):
    write(tmp_path / "s", make_run([1, 1, 2, 2, 2], dp=1, micro=32.0, unit="samples"))
    (event_file,) = (tmp_path / "s").iterdir()
    runs = read_cbs_scalars(event_file)
    assert list(runs) == [event_file.name]
    run = runs[event_file.name]
    assert run_unit(run) == "samples"
    assert find_batch_changes(run) == [
        BatchChange(step=3, seen=64.0, old_microbatches=1, new_microbatches=2)
    ]
    (ax,) = draw_schedule(runs).axes
    assert ax.get_xlabel() == "samples seen"
    assert ax.get_ylabel() == "batch size (samples)"


def test_empty_logdir_error(tmp_path, capsys):
    assert plot.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"cbs-tracker plot: error: no TensorBoard event files (*tfevents*) under LOGDIR {str(tmp_path)!r}\n"
    )
    with pytest.raises(ValueError, match=r"no TensorBoard event files \(\*tfevents\*\) under LOGDIR"):
        read_cbs_scalars(tmp_path)


def test_missing_logdir_error(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert plot.main([str(missing)]) == 2
    assert capsys.readouterr().err == f"cbs-tracker plot: error: LOGDIR {str(missing)!r} does not exist\n"


def test_logdir_without_cbs_tags_error(tmp_path, capsys):
    with SummaryWriter(str(tmp_path / "other")) as w:
        w.add_scalar("loss", 1.0, 1)
    assert plot.main([str(tmp_path), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cbs-tracker plot: error: no cbs/ scalar tags in the event files under LOGDIR {str(tmp_path)!r}")
    assert "(1 run folder(s) read); write them with cbs_tracker.TensorBoardLogger or cbs_tracker.CBSCallback" in err
    assert not (tmp_path / "x.png").exists()


def test_mixed_units_and_missing_seen_tag_errors(tmp_path, capsys):
    write(tmp_path / "t", make_run([1, 1], dp=1))
    write(tmp_path / "s", make_run([1, 1], dp=1, unit="samples"))
    with pytest.raises(ValueError, match=r"runs in different units cannot share an axis: \{'s': 'samples', 't': 'tokens'\}"):
        draw_schedule(read_cbs_scalars(tmp_path))
    assert plot.main([str(tmp_path), "-o", str(tmp_path / "x.png")]) == 2
    assert "runs in different units" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"a run needs exactly one of cbs/tokens_seen, cbs/samples_seen; found \[\]"):
        run_unit({"cbs/noise_scale": (np.array([1]), np.array([1.0]))})
    with pytest.raises(ValueError, match=r"draw_schedule\(runs=\{\}\): expected at least one run"):
        draw_schedule({})
