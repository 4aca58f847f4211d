"""Models, data, controllers and the spawned-rank worker of the Hugging Face ``Trainer`` tests.

Kept in a module of its own so that ``torch.multiprocessing.spawn`` children can import
the worker by name.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from tests.doubles import PlanController

D_IN = 8


class Pairs(torch.utils.data.Dataset):
    """``{"x": x_i, "labels": y_i}`` rows of a regression data set."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


def regression_data(n: int, *, seed: int = 0, sigma: float = 0.5, w_star: torch.Tensor | None = None) -> Pairs:
    """``y = x . w* + sigma * eps`` with ``x ~ N(0, I_8)``."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(D_IN, generator=g) if w_star is None else w_star
    x = torch.randn(n, w.numel(), generator=g)
    return Pairs(x, x @ w + sigma * torch.randn(n, generator=g))


class Regression(nn.Module):
    """``Linear(d, 1)``; the loss is half the mean squared error of the microbatch.

    While training it keeps every microbatch it sees (``seen``) so a test can recompute
    each window's gradient independently.
    """

    def __init__(self, d: int = D_IN, *, seed: int = 0, weight: torch.Tensor | None = None) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Linear(d, 1, bias=weight is None)
        if weight is not None:
            with torch.no_grad():
                self.net.weight.copy_(weight[None])
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return 0.5 * (self.net(x).squeeze(-1) - labels).pow(2).mean()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.training:
            self.seen.append((x.detach().clone(), labels.detach().clone()))
        return {"loss": self.loss(x, labels)}




def training_args(out: str, **kw: Any) -> Any:
    from transformers import TrainingArguments

    defaults = dict(
        output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, num_train_epochs=1,
        learning_rate=0.05, optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, report_to="none",
        train_sampling_strategy="sequential", use_cpu=True, save_strategy="no", logging_steps=10_000,
        disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )
    defaults.update(kw)
    return TrainingArguments(**defaults)


def window_checker(model: Regression, trainer_ref: list[Any]) -> Any:
    """A ``TrainerCallback`` that stores, at every optimizer step, ``.grad`` beside the window's reference.

    The reference is ``mean_k grad(loss_k)`` over the microbatches the model saw since the
    previous step, by autograd at the same weights (clipping is off, so ``.grad`` is what
    the optimizer uses).
    """
    from transformers import TrainerCallback

    class Check(TrainerCallback):
        def __init__(self) -> None:
            self.rows: list[dict[str, Any]] = []

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            window, model.seen = model.seen, []
            got = torch.cat([p.grad.detach().flatten().clone() for p in model.parameters()])
            grads = []
            for x, y in window:
                params = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
                out = torch.func.functional_call(model.net, {k[4:]: v for k, v in params.items()}, (x,))
                loss = 0.5 * (out.squeeze(-1) - y).pow(2).mean()
                g = torch.autograd.grad(loss, list(params.values()))
                grads.append(torch.cat([t.flatten() for t in g]))
            trainer = trainer_ref[0]
            self.rows.append(dict(
                microbatches=len(window), got=got, mean=torch.stack(grads).mean(0),
                first_x=window[0][0].clone(), setting=int(args.gradient_accumulation_steps),
                xs=torch.cat([x for x, _ in window]), epoch=getattr(trainer, "_epoch", None),
                params=torch.cat([p.detach().flatten().clone() for p in model.parameters()]),
                record=trainer.last_record,
            ))

    return Check()


def ddp_worker(rank: int, world: int, port: int, out_dir: str, n: int, plan: Any, save: bool = False,
               resume: str | None = None) -> None:
    """One rank of a 2-process gloo ``CBSTrainer`` run with a planned growth; writes ``rank{r}.pt``.

    ``plan``: ``{step: accumulation}`` (a ``PlanController``) or a tuple of ``(samples, batch)``
    marks (a ``BatchSchedule``). ``save``: a checkpoint every optimizer step; ``resume``: the
    checkpoint to continue from."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from cbs_tracker.integrations.transformers import CBSTrainer

    from cbs_tracker import BatchSchedule

    controller = PlanController(plan) if isinstance(plan, dict) else BatchSchedule(plan)
    model = Regression(seed=0)
    ref: list[Any] = []
    check = window_checker(model, ref)
    # a batch schedule: three epochs and a linear LR decay (its timing in starting-batch steps is checked)
    sched = {} if isinstance(plan, dict) else {"num_train_epochs": 3, "lr_scheduler_type": "linear"}
    saving = {"save_strategy": "steps", "save_steps": 1} if save else {}
    args = training_args(os.path.join(out_dir, "run"), ddp_backend="gloo",
                         **({"num_train_epochs": 2} | sched | saving))
    trainer = CBSTrainer(model=model, args=args, train_dataset=regression_data(n), unit="samples",
                         controller=controller, callbacks=[check], lr_coupling="keep")
    ref.append(trainer)
    trainer.train(resume_from_checkpoint=resume)
    rows = [{k: v for k, v in r.items() if k != "record"} | {"record": vars(r["record"])} for r in check.rows]
    torch.save({"rows": rows, "applied": trainer.applied_changes}, os.path.join(out_dir, f"rank{rank}.pt"))


def resized_run(out_dir: str, n: int, marks: Any, accumulation: int, *, save: bool = False,
                resume: str | None = None, **kw: Any) -> dict[str, Any]:
    """A ``CBSTrainer`` run of three epochs under a ``BatchSchedule`` with a linear LR decay, on the ranks there are.

    ``marks``: the schedule's, or ``None`` (no controller: the accumulation stays). ``save``: a
    checkpoint every optimizer step in ``out_dir/run``; ``resume``: the checkpoint to go on from.
    Returns every step's window check (the record as a dict) and the applied changes, with the
    warnings the run raised."""
    import warnings

    from cbs_tracker.integrations.transformers import CBSTrainer

    from cbs_tracker import BatchSchedule

    model = Regression(seed=0)
    ref: list[Any] = []
    check = window_checker(model, ref)
    saving = {"save_strategy": "steps", "save_steps": 1} if save else {}
    args = training_args(os.path.join(out_dir, "run"), num_train_epochs=3, lr_scheduler_type="linear",
                         gradient_accumulation_steps=accumulation, **(saving | kw))
    trainer = CBSTrainer(model=model, args=args, train_dataset=regression_data(n), unit="samples",
                         controller=None if marks is None else BatchSchedule(marks), callbacks=[check])
    ref.append(trainer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=resume)
    rows = [{k: v for k, v in r.items() if k != "record"} | {"record": vars(r["record"])} for r in check.rows]
    return {"rows": rows, "applied": trainer.applied_changes, "warnings": [str(w.message) for w in caught],
            "steps": trainer.state.global_step, "max_steps": trainer.state.max_steps}


def resize_worker(rank: int, world: int, port: int, out_dir: str, n: int, marks: Any, accumulation: int,
                  save: bool, resume: str | None = None, sampling: str = "sequential") -> None:
    """One rank of a gloo :func:`resized_run` (``sampling``: the Trainer's ``train_sampling_strategy``); writes
    ``rank{r}.pt``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    out = resized_run(out_dir, n, marks, accumulation, save=save, resume=resume, ddp_backend="gloo",
                      train_sampling_strategy=sampling)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
