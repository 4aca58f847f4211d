"""The efficiency-budget growth rule: its accounting, where it doubles, how smoothly its knob moves that.

Truths that can disagree: McCandlish's tokens-to-target ``E_min (1 + B / B_noise)`` for the waste share,
the closed-form token where the projected waste of a doubling meets the budget on a plateau, a hand sum
of the LR-weighted waste, and the same run resumed from a state saved halfway.
"""

from __future__ import annotations

import math

import pytest

from benchmarks.planted_noise import offline_optimum
from cbs_tracker.policy.controller import BatchSizeController
from cbs_tracker.policy.efficiency import waste_share

MICRO = 256.0  # units per accumulation step


def drive(controller: BatchSizeController, *, total: float, noise_scale, lr=lambda p: 1.0, start_acc: int = 2,
          stop_at: float | None = None, state: dict | None = None):
    """Run ``controller`` over ``total`` units; ``noise_scale(tokens)``. Returns steps, changes, spent per step."""
    acc, tokens, step, changes, spent = start_acc, 0.0, 0, [], []
    if state is not None:
        acc, tokens, step = state["acc"], state["tokens"], state["step"]
    while tokens + MICRO * acc <= total:
        if stop_at is not None and tokens >= stop_at:
            return {"acc": acc, "tokens": tokens, "step": step, "changes": changes}
        batch = MICRO * acc
        tokens += batch
        step += 1
        ns = noise_scale(tokens)
        d = controller.update(step=step, tokens_seen=tokens, global_batch=batch, accumulation_steps=acc,
                              noise_scale=ns, noise_scale_low=0.8 * ns, noise_scale_high=1.25 * ns,
                              scheduled_lr=lr(tokens / total))
        spent.append(controller._efficiency.spent)
        if d.changed:
            changes.append((tokens, d.global_batch))
            acc = d.accumulation_steps
    return {"steps": step, "changes": changes, "spent": spent, "tokens": tokens}


def test_waste_share_is_the_share_of_tokens_lost_in_mccandlishs_tokens_to_target():
    for start, batch, noise in ((512, 1024, 2400), (256, 4096, 1000), (128, 128, 50), (512, 8192, 20000)):
        tokens_start = 1 + start / noise  # E(B) / E_min
        tokens_batch = 1 + batch / noise
        lost = 1 - tokens_start / tokens_batch  # the same data reaches less far at `batch`
        assert waste_share(batch, start, noise) == pytest.approx(lost, rel=1e-12)
    assert waste_share(256, 512, 1000) == 0.0  # below the starting batch nothing counts as lost


@pytest.mark.parametrize("budget", [0.04, 0.06, 0.1])
def test_on_a_plateau_the_doubling_comes_where_the_projected_waste_meets_the_budget(budget):
    total, plateau, b0 = 5e6, 2400.0, 2 * MICRO
    c = BatchSizeController(efficiency_budget=budget, total_tokens=total, convert_lr_decay=False)
    run = drive(c, total=total, noise_scale=lambda t: plateau)
    first_tokens, first_batch = run["changes"][0]
    assert first_batch == 2 * b0
    # nothing is spent at the starting batch, so the test is (T - t) w(2 B0) <= budget T, w at the
    # interval's lower end (0.8 x the plateau here)
    expected = total - budget * total / waste_share(2 * b0, b0, 0.8 * plateau)
    patience = c.patience * b0
    assert expected <= first_tokens <= expected + patience + b0, (first_tokens, expected)


def test_the_spent_waste_is_the_hand_sum_weighted_by_the_scheduled_lr():
    total, plateau = 2e6, 3000.0
    lr = lambda p: 0.1 + 0.45 * (1 + math.cos(math.pi * p))  # noqa: E731
    c = BatchSizeController(efficiency_budget=0.1, total_tokens=total, convert_lr_decay=False)
    run = drive(c, total=total, noise_scale=lambda t: plateau, lr=lr)
    assert run["changes"], "the run never grew; the sum would be trivially 0"
    # hand sum: every step at a batch above the start adds tokens * w * lr / peak (peak 1 at p -> 0)
    hand, tokens, batch, b0, k = 0.0, 0.0, 2 * MICRO, 2 * MICRO, 0
    changes = list(run["changes"])
    peak = 0.0
    while k < run["steps"]:
        tokens += batch
        k += 1
        peak = max(peak, lr(tokens / total))
        hand += batch * waste_share(batch, b0, plateau) * lr(tokens / total) / peak
        if changes and changes[0][0] == tokens:
            batch = changes.pop(0)[1]
    assert c._efficiency.spent == pytest.approx(hand, rel=1e-9)
    assert c._efficiency.spent <= 0.1 * total * (1 + 1e-9)


