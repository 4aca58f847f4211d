"""Test order and threads for ``pytest -n 2 --dist loadfile`` on two cores.

Order: the longest files first. xdist hands whole files to the two workers; by default it orders
them by their number of tests (``--no-loadscope-reorder``, in ``pyproject.toml``, turns that off),
which put the long multi-process files, few tests each, last, and one worker ran them alone for
minutes. Longest first, the short files fill in at the end. The list is the files that took
longest in a full run (``--durations``); order only, every test still runs.

Threads: one intra-op thread per process unless ``OMP_NUM_THREADS`` says otherwise (two workers
and their spawned ranks on two cores: more threads only contend; inherited by the subprocesses).

Bytecode: the project's sources are compiled once, before the workers start. Where
``PYTHONDONTWRITEBYTECODE`` is set no ``.pyc`` is ever written, so every subprocess a test
starts (ranks, examples, torchrun) compiled the package again, about 0.7 s each.
"""

from __future__ import annotations

import compileall
import os
from pathlib import Path

if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)

LONGEST_FIRST = (
    "test_examples_loops.py",
    "test_estimator_accuracy.py",
    "test_estimator_frozen_regression.py",
    "test_examples_lightning.py",
    "test_resume_ranks_lightning.py",
    "test_resume_ranks_hf.py",
    "test_resume_ranks.py",
    "test_gpt_proof.py",
    "test_batch_schedule_lightning.py",
    "test_transformers.py",
    "test_torchrun_examples.py",
    "test_elastic.py",
    "test_padded.py",
    "test_distributed.py",
    "test_decisions_on_noise.py",
    "test_microbatch_first_dist.py",
    "test_batch_schedule_hf.py",
    "test_tracking.py",
)
_RANK = {name: i for i, name in enumerate(LONGEST_FIRST)}


# Run only with CBS_ALL_TESTS=1 (deselected, reported as such): long multi-process runs whose ranks are also
# checked by shorter tests (tests/test_lightning.py's ddp_spawn ranks, tests/test_batch_schedule.py's schedule),
# so that CI on two cores stays under its 15 minutes.
ALL_TESTS_ONLY = (
    "tests/test_batch_schedule_lightning.py::test_the_schedule_on_two_ddp_spawn_ranks_and_a_resume_there",
    "tests/test_examples_lightning.py::test_lightning_gpt_under_ddp_with_two_cpu_processes_matches_the_reference",
    "tests/test_elastic.py::test_two_agent_runs_in_a_row_finish_without_a_worker_aborting",
)


def pytest_collection_modifyitems(config, items) -> None:
    items.sort(key=lambda item: _RANK.get(Path(str(item.fspath)).name, len(_RANK)))  # stable: a file keeps its order
    if os.environ.get("CBS_ALL_TESTS") == "1":
        return
    left_out = [item for item in items if item.nodeid in ALL_TESTS_ONLY]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item.nodeid not in ALL_TESTS_ONLY]


def pytest_configure(config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the controller compiled already
        return
    root = Path(__file__).resolve().parents[1]
    for folder in ("cbs_tracker", "integrations", "examples", "benchmarks", "tests"):
        if (root / folder).is_dir():
            compileall.compile_dir(root / folder, quiet=1)
