"""``kappa_rise``: a constant ``kappa`` that rises linearly in units over the run's length (an option; the
frontier's ``kappa0.4-0.8+convert``).

The truth is the rule as documented, computed here by hand: ``kappa(t) = kappa * (1 + (rise - 1) * min(1, t / T))``.
A noise scale held flat makes the first doubling fall where ``kappa(t) * B_simple`` first clears twice the batch
by the margin, so its position moves with the rise and is predicted from the formula, not from the code.
"""

from __future__ import annotations

import warnings

import pytest

from cbs_tracker.policy.controller import BatchSizeController
from cbs_tracker.policy.kappa import KappaSchedule

MICRO = 512.0


def feed(ctrl, noise, steps, *, start=1, tokens=0.0, acc=1):
    """One update per step at ``MICRO * acc`` units, the decision applied at the next step; returns the
    kappa in force after each update and the changes ``(step, tokens, accumulation)``."""
    kappas, grown = [], []
    for step in range(start, start + steps):
        tokens += MICRO * acc
        d = ctrl.update(step=step, tokens_seen=tokens, global_batch=MICRO * acc, accumulation_steps=acc,
                        noise_scale=noise, noise_scale_low=noise, noise_scale_high=noise)
        kappas.append((tokens, ctrl.kappa))
        if d.changed:
            grown.append((step, tokens, d.accumulation_steps))
        acc = d.accumulation_steps
    return kappas, grown


def test_kappa_rises_linearly_in_units_from_its_start_to_rise_times_it_at_the_runs_end_and_stays():
    total = 400 * MICRO
    ctrl = BatchSizeController(kappa=0.4, kappa_rise=2.0, total_tokens=total, feedback_guard=False)
    kappas, _ = feed(ctrl, 1.0, 600)  # a noise scale far too low to grow: the batch stays at 512
    for tokens, kappa in kappas:
        assert kappa == pytest.approx(0.4 * (1 + min(1.0, tokens / total)), rel=1e-12), tokens
    assert kappas[-1][1] == pytest.approx(0.8)


def test_the_first_doubling_falls_where_the_rising_kappa_clears_twice_the_batch():
    # B_simple flat at 4 x 512: a fixed 0.4 needs 0.4 x 2048 = 819 >= 2 x 512 x 1.1 = 1126: never. Rising to 0.8
    # over T = 2000 steps of 512, kappa clears 1126 / 2048 = 0.55 at t / T = 0.375 (step 750); the doubling
    # follows 16 measurements later (patience), at step 750 + 15.
    total, noise = 2000 * MICRO, 4 * MICRO
    threshold_step = next(s for s in range(1, 3000) if 0.4 * (1 + s * MICRO / total) * noise >= 2 * MICRO * 1.1)
    _, grown = feed(BatchSizeController(kappa_rise=2.0, total_tokens=total), noise, 1200)
    assert grown and grown[0][0] == threshold_step + 15 and grown[0][2] == 2
    _, fixed = feed(BatchSizeController(total_tokens=total), noise, 1200)  # the default: kappa fixed
    assert fixed == []


def test_the_run_length_from_an_adapter_sets_the_rise_and_is_resumed_with_the_state():
    total, noise = 2000 * MICRO, 4 * MICRO
    ctrl = BatchSizeController(kappa_rise=2.0)
    ctrl.set_run_length(total)
    first, _ = feed(ctrl, noise, 300)
    state = ctrl.state_dict()
    resumed = BatchSizeController(kappa_rise=2.0)  # built as a resumed script builds it: no length until the state gives it
    resumed.load_state_dict(state)
    assert resumed.kappa == pytest.approx(ctrl.kappa) and resumed.kappa == pytest.approx(0.4 * (1 + 300 / 2000))
    rest_a = feed(ctrl, noise, 900, start=301, tokens=300 * MICRO)
    rest_b = feed(resumed, noise, 900, start=301, tokens=300 * MICRO)
    assert rest_a == rest_b and rest_a[1], "the resumed run decides as the uninterrupted one, and grows"


