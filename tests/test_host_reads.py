"""No host sync per step on the accelerator path, in the Lightning and Hugging Face adapters.

A CPU stand-in for CUDA's sync debug mode: the collector's host shortcut is switched off
(so the window's sums stay tensors, as on an accelerator), and every tensor-to-host read
(``item``, ``float``, ``bool``, ``int``, ``tolist``, ``numpy``) inside the adapter's step
is counted. The one read allowed per step is the reduced vector's ``tolist``. The plain
loop's test is in ``tests/test_cadence.py``.
"""

from __future__ import annotations

from contextlib import nullcontext

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

    from tests.hf_workers import training_args
    from tests.padded_workers import PaddedTokens, TokenRegression, setting

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


# ---------------------------------------------------------------------- the plain loop, labels=
ACC, MICRO, LENGTH, DIM = 4, 4, 6, 5


def _token_data(windows: int, seed: int = 3):
    """Features, float targets and int64 labels (a quarter of the positions ignored, -100) per microbatch."""
    g = torch.Generator().manual_seed(seed)
    n = windows * 8 * MICRO  # enough for a window that grows to 8 microbatches
    x = torch.randn(n, LENGTH, DIM, generator=g)
    target = x.sum(-1) + 0.5 * torch.randn(n, LENGTH, generator=g)
    labels = torch.randint(0, 50, (n, LENGTH), generator=g)
    labels[torch.rand(n, LENGTH, generator=g) < 0.25] = -100
    return x, target, labels


