"""Elastic torchrun: a node is lost mid-run and the survivor finishes on fewer ranks with the same run.

Two torchrun agents on this machine stand for two nodes (``--nnodes=1:2``, c10d rendezvous,
gloo, one worker each) running ``examples/elastic_ddp.py``. The agent started with
``is_host=1`` hosts the c10d store and survives. Once the batch has grown and a checkpoint
after the growth exists, the other agent and its worker are killed (SIGKILL, as a lost node);
the survivor's worker fails in its next collective, its agent re-rendezvouses alone and
restarts it at world size 1, and the script resumes from its newest checkpoint.

Two truths the survivor is compared with:

- a reference resumed by hand from the same checkpoint at world size 1 (``torchrun
  --standalone --nproc-per-node=1 ... --resume-from``): every step's log line (global batch,
  accumulation, LR at each token count, stream position, rank 0's loss, noise scale) and the final
  checkpoint (tracker state, weights, optimizer, stream) must be equal, bit for bit (the same
  computation at the same world size);
- the two-rank run itself on the steps it logged after that checkpoint, before it lost the
  node: the same tokens, global batch, LR and stream position (exactly), the same noise scale
  to float32 reduction order (rank 0's loss covers only its half of the batch there, so it is
  not compared). A resume that kept the accumulation per rank (halving the global batch) or
  restarted the data would agree with the reference and fail here.

A node that joins mid-run: the host agent runs alone on one rank; once its batch has grown and a
checkpoint after the growth exists, its worker is paused (SIGSTOP, a slow step) and the second
agent starts. The host's agent sees the waiting node, stops its worker and both restart it at
world size 2 from the newest checkpoint. The truth is a run that never changed size (one rank,
same budget, from scratch): the one-rank steps equal it exactly, and every two-rank step has its
tokens, global batch, LR and stream position exactly, the accumulation per rank halved, and the
noise scale to float32 reduction order. A resume that kept the accumulation per rank (doubling
the global batch) or restarted the data fails there. Without ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
(the guide's command) both agents die in that rendezvous. Both tests also check the exit: each
start of a worker is logged, so a finished worker that aborted and was restarted shows as one
more start. ``CBS_ALL_TESTS=1`` adds twenty plain two-agent runs in a row (``CBS_ELASTIC_RUNS``).

Rendezvous settings keep the restart short: heartbeats every second, a node declared dead
after four missed ones (torch sends one only once a whole interval has passed since the last, so
about every two seconds; a node declared dead after two is sometimes dropped by a joining node,
which then starts a run of its own), and a 3 s last call once one node is in.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.doubles import assert_same

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "elastic_ddp.py"
RUN = [
    "--backend", "gloo", "--total-steps", "300", "--checkpoint-every", "20",
    "--batch-sequences", "8", "--micro-sequences", "2", "--seq-len", "32", "--print-every", "100",
]
START_BATCH = 8 * 32  # tokens: --batch-sequences x --seq-len
RDZV = "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=4,join_timeout=60"
SHARE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # on every agent, as in the guide's command

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_", "PET_"))}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **SHARE}


def _start_agent(is_host: int, port: int, ckpt_dir: Path, log: Path, out: Path) -> subprocess.Popen:
    """One torchrun agent (one worker) of the guide's elastic command, on this machine."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=elastic-{port}",
        "--max-restarts=3", f"--rdzv-conf=is_host={is_host},{RDZV}",
        str(SCRIPT), *RUN, "--checkpoint-dir", str(ckpt_dir), "--log-file", str(log), "--keep", "0",
    ]
    with open(out, "w") as f:
        return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _worker(agent: subprocess.Popen) -> int | None:
    """The pid of the agent's worker (the process running the script), if one is running."""
    for pid in _descendants(agent.pid):
        with contextlib.suppress(OSError):
            if SCRIPT.name.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    return None


