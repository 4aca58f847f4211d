"""Models, data and callbacks for the Lightning tests (module level, so spawned ranks can import them).

Kept out of the test module: ``ddp_spawn`` pickles the LightningModule and the
callbacks into its child processes, which import them by module name
(docs/design.md).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from tests.doubles import PlanController  # noqa: F401 (imported from here by the tests)

D_IN = 8


# ---------------------------------------------------------------------------- data
def regression_data(n: int, *, seed: int = 0, sigma: float = 0.5) -> torch.utils.data.TensorDataset:
    """``y = x . w* + sigma * eps`` with ``x ~ N(0, I_8)`` (docs/design.md, ground truth)."""
    g = torch.Generator().manual_seed(seed)
    w_star = torch.randn(D_IN, generator=g)
    x = torch.randn(n, D_IN, generator=g)
    y = x @ w_star + sigma * torch.randn(n, generator=g)
    return torch.utils.data.TensorDataset(x, y[:, None])


class RankSlice(torch.utils.data.Sampler[int]):
    """Rank ``r`` of ``R`` sees samples ``r, r + R, r + 2R, ...`` in order (no shuffling).

    The rank is read when iterating, inside the spawned process. Lightning's own
    ``DistributedSampler`` always shuffles training data, so the DDP test passes
    ``Trainer(use_distributed_sampler=False)`` and this sampler instead.
    """

    def __init__(self, n: int, ranks: int) -> None:
        self.n, self.ranks = n, ranks

    def __iter__(self):
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return iter(range(rank, self.n, self.ranks))

    def __len__(self) -> int:
        return len(range(0, self.n, self.ranks))


class InterleavedBatches(torch.utils.data.Sampler[list[int]]):
    """The batches ``ddp_spawn`` with ``ranks`` ranks runs, in one process, rank-interleaved.

    With :class:`RankSlice`, rank ``r`` sees samples ``r, r + R, r + 2R, ...``,
    batched by ``batch_size``. This sampler yields
    rank 0's batch 0, rank 1's batch 0, rank 0's batch 1, ... so that a single process
    with ``R`` times the accumulation holds exactly the microbatches of one DDP step
    in each window.
    """

    def __init__(self, n: int, batch_size: int, ranks: int) -> None:
        self.n, self.batch_size, self.ranks = n, batch_size, ranks

    def _order(self) -> list[list[int]]:
        per_rank = [list(range(r, self.n, self.ranks)) for r in range(self.ranks)]
        batches = []
        for j in range(0, len(per_rank[0]), self.batch_size):
            for r in range(self.ranks):
                batches.append(per_rank[r][j : j + self.batch_size])
        return batches

    def __iter__(self):
        return iter(self._order())

    def __len__(self) -> int:
        return len(self._order())


# ---------------------------------------------------------------------------- model
def window_accumulation(trainer: Any, cbs: Any = None) -> int:
    """Microbatches of the window Lightning runs: the callback's (``trainer.accumulate_grad_batches`` is set
    batch by batch in a window that does not start at a multiple of its length), else Lightning's own."""
    value = None if cbs is None else cbs.window_accumulation
    return int(trainer.accumulate_grad_batches) if value is None else int(value)


class Regression(pl.LightningModule):
    """``Linear(8, 1)`` with the mean squared error of its microbatch, SGD (or Adam)."""

    def __init__(self, lr: float = 0.05, *, seed: int = 0, scheduler: str | None = None, manual: bool = False,
                 optimizer: str = "sgd") -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Linear(D_IN, 1)
        self.lr = lr
        self.optimizer_name = optimizer
        self.scheduler = scheduler
        self.automatic_optimization = not manual

    def loss(self, batch: Any, params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        x, y = batch
        out = self.net(x) if params is None else torch.func.functional_call(self.net, params, (x,))
        return nn.functional.mse_loss(out.float(), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        loss = self.loss(batch)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            return None
        return loss

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adam":
            opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        if self.scheduler == "onecycle":
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.lr, total_steps=self.trainer.estimated_stepping_batches)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        if self.scheduler == "cosine":
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=int(self.trainer.estimated_stepping_batches))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        if self.scheduler == "warmup":
            sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=2)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        return opt


