"""The README's proof under decaying learning rates against docs/proof_lr_results.json (what the script wrote)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.proof import gpt_proof_lr
from tests.test_claims import _rows

ROOT = Path(__file__).resolve().parents[1]


def _readme_rows(header: str = "| run | LR schedule | seed | final val loss |") -> list[list[str]]:
    return [[c.replace("**", "") for c in row] for row in _rows(header)]


@pytest.mark.parametrize(
    ("header", "results"),
    [("| run | LR schedule | seed | final val loss |", "proof_lr_results.json"),
     ("| run (window estimator) | LR schedule | seed | final val loss |", "proof_lr_window_results.json"),
     ("| run (κ = 0.4) | LR schedule | seed | final val loss |", "proof_kappa04_results.json"),
     ("| run (constant LR, window estimator) | LR schedule | seed | final val loss |", "proof_constlr_results.json"),
     ("| run (seeds 2 and 3) | LR schedule | seed | final val loss |", "proof_seeds_results.json")],
)
def test_readme_proof_table_is_what_the_script_wrote(header, results):
    runs = {(r["name"].rsplit("_seed", 1)[0], r["seed"]): r for r in json.loads(
        (ROOT / "docs" / results).read_text())["runs"]}
    rows = _readme_rows(header)
    assert len(rows) == len(runs)
    for row in rows:
        run = runs[(row[0], int(row[2]))]
        assert row[1] == run["lr_schedule"]
        assert float(row[3]) == round(run["final_val_loss"], 4)
        assert int(row[5].replace(",", "")) == run["steps"]
        if "delta_loss_vs_constant_512" in run:
            assert float(row[4]) == run["delta_loss_vs_constant_512"]
            assert row[6] == f"{run['fewer_steps_vs_constant_512']:.0%}"
    # every tracker run is named as such and carries its LR schedule
    assert all(r["lr_schedule"] in ("cosine", "wsd", "constant") for r in runs.values())
    assert all(r["schedule"] == "constant" or r["schedule"].startswith("tracker") for r in runs.values())


@pytest.mark.parametrize(("results", "label"), [("proof_mbfirst_wallclock.json", "run"),
                                                 ("proof_mbfirst_idle_wallclock.json", "run (idle machine)"),
                                                 ("proof_seeds_wallclock.json", "run (seeds 2 and 3)")])
def test_microbatch_first_wallclock_table_is_what_the_script_wrote(results, label):
    """docs/results.md's wall-clock tables against what the script wrote, through the script's own
    formatter; the README's row quotes the range of the microbatch-first time ratios over every seed."""
    script = gpt_proof_lr
    rows = json.loads((ROOT / "docs" / results).read_text())
    header = f"| seed | {label} | final val loss | vs constant 512 | optimizer steps | training seconds |"
    assert _readme_rows(header) == [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in script.wallclock_table(rows, label=label).splitlines()[2:]
    ]
    ratios = [row["microbatch_first"]["vs_constant"] for name in ("proof_mbfirst_wallclock.json",
              "proof_mbfirst_idle_wallclock.json", "proof_seeds_wallclock.json")
              for row in json.loads((ROOT / "docs" / name).read_text())]
    readme = (ROOT / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith("| growing the microbatch first"))
    assert f"{min(ratios):.2f}–{max(ratios):.2f}× the constant batch's training time" in line


def test_microbatch_first_phase_table_is_what_the_script_wrote():
    """The per-batch time ratios in docs/results.md are the script's ``phase_ratios`` of the idle-machine runs,
    as written to their JSON."""
    script = gpt_proof_lr
    rows = json.loads((ROOT / "docs" / "proof_mbfirst_idle_wallclock.json").read_text())
    table = script.phase_table(rows)
    assert len(table.splitlines()) > 2
    results = (ROOT / "docs" / "results.md").read_text()
    assert "\n".join("  " + line for line in table.splitlines()) in results
    at_2048 = {f"{ph['vs_constant']:.2f}" for row in rows for ph in row["microbatch_first"]["phases"]
               if ph["global_batch"] == 2048}
    assert len(at_2048) == 1  # both seeds round alike


def test_phase_ratios_against_a_hand_computed_run():
    # a run at batch 1 for 4 tokens then batch 2 for 4 more, twice as fast per token in its second phase as the
    # reference's steady 1 s per token: the ratios are 1.0 and 0.5, read off evaluations at every 2 tokens
    script = gpt_proof_lr
    run = {"trace": {"tokens": [1, 2, 3, 4, 6, 8], "global_batch": [1, 1, 1, 1, 2, 2]},
           "evals": {"tokens": [0, 2, 4, 6, 8], "train_s": [0, 2, 4, 5, 6]}}
    ref = {"evals": {"tokens": [0, 2, 4, 6, 8], "train_s": [0, 2, 4, 6, 8]}}
    assert script.phase_ratios(run, ref) == [
        {"global_batch": 1, "from_tokens": 0.0, "to_tokens": 4, "vs_constant": 1.0},
        {"global_batch": 2, "from_tokens": 4, "to_tokens": 8, "vs_constant": 0.5}]


def test_readme_accumulation_only_range_is_what_the_runs_wrote():
    rows = [row for name in ("proof_mbfirst_wallclock.json", "proof_seeds_wallclock.json")
            for row in json.loads((ROOT / "docs" / name).read_text())]
    ratios = [row["accumulation_only"]["vs_constant"] for row in rows]
    assert len(ratios) == 4
    line = next(x for x in (ROOT / "README.md").read_text().splitlines() if x.startswith("| growing the microbatch first"))
    assert f"accumulation only: {min(ratios):.2f}–{max(ratios):.2f}×" in line
