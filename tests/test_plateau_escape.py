"""``benchmarks/plateau_escape.py``: steps, escapes and gaps read off hand-made runs whose answers are computed
by hand here."""

from __future__ import annotations

import pytest

from tests.scripts import load_script


@pytest.fixture(scope="module")
def escape():
    return load_script("benchmarks/plateau_escape.py", "plateau_escape_under_test")


TOTAL = 1000.0


def curve(knee: float, drop_per_100: float = 0.05) -> list[list[float]]:
    """A plateau at 3.0 from 100 tokens to ``knee``, then a fall of ``drop_per_100`` nats per 100 tokens."""
    return [[t, 5.0 if t == 0 else 3.0 - drop_per_100 * max(0.0, t - knee) / 100] for t in range(0, 1001, 100)]


def run(rule, seed, knee, changes, drop_per_100=0.05):
    return {"setting": "s", "lr_schedule": "cosine", "rule": rule, "seed": seed, "tokens": TOTAL,
            "val_curve": curve(knee, drop_per_100), "batch_changes": changes}


def test_steps_count_each_stretch_at_its_batch_the_first_from_zero(escape):
    changes = [[10.0, 10.0], [300.0, 20.0], [700.0, 40.0]]  # the first dated at its first step, as the records do
    assert escape.steps_at(changes, 200.0) == pytest.approx(20.0)
    assert escape.steps_at(changes, 500.0) == pytest.approx(30 + 10)  # 300 / 10 + 200 / 20
    assert escape.steps_at(changes, 1000.0) == pytest.approx(30 + 20 + 7.5)


def test_steps_at_the_end_are_the_committed_runs_step_counts(escape):
    """Against the step counts the runs recorded: a constant run's exactly; a grown run's at most what its batch
    changes, dated on the trace's grid (up to 8,192 tokens late, each), can add: 8,192 x (1 / B_before - 1 / B_after)
    steps a change."""
    runs = [r for r in escape.frontier.load()["runs"] if r["setting"] in ("wide", "long")
            and r["rule"] in ("constant", escape.frontier.KAPPA_RULE)]
    assert len(runs) == 32
    for r in runs:
        steps = escape.steps_at(r["batch_changes"], r["tokens"])
        if r["rule"] == "constant":
            assert steps == pytest.approx(r["steps"], abs=1e-6)
        else:
            late = sum(8192 * (1 / a[1] - 1 / b[1]) for a, b in zip(r["batch_changes"], r["batch_changes"][1:]))
            assert r["steps"] <= steps <= r["steps"] + late + 1e-6


def test_the_escape_is_where_the_loss_falls_below_the_plateau_and_the_gap_is_the_rules_loss_minus_the_constants(
        escape):
    """Both runs leave the plateau (3.0 at a fifth of the run) at 400 tokens. The constant, at 10 tokens a step,
    falls 0.05 nats per 100 tokens and is 0.09 below the plateau past 580 tokens: at the evaluation at 600, its step
    60. The rule doubled to 20 tokens a step at 300 tokens and falls at half the rate: 0.09 below past 760 tokens, at
    800, its step 300 / 10 + 500 / 20 = 55. Its gap to the constant is 0 on the plateau and then 0.025 nats per 100
    tokens."""
    runs = [run("constant", s, 400.0, [[0.0, 10.0]]) for s in (0, 1)]
    runs += [run("r", s, 400.0, [[0.0, 10.0], [300.0, 20.0]], drop_per_100=0.025) for s in (0, 1)]
    runs += [run("r", 2, 400.0, [[0.0, 10.0]])]  # no constant run of seed 2: not paired
    pairs = escape.frontier.paired_by_seed(runs, "s", "cosine", "r")
    assert [(c["seed"], g["seed"]) for c, g in pairs] == [(0, 0), (1, 1)]
    row = escape.escape_row(pairs, drop=0.09)
    assert row["tokens"] == pytest.approx({"constant": 600.0, "rule": 800.0})
    assert row["escaped"] == {"constant": 2, "rule": 2} and row["later_same_earlier"] == [2, 0, 0]
    assert row["saved"] == pytest.approx((1 - 55 / 60,) * 3)
    assert escape.gap_row(pairs, marks=(0.2, 0.4, 0.6, 1.0)) == pytest.approx([0.0, 0.0, 0.05, 0.15])


def test_a_seed_that_never_leaves_its_plateau_is_counted_out_and_said(escape):
    """Seed 1's rule run never falls 0.09 below the plateau: the rule's median is seed 0's, the cell says 1 of 2, and
    only seed 0 is compared (same evaluation, 60 steps against 60)."""
    runs = [run("constant", s, 400.0, [[0.0, 10.0]]) for s in (0, 1)]
    runs += [run("r", 0, 400.0, [[0.0, 10.0]]), run("r", 1, 2000.0, [[0.0, 10.0], [300.0, 20.0]])]
    row = escape.escape_row(escape.frontier.paired_by_seed(runs, "s", "cosine", "r"), drop=0.09)
    assert row["escaped"] == {"constant": 2, "rule": 1} and row["tokens"]["rule"] == pytest.approx(600.0)
    assert row["later_same_earlier"] == [0, 1, 0] and row["saved"] == pytest.approx((0.0, 0.0, 0.0))
    assert "| 1k | 1k (1 of 2 seeds) | 0 / 1 / 0 | 0% (0%–0%) |" in escape.escape_table(runs, ["s"], "r", 0.09)


def test_around_the_escape_the_trace_is_read_before_and_after_it_and_a_run_that_grew_is_refused(escape):
    """A run at a constant 10 tokens a step whose loss leaves its plateau (3.0) at 400 tokens and is 0.09 below it at
    600; its trace's noise scale is 40 before 600 tokens and 20 from there, ``|G|^2`` 1 and then 3: the medians over
    [300, 600) and [600, 900)."""
    tokens = [float(t) for t in range(0, 1001, 50)]
    record = {"name": "r", "tokens": TOTAL, "evals": {"tokens": [t for t, _ in curve(400.0)],
                                                      "val_loss": [v for _, v in curve(400.0)]},
              "trace": {"tokens": tokens, "global_batch": [10.0] * len(tokens),
                        "noise_scale": [40.0 if t < 600 else 20.0 for t in tokens],
                        "grad_sq_norm": [1.0 if t < 600 else 3.0 for t in tokens]}}
    got = escape.around_escape(record, drop=0.09)
    assert got == {"tokens": 600.0, "noise_before": 40.0, "noise_after": 20.0, "grad_before": 1.0, "grad_after": 3.0}
    record["trace"]["global_batch"][-1] = 20.0
    with pytest.raises(ValueError, match=r"r: its batch changed \(\[10.0, 20.0\]\)"):
        escape.around_escape(record, drop=0.09)


def test_the_results_table_is_what_the_committed_frontier_gives(escape):
    """``docs/results.md``'s escape table is the script's on ``docs/frontier.json`` (the command beside it)."""
    runs = escape.frontier.load()["runs"]
    table = escape.escape_table(runs, ["wide", "wide_lr3", "long", "narrow"], escape.frontier.KAPPA_RULE, 0.1)
    results = (escape.frontier.ROOT / "docs" / "results.md").read_text()
    assert "python benchmarks/plateau_escape.py --settings wide,wide_lr3,long,narrow\n" in results
    assert "\n".join("  " + line for line in table.splitlines()) in results
