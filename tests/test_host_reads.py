"""No host sync per step on the accelerator path, in the Lightning and Hugging Face adapters.

A CPU stand-in for CUDA's sync debug mode: the collector's host shortcut is switched off
(so the window's sums stay tensors, as on an accelerator), and every tensor-to-host read
(``item``, ``float``, ``bool``, ``int``, ``tolist``, ``numpy``) inside the adapter's step
is counted. The one read allowed per step is the reduced vector's ``tolist``. The plain
loop's test is in ``tests/test_cadence.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from cbs_tracker.core.collector import GradStatsCollector

HOST_READS = {torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__index__}


class Count(TorchFunctionMode):
    def __init__(self, reads: list[str]) -> None:
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            self.reads.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def _counting(monkeypatch, cls, name: str, per_step: list[list[str]]) -> None:
    real = getattr(cls, name)

    def wrapped(self, *args, **kwargs):
        reads: list[str] = []
        with Count(reads):
            out = real(self, *args, **kwargs)
        per_step.append(reads)
        return out

    monkeypatch.setattr(cls, name, wrapped)


def test_lightning_step_reads_the_host_once(monkeypatch, tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from cbs_tracker import CBSCallback
    from tests.lightning_workers import Regression, regression_data

    monkeypatch.setattr(GradStatsCollector, "host_window_sums", lambda self: None)
    monkeypatch.setattr(GradStatsCollector, "read_each_on_cpu", False)
    per_step: list[list[str]] = []
    _counting(monkeypatch, CBSCallback, "on_before_optimizer_step", per_step)
    cbs = CBSCallback(controller=None, batch_size_fn=lambda b: (b[1] == b[1]).sum(), unit="tokens",
                      measure_every=2, prog_bar=False)
    trainer = pl.Trainer(max_steps=6, accumulate_grad_batches=2, callbacks=[cbs], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu", default_root_dir=str(tmp_path))
    trainer.fit(Regression(), torch.utils.data.DataLoader(regression_data(64), batch_size=4))
    assert len(per_step) == 6
    assert all(reads == ["tolist"] for reads in per_step), per_step


def test_hf_trainer_step_reads_the_host_once(monkeypatch):
    pytest.importorskip("transformers")
    from cbs_tracker.integrations.transformers import CBSTrainer
    from tests.padded_workers import PaddedTokens, TokenRegression, setting
    from tests.hf_workers import training_args

    monkeypatch.setattr(GradStatsCollector, "host_window_sums", lambda self: None)
    monkeypatch.setattr(GradStatsCollector, "read_each_on_cpu", False)
    per_step: list[list[str]] = []
    _counting(monkeypatch, CBSTrainer, "_finish_window", per_step)
    w_star, delta = setting()
    data = PaddedTokens(48, length=16, valid=(1, 16), w_star=w_star, sigma=0.5, seed=1)
    args = training_args("unused", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                         learning_rate=0.0, save_strategy="no", max_steps=6)
    trainer = CBSTrainer(model=TokenRegression(w_star + delta), args=args, train_dataset=data, unit="tokens",
                         controller=None, measure_every=2)
    trainer.train()
    assert len(per_step) == 6
    assert all(reads == ["tolist"] for reads in per_step), per_step
