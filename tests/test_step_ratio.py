"""The step-length diagnostic against a quadratic, where the loss-optimal step along any direction is known."""

import torch

from benchmarks.proof.step_ratio import descent_before_and_after


class Quadratic(torch.nn.Module):
    """``L(w) = 1/2 (w - c)^T H (w - c)`` on a diagonal ``H``; the probe batch is ignored (``model(x, y)``)."""

    def __init__(self, h: torch.Tensor, c: torch.Tensor, w: torch.Tensor) -> None:
        super().__init__()
        self.h, self.c = h, c
        self.w = torch.nn.Parameter(w.clone())

    def forward(self, x, y):
        r = self.w - self.c
        return None, 0.5 * (self.h * r * r).sum()


def _ratio(lr: float, sgd: bool) -> tuple[float, float]:
    torch.manual_seed(0)
    h = torch.rand(50, dtype=torch.float64) * 4 + 0.1
    c = torch.randn(50, dtype=torch.float64)
    model = Quadratic(h, c, torch.zeros(50, dtype=torch.float64))
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    g = h * (model.w.detach() - c)
    with torch.no_grad():  # one step along -g (SGD) or along a direction that is not the gradient
        d = -lr * (g if sgd else g.sign() * g.abs().sqrt())
        model.w.add_(d)
    a0, a1, _ = descent_before_and_after(model, params, (None, None), before)
    # along d the loss is a parabola: the best step is t* = (-g.d) / (d^T H d) in units of d
    best = float(-(g * d).sum() / (h * d * d).sum())
    assert torch.equal(model.w.detach(), before[0] + d)  # the parameters are left after the update
    return 1 - a1 / a0, 1 / best


def test_step_over_best_step_is_exact_on_a_quadratic():
    for lr in (0.01, 0.1, 0.4):
        for sgd in (True, False):
            got, truth = _ratio(lr, sgd)
            assert abs(got - truth) < 1e-9 * max(1.0, truth), (lr, sgd, got, truth)
    short, _ = _ratio(0.01, True)
    assert 0 < short < 0.1  # a step far too short reads near 0, not near 1
