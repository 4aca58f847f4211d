"""``benchmarks/proof/group_scale.py``: every parameter in one group, each step's noise measured over all groups
equal to the tracker's on the same run, the stretches and the ratios from their sums."""

from __future__ import annotations

import json

import pytest

from benchmarks.proof import gpt_proof as base
from benchmarks.proof import gpt_proof_lr as proof_lr
from benchmarks.proof import group_scale


@pytest.mark.parametrize("name", sorted(base.SETTINGS))
def test_every_parameter_of_every_settings_model_is_in_one_group_and_every_group_is_used(name):
    model = proof_lr.start_of_run(base.SETTINGS[name], 0, "cosine", base.SETTINGS[name].tracker_start_tokens)[0]
    assert {group_scale.group_of(n) for n, _ in model.named_parameters()} == set(group_scale.GROUPS)
    with pytest.raises(ValueError, match="lm_head.weight"):
        group_scale.group_of("lm_head.weight")


def test_the_first_step_measured_over_all_groups_is_the_trackers_on_the_same_constant_run(tmp_path):
    """The tiny setting's constant run trains at the tracker's starting batch and microbatches, on the same data
    from the same weights as ``measure``'s loop (no tracker). At the first step the tracker measures every
    microbatch, so the step's ``|G|^2`` and ``tr(Sigma)`` from the groups' norms must be the tracker's own,
    measured through its hooks (later steps it measures in part, so they differ by sampling, not by a bug)."""
    setting = base.SETTINGS["tiny"]
    assert (setting.constant_tokens or proof_lr.BASELINE_TOKENS) == setting.tracker_start_tokens
    measured = group_scale.measure(setting, 0, until=1.0, stretches=4)
    run = proof_lr.train(proof_lr.Run("constant", 0, "cosine"), setting, tmp_path)
    trace = run["trace"]
    assert len(measured["steps"]) == run["steps"] and trace["tokens"][0] == measured["steps"][0][0]
    tokens, g, s = measured["steps"][0]
    assert g == pytest.approx(trace["grad_sq_norm"][0], rel=1e-5)
    assert s == pytest.approx(trace["trace_cov"][0], rel=1e-5)
    # each stretch sums its own steps, for all groups together and group by group
    for k, end in enumerate(measured["ends"]):
        begin = measured["ends"][k - 1] if k else 0.0
        inside = [(g, s) for t, g, s in measured["steps"] if begin < t <= end]
        assert inside and measured["grad_sq_norm"][k]["all"] == pytest.approx(sum(g for g, _ in inside), rel=1e-9)
        assert measured["trace_cov"][k]["all"] == pytest.approx(sum(s for _, s in inside), rel=1e-9)
        for key in ("grad_sq_norm", "trace_cov"):  # the estimates are linear in the norms: the groups add up
            row = measured[key][k]
            assert sum(row[g] for g in group_scale.GROUPS) == pytest.approx(row["all"], rel=1e-6)


def test_ratios_take_the_median_over_seeds_and_the_stretches_inside_the_window():
    runs = [{"ends": [10, 20, 30, 40], "noise_scale": [
        {"all": 100, "embedding": 900, "attention": 100, "mlp": 100, "layernorm": None},
        {"all": 100, "embedding": 50, "attention": 200, "mlp": 100, "layernorm": 10},
        {"all": 200, "embedding": 100, "attention": 200, "mlp": 100, "layernorm": 20},
        {"all": 100, "embedding": 100, "attention": 300, "mlp": 100, "layernorm": 30}]},
        {"ends": [10, 20, 30, 40], "noise_scale": [
            {"all": 100, "embedding": 100, "attention": 100, "mlp": 100, "layernorm": 40}] * 4}]
    # budget 40, window (0.25, 0.75]: the stretches ending at 20 and 30 of each seed
    assert group_scale.ratios(runs, 40, lo=0.25, hi=0.75) == {
        "embedding": 0.75, "attention": 1.0, "mlp": 1.0, "layernorm": 0.25}


def test_the_command_keeps_each_settings_ratios_and_drops_the_steps(tmp_path):
    out = tmp_path / "groups.json"
    assert group_scale.main(["--setting", "tiny", "--seeds", "0", "--until", "0.5", "--stretches", "2",
                             "--out", str(out)]) == 0
    (saved,) = json.loads(out.read_text())["runs"]
    assert saved["setting_key"] == base.SETTINGS["tiny"].key() and set(saved["ratio_to_b_simple"]) == set(
        group_scale.GROUPS)
    assert "steps" not in saved["runs"][0] and len(saved["runs"][0]["noise_scale"]) == 2
