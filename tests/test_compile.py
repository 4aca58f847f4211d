"""``torch.compile``: a compiled model's per-step estimates equal the eager model's at frozen weights.

Truth: the same microbatches through the eager module (LR 0, so every step sees the same
weights and the per-step ``|G_small|^2``, ``|G_big|^2`` and the estimate are comparable step by
step). Compiled kernels reorder float32 sums, so the two agree to about 1e-7 relative; a hook
that the compiled backward skipped, a microbatch counted twice or a norm read before the
compiled graph wrote ``.grad`` moves them by far more. The step's own estimate
``tr(Sigma)/|G|^2`` is compared (the smoothed one needs more steps than five). ``torch._dynamo``'s counters show the
compiled path really ran.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from cbs_tracker import CBSCallback, CBSTracker

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
    pytest.mark.filterwarnings("ignore:.*isinstance.*treespec.*"),
    pytest.mark.filterwarnings("ignore:.*litlogger.*"),
]
RTOL = 1e-5
A, ROWS, STEPS = 4, 8, 5


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    return x, torch.sin(x.sum(1, keepdim=True)) + 0.3 * torch.randn(n, 1, generator=g)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _plain(compiled: bool) -> list[tuple[float, float, float]]:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    run = torch.compile(model) if compiled else model
    tracker = CBSTracker(run, opt, accumulation_steps=A, unit="samples")  # the compiled module itself
    x, y = _data(STEPS * A * ROWS)
    out = []
    for step in range(STEPS):
        for k in range(A):
            i = (step * A + k) * ROWS
            with tracker.microbatch(size=ROWS):
                (nn.functional.mse_loss(run(x[i:i + ROWS]), y[i:i + ROWS]) / A).backward()
        record = tracker.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append((tracker.last_stats.small_sq_norm, tracker.last_stats.big_sq_norm,
                    record.step_trace_cov / record.step_grad_sq_norm))
    return out


def _same(eager, compiled) -> None:
    assert len(eager) == len(compiled) == STEPS
    for e, c in zip(eager, compiled, strict=True):
        assert c[0] == pytest.approx(e[0], rel=RTOL) and c[1] == pytest.approx(e[1], rel=RTOL)
        assert c[2] == pytest.approx(e[2], rel=1e-4)  # the step's own noise scale: differences of norms
    assert len({round(e[0], 6) for e in eager}) == STEPS  # the microbatches differ from step to step


def test_a_compiled_model_in_the_plain_loop_gives_the_eager_estimates():
    eager = _plain(False)
    before = _graphs()
    compiled = _plain(True)
    assert _graphs() > before  # dynamo compiled the forward (and AOT autograd its backward)
    _same(eager, compiled)


class _Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class _Stats(pl.Callback):
    def __init__(self, cbs: CBSCallback) -> None:
        self.cbs, self.rows = cbs, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        stats, record = self.cbs.last_stats, self.cbs.last_record
        self.rows.append((stats.small_sq_norm, stats.big_sq_norm, record.step_trace_cov / record.step_grad_sq_norm))


def _lightning(compiled: bool) -> list[tuple[float, float, float]]:
    cbs = CBSCallback(unit="samples")
    stats = _Stats(cbs)
    module = _Net()
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, max_epochs=1,
                         accumulate_grad_batches=A, callbacks=[cbs, stats])
    x, y = _data(STEPS * A * ROWS)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=ROWS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        trainer.fit(torch.compile(module) if compiled else module, loader)
    return stats.rows


def test_a_compiled_lightning_module_gives_the_eager_estimates():
    eager = _lightning(False)
    before = _graphs()
    compiled = _lightning(True)
    assert _graphs() > before
    _same(eager, compiled)
