"""Microbatch-first growth in Lightning: ``CBSCallback(max_microbatch=...)`` with a ``CBSDataLoader``.

Checked against what ran, recomputed independently in float64: every sample once per
epoch, no microbatch mixing two sizes, each optimizer step's gradient equal to
Lightning's ``sum_k g_k / A`` over the microbatches it held, and each step's estimate
equal to the estimate from those microbatch gradients.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from cbs_tracker import CBSCallback, CBSDataLoader
from cbs_tracker.core.estimator import estimate_from_norms
from tests.doubles import PlanController
from tests.lightning_workers import leave_process_group
from tests.test_microbatch_first import ROWS, D, Indexed

LEVELS = [2] * 3 + [4] * 3 + [8] * 3 + [16] * 6  # loader batches per window, as planned (one epoch's worth)
N = ROWS * sum(LEVELS)
PLAN = {3: 4, 6: 8, 9: 16}


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(D, 1, bias=False).double()
        self.seen: list[dict] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(dict(epoch=self.current_epoch, step=self.trainer.global_step, index=batch["index"].tolist()))
        return 0.5 * (self.lin(batch["x"]).squeeze(-1) - batch["y"]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        return 0.5 * (self.lin(batch["x"]).squeeze(-1) - batch["y"]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class StepLog(pl.Callback):
    """Per optimizer step: the weights it was computed at, its gradient, the accumulation and the record."""

    def __init__(self, cbs: CBSCallback) -> None:
        self.cbs, self.steps = cbs, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps.append(dict(w=pl_module.lin.weight.detach().flatten().clone(),
                               grad=pl_module.lin.weight.grad.flatten().clone(),
                               acc=self.cbs.window_accumulation, record=self.cbs.last_record))


def _fit(epochs: int = 2, *, shuffle: bool = True, validate_on_train_loader: int | None = None, **loader_kw):
    cbs = CBSCallback(controller=PlanController(PLAN), max_microbatch=4 * ROWS, unit="samples", prog_bar=False)
    log = StepLog(cbs)
    module = Regression()
    loader = CBSDataLoader(Indexed(N), batch_size=ROWS, shuffle=shuffle,
                           generator=torch.Generator().manual_seed(0) if shuffle else None, **loader_kw)
    kw = {} if validate_on_train_loader is None else dict(val_check_interval=validate_on_train_loader)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, accumulate_grad_batches=2, logger=False,
                         callbacks=[cbs, log], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, **kw)
    trainer.fit(module, loader, loader if validate_on_train_loader is not None else None)
    return module, log, cbs


@pytest.fixture(scope="module")
def run():
    return _fit()


def _mb_grad(data: Indexed, w: torch.Tensor, idx: list[int]) -> torch.Tensor:
    x, y = data.x[idx], data.y[idx]
    return ((x @ w - y)[:, None] * x).mean(0)


def test_each_sample_once_per_epoch_and_the_microbatch_grows_first(run):
    module, log, _ = run
    for epoch in range(2):
        used = [i for s in module.seen if s["epoch"] == epoch for i in s["index"]]
        assert sorted(used) == list(range(N))  # the epoch's shuffled samples, each once
    steps: dict[int, list[list[int]]] = {}
    for s in module.seen:
        steps.setdefault(s["step"], []).append(s["index"])
    for mbs in steps.values():  # no microbatch mixes two sizes (only an epoch's very last one may be short)
        assert len({len(m) for m in mbs[:-1]}) <= 1 and len(mbs[-1]) <= len(mbs[0])
    layout = [(len(mbs), len(mbs[0])) for mbs in steps.values()]
    # (microbatches, rows): the microbatch doubles up to the cap (8 rows) before the accumulation grows. A decision
    # reaches the loader one window late (Lightning fetches a batch before training the one before it): the plan's
    # doublings at steps 3, 6 and 9 take effect at windows 4, 7 and 10.
    assert layout[:13] == [(2, 2)] * 4 + [(2, 4)] * 3 + [(2, 8)] * 3 + [(4, 8)] * 3
    assert all(count >= 2 for count, _ in layout[:-1])  # one rank: never below two microbatches
    # the records count the level in loader batches: microbatches x loader batches per microbatch
    records = [s["record"] for s in log.steps]
    full = 0
    for r, mbs in zip(records, steps.values(), strict=True):
        if len({len(m) for m in mbs}) == 1 and r.accumulation_steps <= 16:  # not an epoch's cut-short last window
            assert r.accumulation_steps * ROWS == sum(len(m) for m in mbs)
            assert r.micro_batch == len(mbs[0])
            full += 1
    assert full >= len(records) - 2
    assert records[-1].tokens_seen == 2 * N


def test_every_step_gradient_and_estimate_equal_what_ran(run):
    module, log, _ = run
    data = Indexed(N)
    steps: dict[int, list[list[int]]] = {}
    for s in module.seen:
        steps.setdefault(s["step"], []).append(s["index"])
    checked = 0
    for s, mbs in zip(log.steps, steps.values(), strict=True):
        g = torch.stack([_mb_grad(data, s["w"], idx) for idx in mbs])
        # Lightning divides each microbatch loss by the accumulation it reads, also in a short last window
        torch.testing.assert_close(s["grad"], g.sum(0) / s["acc"], rtol=1e-10, atol=1e-13)
        r = s["record"]
        if len({len(m) for m in mbs}) == 1 and len(mbs) == s["acc"]:
            b = float(len(mbs[0]))
            want = estimate_from_norms(float(g.pow(2).sum(1).mean()), float(g.mean(0).pow(2).sum()), b, len(mbs) * b)
            assert r.step_grad_sq_norm == pytest.approx(want.grad_sq_norm, rel=1e-9)
            assert r.step_trace_cov == pytest.approx(want.trace_cov, rel=1e-9)
            checked += 1
    assert checked >= len(log.steps) - 2


def test_loader_workers_give_the_same_run(run):
    module, log, _ = run
    other, other_log, _ = _fit(num_workers=2)
    assert [s["index"] for s in other.seen] == [s["index"] for s in module.seen]
    torch.testing.assert_close(other.lin.weight, module.lin.weight, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_validating_on_the_same_loader_mid_epoch_leaves_training_as_it_was():
    # the same CBSDataLoader object as train and val loader, validated every 3 batches: validation reads its
    # batches as they are and training runs exactly as without it
    plain, plain_log, _ = _fit(epochs=1, shuffle=False)
    shared, shared_log, _ = _fit(epochs=1, shuffle=False, validate_on_train_loader=3)
    assert [s["index"] for s in shared.seen] == [s["index"] for s in plain.seen]
    assert [s["acc"] for s in shared_log.steps] == [s["acc"] for s in plain_log.steps]
    torch.testing.assert_close(shared.lin.weight, plain.lin.weight, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_resume_in_the_middle_of_an_epoch_is_refused_before_a_window_is_misread(tmp_path):
    class SaveAt(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 8 and not (tmp_path / "mid.ckpt").exists():
                trainer.save_checkpoint(tmp_path / "mid.ckpt")

    def trainer(cbs, *extra):
        return pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, accumulate_grad_batches=2, logger=False,
                          callbacks=[cbs, *extra], enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False)

    def cbs():
        return CBSCallback(controller=PlanController(PLAN), max_microbatch=4 * ROWS, unit="samples", prog_bar=False)

    loader = CBSDataLoader(Indexed(N), batch_size=ROWS)
    trainer(cbs(), SaveAt()).fit(Regression(), loader)
    with pytest.raises(RuntimeError, match=r"Lightning's batch \d+ is the loader's microbatch 0: Lightning's counters "
                                           r"and the loader's windows no longer line up"):
        trainer(cbs()).fit(Regression(), loader, ckpt_path=tmp_path / "mid.ckpt")


def test_the_setup_is_checked_at_fit_start():
    cbs = CBSCallback(controller=PlanController(PLAN), max_microbatch=8, unit="samples", prog_bar=False)
    loader = torch.utils.data.DataLoader(Indexed(N), batch_size=ROWS)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=2, logger=False,
                         callbacks=[cbs],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(RuntimeError, match=r"CBSCallback\(max_microbatch=8\): the train dataloader is a DataLoader, "
                                           r"not a cbs_tracker.CBSDataLoader"):
        trainer.fit(Regression(), loader)
    with pytest.raises(ValueError, match=r"CBSCallback\(max_microbatch=0\): must be None or an integer >= 1"):
        CBSCallback(max_microbatch=0)


# ---------------------------------------------------------------------------- two ranks (ddp_spawn)
class Dump(pl.Callback):
    """Writes each rank's microbatches and steps to ``rank{r}.json`` (spawned ranks cannot return them)."""

    def __init__(self, log: StepLog, out_dir: str) -> None:
        self.step_log, self.out_dir = log, out_dir

    def on_fit_end(self, trainer, pl_module):
        import json
        from pathlib import Path

        steps = [dict(w=s["w"].tolist(), grad=s["grad"].tolist(), acc=s["acc"],
                      level=s["record"].accumulation_steps, micro=s["record"].micro_batch,
                      grad_sq=s["record"].step_grad_sq_norm, trace_cov=s["record"].step_trace_cov)
                 for s in self.step_log.steps]
        Path(self.out_dir, f"rank{trainer.global_rank}.json").write_text(
            json.dumps(dict(seen=pl_module.seen, steps=steps, world=trainer.world_size)))

    def teardown(self, trainer, pl_module, stage):
        leave_process_group()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_two_ranks_with_lightnings_distributed_sampler_match_a_float64_reference(tmp_path):
    import json

    cbs = CBSCallback(controller=PlanController(PLAN), max_microbatch=4 * ROWS, unit="samples", prog_bar=False)
    log = StepLog(cbs)
    loader = CBSDataLoader(Indexed(N), batch_size=ROWS, shuffle=True)  # Lightning injects DistributedSampler
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=2, accumulate_grad_batches=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[cbs, log, Dump(log, str(tmp_path))])
    trainer.fit(Regression(), loader)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["world"] == 2
    for epoch in range(2):  # the injected DistributedSampler's shards: each sample once per epoch over both ranks
        used = [i for rank in ranks for s in rank["seen"] if s["epoch"] == epoch for i in s["index"]]
        assert sorted(used) == list(range(N))
    per_rank = []
    for rank in ranks:
        steps: dict[int, list[list[int]]] = {}
        for s in rank["seen"]:
            steps.setdefault(s["step"], []).append(s["index"])
        per_rank.append(list(steps.values()))
    layouts = [[(len(m), len(m[0])) for m in r] for r in per_rank]
    assert layouts[0] == layouts[1]  # the same layout on both ranks, window by window
    # Derived from the rules: the first window runs as Lightning starts it (A = 2 batches of 2 rows; the callback is
    # linked after Lightning fetched its first batch). Two ranks give two microbatches, so one per rank is allowed:
    # level 2 -> 1 x 4 rows. A decision after window t reaches the window whose first microbatch is fetched after
    # it: with one microbatch per window that is t + 2 (the plan's steps 3 and 6 -> windows 5 and 8); level 16
    # (4 x 8, decided after window 9) reaches window 11 (window 10's first microbatch, index 12, was fetched before
    # the decision): it starts there, at index 14, which 4 does not divide (the callback keeps the window whole);
    # the epoch's last window is cut to the 3 microbatches left.
    assert layouts[0][:12] == [(2, 2)] + [(1, 4)] * 3 + [(1, 8)] * 3 + [(2, 8)] * 3 + [(4, 8), (3, 8)]
    data = Indexed(N)
    checked = 0
    for t, (s0, s1) in enumerate(zip(ranks[0]["steps"], ranks[1]["steps"], strict=True)):
        w = torch.tensor(s0["w"], dtype=torch.float64)
        g = [torch.stack([_mb_grad(data, w, idx) for idx in per_rank[r][t]]) for r in range(2)]
        want = (g[0].sum(0) / s0["acc"] + g[1].sum(0) / s1["acc"]) / 2  # DDP averages the ranks' Lightning sums
        for s in (s0, s1):
            torch.testing.assert_close(torch.tensor(s["grad"], dtype=torch.float64), want, rtol=1e-10, atol=1e-13)
        every = torch.cat(g)
        if len({len(m) for r in range(2) for m in per_rank[r][t]}) == 1 and len(every) == 2 * s0["acc"]:
            b = float(len(per_rank[0][t][0]))
            est = estimate_from_norms(float(every.pow(2).sum(1).mean()), float(every.mean(0).pow(2).sum()), b,
                                      len(every) * b)
            assert s0["grad_sq"] == pytest.approx(est.grad_sq_norm, rel=1e-9)
            assert s0["trace_cov"] == pytest.approx(est.trace_cov, rel=1e-9)
            assert s0["level"] * ROWS == len(per_rank[0][t]) * b and s0["micro"] == b
            checked += 1
    assert checked >= len(ranks[0]["steps"]) - 2