def _alive(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


def _no_abort(*outs: Path) -> None:
    """No worker aborted at exit (the C++ runtime's message; its agent would then have restarted it)."""
    for out in outs:
        assert "terminate called" not in out.read_text(), _tail(out)


def _descendants(pid: int) -> list[int]:
    """``pid``'s living children, grandchildren... (torchrun starts each worker in a session of its own)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # after "pid (comm) state"
            parents.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL an agent and everything it started (a lost node); nothing once it has been reaped."""
    if proc.poll() is not None:
        return  # its pid may belong to someone else by now; its workers ended with it
    pids = [proc.pid, *_descendants(proc.pid)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # each leads a session of its own: its group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _read_log(path: Path) -> list[dict]:
    """The JSON lines of a log; a line cut short by a killed writer is skipped."""
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            events.append(json.loads(line))
    return events


def _segments(events: list[dict]) -> list[list[dict]]:
    """The log cut at each worker start: one list per start, beginning with its "start" event."""
    segs: list[list[dict]] = []
    for e in events:
        if e["event"] == "start":
            segs.append([])
        if segs:
            segs[-1].append(e)
    return segs


def _ready_to_stop(events: list[dict], world_size: int = 2) -> bool:
    """The current run is on ``world_size`` ranks, its batch has grown, a checkpoint after that
    exists, and a step after that checkpoint is logged (to compare the next run with)."""
    segs = _segments(events)
    if not segs or segs[-1][0]["world_size"] != world_size:
        return False
    seg = segs[-1]
    grown = [e["step"] for e in seg if e["event"] == "step" and e["global_batch"] > START_BATCH]
    if not grown:
        return False
    ckpts = [e["step"] for e in seg if e["event"] == "checkpoint" and e["step"] >= grown[0]]
    return bool(ckpts) and any(e["event"] == "step" and e["step"] > ckpts[-1] for e in seg)


def _tail(*paths: Path) -> str:
    return "\n".join(f"--- {p.name}:\n" + (p.read_text()[-3000:] if p.exists() else "(none)") for p in paths)


def _load(path: Path | str) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def test_a_lost_node_resumes_on_the_survivor_with_the_reference_batch_lr_and_state(tmp_path):
    ckpt_dir, log = tmp_path / "ckpt", tmp_path / "elastic.jsonl"
    port = _free_port()
    agents: dict[str, subprocess.Popen] = {}
    outs = {name: tmp_path / f"agent_{name}.out" for name in ("host", "other")}
    try:
        # the other agent first: it waits for the host's store and joins as soon as it is up, so the
        # first round holds both nodes (a join later than the last call would start the run alone)
        for name, is_host in (("other", 0), ("host", 1)):
            agents[name] = _start_agent(is_host, port, ckpt_dir, log, outs[name])
        deadline = time.monotonic() + 90
        while not _ready_to_stop(_read_log(log)):
            assert time.monotonic() < deadline, "no checkpoint after a growth on 2 ranks in 90 s\n" + _tail(*outs.values(), log)
            assert agents["host"].poll() is None and agents["other"].poll() is None, _tail(*outs.values(), log)
            time.sleep(0.02)
        _kill_tree(agents["other"])  # the node is lost: its agent and its worker
        rc = agents["host"].wait(timeout=120)
        assert rc == 0, _tail(outs["host"], log)
    finally:
        for proc in agents.values():
            _kill_tree(proc)
    _no_abort(outs["host"])

    events = _read_log(log)
    segs = _segments(events)
    before = [seg for seg in segs if seg[0]["world_size"] == 2][-1]  # the run the node was lost from
    last = segs[-1]
    start = last[0]
    # the survivor's worker was restarted by its agent, on one rank, from the script's own checkpoint
    assert before[0]["world_size"] == 2
    assert start["world_size"] == 1 and start["restart"] >= 1, start
    resumed = Path(start["resumed_from"])
    assert resumed.parent == ckpt_dir and resumed.exists(), start
    ckpt = _load(resumed)
    assert ckpt["world_size"] == 2 and ckpt["step"] == start["step"]
    saved = ckpt["tracker"]
    assert saved["dp_degree"] == 2 and saved["accumulation_steps"] * 2 * 2 * 32 > START_BATCH, "no growth before the checkpoint"
    assert last[-1]["event"] == "done", last[-1]
    survivor = [e for e in last if e["event"] == "step"]
    assert survivor[0]["step"] == start["step"] + 1

    # the same run as the two-rank one where both logged a step: data, batch, LR, decisions
    two_rank = [e for e in before if e["event"] == "step" and e["step"] > start["step"]]
    assert two_rank, "no two-rank step logged after the checkpoint the survivor resumed from"
    for old, new in zip(two_rank, survivor):
        where = f"step {new['step']}"
        for key in ("step", "tokens_seen", "global_batch", "lr", "position", "starting_batch_steps"):
            assert new[key] == old[key], f"{where}: {key} {new[key]!r} on 1 rank, {old[key]!r} on 2"
        assert new["accumulation"] * 1 == old["accumulation"] * 2, where
        assert new["next_accumulation"] * 1 == old["next_accumulation"] * 2, where
        # the same gradients summed in another order (float32): ~1e-8 seen; other data moves it by percents
        assert math.isclose(new["noise_scale"], old["noise_scale"], rel_tol=1e-5), where

    # the reference: resumed by hand on one rank from the same checkpoint
    ref_dir, ref_log, ref_out = tmp_path / "ref", tmp_path / "ref.jsonl", tmp_path / "ref.out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", str(SCRIPT), *RUN,
           "--checkpoint-dir", str(ref_dir), "--log-file", str(ref_log), "--resume-from", str(resumed)]
    with open(ref_out, "w") as out:
        ref = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert ref.wait(timeout=120) == 0, _tail(ref_out)
    finally:
        _kill_tree(ref)
    ref_events = _read_log(ref_log)
    assert [e["event"] for e in ref_events if e["event"] == "start"] == ["start"]
    assert ref_events[0]["world_size"] == 1 and ref_events[0]["resumed_from"] == str(resumed)
    reference = [e for e in ref_events if e["event"] == "step"]
    assert len(survivor) == len(reference) > 0
    for got, want in zip(survivor, reference):
        assert got == want, f"survivor {got} != reference {want}"
    assert any(e["next_accumulation"] != e["accumulation"] for e in reference), "no decision after the resume"
    assert last[-1] == ref_events[-1]
    # the final state: tracker (estimate, controller, accumulation, tokens, schedule), weights, optimizer, stream
    final, ref_final = _load(ckpt_dir / f"ckpt-{last[-1]['step']:06d}.pt"), _load(ref_dir / f"ckpt-{ref_events[-1]['step']:06d}.pt")
    assert_same(final, ref_final, "checkpoint")
    assert final["tracker"]["dp_degree"] == 1 and final["tracker"]["tokens_seen"] == last[-1]["tokens_seen"]
    # the reference kept its last two checkpoints (--keep 2) and left no temporary file
    assert len(list(ref_dir.glob("ckpt-*.pt"))) == 2 and not list(ref_dir.glob("*.tmp"))


def _reference(tmp_path: Path) -> list[dict]:
    """The truth: one rank from scratch to the end, never resized (``--standalone``)."""
    ref_log, ref_out = tmp_path / "ref.jsonl", tmp_path / "ref.out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", str(SCRIPT), *RUN,
           "--checkpoint-dir", str(tmp_path / "ref"), "--log-file", str(ref_log)]
    with open(ref_out, "w") as out:
        ref = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert ref.wait(timeout=120) == 0, _tail(ref_out)
    finally:
        _kill_tree(ref)
    return _read_log(ref_log)