def test_a_quarter_more_budget_moves_the_saving_by_a_few_points_where_a_quarter_more_kappa_flips_it():
    total, b0 = 5e6, 2 * MICRO
    # kappa = 0.4 times the interval's lower end (0.8 x the plateau) sits just under the growth threshold
    plateau = 0.95 * 2 * b0 * 1.1 / (0.4 * 0.8)

    def saved(**kw):
        c = BatchSizeController(total_tokens=total, convert_lr_decay=False, **kw)
        return 1 - drive(c, total=total, noise_scale=lambda t: plateau)["steps"] / (total / b0)

    eff = [saved(efficiency_budget=b) for b in (0.06, 0.075)]
    kappa = [saved(kappa=k) for k in (0.4, 0.5)]
    assert abs(eff[1] - eff[0]) <= 0.15, eff
    assert eff[0] > 0.05  # it grows at all
    assert abs(kappa[1] - kappa[0]) > 0.15, kappa  # the threshold rule's knife edge, for contrast


def test_a_run_resumed_from_a_state_saved_halfway_decides_as_the_uninterrupted_one():
    total = 3e6
    noise = lambda t: 1500.0 + t / 1000.0  # noqa: E731  a noise scale that rises with the data
    lr = lambda p: 1.0 if p < 0.8 else 1.0 - 0.9 * (p - 0.8) / 0.2  # noqa: E731  WSD
    whole = drive(BatchSizeController(efficiency_budget=0.08, total_tokens=total), total=total, noise_scale=noise,
                  lr=lr)
    first = BatchSizeController(efficiency_budget=0.08, total_tokens=total)
    half = drive(first, total=total, noise_scale=noise, lr=lr, stop_at=total / 2)
    saved = first.state_dict()
    assert saved["efficiency_spent"] > 0  # the halfway point is past a doubling: something to carry
    second = BatchSizeController(efficiency_budget=0.08, total_tokens=total)
    second.load_state_dict(saved)
    rest = drive(second, total=total, noise_scale=noise, lr=lr, state=half)
    assert half["changes"] + rest["changes"] == whole["changes"]
    assert rest["steps"] == whole["steps"]


def test_a_run_length_set_by_the_adapter_resumes_exactly_without_total_tokens_in_the_configuration():
    """The adapter's length is state: the resumed controller, built with the same arguments (no
    total_tokens), decides as the uninterrupted one from its first step, before the adapter gives it again."""
    total = 3e6
    noise = lambda t: 1500.0 + t / 1000.0  # noqa: E731
    whole_ctl = BatchSizeController(efficiency_budget=0.08)
    whole_ctl.set_run_length(total)
    whole = drive(whole_ctl, total=total, noise_scale=noise)
    reference = drive(BatchSizeController(efficiency_budget=0.08, total_tokens=total), total=total, noise_scale=noise)
    assert whole["changes"] == reference["changes"] and whole["changes"]
    first = BatchSizeController(efficiency_budget=0.08)
    first.set_run_length(total)
    half = drive(first, total=total, noise_scale=noise, stop_at=total / 2)
    saved = first.state_dict()
    assert saved["efficiency_run_length"] == total
    second = BatchSizeController(efficiency_budget=0.08)
    second.load_state_dict(saved)
    assert second.total_tokens == total
    rest = drive(second, total=total, noise_scale=noise, state=half)
    assert half["changes"] + rest["changes"] == whole["changes"]
    assert rest["steps"] == whole["steps"]


def test_the_users_total_tokens_wins_over_the_adapters_and_a_later_adapter_value_replaces_the_earlier():
    mine = BatchSizeController(efficiency_budget=0.1, total_tokens=5e6)
    mine.set_run_length(1e6)
    assert mine.total_tokens == 5e6
    loaded = BatchSizeController(efficiency_budget=0.1, total_tokens=5e6)
    loaded.load_state_dict(mine.state_dict())
    assert loaded.total_tokens == 5e6  # a state never replaces the user's either
    theirs = BatchSizeController(efficiency_budget=0.1)
    theirs.set_run_length(1e6)
    assert theirs.total_tokens == 1e6
    theirs.set_run_length(2e6)  # a resumed run made longer
    assert theirs.total_tokens == 2e6
    theirs.total_tokens = 3e6  # assigned by the user: kept
    theirs.set_run_length(4e6)
    assert theirs.total_tokens == 3e6
    plain = BatchSizeController()
    plain.set_run_length(1e6)  # no efficiency budget: recorded, the kappa rule still decides
    assert plain.total_tokens == 1e6 and not plain._efficiency.active


@pytest.mark.parametrize(("units", "error"), [(0, ValueError), (-5.0, ValueError), (math.inf, ValueError),
                                              (math.nan, ValueError), ("1e6", TypeError), (True, TypeError)])
def test_a_bad_run_length_names_the_argument_and_the_value(units, error):
    controller = BatchSizeController(efficiency_budget=0.1)
    with pytest.raises(error, match=r"set_run_length\(units=" + __import__("re").escape(repr(units))):
        controller.set_run_length(units)
    assert controller.total_tokens is None


