"""Branches with an LR cooldown: the LR each step of a branch runs at, and whether cooled branches
predict the batch that is best for the rest of a run where uncooled ones over-predict it (the noisy
quadratic model, where that batch is computed exactly)."""

from __future__ import annotations

import math

import pytest
import torch

from cbs_tracker.calibrate import measure_critical_batch
from cbs_tracker.theory.nqm import NQMConfig
from cbs_tracker.theory.nqm_branches import branch_study


def _decay_branch(**cooldown):
    """A 1-D quadratic without noise, loss theta^2 / 2: each SGD step multiplies theta by (1 - lr), so a
    branch's end is the product of its steps' (1 - lr) and reads back every step's LR."""
    model = torch.nn.Linear(1, 1, bias=False, dtype=torch.float64)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    point = measure_critical_batch(
        model, opt, batch=1, tokens=0, loss_fn=lambda m, x: 0.5 * (m.weight ** 2).sum(),
        data=lambda r: iter(lambda: torch.zeros(1, 1, dtype=torch.float64), None), evaluate=lambda m: float(m.weight.detach()),
        microbatch_size=1, branch_tokens=8, multiples=(1, 2), replicates=1, frozen_microbatches=0, control=False,
        **cooldown)
    return point


def _product(lrs):
    out = 1.0
    for lr in lrs:
        out *= 1.0 - lr
    return out


@pytest.mark.parametrize("shape", ["sqrt", "linear"])
def test_each_branch_anneals_its_lr_over_its_last_fraction_measured_at_each_steps_middle(shape):
    point = _decay_branch(cooldown=0.5, cooldown_shape=shape, cooldown_to=0.1)
    one, two = point.branches
    fall = math.sqrt if shape == "sqrt" else (lambda s: s)
    # batch 1: 8 steps at 0.05; steps 4..7 (middles at 4.5/8 .. 7.5/8) are s = 1/8, 3/8, 5/8, 7/8 into the cooldown
    lrs_one = [0.05] * 4 + [0.05 * (1 - 0.9 * fall(s)) for s in (1 / 8, 3 / 8, 5 / 8, 7 / 8)]
    assert one.losses[0] == pytest.approx(_product(lrs_one), rel=1e-12)
    # batch 2 (LR x 2 for SGD): 4 steps over the same 8 samples; steps 2, 3 are s = 1/4, 3/4 into it
    lrs_two = [0.1, 0.1] + [0.1 * (1 - 0.9 * fall(s)) for s in (1 / 4, 3 / 4)]
    assert two.losses[0] == pytest.approx(_product(lrs_two), rel=1e-12)
    uncooled = _decay_branch().branches[0]
    assert uncooled.losses[0] == pytest.approx(0.95 ** 8, rel=1e-12) and one.losses[0] > uncooled.losses[0]


@pytest.mark.parametrize("kwargs, match", [
    (dict(cooldown=1.5), r"cooldown=1\.5\): must be a fraction of the branch in \[0, 1\]"),
    (dict(cooldown=True), r"cooldown=True\)"),
    (dict(cooldown=0.5, cooldown_shape="cosine"), r"cooldown_shape='cosine'\): must be one of \('sqrt', 'linear'\)"),
    (dict(cooldown=0.5, cooldown_to=-0.1), r"cooldown_to=-0\.1\): must be a fraction of the LR in \[0, 1\]"),
])
def test_a_bad_cooldown_is_refused_naming_it(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _decay_branch(**kwargs)


@pytest.mark.parametrize("noise_floor", [0.25, 0.1])
def test_cooled_branches_land_near_the_best_batch_for_the_rest_of_the_run_where_uncooled_ones_over_predict(
        noise_floor):
    # the rest of a cosine run at k x 8 samples (sqrt coupling, the final decay included) computed
    # exactly at four branch points; branches of 20% of the remaining budget, cooled over their last half
    points = branch_study(NQMConfig(lr=0.25, dims=300, noise_floor=noise_floor), fractions=(0.1, 0.2, 0.3, 0.45),
                          branch_share=0.2, cooldown=0.5)
    largest = 32 * 8
    for p in points:
        miss_cooled = abs(math.log2(p.cooled_pick / p.best_batch))
        miss_uncooled = abs(math.log2(p.uncooled_pick / p.best_batch))
        assert miss_cooled <= miss_uncooled, p  # never further from the truth than the uncooled branches
        assert p.uncooled_pick == largest  # uncooled: the largest batch, whatever the end says
    within = [p for p in points if p.best_batch / 2 <= p.cooled_pick <= 2 * p.best_batch]
    assert len(within) >= 3, [(p.best_batch, p.cooled_pick) for p in points]
    early = points[0]  # early in the run the best batch is interior, and the uncooled branches miss it
    assert early.best_batch <= largest / 8 and early.uncooled_pick > 2 * early.best_batch, early
    assert abs(math.log2(early.cooled_pick / early.best_batch)) < abs(math.log2(early.uncooled_pick / early.best_batch))


def test_cli_calibrate_cooldown_branches_from_the_same_state_and_records_it(tmp_path, capsys):
    import json

    from cbs_tracker.cli import main

    args = ["calibrate", "--quick", "--marks", "4096", "--multiples", "1,2", "--no-plot"]
    assert main([*args, "--out", str(tmp_path / "plain")]) == 0
    assert main([*args, "--out", str(tmp_path / "cooled"), "--cooldown", "0.5"]) == 0
    (plain,) = json.loads((tmp_path / "plain" / "calibration.json").read_text())
    (cooled,) = json.loads((tmp_path / "cooled" / "calibration.json").read_text())
    assert (plain["cooldown"], cooled["cooldown"]) == (0.0, 0.5)
    assert cooled["start_loss"] == plain["start_loss"] and cooled["tokens"] == plain["tokens"]  # the same state
    assert all(c["losses"] != p["losses"] for c, p in zip(cooled["branches"], plain["branches"]))
    with pytest.raises(SystemExit):
        main([*args, "--out", str(tmp_path / "bad"), "--cooldown", "1.5"])
    assert "--cooldown=1.5" in capsys.readouterr().err
