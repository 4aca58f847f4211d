"""``benchmarks/proof/curvature_scale.py``: the quadratic forms unbiased against their analytic values, the
Hessian-vector product against central differences of the gradient, and the diagnostic end to end."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.proof import curvature_scale as cs
from benchmarks.proof import gpt_proof as base


@pytest.mark.parametrize("n, k", [(4, 4), (8, 3)])
def test_the_quadratic_forms_are_unbiased_at_a_few_microbatches(n, k):
    """Gradients drawn from ``N(G, Sigma)`` ``n`` at a time, the Hessian (a known symmetric ``A``) applied to ``k`` of
    them, a known scale for the preconditioner: over many draws the mean of each estimate is its analytic value.
    The noise is four times the signal, so the estimates without their ``1/N`` corrections would be biased by 50%
    to 100%."""
    gen = torch.Generator().manual_seed(n)
    dim, draws = 5, 20_000
    root = torch.randn(dim, dim, generator=gen, dtype=torch.float64)
    sigma = root @ root.T
    mean = torch.randn(dim, generator=gen, dtype=torch.float64)
    mean *= (sigma.trace() / 4 / mean.pow(2).sum()).sqrt()  # tr(Sigma) = 4 |G|^2
    a = torch.randn(dim, dim, generator=gen, dtype=torch.float64)
    a = a @ a.T + torch.eye(dim, dtype=torch.float64)
    scale = torch.rand(dim, generator=gen, dtype=torch.float64) + 0.5
    for s in (None, scale):
        p = torch.eye(dim, dtype=torch.float64) if s is None else torch.diag(s)
        truth = {"trace_cov": float((p @ sigma @ p).trace()), "grad_sq_norm": float((p @ mean).pow(2).sum()),
                 "h_trace_cov": float((p @ a @ p @ sigma).trace()), "h_grad_sq_norm": float(mean @ p @ a @ p @ mean)}
        sums = dict.fromkeys(truth, 0.0)
        for _ in range(draws):
            grads = mean + torch.randn(n, dim, generator=gen, dtype=torch.float64) @ root.T
            scaled = grads if s is None else grads * s
            forms = cs.quadratic_forms(grads.sum(0), float(scaled.pow(2).sum()), n, grads[:k], lambda v: a @ v, s)
            for key, v in forms.items():
                sums[key] += v / draws
        for key, v in truth.items():
            assert sums[key] == pytest.approx(v, rel=0.03), key


def test_the_hessian_vector_product_is_the_central_difference_of_the_gradient():
    """A small GPT in float64, two batches: ``H v`` by double backward against ``(grad L(w + e v) - grad L(w - e v))
    / 2e`` of the two batches' mean loss, for two directions."""
    torch.manual_seed(0)
    from cbs_tracker.demo.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(context_length=8, n_layer=1, d_model=16, n_head=2)).double()
    params = [p for p in model.parameters() if p.requires_grad]
    batches = [(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8))) for _ in range(2)]
    hvp = cs.hessian_vector_product(model, params, batches)

    def grad() -> torch.Tensor:
        loss = sum(model(x, y)[1] for x, y in batches) / len(batches)
        return cs._flat(torch.autograd.grad(loss, params))

    e = 1e-6  # the error falls as e^2 to here (1e-8 of the largest entry)
    directions = [torch.randn(sum(p.numel() for p in params), dtype=torch.float64) for _ in range(2)]
    products = [hvp(v) for v in directions]  # before the weights move: the graphs hold them
    for v, product in zip(directions, products, strict=True):
        moved = []
        for sign in (1, -1):
            with torch.no_grad():
                offset = 0
                for p in params:
                    p += sign * e * v[offset: offset + p.numel()].view_as(p)
                    offset += p.numel()
            moved.append(grad())
            with torch.no_grad():
                offset = 0
                for p in params:
                    p -= sign * e * v[offset: offset + p.numel()].view_as(p)
                    offset += p.numel()
        difference = (moved[0] - moved[1]) / (2 * e)
        assert torch.allclose(product, difference, rtol=1e-5, atol=1e-6 * float(difference.abs().max()))


def test_the_diagnostic_measures_the_tiny_setting_at_its_marks(tmp_path):
    """End to end on the tiny setting: a point at each mark, the noise scales positive where defined, written to
    the file with the setting's key."""
    out = tmp_path / "cs.json"
    assert cs.main(["--setting", "tiny", "--marks", "0.5,1", "--microbatches", "64", "--deviations", "4", "--hessian", "1",
                    "--out", str(out)]) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["setting_key"] == base.SETTINGS["tiny"].key() and [p["mark"] for p in run["points"]] == [0.5, 1.0]
    for point in run["points"]:
        for key in ("b_simple", "b_noise", "b_adam_simple", "b_adam_noise"):
            assert point[key] is None or point[key] > 0
        assert point["b_simple"] is not None


def test_the_report_takes_the_median_and_range_of_each_settings_ratios_in_the_order_of_their_kappa():
    """Three points on prose (``B_noise`` ratios 0.2, 0.9, 0.4; a fourth with a negative ``B_noise`` counts for the
    Adam columns only) and one on wide: a row each, wide (``kappa`` 0.2) first."""
    def point(simple, noise, adam, adam_next):
        return {"b_simple": simple, "b_noise": noise, "b_adam_noise": adam, "b_adam_next_noise": adam_next}

    runs = [{"setting": "prose", "points": [point(1000, 200, 500, 100), point(1000, 900, 300, None)]},
            {"setting": "prose", "points": [point(500, 200, 250, 400), point(800, -50, 400, 800)]},
            {"setting": "wide", "points": [point(2000, 1000, 600, 300)]}]
    rows = cs.report(runs).splitlines()[2:]
    assert rows == ["| wide | 0.2 | 1 | 0.50 (0.50–0.50) | 0.30 (0.30–0.30) | 0.15 (0.15–0.15) |",
                    "| prose | 1.0 | 4 | 0.40 (0.20–0.90) | 0.50 (0.30–0.50) | 0.80 (0.10–1.00) |"]
