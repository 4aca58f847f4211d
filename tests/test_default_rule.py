"""The default growth rule (``BatchSizeController()``: kappa 0.4 with the LR-decay conversion, held for a quarter of
the run by its hold on a loss plateau, whose verdict on the planted loss lets it grow) on a noise scale planted by
construction, against the best power-of-two schedule for the same waste.

The truth that can disagree is the offline optimum of ``benchmarks/planted_noise.py`` (its table): dynamic programming
over the whole run, knowing the noise scale at every token in advance, for the power-of-two schedule with
the fewest steps whose waste (tokens x McCandlish's share lost to the batch x LR / peak LR) fits a budget.
The affordable batch, by construction: that schedule for a waste of 5% and of 8% of the run's tokens (the
efficiency budget kept the loss on five of the frontier's six settings and schedules at 8%). A default
that grows too early or too far (``kappa`` x 2.5) leaves it by more than 2x under WSD. Given the waste the
default itself spent, the optimum also shows whether it spends that waste where it buys the most steps.
A threshold rule on a smooth noise scale must not flip with a 25% change of ``kappa`` (on a plateau just
under the threshold it does: the knife edge of ``test_efficiency.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.planted_noise import B0, NOISE, SCHEDULES, TOTAL, offline_optimum, run
from cbs_tracker.policy.controller import BatchSizeController

ROOT = Path(__file__).resolve().parents[1]


def batch_at(batches: list[tuple[float, float]], fraction: float) -> float:
    return next(b for t, b in batches if t >= fraction * TOTAL)


@pytest.mark.parametrize("budget", [0.05, 0.08])
@pytest.mark.parametrize("noise", NOISE)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_defaults_doublings_land_within_2x_of_the_affordable_batch(schedule, noise, budget):
    lr = SCHEDULES[schedule]
    _, _, path = offline_optimum(budget, TOTAL, B0, NOISE[noise], lambda t: lr(t / TOTAL))
    _, batches, _ = run(BatchSizeController(total_tokens=TOTAL), NOISE[noise], lr)
    assert max(path) >= 2, "the affordable schedule must grow here for the comparison to mean anything"
    for fraction in (0.2, 0.4, 0.6, 0.8, 0.95):
        online, affordable = batch_at(batches, fraction), B0 * 2 ** path[int(fraction * len(path))]
        assert affordable / 2 <= online <= 2 * affordable, (fraction, online / B0, affordable / B0)


@pytest.mark.parametrize("noise", NOISE)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_default_spends_its_waste_within_10_points_of_the_best_schedule_for_it(schedule, noise):
    lr = SCHEDULES[schedule]
    default = BatchSizeController(total_tokens=TOTAL)
    assert (default.kappa, default.convert_lr_decay, default.plateau.below) == (0.4, True, 0.15)  # the rule judged
    steps, batches, waste = run(default, NOISE[noise], lr)
    # the hold's verdict, a quarter in, reads the planted loss's 0.5 nats per e-fold and lets the rule grow
    assert default.plateau.held is False and default.plateau.verdict_slope == pytest.approx(0.5)
    assert batch_at(batches, 0.24) == B0 < batches[-1][1]
    _, best_steps, path = offline_optimum(waste / TOTAL, TOTAL, B0, NOISE[noise], lambda t: lr(t / TOTAL))
    saved, best = 1 - steps / (TOTAL / B0), 1 - best_steps / (TOTAL / B0)
    assert len({b for _, b in batches}) >= 3, "the default must grow here for the comparison to mean anything"
    assert saved <= best + 0.01  # the optimum at this waste, up to its 200 spans' rounding
    for fraction in (0.2, 0.4, 0.6, 0.8, 0.95):
        online, offline = batch_at(batches, fraction), B0 * 2 ** path[int(fraction * len(path))]
        assert offline / 2 <= online <= 2 * offline, (fraction, online / B0, offline / B0)
    assert saved >= best - 0.1, (saved, best)  # within 10 points of the optimum's saving


@pytest.mark.parametrize("noise", NOISE)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_quarter_more_or_less_kappa_moves_the_defaults_saving_by_at_most_15_points(schedule, noise):
    """``kappa`` 0.4 against 1.25 x 0.4 and 0.4 / 1.25 (the default's ``convert_lr_decay`` kept)."""
    lr = SCHEDULES[schedule]
    saved = {k: 1 - run(BatchSizeController(kappa=k, total_tokens=TOTAL), NOISE[noise], lr)[0] / (TOTAL / B0)
             for k in (0.32, 0.4, 0.5)}
    assert saved[0.32] <= saved[0.4] <= saved[0.5] and saved[0.32] < saved[0.5], saved  # the knob moves it at all
    assert abs(saved[0.5] - saved[0.4]) <= 0.15 and abs(saved[0.4] - saved[0.32]) <= 0.15, saved


def test_the_results_table_is_what_the_benchmark_prints(capsys):
    from benchmarks.planted_noise import main

    main()
    table = capsys.readouterr().out
    assert table.count("\n") == 8
    assert table in (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
