"""The gradient-persistence diagnostic against weights that do not move: there the product of consecutive steps'
gradients and the product of one step's two microbatch gradients estimate the same ``|G|^2``, so their ratio is 1."""

from dataclasses import replace

from benchmarks.proof import gpt_proof as base
from benchmarks.proof.persistence import measure


def test_frozen_weights_persist_and_a_moving_run_is_measured():
    # the quick setting from two 64-token microbatches a step; an LR so small the weights stay put
    setting = replace(base.QUICK, constant_tokens=2 * base.QUICK.tracker_micro_sequences * base.QUICK.seq_len)
    frozen = measure(replace(setting, lr=1e-12, warmup_tokens=0), 0, "cosine", marks=1, until=0.5, log=lambda _: None)
    (point,) = frozen["points"]
    assert point["within"] > 0 and abs(point["persistence"] - 1) < 0.1, point
    moving = measure(setting, 0, "cosine", marks=2, until=0.5, log=lambda _: None)
    assert len(moving["points"]) == 2 and all(p["within"] > 0 for p in moving["points"])