class ToyLM(pl.LightningModule):
    """Embedding -> Linear next-token model with ``ignore_index=-100`` labels (token counting)."""

    def __init__(self, vocab: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, 8)
        self.head = nn.Linear(8, vocab)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.head(self.emb(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


# ---------------------------------------------------------------------------- controllers


# ---------------------------------------------------------------------------- observers
def leave_process_group() -> None:
    """Destroy the process group at the end of a ``ddp_spawn`` rank's fit (a callback's ``teardown``: Lightning's last
    collective has run by then). Lightning leaves gloo's group up; torn down by the interpreter at exit, its worker
    threads now and then abort the rank ("terminate called without an active exception", pytorch/pytorch#190489)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class Recorder(pl.Callback):
    """Per optimizer step: the CBS record, Lightning's accumulation and the microbatches run.

    Place it after the CBSCallback. With ``out_dir`` each rank writes ``rank{r}.json``
    at the end of fit (the parent process of ``ddp_spawn`` sees none of this state).
    """

    def __init__(self, cbs: Any, out_dir: str | None = None) -> None:
        self.cbs = cbs
        self.out_dir = out_dir
        self.rows: list[dict[str, Any]] = []
        self._micro = 0
        self._samples = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._micro += 1
        self._samples += int(batch[0].shape[0])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        rec = self.cbs.last_record
        self.rows.append(dict(
            epoch=trainer.current_epoch,
            batch_idx=trainer.fit_loop.epoch_loop.batch_idx,
            lightning_accumulation=window_accumulation(trainer, self.cbs),
            microbatches=self._micro,
            samples=self._samples,
            record=asdict(rec),
            decision_changed=bool(getattr(self.cbs.last_decision, "changed", False)),
        ))
        self._micro = 0
        self._samples = 0

    def teardown(self, trainer, pl_module, stage):
        leave_process_group()

    def on_fit_end(self, trainer, pl_module):
        if self.out_dir is not None:
            path = os.path.join(self.out_dir, f"rank{trainer.global_rank}.json")
            with open(path, "w") as f:
                json.dump({"rows": self.rows, "applied": self.cbs.applied_changes,
                           "world_size": trainer.world_size}, f)


class GradCheck(pl.Callback):
    """Recomputes, with autograd on the same batches, the ideal mean gradient of every window.

    At each optimizer step (after the CBSCallback in the callback list, so after any
    rescaling) it stores what the optimizer is about to use (``p.grad``) next to
    ``mean_k grad(loss_k)`` over the microbatches run since the previous step, computed
    at the same weights under the same autocast, and the reference squared norms
    ``mean_k |grad(loss_k)|^2`` and ``|mean_k grad(loss_k)|^2``.
    """

    def __init__(self, cbs: Any) -> None:
        self.cbs = cbs
        self.window: list[Any] = []
        self.rows: list[dict[str, Any]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.window.append([t.detach().clone() for t in batch])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        names = [n for n, _ in pl_module.net.named_parameters()]
        got = torch.cat([p.grad.detach().flatten().clone() for p in pl_module.net.parameters()])
        grads = []
        for batch in self.window:
            params = {n: p.detach().clone().requires_grad_(True) for n, p in pl_module.net.named_parameters()}
            with trainer.precision_plugin.forward_context():
                loss = pl_module.loss(batch, params)
            g = torch.autograd.grad(loss, [params[n] for n in names])
            grads.append(torch.cat([t.flatten().float() for t in g]))
        stacked = torch.stack(grads)
        mean = stacked.mean(0)
        stats = self.cbs.last_stats
        self.rows.append(dict(
            microbatches=len(self.window),
            lightning_accumulation=window_accumulation(trainer, self.cbs),
            got=got,
            mean=mean,
            ref_small=float(stacked.double().pow(2).sum(1).mean()),
            ref_big=float(mean.double().pow(2).sum()),
            cbs_small=stats.small_sq_norm,
            cbs_big=stats.big_sq_norm,
            cbs_k=stats.num_microbatches,
            finite=bool(torch.isfinite(got).all()),
            dropped=self.cbs.last_record.dropped,
        ))
        self.window = []


class SavedGradCheck(GradCheck):
    """:class:`GradCheck` whose rows (and each step's record) each rank saves as ``rank{r}.pt`` at the end of fit."""

    def __init__(self, cbs: Any, out_dir: str) -> None:
        super().__init__(cbs)
        self.out_dir = out_dir

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        self.rows[-1]["record"] = asdict(self.cbs.last_record)
        self.rows[-1]["batch_idx"] = trainer.fit_loop.epoch_loop.batch_idx
        self.rows[-1]["lr"] = float(optimizer.param_groups[0]["lr"])

    def teardown(self, trainer, pl_module, stage):
        leave_process_group()

    def on_fit_end(self, trainer, pl_module):
        torch.save(self.rows, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


class LambdaRegression(Regression):
    """Adam and a step scheduler whose length does not depend on max_epochs (a resumed fit stays comparable)."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1.0 + 0.1 * e))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class SampleLog(pl.Callback):
    """Per optimizer step: the record, Lightning's accumulation and position, the LR, and the samples run.

    A sample is named by its index in ``dataset`` (found from its first feature, unique in
    :func:`regression_data`). Each rank writes ``rank{r}.json`` to ``out_dir`` at the end of fit,
    with the warnings raised from the fit's setup on.
    """

    def __init__(self, cbs: Any, dataset: Any, out_dir: str) -> None:
        self.cbs, self.out_dir = cbs, out_dir
        keys = dataset.tensors[0][:, 0].tolist()
        self.index = {k: i for i, k in enumerate(keys)}
        assert len(self.index) == len(keys)
        self.rows: list[dict[str, Any]] = []
        self.window: list[int] = []
        self.samples: list[tuple[int, int]] = []  # (epoch, index) of every sample run, in order
        self._catch: Any = None
        self._caught: list[Any] = []

    def setup(self, trainer, pl_module, stage):
        import warnings

        self._catch = warnings.catch_warnings(record=True)
        self._caught = self._catch.__enter__()
        warnings.simplefilter("always")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        ids = [self.index[k] for k in batch[0][:, 0].tolist()]
        self.window += ids
        self.samples += [(trainer.current_epoch, i) for i in ids]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.rows.append(dict(
            epoch=trainer.current_epoch, batch_idx=trainer.fit_loop.epoch_loop.batch_idx,
            lightning_accumulation=window_accumulation(trainer, self.cbs), samples=self.window,
            record=asdict(self.cbs.last_record), lr=float(optimizer.param_groups[0]["lr"]),
        ))
        self.window = []

    def teardown(self, trainer, pl_module, stage):
        leave_process_group()

    def on_fit_end(self, trainer, pl_module):
        messages = [str(w.message) for w in self._caught]
        if self._catch is not None:
            self._catch.__exit__(None, None, None)
            self._catch = None
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"rows": self.rows, "applied": self.cbs.applied_changes, "samples": self.samples,
                       "world_size": trainer.world_size, "global_step": trainer.global_step,
                       "warnings": messages}, f)
