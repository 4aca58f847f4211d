"""The wall-clock proof's interleaving (benchmarks/proof/gpt_proof_lr.py, ``--runs a+b``).

Runs that share one process step by step must train exactly as they do alone (no state
leaks between them: RNG, LR schedule, tracker), and each run's clock must count its own
steps only, so the runs' clocks add up to the process's time instead of each reading all of it.
"""

from __future__ import annotations

import time
from types import ModuleType

import pytest
import torch

from benchmarks.proof import gpt_proof_lr
from tests.scripts import load_script


@pytest.fixture(scope="module")
def script() -> ModuleType:
    return gpt_proof_lr


def test_interleaved_runs_train_as_they_do_alone_and_time_only_themselves(script, tmp_path, monkeypatch):
    import cbs_tracker.demo.corpus as corpus

    evaluate = corpus.evaluate

    def slow_evaluate(*args, **kwargs):  # each evaluation takes at least 50 ms, to be left out of training time
        time.sleep(0.05)
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(corpus, "evaluate", slow_evaluate)
    threads = torch.get_num_threads()
    setting = script.base.QUICK
    runs = [script.Run("constant", 0, "cosine"), script.Run("tracker_mbfirst", 0, "cosine"),
            script.Run("constant_fast", 0, "cosine")]
    try:
        start = time.perf_counter()
        together = script.train_interleaved(runs, setting, tmp_path / "together")
        elapsed = time.perf_counter() - start
        alone = {run.name: script.train(run, setting, tmp_path / run.name) for run in runs}
    finally:
        torch.set_num_threads(threads)

    for run in runs:
        a, b = together[run.name], alone[run.name]
        assert a["evals"]["val_loss"] == b["evals"]["val_loss"], run.name
        assert a["evals"]["tokens"] == b["evals"]["tokens"], run.name
        assert a["trace"] == b["trace"], run.name
        assert a["steps"] == b["steps"] and a["tokens"] == b["tokens"], run.name
        assert a["interleaved_with"] == [r.name for r in runs if r != run]
        assert b["interleaved_with"] == []
        # evaluation times are left out, and the per-evaluation clock only moves forward
        assert a["evals"]["train_s"] == sorted(a["evals"]["train_s"])
        assert a["train_time_s"] - a["train_only_s"] >= 0.05 * len(a["evals"]["val_loss"]) - 0.1
        assert a["evals"]["train_s"][-1] == pytest.approx(a["train_only_s"], abs=0.15)
    # the tracker run grew its microbatch (otherwise this checks nothing new)
    assert max(together[runs[1].name]["trace"]["global_batch"]) > setting.tracker_start_tokens
    # each clock counts only its own run: together they add up to the process's time (setups
    # aside, which no clock counts); a clock that kept running would count about 3x
    own = sum(r["train_time_s"] for r in together.values())
    assert own <= elapsed + 0.3
    assert own >= 0.4 * elapsed


def test_interleave_cost_benchmark_times_only_the_timed_run(capsys):
    # with two other runs stepping between its steps, a clock that counted them would read about 3x
    import json

    bench = load_script("benchmarks/interleave_cost.py", "cbs_interleave_cost")
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--others", "2", "--rounds", "2", "--steps", "4", "--seq-len", "32", "--json"]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["alone_step_s"] > 0
    assert result["ratio_median"] < 1.8, result


def test_more_seeds_name_more_runs_and_bad_seeds_are_refused(script, tmp_path, capsys):
    # --seeds widens the plan (runs at seed 2 become nameable) without changing the setting's key,
    # so earlier results at seeds 0 and 1 stay valid; bad lists name the argument and what is allowed.
    from dataclasses import replace

    setting = script.base.QUICK
    wider = replace(setting, seeds=(0, 1, 2))
    names = {r.name for r in script.plan(wider)}
    assert "constant_512_cosine_seed2" in names and "tracker_default_cosine_seed2" in names
    assert "constant_512_cosine_seed2" not in {r.name for r in script.plan(setting)}
    assert wider.key() == setting.key()
    for bad in ("0,x", "1,1", "-1", ","):
        with pytest.raises(SystemExit):
            script.main(["--quick", "--out", str(tmp_path), "--seeds", bad, "--report-only"])
        assert f"--seeds={bad!r}" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="unknown run names"):
        script.main(["--quick", "--out", str(tmp_path), "--runs", "constant_512_cosine_seed7"])


def test_the_library_commit_is_read_once_when_a_run_starts(script, monkeypatch):
    # a commit made while a long run trains must not be recorded as the run's: read once, and
    # ``-dirty`` when the tree had uncommitted changes
    import subprocess
    import types

    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        return types.SimpleNamespace(returncode=0, stdout=f"abc{len(calls)}-dirty\n")

    base = script.base
    base._library_commit.cache_clear()
    monkeypatch.setattr(subprocess, "run", fake_run)
    try:
        assert base._library_commit() == "abc1-dirty"
        assert base._library_commit() == "abc1-dirty"  # a later commit is not seen
        assert len(calls) == 1 and "--dirty" in calls[0]
    finally:
        base._library_commit.cache_clear()