def test_without_the_runs_length_kappa_stays_and_one_warning_says_how_to_give_it():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        kappas, _ = feed(BatchSizeController(kappa_rise=2.0), 1.0, 400)
    assert {k for _, k in kappas} == {0.4}
    said = [str(w.message) for w in seen if "kappa_rise" in str(w.message)]
    assert len(said) == 1 and "total_tokens=" in said[0] and "tracker.done(" in said[0] and "kappa_rise=1" in said[0]
    for said_too in (BatchSizeController(kappa_rise=2.0, observe_only=True),  # its target follows kappa too
                     BatchSizeController(kappa_rise=2.0, efficiency_budget=0.08)):  # the kappa rule decides then
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            feed(said_too, 1.0, 400)
        assert len([w for w in seen if "kappa_rise" in str(w.message)]) == 1
    for quiet in (BatchSizeController(), BatchSizeController(kappa_rise=2.0, total_tokens=1e9)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            feed(quiet, 1.0, 400)
        assert not [w for w in seen if "kappa_rise" in str(w.message)]


def test_a_measured_kappa_schedule_is_used_as_given():
    ctrl = BatchSizeController(kappa=KappaSchedule([(0, 0.3), (1e6, 0.6)]), total_tokens=1e5)
    kappas, _ = feed(ctrl, 1.0, 100)
    for tokens, kappa in kappas:
        assert kappa == pytest.approx(0.3 + 0.3 * tokens / 1e6)


@pytest.mark.parametrize("bad, exc", [(0, ValueError), (-1.0, ValueError), (0.5, ValueError), (float("nan"), ValueError),
                                      (float("inf"), ValueError), ("2", TypeError), (True, TypeError)])
def test_a_bad_kappa_rise_is_refused_naming_it(bad, exc):
    with pytest.raises(exc, match=r"BatchSizeController\(kappa_rise="):
        BatchSizeController(kappa_rise=bad)


def test_kappa_rise_2_decides_as_the_frontiers_rising_rule_on_a_planted_noise_scale():
    """The frontier's ``kappa0.4-0.8+convert`` (a two-point ``KappaSchedule`` over the setting's budget) and
    ``BatchSizeController(kappa_rise=2)`` given the run's length decide the same at every step under cosine and
    WSD, so the option's frontier numbers are the option's."""
    from benchmarks.planted_noise import NOISE, SCHEDULES, TOTAL
    from benchmarks.planted_noise import run as planted_run
    from tests.scripts import load_script

    frontier = load_script("benchmarks/frontier.py", "frontier_for_kappa_rise")

    setting = frontier.base.replace(frontier.base.SETTINGS["full"], budget_tokens=int(TOTAL))
    rule = frontier.proof_lr.Run(frontier.RULES["kappa0.4-0.8+convert"], 0, "cosine")
    config = frontier.base.controller_config
    made, library = frontier.proof_lr.make_controller(rule, setting), BatchSizeController(kappa_rise=2.0, convert_until=1.0, total_tokens=TOTAL, hold_on_plateau=None)
    assert made.kappa_schedule is not None and library.kappa_schedule is None  # two ways of saying it
    assert {k: v for k, v in config(made).items() if k not in ("kappa", "kappa_rise", "total_tokens")} == \
        {k: v for k, v in config(library).items() if k not in ("kappa", "kappa_rise", "total_tokens")}
    for schedule in SCHEDULES:
        made = frontier.proof_lr.make_controller(rule, setting)
        library = BatchSizeController(kappa_rise=2.0, convert_until=1.0, total_tokens=TOTAL, hold_on_plateau=None)
        ours = planted_run(made, NOISE["linear"], SCHEDULES[schedule])
        theirs = planted_run(library, NOISE["linear"], SCHEDULES[schedule])
        assert ours == theirs and len({b for _, b in ours[1]}) >= 4, schedule  # it grows, the same way


def test_a_constant_set_during_the_run_is_the_new_start_of_the_rise_made_so_far():
    total = 1000 * MICRO
    ctrl = BatchSizeController(kappa=0.4, kappa_rise=2.0, total_tokens=total)
    feed(ctrl, 1.0, 500)
    assert ctrl.kappa == pytest.approx(0.4 * 1.5) and ctrl.kappa_start == 0.4
    ctrl.kappa = 0.6
    assert ctrl.kappa_start == 0.6 and ctrl.kappa == pytest.approx(0.6 * 1.5)
    kappas, _ = feed(ctrl, 1.0, 100, start=501, tokens=500 * MICRO)
    assert kappas[-1][1] == pytest.approx(0.6 * (1 + 600 / 1000))


def test_kappa_is_its_start_before_the_first_update_and_a_length_given_mid_run_moves_it_at_once():
    ctrl = BatchSizeController(kappa=0.4, kappa_rise=2.0, total_tokens=1e6)
    ctrl.set_kappa(0.5)  # before any update: no units seen yet
    assert ctrl.kappa == 0.5
    fresh = BatchSizeController(kappa_rise=2.0, total_tokens=1e6)
    fresh.load_state_dict(BatchSizeController().state_dict())  # a state saved before any update
    assert fresh.kappa == 0.4
    late = BatchSizeController(kappa=0.4, kappa_rise=2.0)
    with pytest.warns(UserWarning, match="has no run length"):
        feed(late, 1.0, 500)
    assert late.kappa == 0.4
    late.set_run_length(1000 * MICRO)
    assert late.kappa == pytest.approx(0.4 * 1.5)


def test_kappa_rise_with_a_measured_schedule_is_said_to_be_ignored():
    with pytest.warns(UserWarning, match=r"kappa_rise=2.0\) is ignored: kappa is a measured KappaSchedule"):
        BatchSizeController(kappa=KappaSchedule([(0, 0.3), (1e6, 0.6)]), kappa_rise=2.0)


def test_the_benchmarks_record_kappa_as_given_not_as_risen():
    """A stored run is reused only while its controller's settings match a fresh one's: a rising kappa read at
    the run's end must not make every stored run look changed."""
    from benchmarks.proof.gpt_proof import controller_config

    total = 1000 * MICRO
    used = BatchSizeController(kappa_rise=2.0, total_tokens=total)
    feed(used, 1.0, 1000)
    assert used.kappa == pytest.approx(0.8)
    assert controller_config(used) == controller_config(BatchSizeController(kappa_rise=2.0, total_tokens=total))
    assert controller_config(used)["kappa"] == 0.4 and controller_config(used)["kappa_rise"] == 2.0
