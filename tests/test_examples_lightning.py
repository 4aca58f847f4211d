"""examples/lightning_gpt.py, shortened, against its single-process reference.

Each run (one process, and ``--devices 2 --strategy ddp`` with two gloo CPU
processes) logs every step (``--log-every-n-steps 1``) and is compared step by
step with :func:`tests.example_reference.lightning_reference`: the same weights,
data, windows and learning rates without Lightning or the tracker's hooks and
reductions, every microbatch gradient ``g_k`` materialised in float64. The
one-process run grows its batch twice (2 -> 4 -> 8 microbatches); the reference
replays the accumulation from the example's printed changes (epoch and batch where
each took effect) and the comparison checks, at every step, that the replay ran
the accumulation the example logged.

Data. On one process the loader reads the dataset in order; under DDP Lightning
injects ``DistributedSampler(shuffle=True, seed=0)`` (it treats every training
loader as shuffled) with ``set_epoch``, so each rank's shard is a new permutation
every epoch; the reference builds the same sampler.

Tolerances. The reference steps the optimizer with the float32 gradient Lightning
accumulates (the same additions in the same order, DDP's ``x / 2 + y / 2``, the same
clipping and AdamW), so its weights follow the example's (the validation loss agrees
to the printed digits; a reference that sums the step gradient in float64 instead
gave the same numbers here). What differs is how the two squared norms are summed:
float32 per-parameter norms in the tracker, float64 in the reference. The reference
measures that rounding on the run's own vectors (``float32_error``: float32 norms of
each ``g_k`` and of the float32 step gradient against the float64 ones; at most
~2e-5 here, e.g. torch's float32 norm of the 32k-element embedding gradient alone is
off by 1e-6) and the test allows ``delta`` = 4 times its largest value on both norms.
A logged estimate must lie between those of two reference estimators fed the norms
moved by ``delta`` in opposite directions (small up and big down, and the reverse):
the extremes of every per-step ``|G|^2`` and ``tr(Sigma)`` estimate (linear in the
two norms) and, through the estimator's positively weighted averages, of the smoothed
values and their ratio; plus one float32 rounding, as TensorBoard stores float32.
That allows 1e-4 to 1e-3 relative where the estimates cancel (the runs differ from
the reference by 1e-6 to 8e-5), while a wrong ``A`` or ``K`` factor, a skipped or
double-counted microbatch, a clipped or mis-averaged gradient moves them by percents
(checked by hand: the big norm scaled by 1.001 fails from step 1; a short window
measured with ``1/K`` in place of Lightning's ``1/A`` fails at its step). Counters
(accumulation, tokens) are compared exactly and the learning rate to float32 storage.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cbs_tracker import NoiseScaleEstimator
from tests.example_reference import lightning_reference

ROOT = Path(__file__).resolve().parents[1]
F32 = 2.0**-24  # TensorBoard stores float32 scalars: one rounding
ESTIMATES = ("step_grad_sq_norm", "step_trace_cov", "grad_sq_norm", "trace_cov", "noise_scale")
# "[  7.5s] epoch 0 batch 276, after step 138: ... -> accumulate_grad_batches 2 -> 4 (global batch ..."
CHANGE = re.compile(r"\] epoch (\d+) batch (\d+), after step \d+: .*? accumulate_grad_batches (\d+) -> (\d+) \(")
DONE = re.compile(
    r"done in \d+s: (?P<steps>\d+) optimizer steps, (?P<tokens>[\d,]+) tokens, val loss (?P<val>[\d.]+) nats/byte, "
    r"noise scale (?P<ns>[\d,]+) tokens"
)


@dataclass(frozen=True)
class Run:
    out: str
    scalars: dict[str, dict[int, float]]


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _read_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(log_dir), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}


def _run_example(tmp_path: Path, *extra: str) -> Run:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "lightning_gpt.py"), "--quick", "--logdir", "runs",
         "--log-every-n-steps", "1", *extra],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return Run(out, _read_scalars(tmp_path / "runs" / "version_0"))


def _sequences_per_epoch(tokens: float, epochs: int = 2) -> int:
    """The example's --quick data: min(tokens, 1.5e5) tokens of 128-token sequences, split into the epochs."""
    return max(2, int(min(tokens, 1.5e5) // 128) // epochs)


def _estimator_run(steps: list[dict[str, Any]], delta: float) -> list[dict[str, float | None]]:
    """The reference's estimates with ``small * (1 + delta)`` and ``big * (1 - delta)`` at every step."""
    est, out = NoiseScaleEstimator(), []
    for r in steps:
        row: dict[str, float | None] = {"step_grad_sq_norm": None, "step_trace_cov": None}
        if r["k"] >= 2:
            e = est.update(r["small"] * (1 + delta), r["big"] * (1 - delta), r["small_batch"], r["big_batch"],
                           r["units"])
            row.update(step_grad_sq_norm=e.step.grad_sq_norm, step_trace_cov=e.step.trace_cov)
        out.append({**row, "grad_sq_norm": est.grad_sq_norm, "trace_cov": est.trace_cov,
                    "noise_scale": est.noise_scale})
    return out


def _assert_matches_reference(run: Run, *, world: int, sequences_per_epoch: int) -> dict[str, Any]:
    changes = {(int(e), int(b)): int(new) for e, b, _, new in CHANGE.findall(run.out)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the example: the same kernels, the same float32 results
    try:
        ref = lightning_reference(sequences_per_epoch=sequences_per_epoch, epochs=2, world=world, changes=changes)
    finally:
        torch.set_num_threads(threads)
    steps, sc = ref["steps"], run.scalars
    assert sorted(sc["cbs/accumulation_steps"]) == [r["step"] for r in steps], "not every step logged, or other steps"

    measured = [r for r in steps if r["k"] >= 2]
    delta = 4 * max(r["float32_error"] for r in measured)
    assert delta < 1e-3, delta  # float32 rounding, not a different computation in the reference
    up, down = _estimator_run(steps, delta), _estimator_run(steps, -delta)
    failures = []
    for r, hi, lo in zip(steps, up, down, strict=True):
        s = r["step"]
        exact = {
            "cbs/accumulation_steps": r["accumulation"], "cbs/global_batch_tokens": r["units"],
            "cbs/tokens_seen": r["tokens_seen"], "cbs/dp_degree": world,
            "cbs/micro_batch_tokens": r["units"] / r["k"],
        }
        for tag, want in exact.items():
            if sc[tag][s] != float(np.float32(want)):
                failures.append(f"step {s} {tag}: logged {sc[tag][s]}, reference {want}")
        if abs(sc["cbs/lr"][s] - r["lr"]) > F32 * r["lr"]:
            failures.append(f"step {s} cbs/lr: logged {sc['cbs/lr'][s]}, reference {r['lr']}")
        for key in ESTIMATES:
            got = sc.get(f"cbs/{key}", {}).get(s)
            want = r.get(key)
            if want is None or got is None:
                if (want is None) != (got is None):
                    failures.append(f"step {s} cbs/{key}: logged {got}, reference {want}")
                continue
            bounds = [want] + [v[key] for v in (hi, lo) if v[key] is not None]
            low, high = min(bounds) - F32 * abs(got), max(bounds) + F32 * abs(got)
            if not low <= got <= high:
                failures.append(
                    f"step {s} (K={r['k']}) cbs/{key}: logged {got:.7g}, reference {want:.7g}, "
                    f"float32 rounding allows [{low:.7g}, {high:.7g}] (relative {abs(got / want - 1):.2e})"
                )
    assert not failures, f"{len(failures)} mismatches (delta={delta:.2e}):\n" + "\n".join(failures[:20])

    done = DONE.search(run.out)
    assert done, run.out[-3000:]
    assert int(done["steps"]) == len(steps) and done["tokens"] == f"{steps[-1]['tokens_seen']:,.0f}"
    # the summary's noise scale is the last step's (compared above), rounded to a token
    ns = sc["cbs/noise_scale"][len(steps)]
    assert abs(int(done["ns"].replace(",", "")) - ns) <= 0.5 + F32 * ns, (done["ns"], ns)
    # the same weights: the validation loss agrees to the printed digits
    assert abs(float(done["val"]) - ref["val"]) <= 5e-4 + 1e-6, (done["val"], ref["val"])
    return ref


def test_lightning_gpt_quick_grows_the_batch_and_matches_the_reference(tmp_path):
    run = _run_example(tmp_path)
    out, scalars = run.out, run.scalars
    # the change is announced by the callback and seen by the next batch
    assert re.search(r"CBSCallback step \d+: accumulate_grad_batches 2 -> 4", out), out
    assert re.search(r"accumulate_grad_batches 2 -> 4 \(global batch 512 -> 1,024 tokens\)", out), out
    assert re.search(r"done in \d+s: \d+ optimizer steps, [\d,]+ tokens, val loss [\d.]+ nats/byte", out), out

    accum, batch = scalars["cbs/accumulation_steps"], scalars["cbs/global_batch_tokens"]
    # every label is a real byte: the counted tokens are 128 per sequence, 2 sequences per
    # microbatch, times the microbatches of the window (a short last window has fewer)
    assert all(batch[s] == 256 * accum[s] or batch[s] == 128 * (2 * accum[s] - 1) for s in batch)
    assert max(accum.values()) >= 4 and min(accum.values()) <= 2
    assert all(v > 0 for v in scalars["cbs/noise_scale"].values())
    assert "cbs_tokens/global_batch_tokens" in scalars

    # growth from 2 to 4 to 8 microbatches, replayed by the reference: every step's norms,
    # estimates, counters and learning rate (x sqrt(2) per doubling)
    ref = _assert_matches_reference(run, world=1, sequences_per_epoch=_sequences_per_epoch(1.2e6))
    assert {r["accumulation"] for r in ref["steps"]} >= {2, 4, 8}
    assert any(r["accumulation"] < r["window_accumulation"] for r in ref["steps"])  # short windows ran


def test_lightning_gpt_under_ddp_with_two_cpu_processes_matches_the_reference(tmp_path):
    # strategy="ddp" relaunches the script itself for rank 1, so it runs as a subprocess here
    run = _run_example(tmp_path, "--tokens", "4e4", "--devices", "2", "--strategy", "ddp")
    out, scalars = run.out, run.scalars
    assert "distributed_backend=gloo" in out and re.search(r"done in \d+s", out), out
    assert set(scalars["cbs/dp_degree"].values()) == {2.0}
    accum, batch = scalars["cbs/accumulation_steps"], scalars["cbs/global_batch_tokens"]
    # both ranks' tokens: 2 ranks x 256 tokens x the microbatches of the window (each rank
    # holds 78 sequences, 39 full 2-sequence batches; an epoch's last window has K = 1 < A)
    assert all(batch[s] == 2 * 256 * accum[s] for s in batch)
    assert all(v > 0 for v in scalars["cbs/noise_scale"].values())

    # each rank's shard of the epoch's permutation; a window holds both ranks' microbatches
    ref = _assert_matches_reference(run, world=2, sequences_per_epoch=_sequences_per_epoch(4e4))
    # the short window (K = 1 < A per rank) at each epoch's end, measured with both ranks' microbatches
    assert any(r["accumulation"] < r["window_accumulation"] and r["k"] == 2 for r in ref["steps"])
