"""``benchmarks/proof/adam_scale.py``: the medians per stretch against a hand computation, and a seconds-long pair
of runs that train alike and measure two different noise scales."""

from __future__ import annotations

import json

import pytest

from benchmarks.proof import adam_scale
from benchmarks.proof import gpt_proof as base


def test_stretches_take_the_median_of_each_scale_and_of_their_ratio_over_points_measured_by_both():
    tokens = [0, 10, 20, 30, 50, 60, 70, 99]
    simple = [None, 100, 200, 400, 1000, 1000, 2000, 500]
    adam = [300, 300, 200, 1600, 3000, None, 4000, 500]
    first, second = adam_scale.stretches(tokens, simple, adam, budget=100, marks=2)
    # [0, 50): points 10, 20, 30 (0 has no B_simple); ratios 3, 1, 4
    assert (first["points"], first["b_simple"], first["b_adam"], first["ratio"]) == (3, 200, 300, 3)
    # [50, 100): points 50, 70, 99 (60 has no B_adam); ratios 3, 2, 1
    assert (second["points"], second["b_simple"], second["b_adam"], second["ratio"]) == (3, 1000, 3000, 2)
    (empty,) = adam_scale.stretches([5], [None], [None], budget=10, marks=1)
    assert empty["points"] == 0 and empty["ratio"] is None


def test_a_tiny_pair_trains_alike_and_reads_the_adam_scale_apart(tmp_path):
    out = tmp_path / "scale.json"
    assert adam_scale.main(["--setting", "tiny", "--marks", "2", "--runs", str(tmp_path / "runs"),
                            "--out", str(out)]) == 0
    (saved,) = json.loads(out.read_text())["runs"]
    assert saved["setting_key"] == base.SETTINGS["tiny"].key() and len(saved["points"]) == 2
    assert all(p["points"] > 0 and p["b_simple"] > 0 and abs(p["ratio"] - 1) > 0.01 for p in saved["points"])
    # a second call reads both runs back instead of training them again
    for path in (tmp_path / "runs" / "runs").iterdir():
        run = json.loads(path.read_text())
        run["trace"]["noise_scale"] = [None if s is None else 2 * s for s in run["trace"]["noise_scale"]]
        path.write_text(json.dumps(run))
    assert adam_scale.main(["--setting", "tiny", "--marks", "2", "--runs", str(tmp_path / "runs"),
                            "--out", str(out)]) == 0
    (again,) = json.loads(out.read_text())["runs"]
    assert [p["b_simple"] for p in again["points"]] == pytest.approx([2 * p["b_simple"] for p in saved["points"]])
    assert [p["ratio"] for p in again["points"]] == pytest.approx([p["ratio"] for p in saved["points"]])
