"""``benchmarks/gate_toy.py``, CI-sized: on its bigram toy the size gate overturns the verdict the ungated option
holds, at the tokens per parameter the run has seen by then, and the run takes fewer steps on the same tokens."""

from __future__ import annotations

import pytest

from tests.scripts import load_script


@pytest.fixture(scope="module")
def toy():
    return load_script("benchmarks/gate_toy.py", "gate_toy_under_test")


def test_the_gate_frees_the_run_the_ungated_option_holds_at_its_tokens_per_parameter(toy):
    steps = 1500  # the benchmark's run, one seed: 768,000 tokens of 512-token batches; 544 parameters
    ungated_loss, ungated_steps, ungated = toy.train(0, "ungated", steps)
    gated_loss, gated_steps, gated = toy.train(0, "gated", steps)  # the library's default
    assert ungated.plateau.held is True and ungated_steps == steps and ungated.plateau.gated is None
    assert gated.model_parameters == toy.V * toy.D + toy.D * toy.V + toy.V == 544
    assert gated.plateau.held is False and gated.plateau.verdict_slope < 0.15
    assert gated.plateau.gated == pytest.approx(gated.plateau.verdict_tokens / 544)
    assert 0.25 * steps * 512 / 544 <= gated.plateau.gated < 0.27 * steps * 512 / 544
    assert gated_steps < steps
    assert ungated_loss != gated_loss
    noise = []
    _, taken, observed = toy.train(0, "observed", 300, factor=2, noise=noise)  # --constant's runs: 2 x, same tokens
    assert taken == 150 and observed.observe_only and observed.plateau.held is None and len(noise) > 100
    mean, se, upper = toy.paired([0.01, 0.02, 0.03])
    assert (mean, upper) == pytest.approx((0.02, 0.02 + 2.920 * 0.01 / 3 ** 0.5))