def test_a_state_saved_before_the_rule_existed_loads_with_nothing_spent():
    old = BatchSizeController()
    drive(old, total=4e5, noise_scale=lambda t: 2000.0)
    state = {k: v for k, v in old.state_dict().items() if not k.startswith("efficiency_")}
    new = BatchSizeController(efficiency_budget=0.1, total_tokens=1e6)
    new.load_state_dict(state)
    assert new._efficiency.spent == 0.0 and new._efficiency.last_tokens is None


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"efficiency_budget": 1.5}, "efficiency_budget=1.5"),
    ({"efficiency_budget": 0}, "efficiency_budget=0"),
    ({"total_tokens": -1.0}, "total_tokens=-1.0"),
    ({"efficiency_budget": "0.1"}, "efficiency_budget='0.1'"),
])
def test_bad_arguments_name_themselves(kwargs, name):
    with pytest.raises((TypeError, ValueError), match=name.replace("(", r"\(")):
        BatchSizeController(**kwargs)


def test_on_a_planted_noise_scale_doublings_land_within_2x_of_the_offline_optimum_and_the_knob_is_smooth():
    """A noise scale planted by construction (rising from 2.5 to 14.5 starting batches under a cosine LR):
    at every fifth of the run the online rule's batch is within 2x of the batch of the offline optimum for the
    same budget, and a 25% larger budget changes the steps saved by at most 15 points."""
    total, b0 = 4e6, 2 * MICRO
    noise = lambda t: b0 * (2.5 + 12 * t / total)  # noqa: E731
    lr = lambda p: 0.1 + 0.45 * (1 + math.cos(math.pi * min(p, 1.0)))  # noqa: E731
    saved = {}
    for budget in (0.06, 0.075):
        c = BatchSizeController(efficiency_budget=budget, total_tokens=total, convert_lr_decay=False)
        acc, tokens, steps, batches = 2, 0.0, 0, []
        while tokens + MICRO * acc <= total:
            batch = MICRO * acc
            tokens += batch
            steps += 1
            n = noise(tokens)
            d = c.update(step=steps, tokens_seen=tokens, global_batch=batch, accumulation_steps=acc, noise_scale=n,
                         noise_scale_low=n, noise_scale_high=n, scheduled_lr=lr(tokens / total))
            batches.append((tokens, batch))
            acc = d.accumulation_steps
        saved[budget] = 1 - steps / (total / b0)
        waste, best_steps, path = offline_optimum(budget, total, b0, noise, lambda t: lr(t / total))
        assert c._efficiency.spent <= budget * total * (1 + 1e-9)
        assert saved[budget] <= 1 - best_steps / (total / b0) + 1e-9  # the optimum saves at least as much
        for fraction in (0.2, 0.4, 0.6, 0.8, 0.95):
            online = next(b for t, b in batches if t >= fraction * total)
            offline = b0 * 2 ** path[int(fraction * len(path))]
            assert offline / 2 <= online <= 2 * offline, (budget, fraction, online, offline)
    assert abs(saved[0.075] - saved[0.06]) <= 0.15, saved
    assert saved[0.06] > 0.3, saved


def test_steps_at_the_starting_level_whose_units_vary_spend_nothing():
    """Tokens per step vary with padding and masked labels: a step at the starting accumulation is compared
    with its own units, not with the mean starting batch, so nothing is spent before a doubling."""
    import random

    rng = random.Random(0)
    total = 2e7
    c = BatchSizeController(efficiency_budget=0.05, total_tokens=total, max_accumulation_steps=2,
                            convert_lr_decay=False)
    tokens = 0.0
    for step in range(1, 2001):
        batch = 8192.0 * (1 + rng.uniform(-0.15, 0.15))
        tokens += batch
        c.update(step=step, tokens_seen=tokens, global_batch=batch, accumulation_steps=2, noise_scale=30000.0,
                 noise_scale_low=25000.0, noise_scale_high=36000.0, scheduled_lr=1.0)
    assert c.accumulation_steps == 2  # max_accumulation_steps keeps it at the start
    assert c._efficiency.spent == 0.0


def test_min_batch_lifts_the_target_as_under_kappa_and_does_not_block_growth():
    total = 5e6
    grown = drive(BatchSizeController(efficiency_budget=0.2, total_tokens=total, min_batch=4096.0,
                                      convert_lr_decay=False), total=total, noise_scale=lambda t: 3000.0)
    assert [b for _, b in grown["changes"]][:2] == [1024.0, 2048.0]


def test_the_budget_refuses_shrinking_and_warns_once_without_a_run_length():
    with pytest.raises(ValueError, match=r"efficiency_budget=0.1, allow_shrink=True"):
        BatchSizeController(efficiency_budget=0.1, allow_shrink=True)
    c = BatchSizeController(efficiency_budget=0.1, convert_lr_decay=False, hold_on_plateau=None)
    with pytest.warns(UserWarning, match=r"efficiency_budget=0.1\) has no run length.*tracker.done") as caught:
        drive(c, total=1e6, noise_scale=lambda t: 6000.0)
    assert sum("no run length" in str(w.message) for w in caught) == 1
    assert c.accumulation_steps > 2  # the kappa rule decided
