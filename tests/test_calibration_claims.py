"""The calibration tables of docs/results.md against the JSON files they are printed from.

A table edited by hand, or a JSON rerun without its table, fails here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.proof import calibrate_proof, measured_kappa_report

ROOT = Path(__file__).resolve().parents[1]

# the uncooled-branch tables of the proof GPT moved, with their commits, to history-2026.md
RESULTS = "\n".join((ROOT / "docs" / name).read_text() for name in ("results.md", "history-2026.md"))


@pytest.mark.parametrize("name", ["calibration_full_seed0.json", "calibration_deep_seed0.json"])
def test_calibration_table_is_the_json(name):
    saved = json.loads((ROOT / "docs" / name).read_text())
    assert len(saved["points"]) >= 4  # at least four checkpoints per setting
    assert calibrate_proof.markdown_table(saved) in RESULTS


def test_measured_kappa_table_is_the_json():
    rep = json.loads((ROOT / "docs" / "proof_measured_results.json").read_text())
    rep["per_seed"] = {int(k): v for k, v in rep["per_seed"].items()}
    assert measured_kappa_report.markdown(rep) in RESULTS
    # the earlier runs' rows are the results files they come from
    for seed, rows in rep["per_seed"].items():
        for key, row in measured_kappa_report._earlier(seed).items():
            assert rows[key]["final_val_loss"] == row["final_val_loss"] and rows[key]["steps"] == row["steps"]
    # the summary is the per-seed rows' arithmetic
    for key, s in rep["summary"].items():
        d = [rep["per_seed"][seed][key]["final_val_loss"] - rep["per_seed"][seed]["constant"]["final_val_loss"]
             for seed in s["seeds"]]
        assert s["vs_constant"] == pytest.approx(measured_kappa_report.paired(d))