def _plain_loop(windows: int, *, every, count=None, logger=None):
    """A seeded plain loop with labels=, AdamW, a step-sized LR schedule and a controller that grows the
    batch; ``count`` (a list) collects the host reads of each window's microbatches and step()."""
    from cbs_tracker import CBSTracker, NoiseScaleEstimator
    from tests.doubles import PlanController

    torch.manual_seed(0)
    model = torch.nn.Linear(DIM, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
    tracker = CBSTracker(model, opt, accumulation_steps=ACC, unit="tokens", controller=PlanController({7: 8}),
                         estimator=NoiseScaleEstimator(min_steps=2), lr_scheduler=sched, measure_every=every,
                         loss_normalization="window", logger=logger)
    x, target, labels = _token_data(windows)
    records, lrs, seen = [], [], []
    i = 0
    for _ in range(windows):
        reads: list[str] = []
        for _ in range(tracker.accumulation_steps):
            y = labels[i : i + MICRO].clone()  # a fresh tensor per microbatch, as a loader gives
            with Count(reads) if count is not None else nullcontext():
                with tracker.microbatch(labels=y):
                    mask = (y != -100).to(x.dtype)
                    err = model(x[i : i + MICRO]).squeeze(-1) - target[i : i + MICRO]
                    (0.5 * (err.pow(2) * mask).sum() / (ACC * MICRO * LENGTH)).backward()
            i += MICRO
        with Count(reads) if count is not None else nullcontext():
            record = tracker.step()
        if count is not None:
            count.append((record.measured, reads))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        records.append(record)
        lrs.append([g["lr"] for g in opt.param_groups])
        seen.append((tracker.steps, tracker.starting_batch_steps, tracker.microbatches_seen))
    return tracker, records, lrs, seen


def _device_path(monkeypatch) -> None:
    """The stand-in: the collector reads the window as on an accelerator (no host shortcut)."""
    monkeypatch.setattr(GradStatsCollector, "host_window_sums", lambda self: None)
    monkeypatch.setattr(GradStatsCollector, "read_each_on_cpu", False)


@pytest.mark.parametrize("every", [2, 3])
def test_plain_loop_unmeasured_window_with_labels_reads_nothing(monkeypatch, every):
    """labels= in a window not measured: no host read in its microbatches or its step() (the counts are
    copied to the host without a wait and read later); one read at the end of a measured window."""
    _device_path(monkeypatch)
    count: list = []
    _plain_loop(12, every=every, count=count)
    assert [m for m, _ in count] == [s % every == 0 for s in range(12)]
    for s, (measured, reads) in enumerate(count):
        if measured:
            assert reads == ["tolist"], (s, reads)
        else:
            assert reads == [], (s, reads)


class _Log:
    def __init__(self) -> None:
        self.records: list = []

    def log(self, record) -> None:
        self.records.append(dict(vars(record)))  # what the record holds when it is logged, as it is then


@pytest.mark.parametrize("every", [2, 3])
def test_plain_loop_device_path_records_lr_and_decisions_equal_the_host_read(monkeypatch, every):
    """The same seeded loop with the CPU's host read (the counts read at step()) and on the stand-in for an
    accelerator (the counts read later): the records returned and logged, the LR at every step, the
    position and the batch decisions are the same, and every record is logged complete, in order."""
    from tests.doubles import assert_same

    log_host = _Log()
    host, records_host, lrs_host, seen_host = _plain_loop(14, every=every, logger=log_host)
    _device_path(monkeypatch)
    log_dev = _Log()
    dev, records_dev, lrs_dev, seen_dev = _plain_loop(14, every=every, logger=log_dev)
    assert any(r.next_accumulation_steps == 8 for r in records_host)  # the controller grew the batch
    assert_same(lrs_dev, lrs_host)
    assert_same(seen_dev, seen_host)
    assert_same(records_dev, records_host)
    assert dev.tokens_seen == host.tokens_seen and dev.last_stats == host.last_stats
    dev.remove_hooks()
    assert_same(log_dev.records, log_host.records)
    assert len(log_host.records) == 14


def test_plain_loop_counts_arrive_without_a_wait_in_an_unmeasured_window(monkeypatch):
    """The copy of the counts never finishes by itself (an accelerator still busy): an unmeasured window
    neither reads the host nor waits for it; the counts are taken at the next measured window's end (after
    its one read), and the records then equal the host read's."""
    from cbs_tracker.core.collector import HostCopy
    from tests.doubles import assert_same

    _, records_host, lrs_host, _ = _plain_loop(9, every=3)
    _device_path(monkeypatch)
    monkeypatch.setattr(HostCopy, "ready", lambda self: False)
    waits: list[int] = []
    real_wait = HostCopy.wait
    monkeypatch.setattr(HostCopy, "wait", lambda self: (waits.append(1), real_wait(self))[1])
    count: list = []

    from cbs_tracker import CBSTracker

    per_window: list[int] = []
    real_step = CBSTracker.step

    def step(self):
        before = len(waits)
        out = real_step(self)
        per_window.append(len(waits) - before)
        return out

    monkeypatch.setattr(CBSTracker, "step", step)
    tracker, records_dev, lrs_dev, _ = _plain_loop(9, every=3, count=count)
    measured = [m for m, _ in count]
    assert measured == [s % 3 == 0 for s in range(9)]
    assert all(reads == ([] if not m else ["tolist"]) for m, reads in count), count
    # no wait in a window not measured; a measured one takes the two before it, after its read
    assert per_window == [0, 0, 0, 2, 0, 0, 2, 0, 0], per_window
    assert_same(lrs_dev, lrs_host)
    assert_same(records_dev, records_host)  # reading the last two records' units waits for them


def test_plain_loop_what_needs_the_units_at_once_waits_for_them(monkeypatch):
    """Counts still on their way (the copy never finishes by itself): the tokens a stop, a checkpoint, a
    pickle of the record or tracker.tokens_seen read are exact, each waiting for the copy first."""
    import pickle

    from cbs_tracker.core.collector import HostCopy

    host, records_host, _, _ = _plain_loop(5, every=3)  # windows 3 and 4 not measured
    _device_path(monkeypatch)
    monkeypatch.setattr(HostCopy, "ready", lambda self: False)
    dev, records_dev, _, _ = _plain_loop(5, every=3)
    assert "_tokens" in vars(records_dev[-1])  # still on its way
    assert pickle.loads(pickle.dumps(records_dev[-1])) == records_host[-1]
    assert "_tokens" not in vars(records_dev[-1])
    _, records_dev, _, _ = _plain_loop(5, every=3)
    assert dev.state_dict()["tokens_seen"] == host.state_dict()["tokens_seen"]
    dev2, _, _, _ = _plain_loop(5, every=3)
    assert dev2.done(tokens=host.tokens_seen)
    dev3, _, _, _ = _plain_loop(5, every=3)
    assert not dev3.done(tokens=host.tokens_seen + 1)
    assert dev3.tokens_seen == host.tokens_seen and dev3.last_stats == host.last_stats


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's synchronisation debug mode needs a CUDA GPU")
def test_plain_loop_unmeasured_window_does_not_synchronise_on_cuda():
    """On a CUDA GPU: with torch.cuda.set_sync_debug_mode('error'), a window not measured with labels= (its
    microbatches and its step()) runs without a synchronising call."""
    from cbs_tracker import CBSTracker

    device = torch.device("cuda")
    torch.manual_seed(0)
    model = torch.nn.Linear(DIM, 1).to(device)
    tracker = CBSTracker(model, accumulation_steps=ACC, unit="tokens", measure_every=4)
    x, target, labels = (t.to(device) for t in _token_data(8))
    i = 0
    for s in range(8):
        unmeasured = s % 4 != 0
        for _ in range(ACC):
            y = labels[i : i + MICRO].clone()
            torch.cuda.set_sync_debug_mode("error" if unmeasured else "default")
            try:
                with tracker.microbatch(labels=y):
                    mask = (y != -100).to(x.dtype)
                    err = model(x[i : i + MICRO]).squeeze(-1) - target[i : i + MICRO]
                    (0.5 * (err.pow(2) * mask).sum() / (ACC * MICRO * LENGTH)).backward()
                record = tracker.step() if _ == ACC - 1 else None
            finally:
                torch.cuda.set_sync_debug_mode("default")
            i += MICRO
        assert record is not None and record.measured == (not unmeasured)
        model.zero_grad(set_to_none=True)
    assert tracker.tokens_seen == float((labels[:i] != -100).sum())
