"""CI-sized run of ``benchmarks/layout_throughput.py``: the layouts it times are the ones it names.

The benchmark's tracker rows must run the asked microbatch and accumulation (it
records what the tracker ran); a layout the tracker cannot run is refused up front.
"""

from __future__ import annotations

import json

import torch

from tests.scripts import load_script


def test_layout_benchmark_runs_the_layouts_it_reports(capsys):
    module = load_script("benchmarks/layout_throughput.py", "cbs_layout_benchmark")
    threads = torch.get_num_threads()
    try:
        code = module.main(["--seq-len", "32", "--global-tokens", "256", "--loader-tokens", "32",
                            "--micro-tokens", "32", "64", "128", "--rounds", "1", "--steps", "1", "--json"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # what the tracker really ran (read from it after timing), against the asked layouts
    assert [(r["tracker_micro_tokens"], r["tracker_accumulation"]) for r in result["rows"]] == [(32, 8), (64, 4), (128, 2)]
    assert [(r["micro_tokens"], r["accumulation"]) for r in result["rows"]] == [(32, 8), (64, 4), (128, 2)]
    assert result["rows"][0]["plain_time_vs_smallest"] == 1.0
    assert all(r["plain_tokens_per_s"] > 0 and r["tracker_tokens_per_s"] > 0 for r in result["rows"])


def test_layout_benchmark_refuses_a_layout_the_tracker_cannot_run(capsys):
    import pytest

    module = load_script("benchmarks/layout_throughput.py", "cbs_layout_benchmark")
    with pytest.raises(SystemExit):
        module.main(["--seq-len", "32", "--global-tokens", "256", "--loader-tokens", "32", "--micro-tokens", "96"])
    assert "--micro-tokens 96: the tracker cannot run it" in capsys.readouterr().err
