"""Ranks whose synced gradients disagree are stopped before the optimizer steps.

Truth: a nanoGPT-style loop on two gloo ranks that sets DDP's ``require_backward_grad_sync``
from its own accumulation count (2) while the tracker's schedule doubles the accumulation to
4 at step 3: the last microbatch of the grown window then skips the all-reduce, and the ranks'
``.grad`` differ. The same loop without the toggle runs all six steps; the check rides in the
tracker's one all-reduce (``tests/test_distributed.py`` counts the collectives).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from cbs_tracker.core.measure import _step_stats
from tests import desync_workers as w
from tests.spawning import spawn

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)


def _run(tmp_path, toggle: bool) -> list[dict]:
    spawn(w.toggle_worker, args=(2, str(tmp_path / f"pg{int(toggle)}"), str(tmp_path), toggle),
             nprocs=2, join=True)
    return [torch.load(tmp_path / f"toggle{int(toggle)}.rank{r}.pt", weights_only=False) for r in range(2)]


def test_a_loop_whose_last_microbatch_did_not_sync_stops_before_the_optimizer_steps(tmp_path):
    r0, r1 = _run(tmp_path, toggle=True)
    for r in (r0, r1):  # on both ranks, at the first grown window (steps 0-2 ran at the loop's own count)
        assert r["steps"] == 3 and r["accumulation"] == [2, 2, 2]
        assert r["error"] is not None and "differs across the 2 data-parallel ranks" in r["error"]
        assert "require_backward_grad_sync" in r["error"]
    torch.testing.assert_close(r0["params"], r1["params"], rtol=0, atol=0)  # the optimizer did not step
    ok0, ok1 = _run(tmp_path, toggle=False)
    assert ok0["error"] is None and ok0["steps"] == 6 and ok0["accumulation"] == [2, 2, 2, 4, 4, 4]
    torch.testing.assert_close(ok0["params"], ok1["params"], rtol=0, atol=0)


def _values(fingerprints: list[float], small: list[float] | None = None) -> list[float]:
    """The reduced vector of a measured window whose ranks report these ``|.grad|^2`` (and microbatch sums)."""
    ranks = len(fingerprints)
    small = small or [1.0 + 0.1 * r for r in range(ranks)]
    return [sum(small), 2.0 * ranks, 1.0, 8.0, sum(fingerprints), 0.0, 0.0, 0.0, 0.0, 2.0 * ranks, 1.0, 1.0,
            float(ranks), float(ranks), sum(x * x for x in small), 1.0, 1.0, sum(f * f for f in fingerprints)]


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_the_spread_of_the_ranks_fingerprints(ranks):
    # replicas: zero spread (to the float64 rounding of the sums) and the big norm is their mean
    stats, faults = _step_stats(_values([0.7] * ranks), avg_ranks=ranks, group=False, ranks=ranks)
    assert faults.replica_spread < 1e-7 and stats.synced_sq_norm == pytest.approx(0.7, rel=1e-15)
    # one rank off by 1%: sqrt(sum over pairs (f_i - f_j)^2) / sum f
    f = [0.7] * (ranks - 1) + [0.707]
    _, faults = _step_stats(_values(f), avg_ranks=ranks, group=False, ranks=ranks)
    want = math.sqrt(sum((a - b) ** 2 for i, a in enumerate(f) for b in f[i + 1:])) / sum(f)
    assert faults.replica_spread == pytest.approx(want, rel=1e-6) and want > 1e-3
    # shards are not replicas: their partial norms add up and are not compared
    stats, faults = _step_stats(_values(f), avg_ranks=ranks, group=False, ranks=ranks, replicas=False)
    assert faults.replica_spread == 0.0 and stats.synced_sq_norm == pytest.approx(sum(f), rel=1e-15)
    assert not faults.shared_data
    # ranks whose own microbatch sums agree ran the same data; a spread of 1e-6 is different data
    _, faults = _step_stats(_values([0.7] * ranks, [1.3] * ranks), avg_ranks=ranks, group=False, ranks=ranks)
    assert faults.shared_data
    near = [1.3] * (ranks - 1) + [1.3 * (1 + 1e-6)]
    _, faults = _step_stats(_values([0.7] * ranks, near), avg_ranks=ranks, group=False, ranks=ranks)
    assert not faults.shared_data


def test_ranks_given_as_data_parallel_that_share_their_data_are_refused(tmp_path):
    spawn(w.toggle_worker, args=(2, str(tmp_path / "pg"), str(tmp_path), False, True), nprocs=2, join=True)
    for r in range(2):
        out = torch.load(tmp_path / f"toggle0.rank{r}.pt", weights_only=False)
        assert out["steps"] == 0 and "ran the same data" in out["error"] and "mesh_dim='dp'" in out["error"]