def test_a_node_that_joins_mid_run_continues_on_two_ranks_like_a_run_that_never_changed_size(tmp_path):
    ckpt_dir, log = tmp_path / "ckpt", tmp_path / "elastic.jsonl"
    port = _free_port()
    agents: dict[str, subprocess.Popen] = {}
    outs = {name: tmp_path / f"agent_{name}.out" for name in ("host", "other")}
    try:
        agents["host"] = _start_agent(1, port, ckpt_dir, log, outs["host"])  # alone: it starts after the last call
        deadline = time.monotonic() + 90
        while not _ready_to_stop(_read_log(log), world_size=1):
            assert time.monotonic() < deadline, "no checkpoint after a growth on 1 rank in 90 s\n" + _tail(outs["host"], log)
            assert agents["host"].poll() is None, _tail(outs["host"], log)
            time.sleep(0.02)
        worker = _worker(agents["host"])
        assert worker is not None, _tail(outs["host"])
        os.kill(worker, signal.SIGSTOP)  # the run waits mid-step while the node joins (the agent still runs)
        agents["other"] = _start_agent(0, port, ckpt_dir, log, outs["other"])
        deadline = time.monotonic() + 90
        while _alive(worker):  # until the host's agent stops it to take the new node in
            assert time.monotonic() < deadline, "the host's agent never stopped its worker\n" + _tail(*outs.values())
            assert agents["host"].poll() is None and agents["other"].poll() is None, _tail(*outs.values(), log)
            with contextlib.suppress(OSError):  # a worker that handles SIGTERM needs to run to see it
                if int(re.search(r"ShdPnd:\s*(\w+)", Path(f"/proc/{worker}/status").read_text()).group(1), 16) \
                        & (1 << (signal.SIGTERM - 1)):
                    os.kill(worker, signal.SIGCONT)
            time.sleep(0.02)
        for name in ("host", "other"):
            assert agents[name].wait(timeout=120) == 0, _tail(outs[name], log)
    finally:
        for proc in agents.values():
            _kill_tree(proc)
    _no_abort(*outs.values())

    segs = _segments(_read_log(log))
    # one start alone, one after the join (not counted as a restart); a worker aborted at exit would add one
    assert [(seg[0]["world_size"], seg[0]["restart"]) for seg in segs] == [(1, 0), (2, 0)], [seg[0] for seg in segs]
    alone, joined = segs
    start = joined[0]
    resumed = Path(start["resumed_from"])
    assert resumed.parent == ckpt_dir and resumed.exists(), start
    ckpt = _load(resumed)
    assert ckpt["world_size"] == 1 and ckpt["step"] == start["step"]
    assert ckpt["tracker"]["dp_degree"] == 1 and ckpt["tracker"]["accumulation_steps"] * 2 * 32 > START_BATCH, \
        "no growth before the checkpoint"
    assert joined[-1]["event"] == "done" and joined[-1]["world_size"] == 2, joined[-1]

    reference = _reference(tmp_path)
    ref_steps = {e["step"]: e for e in reference if e["event"] == "step"}
    # alone: the reference's own computation
    one_rank = [e for e in alone if e["event"] == "step"]
    assert one_rank and all(e == ref_steps[e["step"]] for e in one_rank)
    # joined: every remaining step of the budget, on two ranks, with the reference's batch, LR and data
    two_rank = [e for e in joined if e["event"] == "step"]
    assert [e["step"] for e in two_rank] == list(range(start["step"] + 1, max(ref_steps) + 1))
    for new in two_rank:
        old, where = ref_steps[new["step"]], f"step {new['step']}"
        for key in ("tokens_seen", "global_batch", "lr", "position", "starting_batch_steps"):
            assert new[key] == old[key], f"{where}: {key} {new[key]!r} on 2 ranks, {old[key]!r} on 1"
        assert new["world_size"] == 2 and new["accumulation"] * 2 == old["accumulation"], where
        assert new["next_accumulation"] * 2 == old["next_accumulation"], where
        # the same gradients summed in another order (float32); other data moves it by percents
        assert math.isclose(new["noise_scale"], old["noise_scale"], rel_tol=1e-5), where
    assert any(e["next_accumulation"] != e["accumulation"] for e in two_rank), "no decision after the join"
    done = reference[-1]
    assert done["event"] == "done" and joined[-1]["tokens_seen"] == done["tokens_seen"]
    assert joined[-1]["accumulation"] * 2 == done["accumulation"]


