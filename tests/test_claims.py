"""The README's result tables against what produces them.

Each printed number is compared at its own printed precision (half a unit of its
last digit): the NQM tables by rerunning the command the row names (the model is
deterministic), the proof table by parsing ``docs/proof_results.json``, which
the proof script wrote. A table changed without its source, or a source changed
without its table, fails here.

Not rerun (minutes each on CI): the online rows with the estimator on sampled
gradients and the online rows at 3e6 and 1e7.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from cbs_tracker.commands import nqm as nqm_cmd
from cbs_tracker.theory.nqm import ExactNQM, RowContext, load_row_plugins, registered_rows

ROOT = Path(__file__).resolve().parents[1]
# the result tables live there: this release's in results.md, the earlier releases' in history-2026.md
README = "\n".join((ROOT / "docs" / name).read_text() for name in ("results.md", "history-2026.md"))
B_MIN, B_MAX = 8.0, 8192.0


def _rows(table_header: str) -> list[list[str]]:
    """Cells of the Markdown table whose header line starts with ``table_header`` (no header, no rule)."""
    lines = README.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(table_header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def _numbers(cell: str) -> list[str]:
    """The numbers printed in a cell, as printed (bold, thousands commas and unit signs dropped)."""
    return re.findall(r"\d[\d,]*(?:\.\d+)?", cell.replace("**", ""))


def assert_printed(printed: str, value: float) -> None:
    """``printed`` is ``value`` rounded to the digits shown."""
    printed = printed.replace(",", "")
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    assert abs(float(printed) - value) <= 0.5 * 10.0**-decimals * (1 + 1e-9), (printed, value)


# ------------------------------------------------------------------ the NQM, offline schedules
OFFLINE = _rows("| budget D | two-stage |")


@pytest.fixture(scope="module")
def offline_json() -> dict[str, dict]:
    """``--json`` output of each row's command, by the row's budget cell."""
    out = {}
    for row in OFFLINE:
        command = re.fullmatch(r"`cbs-tracker nqm(.*)`", row[-1])
        assert command, row
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert nqm_cmd.main([*command.group(1).split(), "--json"]) == 0
        out[row[0]] = json.loads(printed.getvalue().strip().splitlines()[-1])
    return out


def test_readme_offline_nqm_table_is_what_its_commands_print(offline_json):
    assert [row[0] for row in OFFLINE] == ["1e6", "3e6", "1e7"]
    for row in OFFLINE:
        data = offline_json[row[0]]
        for cell, name in zip(row[1:4], ("two_stage", "doubling", "optimal"), strict=True):
            assert_printed(_numbers(cell)[0], data[name]["ratio_vs_constant"])


def test_readme_exponents_of_the_seed_setting():
    row = next(r for r in OFFLINE if r[0] == "3e6")
    s, beta = re.search(r"s = ([\d.]+), β = ([\d.]+)", row[3]).groups()
    e = ExactNQM().measure_exponents()
    assert_printed(s, e.s)
    assert_printed(beta, e.beta)


# ------------------------------------------------------------------ the NQM, online controller
ONLINE = _rows("| D | default, exact noise scale |")


def test_readme_online_nqm_row_at_1e6_exact_noise_scale(offline_json):
    row = next(r for r in ONLINE if r[0] == "1e6")
    budget = 1e6
    model = ExactNQM()
    base = offline_json["1e6"]  # the same budget and bounds
    best_constant, optimal = base["constant"]["final_loss"], base["optimal"]["final_loss"]
    ctx = RowContext(model=model, budget=budget, b_min=B_MIN, b_max=B_MAX, exponents=None, rows={})  # type: ignore[arg-type]
    load_row_plugins()  # the online rows live in a module of their own
    default = registered_rows()["online"](ctx)
    aware = registered_rows()["budget_aware"](ctx)
    ratio, vs_start = _numbers(row[1])
    assert_printed(ratio, best_constant / default.final_loss)
    start = model.constant_loss(B_MIN, int(budget // B_MIN))
    assert_printed(vs_start, start / default.final_loss)
    ratio, vs_opt = _numbers(row[3])
    assert_printed(ratio, best_constant / aware.final_loss)
    assert_printed(vs_opt, aware.final_loss / optimal)


# ------------------------------------------------------------------ the proof on the small GPT
PROOF = _rows("| schedule | seed 0 | seed 1 |")
RESULTS = json.loads((ROOT / "docs" / "proof_results.json").read_text())
RUNS = {r["name"]: r for r in RESULTS["runs"]}


def _proof_row(prefix: str) -> list[str]:
    rows = [r for r in PROOF if r[0].startswith(prefix)]
    assert len(rows) == 1, prefix
    return rows[0]


def test_readme_proof_constants_row():
    row = _proof_row("constant 256")
    batches = [int(b[:-1]) * 1024 if b.endswith("k") else int(b) for b in re.findall(r"\d+k?", row[0])]
    assert batches == RESULTS["setting"]["constants"]
    losses = _numbers(row[1])
    assert len(losses) == len(batches)
    for b, printed in zip(batches, losses, strict=True):
        assert_printed(printed, RUNS[f"constant_{b}_seed0"]["final_val_loss"])
    best = RESULTS["best_constant_tokens"]
    assert f"**{best if best < 1024 else f'{best // 1024}k'}**" in row[0]  # the bold one is the best
    b, loss = _numbers(row[2])
    assert int(b) == best
    assert_printed(loss, RUNS[f"constant_{best}_seed1"]["final_val_loss"])
    b, steps = _numbers(row[3])
    assert int(b) == best and int(steps.replace(",", "")) == RUNS[f"constant_{best}_seed0"]["steps"]


@pytest.mark.parametrize(
    ("prefix", "schedule"),
    [("hand ramp", "hand_ramp"), ("tracker, defaults", "tracker_default"), ("tracker, budget-aware", "tracker_budget")],
)
def test_readme_proof_schedule_rows(prefix, schedule):
    row = _proof_row(prefix)
    runs = [RUNS[f"{schedule}_seed{s}"] for s in (0, 1)]
    for cell, run in zip(row[1:3], runs, strict=True):
        assert_printed(_numbers(cell)[0], run["final_val_loss"])
    steps = [int(n.replace(",", "")) for n in _numbers(row[3])]
    if len(steps) == 1:  # one number when both seeds agree
        assert runs[0]["steps"] == runs[1]["steps"]
    assert steps in ([r["steps"] for r in runs], [runs[0]["steps"]])
    reach = _numbers(row[4])  # steps to the best constant's loss per seed, then the savings in percent
    assert [int(n.replace(",", "")) for n in reach[:2]] == [r["steps_to_best_constant"] for r in runs]
    for printed, run in zip(reach[2:], runs, strict=True):
        assert_printed(printed, 100 * run["step_saving_vs_best_constant"])


def test_readme_proof_cosine_row():
    row = _proof_row("with a cosine decay")
    names = [f"constant_{RESULTS['best_constant_tokens']}_cosine_seed0", "hand_ramp_cosine_seed0",
             "tracker_budget_cosine_seed0"]
    for printed, name in zip(_numbers(row[1]), names, strict=True):
        assert_printed(printed, RUNS[name]["final_val_loss"])
    assert [int(n.replace(",", "")) for n in _numbers(row[3])] == [RUNS[n]["steps"] for n in names]


def test_readme_proof_margins_of_the_budget_aware_runs():
    # "ended below the hand-picked ramp (by 0.015 and 0.025) and every constant (by 0.09 and 0.08)"
    m = re.search(r"ended below the hand-picked ramp \(by ([\d.]+) and ([\d.]+)\) and every constant "
                  r"\(by ([\d.]+) and ([\d.]+)\)", README)
    assert m, "the README's sentence on the budget-aware margins moved"
    for seed in (0, 1):
        aware = RUNS[f"tracker_budget_seed{seed}"]["final_val_loss"]
        assert_printed(m.group(1 + seed), RUNS[f"hand_ramp_seed{seed}"]["final_val_loss"] - aware)
        best_constant = min(r["final_val_loss"] for r in RESULTS["runs"]
                            if r["schedule"] == "constant" and r["lr_schedule"] == "constant" and r["seed"] == seed)
        assert_printed(m.group(3 + seed), best_constant - aware)
