"""Lightning adapter: ``CBSCallback`` measures the noise scale and grows the batch safely mid-epoch.

Usage::

    import lightning as L
    from cbs_tracker import CBSCallback

    trainer = L.Trainer(accumulate_grad_batches=2, callbacks=[CBSCallback()])
    trainer.fit(model, train_loader)

What it does, per optimizer step (DESIGN §2–§5, McCandlish et al. 2018, App. A):

* **measure**: a tensor hook on every trainable parameter of the LightningModule
  records the squared norm of each microbatch's local gradient (between
  ``on_before_backward`` and ``on_after_backward``, so only training backwards
  count); ``on_before_optimizer_step`` reads the squared norm of the synced,
  unscaled, not yet clipped ``.grad``. One ``all_reduce`` of seven numbers per
  step carries the sums over the data-parallel ranks;
* **estimate**: Lightning divides each microbatch loss by
  ``trainer.accumulate_grad_batches`` (``A``) and DDP averages over ranks; the
  norms are put back on one scale by :func:`cbs_tracker.integrations.plain.reduce_window`
  (small norms ``x A^2 / S^2``, big norm ``x (D A / K)^2``, ``S`` the AMP loss
  scale, ``K`` the microbatches really run) and fed to a
  :class:`~cbs_tracker.core.estimator.NoiseScaleEstimator`;
* **decide**: a :class:`~cbs_tracker.policy.controller.BatchSizeController` answers with the
  accumulation steps of the next window;
* **apply safely**: Lightning steps when ``(batch_idx + 1) % A == 0``, zeroes the
  gradients when ``batch_idx % A == 0`` and divides by the *current* ``A``, so a
  value changed at an arbitrary moment corrupts a window. A new value ``A'`` is
  written to ``trainer.accumulate_grad_batches`` only in ``on_train_batch_end`` of
  a batch that stepped and only when ``(batch_idx + 1) % A' == 0`` (for a
  doubling: at most one more window of the old size), or at the start of an epoch.

The last window of an epoch (or of ``limit_train_batches``) can be short: Lightning
steps on the last batch and still divides each of its ``K < A`` losses by ``A``
(Lightning issue #19987). The callback measures that window with its real ``K``
and real size; with ``rescale_short_window=True`` it also multiplies the gradient
by ``A / K`` before clipping and the optimizer step, so the step uses the mean
gradient of the window like every other step.

Loss normalisation assumed: ``training_step`` returns the mean loss over the
microbatch's own units (samples or loss-contributing tokens), as is usual. With a
token-weighted loss (sum over tokens divided by the global batch's tokens) the
per-microbatch gradients are weighted by ``b_k / B`` instead (see
:mod:`cbs_tracker.integrations.plain`).

Caveats:

* ``Trainer(max_steps=...)`` counts optimizer steps: after a doubling each step
  consumes twice the data. Budget a run by epochs or tokens; schedulers sized in
  steps (``OneCycleLR`` from ``estimated_stepping_batches``) are warned about.
* A checkpoint is consistent at a window boundary (``ModelCheckpoint`` saves after
  an optimizer step or at an epoch end); the microbatches of an unfinished window
  are not saved (Lightning does not save their gradients either). Resuming
  mid-epoch with a non-resumable DataLoader replays other batches (Lightning warns).
* The learning-rate factor of a change (``lr_scaling`` of the controller) is applied
  to the optimizer and the first LR scheduler attached to it.
* With ``ddp_spawn`` the callback object in the launching process holds no state
  after ``fit``: the ranks measured (read the logs or a checkpoint).
* FSDP (``FSDPStrategy``, ``ModelParallelStrategy``) and DeepSpeed are refused (see
  ``Raises`` of :class:`CBSCallback`); Lightning 2.6 runs FSDP on GPUs only.

Hooks used (Lightning 2.x order): ``setup`` (conflicts refused) -> ``on_fit_start``
(after the strategy wrapped the model: hooks registered, accumulation restored) ->
per batch ``on_train_batch_start`` (count units) -> ``on_before_backward`` ->
backward (tensor hooks) -> ``on_after_backward`` -> ``on_before_optimizer_step``
(measure, decide, log) -> clipping -> ``optimizer.step`` -> ``on_train_batch_end``
(apply a pending accumulation).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from cbs_tracker.integrations.plain import (
    build_record,
    reduce_window,
    unscale_and_get_scale,
    update_estimator,
)
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from cbs_tracker.core import distributed as cbs_dist
from cbs_tracker.core.collector import GradStatsCollector, StepStats, adam_preconditioner
from cbs_tracker.core.estimator import NoiseScaleEstimator
from cbs_tracker.core.record import StepRecord, Unit
from cbs_tracker.core.tags import record_scalars, schedule_scalars, schedule_step
from cbs_tracker.core.units import BatchSizeFn, label_tokens, leading_dim

__all__ = ["CBSCallback", "label_tokens", "leading_dim"]  # the last two live in cbs_tracker.core.units

CALLBACK_STATE_VERSION = 1


# Schedulers sized in optimizer steps: when the accumulation grows, fewer optimizer
# steps are taken and the schedule does not finish (attribute holding the length).
_STEP_SIZED_SCHEDULERS = {
    "OneCycleLR": "total_steps",
    "CosineAnnealingLR": "T_max",
    "LinearLR": "total_iters",
    "PolynomialLR": "total_iters",
    "ConstantLR": "total_iters",
}


def _flatten_schedulers(scheduler: Any) -> list[Any]:
    """The scheduler and, for ``SequentialLR`` / ``ChainedScheduler``, the ones inside it."""
    out = [scheduler]
    for child in getattr(scheduler, "_schedulers", None) or ():
        out.extend(_flatten_schedulers(child))
    return out


class CBSCallback(Callback):
    """Measures the gradient noise scale of a Lightning run and grows ``accumulate_grad_batches`` safely.

    Args:
        controller: ``"auto"`` (default) builds a
            :class:`~cbs_tracker.policy.controller.BatchSizeController` with its defaults;
            pass a configured one, or ``None`` to measure and log only.
        observe_only: never change the accumulation. With ``controller="auto"`` the
            controller is built with ``observe_only=True`` (it still reports its
            critical batch); with an explicit controller pass
            ``BatchSizeController(observe_only=True)`` instead.
        batch_size_fn: ``fn(batch) -> units`` of one microbatch on one rank (an int,
            a float or a 0-d tensor, kept on the device). Default: the leading
            dimension of the batch's first tensor (:func:`leading_dim`). For a language
            model, :func:`label_tokens` counts loss-contributing tokens.
        unit: ``"samples"`` or ``"tokens"``: what ``batch_size_fn`` counts and the unit of
            every reported size. ``None`` (default): ``"samples"`` with the default
            counter, ``"tokens"`` with a ``batch_size_fn``.
        rescale_short_window: multiply the gradient of a short last window of an epoch
            (``K < A`` microbatches, each divided by ``A`` by Lightning, issue #19987)
            by ``A / K`` before clipping and the step, so it is the window's mean
            gradient. Default ``False`` (Lightning's behaviour; the window is measured
            with its real size either way).
        preconditioner: ``None`` (raw gradients) or ``"adam"``: measure
            ``g / (sqrt(v_hat) + eps)`` with the optimizer's second moments.
        estimator: a configured :class:`~cbs_tracker.core.estimator.NoiseScaleEstimator`.
        process_group: the data-parallel group (default: all ranks of the run).
        log_every_n_steps: write the ``cbs/`` tags to the Trainer's loggers every this
            many optimizer steps; ``None`` (default) uses ``Trainer(log_every_n_steps)``.
            Steps at which the accumulation changes are always written.
        prog_bar: show ``cbs/noise_scale`` and ``cbs/global_batch_{unit}`` on the progress bar.
        name: distinguishes the checkpoint state of several instances (``state_key``).

    Raises:
        TypeError / ValueError: on bad arguments (the message names the argument).
        RuntimeError: at ``Trainer.fit``, for a configuration the callback cannot
            handle: manual optimization, a ``GradientAccumulationScheduler``, a strategy
            that accumulates gradients itself (DeepSpeed), or FSDP.
    """

    def __init__(
        self,
        *,
        controller: Any = "auto",
        observe_only: bool = False,
        batch_size_fn: BatchSizeFn | None = None,
        unit: Unit | None = None,
        rescale_short_window: bool = False,
        preconditioner: Literal["adam"] | None = None,
        estimator: NoiseScaleEstimator | None = None,
        process_group: Any | None = None,
        log_every_n_steps: int | None = None,
        prog_bar: bool = True,
        name: str | None = None,
    ) -> None:
        if not isinstance(observe_only, bool):
            raise TypeError(f"CBSCallback(observe_only={observe_only!r}): expected True or False")
        if isinstance(controller, str):
            if controller != "auto":
                raise ValueError(
                    f"CBSCallback(controller={controller!r}): expected 'auto', None or a BatchSizeController"
                )
            from cbs_tracker.policy.controller import BatchSizeController

            controller = BatchSizeController(observe_only=observe_only)
        elif controller is not None:
            if not all(callable(getattr(controller, m, None)) for m in ("update", "state_dict", "load_state_dict")):
                raise TypeError(
                    f"CBSCallback(controller={type(controller).__name__}): expected 'auto', None or a "
                    "BatchSizeController (an object with update(...), state_dict() and load_state_dict())"
                )
            if observe_only and not getattr(controller, "observe_only", False):
                raise ValueError(
                    "CBSCallback(controller=<BatchSizeController>, observe_only=True): pass "
                    "BatchSizeController(observe_only=True) (or controller=None) instead"
                )
        if batch_size_fn is not None and not callable(batch_size_fn):
            raise TypeError(
                f"CBSCallback(batch_size_fn={batch_size_fn!r}): expected a function batch -> units, or None"
            )
        if unit is None:
            unit = "samples" if batch_size_fn is None else "tokens"
        if unit not in ("tokens", "samples"):
            raise ValueError(f"CBSCallback(unit={unit!r}): must be 'tokens', 'samples' or None")
        if not isinstance(rescale_short_window, bool):
            raise TypeError(f"CBSCallback(rescale_short_window={rescale_short_window!r}): expected True or False")
        if preconditioner not in (None, "adam"):
            raise ValueError(f"CBSCallback(preconditioner={preconditioner!r}): must be None or 'adam'")
        if estimator is not None and not isinstance(estimator, NoiseScaleEstimator):
            raise TypeError(
                f"CBSCallback(estimator={type(estimator).__name__}): expected a NoiseScaleEstimator or None"
            )
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1
        ):
            raise ValueError(f"CBSCallback(log_every_n_steps={log_every_n_steps!r}): must be an integer >= 1 or None")
        if not isinstance(prog_bar, bool):
            raise TypeError(f"CBSCallback(prog_bar={prog_bar!r}): expected True or False")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"CBSCallback(name={name!r}): expected a str or None")

        self.controller = controller
        self.observe_only = observe_only
        self.batch_size_fn: BatchSizeFn = batch_size_fn if batch_size_fn is not None else leading_dim
        self.unit: Unit = unit
        self.rescale_short_window = rescale_short_window
        self.preconditioner = preconditioner
        self.estimator = estimator if estimator is not None else NoiseScaleEstimator()
        self.process_group = process_group
        self.log_every_n_steps = log_every_n_steps
        self.prog_bar = prog_bar
        self.name = name

        self.collector: GradStatsCollector | None = None
        self.dp_group: Any | None = None
        self.dp_degree = 1
        self._avg_ranks = 1
        self._transform: Any = None
        self._params: list[nn.Parameter] = []
        self._step = 0
        self._tokens_seen = 0.0
        self._accumulation = 1  # trainer.accumulate_grad_batches as last set (Lightning does not save it)
        self._pending: int | None = None  # decided accumulation not yet applied
        self._pending_lr_factor = 1.0
        self._warned_single = False
        self._restored: dict[str, Any] | None = None  # checkpoint state waiting for the trainer
        self._micro_size: float | torch.Tensor = 0.0
        self._window_divisors: set[int] = set()
        self._stepped = False
        self.last_record: StepRecord | None = None
        self.last_stats: StepStats | None = None
        self.last_decision: Any | None = None
        self.applied_changes: list[tuple[int, int, int]] = []  # (step, batch_idx or -1, new A)

    # ------------------------------------------------------------------ public state
    @property
    def state_key(self) -> str:
        if self.name is None:
            return type(self).__qualname__
        return self._generate_state_key(name=self.name)

    @property
    def noise_scale(self) -> float | None:
        """Smoothed ``B_simple`` in :attr:`unit`; ``None`` until measurable."""
        return self.estimator.noise_scale

    @property
    def tokens_seen(self) -> float:
        """Units (see :attr:`unit`) consumed by all DP ranks in measured steps so far."""
        return self._tokens_seen

    @property
    def steps(self) -> int:
        """Optimizer steps measured so far (equals ``trainer.global_step`` when attached from the start)."""
        return self._step

    @property
    def pending_accumulation_steps(self) -> int | None:
        """A decided accumulation waiting for a safe batch to take effect, else ``None``."""
        return self._pending

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._check_configuration(trainer, pl_module)

    def _check_configuration(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not pl_module.automatic_optimization:
            raise RuntimeError(
                "CBSCallback needs automatic optimization: with `automatic_optimization = False` the "
                "LightningModule steps the optimizer itself and Lightning's `accumulate_grad_batches` is "
                "not used. Use the plain-loop CBSTracker inside `training_step`, or remove CBSCallback."
            )
        from lightning.pytorch.callbacks import GradientAccumulationScheduler

        schedulers = [type(cb).__name__ for cb in trainer.callbacks if isinstance(cb, GradientAccumulationScheduler)]
        if schedulers:
            raise RuntimeError(
                f"CBSCallback cannot be used with {schedulers[0]} in the same Trainer: both set "
                "`trainer.accumulate_grad_batches`. Remove the GradientAccumulationScheduler (CBSCallback "
                "changes the accumulation itself) or use CBSCallback(controller=None) to measure only "
                "(it then still cannot share the Trainer with it)."
            )
        strategy = trainer.strategy
        if getattr(strategy, "handles_gradient_accumulation", False):
            raise RuntimeError(
                f"CBSCallback cannot be used with {type(strategy).__name__}: that strategy accumulates "
                "gradients itself (e.g. DeepSpeed's gradient_accumulation_steps), so the callback can "
                "neither see each microbatch's gradient nor change the accumulation between steps. Use "
                "a strategy such as 'ddp' or the plain-loop CBSTracker."
            )
        if type(strategy).__name__ in ("FSDPStrategy", "ModelParallelStrategy"):
            raise RuntimeError(
                f"CBSCallback does not support {type(strategy).__name__} yet: sharded parameters are "
                "replaced by flat or unsharded copies during forward, so hooks on the module's parameters "
                "do not see the per-microbatch gradients. Use 'ddp' / 'ddp_spawn', or the plain-loop "
                "CBSTracker with FSDP2."
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check_configuration(trainer, pl_module)
        self.dp_group = cbs_dist.resolve_dp_group(self.process_group)
        self.dp_degree = cbs_dist.group_size(self.dp_group)
        # DDP averages the gradients over its ranks (all ranks: Lightning's DDP uses the world).
        self._avg_ranks = trainer.world_size if trainer.world_size > 1 else 1
        if self.preconditioner == "adam":
            if not trainer.optimizers:
                raise RuntimeError("CBSCallback(preconditioner='adam'): the Trainer has no optimizer")
            self._transform = adam_preconditioner(trainer.optimizers[0])
        if self.collector is not None:
            self.collector.remove()
        self._params = [p for p in pl_module.parameters() if p.requires_grad]
        self.collector = GradStatsCollector(self._params, transform=self._transform)
        self._accumulation = int(trainer.accumulate_grad_batches)
        self._apply_restored(trainer)
        self._warn_schedulers(trainer)
        if trainer.accumulate_grad_batches * self.dp_degree < 2 and not self._warned_single:
            self._warned_single = True
            rank_zero_warn(
                "CBSCallback: each optimizer step has a single microbatch (Trainer(accumulate_grad_batches=1) "
                "on one data-parallel rank), so there is no second batch size and the noise scale is not "
                "measured (nor the batch grown). Use accumulate_grad_batches >= 2 (e.g. halve the "
                "DataLoader's batch_size and set accumulate_grad_batches=2) or more data-parallel ranks.",
                category=UserWarning,
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Strategies that restore the checkpoint after setup load it after on_fit_start.
        self._apply_restored(trainer)

    def _apply_restored(self, trainer: pl.Trainer) -> None:
        state = self._restored
        if state is None or self.collector is None:
            return
        self._restored = None
        if int(state["dp_degree"]) != self.dp_degree:
            raise ValueError(
                f"CBSCallback: the checkpoint was taken with dp_degree={state['dp_degree']} but this run has "
                f"dp_degree={self.dp_degree}; accumulate_grad_batches={state['accumulation_steps']} would give "
                "a different global batch. Resume with the same number of data-parallel ranks."
            )
        trainer.accumulate_grad_batches = int(state["accumulation_steps"])
        self._accumulation = int(state["accumulation_steps"])

    def _warn_schedulers(self, trainer: pl.Trainer) -> None:
        if self.controller is None or getattr(self.controller, "observe_only", False):
            return
        estimated: float | None = None
        for config in trainer.lr_scheduler_configs:
            if config.interval != "step":
                continue
            for sched in _flatten_schedulers(config.scheduler):
                attr = _STEP_SIZED_SCHEDULERS.get(type(sched).__name__)
                if attr is None:
                    continue
                length = getattr(sched, attr, None)
                if type(sched).__name__ != "OneCycleLR":
                    if estimated is None:
                        try:
                            estimated = float(trainer.estimated_stepping_batches)
                        except Exception:  # only used to decide whether to warn
                            estimated = math.nan
                    if not (isinstance(length, (int, float)) and length >= 0.5 * estimated):
                        continue  # a short warm-up is not sized by the run's step count
                rank_zero_warn(
                    f"CBSCallback: the LR scheduler {type(sched).__name__}({attr}={length}) is sized in "
                    "optimizer steps (e.g. from Trainer.estimated_stepping_batches, computed with "
                    f"accumulate_grad_batches={trainer.accumulate_grad_batches}). When CBSCallback grows the "
                    "accumulation, fewer optimizer steps are taken and the schedule will not reach its end. "
                    "Size it in tokens (e.g. a LambdaLR on the callback's tokens_seen), or use "
                    "CBSCallback(observe_only=True).",
                    category=UserWarning,
                )

    # ------------------------------------------------------------------ per batch
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A window that never reached its step (the previous epoch was cut short) is discarded:
        # Lightning zeroes its gradients on the first batch of this epoch.
        if self.collector is not None and self.collector.num_microbatches:
            self.collector.reset_window()
        self._window_divisors.clear()
        if self._pending is not None:
            # any value is safe here: batch_idx restarts at 0 (a zero_grad batch)
            self._apply_pending(trainer, batch_idx=-1)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        size = self.batch_size_fn(batch)
        if not isinstance(size, torch.Tensor):
            if isinstance(size, bool) or not isinstance(size, (int, float)) or not size >= 0:
                raise ValueError(
                    f"CBSCallback(batch_size_fn=...) returned {size!r} for batch {batch_idx}: expected a "
                    "number >= 0 or a 0-d tensor"
                )
        self._micro_size = size

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self.collector is None:
            return
        # Lightning divided this microbatch's loss by the value it reads right now.
        self._window_divisors.add(int(trainer.accumulate_grad_batches))
        self.collector.begin_microbatch()

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.collector is None:
            return
        self.collector.end_microbatch(self._micro_size)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.collector is None:
            return
        self._stepped = True
        divisors = sorted(self._window_divisors)
        self._window_divisors.clear()
        divisor = divisors[-1] if divisors else int(trainer.accumulate_grad_batches)
        local_k = self.collector.num_microbatches
        scale = self._loss_scale(trainer, optimizer)
        stats = reduce_window(
            self.collector,
            self._params,
            dp_group=self.dp_group,
            loss_divisor=float(divisor),
            avg_ranks=self._avg_ranks,
            scale=scale,
            transform=self._transform,
        )
        if len(divisors) > 1:
            # someone else changed accumulate_grad_batches inside the window: the 1/A factors differ
            stats = StepStats(stats.small_sq_norm, stats.big_sq_norm, stats.num_microbatches,
                              stats.small_batch, stats.units, finite=False)
            rank_zero_warn(
                f"CBSCallback: trainer.accumulate_grad_batches changed inside an accumulation window "
                f"(values {divisors}); the step is not measured. Only CBSCallback should change it.",
                category=UserWarning,
            )
        self.collector.reset_window()
        if self.rescale_short_window and 0 < local_k < divisor:
            grads = [p.grad for p in self._params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, divisor / local_k)
        self._record_step(trainer, pl_module, optimizer, stats)

    def _loss_scale(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is None or not scaler.is_enabled():
            return None
        # Lightning unscales before on_before_optimizer_step except for optimizers that unscale
        # inside step() (fused); unscale_and_get_scale unscales those here so the big norm is unscaled too.
        return unscale_and_get_scale(scaler, optimizer)

    def _record_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer, stats: StepStats
    ) -> None:
        self._step += 1
        self._tokens_seen += stats.units
        self.last_stats = stats
        k_per_rank = max(1, int(round(stats.num_microbatches / max(self.dp_degree, 1))))

        estimate = update_estimator(self.estimator, stats)

        critical = None
        changed = False
        if self.controller is not None and stats.units > 0:
            decision = self.controller.update(
                step=self._step,
                tokens_seen=self._tokens_seen,
                global_batch=stats.units,
                accumulation_steps=k_per_rank,
                noise_scale=self.estimator.noise_scale,
            )
            self.last_decision = decision
            critical = decision.critical_batch
            if decision.changed and not self.observe_only:
                changed = True
                self._pending = int(decision.accumulation_steps)
                self._pending_lr_factor *= float(decision.lr_factor)
                rank_zero_info(
                    f"CBSCallback step {self._step}: accumulate_grad_batches "
                    f"{trainer.accumulate_grad_batches} -> {self._pending} ({decision.reason})"
                )

        lr = float(optimizer.param_groups[0]["lr"]) if optimizer.param_groups else None
        record = build_record(
            stats, self.estimator, estimate, step=self._step, tokens_seen=self._tokens_seen, unit=self.unit,
            accumulation_steps=k_per_rank, dp_degree=self.dp_degree, critical_batch=critical, lr=lr,
            next_accumulation_steps=self._pending if self._pending is not None else int(trainer.accumulate_grad_batches),
        )
        self.last_record = record
        self._log(trainer, pl_module, record, force=changed)

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, record: StepRecord, *, force: bool) -> None:
        if self.prog_bar:
            if record.noise_scale is not None:
                pl_module.log("cbs/noise_scale", record.noise_scale, prog_bar=True, logger=False,
                              on_step=True, on_epoch=False, batch_size=1)
            pl_module.log(f"cbs/global_batch_{record.unit}", record.global_batch, prog_bar=True,
                          logger=False, on_step=True, on_epoch=False, batch_size=1)
        every = self.log_every_n_steps if self.log_every_n_steps is not None else int(trainer.log_every_n_steps)
        if not trainer.loggers or not (force or record.step % max(every, 1) == 0):
            return
        from lightning.pytorch.loggers import TensorBoardLogger

        scalars = record_scalars(record)
        for logger in trainer.loggers:
            # loggers write on rank 0 only (their log_metrics is rank_zero_only)
            logger.log_metrics(scalars, step=record.step)
            if isinstance(logger, TensorBoardLogger):
                # the schedule against units seen; other loggers need monotonic steps per call
                logger.log_metrics(schedule_scalars(record), step=schedule_step(record))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stepped, self._stepped = self._stepped, False
        if self._pending is None or not stepped:
            return
        # Lightning steps when (batch_idx + 1) % A == 0 and zero-grads when batch_idx % A == 0:
        # the new value keeps both true for the next window only if it divides batch_idx + 1.
        if (batch_idx + 1) % self._pending == 0:
            self._apply_pending(trainer, batch_idx)

    def _apply_pending(self, trainer: pl.Trainer, batch_idx: int) -> None:
        new = self._pending
        if new is None:
            return
        self._pending = None
        trainer.accumulate_grad_batches = new
        self._accumulation = new
        self.applied_changes.append((self._step, batch_idx, new))
        factor, self._pending_lr_factor = self._pending_lr_factor, 1.0
        if factor != 1.0 and trainer.optimizers:
            from cbs_tracker.policy.lr import apply_lr_factor

            optimizer = trainer.optimizers[0]
            # the factor multiplies what the scheduler sets (see apply_lr_factor)
            schedulers = [c.scheduler for c in trainer.lr_scheduler_configs
                          if getattr(c.scheduler, "optimizer", None) is optimizer]
            apply_lr_factor(optimizer, factor, schedulers[0] if schedulers else None)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_hooks()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._remove_hooks()

    def _remove_hooks(self) -> None:
        if self.collector is not None:
            self.collector.remove()
            self.collector = None

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The state that continues the same schedule: small, plain numbers, a version.

        ``accumulation_steps`` is saved because Lightning does not checkpoint
        ``trainer.accumulate_grad_batches``; a decided but not yet applied value is
        kept as ``pending_accumulation_steps`` (0: none).
        """
        return {
            "version": CALLBACK_STATE_VERSION,
            "unit": self.unit,
            "step": self._step,
            "tokens_seen": self._tokens_seen,
            "accumulation_steps": self._accumulation,
            "pending_accumulation_steps": 0 if self._pending is None else self._pending,
            "pending_lr_factor": self._pending_lr_factor,
            "dp_degree": self.dp_degree,
            "warned_single": self._warned_single,
            "estimator": self.estimator.state_dict(),
            "controller": None if self.controller is None else self.controller.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; ``trainer.accumulate_grad_batches`` is set at fit start.

        Raises:
            KeyError: a required key is missing.
            ValueError: the version is newer than this code, or the unit differs.
        """
        required = ("version", "step", "tokens_seen", "accumulation_steps", "dp_degree", "estimator")
        missing = [k for k in required if k not in state_dict]
        if missing:
            raise KeyError(f"CBSCallback.load_state_dict: missing keys {missing}")
        if int(state_dict["version"]) > CALLBACK_STATE_VERSION:
            raise ValueError(
                f"CBSCallback.load_state_dict: state version {state_dict['version']} is newer than "
                f"{CALLBACK_STATE_VERSION}; upgrade cbs-tracker"
            )
        unit = state_dict.get("unit", self.unit)
        if unit != self.unit:
            raise ValueError(
                f"CBSCallback.load_state_dict: the checkpoint counts {unit} but this callback counts "
                f"{self.unit} (unit={self.unit!r}); the noise scale and batch sizes would mix units"
            )
        self._step = int(state_dict["step"])
        self._tokens_seen = float(state_dict["tokens_seen"])
        pending = int(state_dict.get("pending_accumulation_steps", 0))
        self._pending = pending if pending > 0 else None
        self._pending_lr_factor = float(state_dict.get("pending_lr_factor", 1.0))
        self._warned_single = bool(state_dict.get("warned_single", False))
        self.estimator.load_state_dict(state_dict["estimator"])
        if self.controller is not None and state_dict.get("controller") is not None:
            self.controller.load_state_dict(state_dict["controller"])
        self._restored = dict(state_dict)