RUNS = int(os.environ.get("CBS_ELASTIC_RUNS", "20"))


def test_two_agent_runs_in_a_row_finish_without_a_worker_aborting(tmp_path):
    """``RUNS`` runs of the guide's command on two agents from start to end: each logs one start,
    ends on ``done`` and both agents exit 0 (CBS_ALL_TESTS=1 only: about 12 s a run)."""
    for i in range(RUNS):
        ckpt_dir, log, port = tmp_path / f"ckpt{i}", tmp_path / f"run{i}.jsonl", _free_port()
        outs = [tmp_path / f"run{i}_host.out", tmp_path / f"run{i}_other.out"]
        agents = [_start_agent(0, port, ckpt_dir, log, outs[1]), _start_agent(1, port, ckpt_dir, log, outs[0])]
        try:
            for agent, out in zip(agents, outs[::-1]):
                assert agent.wait(timeout=180) == 0, f"run {i}\n" + _tail(out, log)
        finally:
            for agent in agents:
                _kill_tree(agent)
        _no_abort(*outs)
        segs = _segments(_read_log(log))
        assert [seg[0]["world_size"] for seg in segs] == [2], f"run {i}: {[seg[0] for seg in segs]}"
        assert segs[0][-1]["event"] == "done", f"run {i}"
