"""LR decay against its conversion into batch growth on the exact NQM (SGD).

Truth: the per-coordinate recursion ``v <- (1 - eta h)^2 v + eta^2 sigma^2 / B`` run
step by step here, the constant-step closed form of :class:`ExactNQM`, and the step
counts of each schedule worked out by hand.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from cbs_tracker.theory.nqm import ExactNQM
from cbs_tracker.theory.nqm_lr import (
    compare_conversion,
    converted_schedule,
    exact_final_loss,
    fixed_batch_schedule,
    lr_schedule,
)

BUDGET = 3e5


def test_exact_loss_matches_the_constant_closed_form_and_a_step_by_step_recursion():
    model = ExactNQM()
    lrs, batches = np.full(500, model.lr), np.full(500, 8.0)
    assert exact_final_loss(model, lrs, batches) == pytest.approx(model.constant_loss(8.0, 500), rel=1e-12)
    rng = np.random.default_rng(0)
    lrs = np.repeat(rng.uniform(0.05, 0.5, 40), rng.integers(1, 6, 40))
    batches = np.repeat(rng.choice([8.0, 16.0, 64.0], 20), 2)[: len(lrs)]
    batches = np.resize(batches, len(lrs))
    h, v = model.curvatures, model.initial_second_moment.copy()
    for eta, b in zip(lrs, batches):
        v = (1 - eta * h) ** 2 * v + eta**2 * model.noise_variance / b
    assert exact_final_loss(model, lrs, batches) == pytest.approx(0.5 * float(h @ v), rel=1e-10)


def test_conversion_doubles_at_each_halving_up_to_the_cap_at_equal_samples():
    # step decay x0.1 at 50% and 75%: 3.3 halvings at once, so the cap (x8) binds from 50% on
    mult = lr_schedule("step")
    lrs, batches = converted_schedule(mult, 1000.0, 8.0, 0.5, 3)
    assert batches.sum() == pytest.approx(1000.0)
    # 63 steps of 8 start below 500 samples (the last at 496); from 504: 64 at 0.5 * 0.1 * 8,
    # four steps before 750 (504, 568, 632, 696), then 0.5 * 0.01 * 8; 7 full steps and 48 left
    assert len(batches) == 63 + 8 and set(batches[:63]) == {8.0} and set(batches[63:-1]) == {64.0}
    assert batches[-1] == 48.0
    assert list(lrs[:63]) == pytest.approx([0.5] * 63) and list(lrs[63:67]) == pytest.approx([0.4] * 4)
    assert list(lrs[67:-1]) == pytest.approx([0.04] * 3) and lrs[-1] == pytest.approx(0.04 * 48 / 64)
    # the step size per sample is the schedule's, also on the short last step
    fixed_lrs, fixed_batches = fixed_batch_schedule(mult, 1000.0, 8.0, 0.5)
    assert lrs[-1] / batches[-1] == pytest.approx(fixed_lrs[-1] / fixed_batches[-1])


@pytest.mark.parametrize(
    "schedule,steps",
    [
        # half the samples at 8, then 64: 150000/8 + 150000/64 = 18750 + 2343.75
        ("step", 18750 + math.ceil(2343.75)),
        ("cosine", None),
    ],
)
def test_converted_schedules_match_the_original_within_5_percent_with_fewer_steps(schedule, steps):
    # Doubling B at a held step size equals halving the step size to first order in
    # eta * h; the second-order term is largest at the top curvature h = 1, where the
    # stationary floors per sample, eta / (B h (2 - eta h)), differ by
    # (2 - eta_end) / (2 - 8 eta_end) at the end of the run. Both schedules end far below
    # the peak (step: eta_end = 0.005, bound 1.018; cosine: eta_end -> 0, bound 1), so the
    # conversion's loss must lie within the 5% target and below that bound plus 0.5%.
    res = compare_conversion(schedule, budget=BUDGET)
    eta_end = 0.5 * lr_schedule(schedule)(1.0)
    bound = (2 - eta_end) / (2 - 8 * eta_end)
    assert 1.0 - 0.005 < res.loss_ratio <= min(1.05, bound + 0.005)
    assert res.fixed_steps == BUDGET / 8 and res.converted_steps < 0.65 * res.fixed_steps
    if steps is not None:
        assert res.converted_steps == steps
    assert res.largest_batch == 64.0


def test_a_cosine_that_ends_at_10_percent_of_its_peak_loses_more_than_the_schedules_that_end_low():
    # the LR ends at 0.05 (converted: 0.4): the bound above is (2 - 0.05) / (2 - 0.4) = 1.22.
    # The schedules that end low stay within 0.5% of the original (above); this one does not.
    # At this budget it ends 4% above the original; at the reference budget 3e6 (1.061x,
    # outside the 5% target) it is not rerun here (minutes; see the module's command).
    res = compare_conversion("cosine_to_10pct", budget=BUDGET)
    assert 1.0 + 0.005 < res.loss_ratio <= (2 - 0.05) / (2 - 0.4)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"batch": 0.0}, r"compare_conversion\(batch=0.0\): expected a finite number > 0"),
        ({"budget": 4.0}, r"compare_conversion\(budget=4.0\): expected a finite number >= batch=8.0"),
        ({"max_doublings": -1}, r"compare_conversion\(max_doublings=-1\): expected an int >= 0"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compare_conversion("step", **kwargs)


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match=r"lr_schedule\(name='linear'\): expected one of"):
        lr_schedule("linear")
