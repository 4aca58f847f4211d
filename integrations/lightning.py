"""Lightning adapter: ``CBSCallback`` measures the noise scale and grows ``accumulate_grad_batches`` safely.

Usage::

    trainer = L.Trainer(accumulate_grad_batches=2, callbacks=[CBSCallback()])
    trainer.fit(model, train_loader)

The callback is hooks plus one decision, *when* a pending accumulation may take
effect (after a step, at a batch where Lightning's counters stay aligned, or at an
epoch start); the step engine does the rest. Facts it relies on: docs/design.md.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from collections.abc import Iterator
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from cbs_tracker.calibrate import CalibrateAt, calibration_scalars
from cbs_tracker.core import distributed as cbs_dist
from cbs_tracker.core.collector import GradStatsCollector, StepStats
from cbs_tracker.core.engine import Engine, EngineSettings
from cbs_tracker.core.estimator import NoiseScaleEstimator
from cbs_tracker.core.loop import group_cap, join_batches, leading_rows, microbatch_layout
from cbs_tracker.core.measure import LOSS_NORMALIZATIONS, loss_scale, unscale_and_get_scale
from cbs_tracker.core.record import StepRecord, Unit
from cbs_tracker.core.session import TrackingSession, check_size
from cbs_tracker.core.tags import record_scalars, schedule_scalars, schedule_step
from cbs_tracker.core.units import BatchSizeFn, label_tokens, leading_dim
from cbs_tracker.policy.lr import COUPLINGS, ScheduleTimer

__all__ = ["CBSCalibration", "CBSCallback", "CBSDataLoader", "label_tokens", "leading_dim"]


class CBSCallback(Callback):
    """Measures the gradient noise scale of a Lightning run and grows ``accumulate_grad_batches`` safely.

    Args:
        controller: ``"auto"`` (default) builds a
            :class:`~cbs_tracker.policy.controller.BatchSizeController` with its defaults;
            pass a configured instance, or ``None`` to measure and log only.
        observe_only: never change the accumulation (with ``controller="auto"`` the
            controller is built with ``observe_only=True`` and still reports its target).
        batch_size_fn: ``fn(batch) -> units`` of one microbatch on one rank (a number or a
            one-element tensor, kept on the device). Default: the leading dimension of the
            batch's first tensor (:func:`leading_dim`); :func:`label_tokens` counts
            loss-contributing tokens.
        unit: ``"samples"`` or ``"tokens"``; ``None`` (default): ``"samples"`` with the
            default counter, ``"tokens"`` with a ``batch_size_fn``.
        rescale_short_window: multiply the gradient of a short last window of an epoch
            (``K < A`` microbatches, each divided by ``A`` by Lightning) by ``A / K`` before
            clipping and the step. Default ``False`` (the window is measured right either way).
            With ``loss_normalization="mean"`` only.
        loss_normalization: what ``training_step`` returns, before Lightning divides it by
            ``accumulate_grad_batches`` (a division the tracker undoes in every mode).
            ``"mean"`` (default): the mean loss of the microbatch. ``"window"``: the sum of
            its units' losses divided by the units of this rank's whole window (as the
            Hugging Face ``Trainer`` does with ``num_items_in_batch``; padded microbatches
            then weigh every token alike). ``"group"``: divided by the window's units on all
            data-parallel ranks, times their number. ``batch_size_fn`` must count the units
            the loss counts (:func:`label_tokens`).
        preconditioner: ``None`` or ``"adam"``: measure ``g / (sqrt(v_hat) + eps)``.
        estimator: a configured :class:`~cbs_tracker.core.estimator.NoiseScaleEstimator`.
        process_group: the data-parallel group (default: all ranks of the run).
        log_every_n_steps: write the ``cbs/`` tags every this many optimizer steps;
            ``None`` uses ``Trainer(log_every_n_steps)``. Changes are always written.
        prog_bar: show ``cbs/noise_scale`` and ``cbs/global_batch_{unit}`` on the progress bar.
        name: distinguishes the checkpoint state of several instances (``state_key``).
        lr_coupling: ``"auto"`` (default: LR x sqrt(B/B0) for Adam-family optimizers, x B/B0
            for SGD), ``"keep"``, ``"sqrt"`` or ``"linear"``.
        cap_lr_at_peak: never let the coupling raise the LR above the schedule's peak
            (default ``None``: ``True`` when the controller has a ``budget_tokens``).
        retime_schedulers: keep every LR scheduler of the Trainer on its timing in units
            seen (default ``True``): an ``interval="step"`` scheduler sized in optimizer steps
            at the starting accumulation (e.g. from ``estimated_stepping_batches``) advances
            by the starting-batch steps each optimizer step held, so it ends with the data.
        max_tokens: stop the run once this many units were consumed (all ranks).
        measure_every: measure one window in ``n`` (default 1), or ``"auto"``: the smallest
            ``n`` keeping the measurement at or below ``measure_target`` of the step time.
            Windows not measured still count for the units, the counters and the schedule.
        measure_target: the share of the step time ``"auto"`` allows (default 0.01).

    Under growth, ``Trainer(max_steps=N)`` means N optimizer steps **at the starting
    accumulation**: the callback stops the run once the units of N such steps were
    consumed, the same data a run without growth would see.

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
        loss_normalization: str = "mean",
        preconditioner: Literal["adam"] | None = None,
        estimator: NoiseScaleEstimator | None = None,
        process_group: Any | None = None,
        log_every_n_steps: int | None = None,
        prog_bar: bool = True,
        name: str | None = None,
        lr_coupling: str | None = "auto",
        cap_lr_at_peak: bool | None = None,
        retime_schedulers: bool = True,
        max_tokens: float | None = None,
        measure_every: int | str = 1,
        measure_target: float = 0.01,
        max_microbatch: int | None = None,
    ) -> None:
        if max_microbatch is not None and (
            isinstance(max_microbatch, bool) or not isinstance(max_microbatch, int) or max_microbatch < 1
        ):
            raise ValueError(
                f"CBSCallback(max_microbatch={max_microbatch!r}): must be None or an integer >= 1 (sequences per "
                "microbatch and rank; the train DataLoader must be a CBSDataLoader)"
            )
        from cbs_tracker.policy.controller import adapter_controller

        controller = adapter_controller("CBSCallback", controller, observe_only)
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
        # measure_every and measure_target are checked here, once (the engine is built at fit start)
        self._settings = EngineSettings(
            owner="CBSCallback", unit=unit, estimator=estimator if estimator is not None else NoiseScaleEstimator(),
            controller=controller, lr_coupling=lr_coupling, cap_lr_at_peak=cap_lr_at_peak,
            warn=_warn_on_rank_zero, measure_every=measure_every,
            measure_target=measure_target, preconditioner=preconditioner,
        )
        if loss_normalization not in LOSS_NORMALIZATIONS:
            raise ValueError(
                f"CBSCallback(loss_normalization={loss_normalization!r}): must be one of {LOSS_NORMALIZATIONS} "
                "('mean': training_step returns the microbatch's mean loss; 'window': its summed unit losses "
                "over this rank's window units; 'group': over the window units of all ranks)"
            )
        if preconditioner not in (None, "adam"):
            raise ValueError(f"CBSCallback(preconditioner={preconditioner!r}): must be None or 'adam'")
        if isinstance(estimator, type) or (estimator is not None and not callable(getattr(estimator, "update", None))):
            raise TypeError(
                f"CBSCallback(estimator={getattr(estimator, '__name__', type(estimator).__name__)}): expected a "
                "NoiseScaleEstimator or None"
            )
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1
        ):
            raise ValueError(f"CBSCallback(log_every_n_steps={log_every_n_steps!r}): must be an integer >= 1 or None")
        _check_logging_and_lr_options(prog_bar=prog_bar, name=name, lr_coupling=lr_coupling,
                                      cap_lr_at_peak=cap_lr_at_peak, retime_schedulers=retime_schedulers,
                                      max_tokens=max_tokens)

        self.controller = controller
        self.observe_only = observe_only
        self.batch_size_fn: BatchSizeFn = batch_size_fn if batch_size_fn is not None else leading_dim
        self.unit: Unit = unit
        self.rescale_short_window = rescale_short_window and loss_normalization == "mean"
        self.loss_normalization = loss_normalization
        self.measure_every, self.measure_target = measure_every, measure_target
        self.preconditioner = preconditioner
        self.estimator = self._settings.estimator
        self.process_group = process_group
        self.log_every_n_steps = log_every_n_steps
        self.prog_bar = prog_bar
        self.name = name
        self.lr_coupling = lr_coupling
        self.cap_lr_at_peak = cap_lr_at_peak
        self.retime_schedulers = retime_schedulers
        self.max_tokens = None if max_tokens is None else float(max_tokens)
        self.max_microbatch = max_microbatch
        self._max_group = 1  # loader batches per microbatch at most (from the first batch's rows)
        self._loader: CBSDataLoader | None = None
        self._trainer: pl.Trainer | None = None

        #: the collector, the reduction of each window, the session and their state (built at fit start)
        self.engine: Engine | None = None
        self._unsynced = False
        self.dp_group: Any | None = None
        self._avg_ranks = 1
        self._params: list[nn.Parameter] = []
        self._epoch_timers: list[ScheduleTimer] = []
        self._micro_size: float | torch.Tensor = 0.0
        self._window_divisors: set[int] = set()
        self._stepped = False
        self._restored: dict[str, Any] | None = None  # checkpoint state waiting for the session
        self.applied_changes: list[tuple[int, int, int]] = []  # (step, batch_idx or -1, new A)
        # the window Lightning runs now: (its first batch_idx, its microbatches), and the value of
        # accumulate_grad_batches this batch runs under (see _align); None between fits and epochs
        self._window: tuple[int, int] | None = None
        self._batch_accumulation: int | None = None

    # ------------------------------------------------------------------ public state
    @property
    def session(self) -> TrackingSession | None:
        """The engine's session (``None`` before the first fit)."""
        return None if self.engine is None else self.engine.session

    @property
    def collector(self) -> GradStatsCollector | None:
        """The engine's collector while the callback is attached to a fit, else ``None``."""
        return None if self.engine is None else self.engine.collector

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
    def noise_scale_interval(self) -> tuple[float, float] | None:
        """90% confidence interval of :attr:`noise_scale` (``None`` until measurable)."""
        return getattr(self.estimator, "noise_scale_interval", None)

    @property
    def dp_degree(self) -> int:
        return 1 if self.session is None else self.session.dp_degree

    @property
    def tokens_seen(self) -> float:
        """Units (see :attr:`unit`) consumed by all DP ranks in measured steps so far."""
        return 0.0 if self.session is None else self.session.units_seen

    @property
    def steps(self) -> int:
        """Optimizer steps measured so far (``trainer.global_step`` when attached from the start)."""
        return 0 if self.session is None else self.session.step

    @property
    def starting_batch_steps(self) -> int:
        """Optimizer steps counted at the starting accumulation (the schedulers' position)."""
        return 0 if self.session is None else self.session.starting_batch_steps

    @property
    def window_accumulation(self) -> int | None:
        """Microbatches of the window Lightning runs now (``None`` outside ``fit``).

        ``trainer.accumulate_grad_batches`` is that number, except in a window that starts where
        its length does not divide the position in the epoch: there the callback sets it batch
        by batch to a value on which Lightning zeroes and steps exactly at the window's bounds
        (and scales each loss to ``1 / window_accumulation``).
        """
        return None if self._window is None else self._window[1]

    @property
    def pending_accumulation_steps(self) -> int | None:
        """A decided accumulation waiting for a safe batch to take effect, else ``None``."""
        return None if self.session is None else self.session.pending_accumulation

    @property
    def last_record(self) -> StepRecord | None:
        return None if self.session is None else self.session.last_record

    @property
    def last_stats(self) -> StepStats | None:
        return None if self.session is None else self.session.last_stats

    @property
    def last_decision(self) -> Any | None:
        return None if self.session is None else self.session.last_decision

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
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
                "do not see the per-microbatch gradients. Use 'ddp' / 'ddp_spawn', or FSDP2 in a plain "
                "loop with FSDPTracker (from cbs_tracker.integrations.fsdp import FSDPTracker)."
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check_configuration(trainer, pl_module)
        self._trainer = trainer
        self.dp_group = cbs_dist.resolve_dp_group(self.process_group)
        # DDP averages the gradients over its ranks (Lightning's DDP uses the world).
        self._avg_ranks = trainer.world_size if trainer.world_size > 1 else 1
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        if self.preconditioner == "adam" and optimizer is None:
            raise RuntimeError("CBSCallback(preconditioner='adam'): the Trainer has no optimizer")
        self._remove_hooks()
        self.engine = Engine(self._settings, starting_accumulation=int(trainer.accumulate_grad_batches),
                             dp_degree=cbs_dist.group_size(self.dp_group), optimizer=optimizer,
                             dp_group=self.dp_group)
        self._params = [p for p in pl_module.parameters() if p.requires_grad]
        if not self._params:
            raise ValueError("CBSCallback: the LightningModule has no parameter with requires_grad=True")
        self.engine.collect(self._params)
        self.engine.give_model_size(pl_module)
        # one device, no wrapper: a backward never syncs, so a window's first gradients can be read from .grad
        self._unsynced = isinstance(trainer.strategy, SingleDeviceStrategy)
        self._apply_restored(trainer)
        if self.session.starting_accumulation * self.session.dp_degree < 2:
            self.session.warn_once(
                "single_microbatch",
                "CBSCallback: each optimizer step has a single microbatch (Trainer(accumulate_grad_batches=1) "
                "on one data-parallel rank), so there is no second batch size and the noise scale is not "
                "measured (nor the batch grown). Use accumulate_grad_batches >= 2 (e.g. halve the "
                "DataLoader's batch_size and set accumulate_grad_batches=2) or more data-parallel ranks.",
            )
        if self._can_grow() and trainer.max_steps is not None and trainer.max_steps > 0:
            self.session.warn_once(
                "max_steps",
                f"CBSCallback: Trainer(max_steps={trainer.max_steps}) counts optimizer steps, and a grown "
                "batch makes each step hold more data. CBSCallback stops the run once the data of "
                f"{trainer.max_steps} steps at the starting accumulation "
                f"(accumulate_grad_batches={self.session.starting_accumulation}) was consumed, the same data "
                "as a run without growth. Use CBSCallback(max_tokens=...) to give the budget in units.",
            )

    def _can_grow(self) -> bool:
        return self.controller is not None and not getattr(self.controller, "observe_only", False)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Strategies that restore the checkpoint after setup load it after on_fit_start.
        self._apply_restored(trainer)
        session = self.session
        if session is None:
            return
        trainer.accumulate_grad_batches = session.accumulation_steps
        self._convert_position(trainer)
        if self.retime_schedulers and session.optimizer is not None:
            self._attach_schedulers(trainer)
        batches = trainer.num_training_batches
        self._give_run_length(trainer, batches)
        if self.max_microbatch is not None:
            self._link_loader(trainer)  # the epoch cap counts the loader's batches, not microbatches
        elif isinstance(batches, (int, float)) and math.isfinite(batches) and batches >= 1 and self._can_grow():
            session.limit_to_epoch(int(batches), "batches")

    def _give_run_length(self, trainer: pl.Trainer, batches: Any) -> None:
        """The run's length, for a controller's efficiency budget (``set_run_length``): ``max_tokens``; else
        the loader batches per rank the constant-batch run trains on, ``max_epochs`` epochs of
        ``num_training_batches`` or ``max_steps`` steps at the starting accumulation (an epoch's short last
        step holds its batches), whichever ends first; else ``max_steps`` times the starting global batch."""
        session = self.session
        assert session is not None
        if self.max_tokens is not None:
            session.set_run_length(units=self.max_tokens)
            return
        max_steps = trainer.max_steps if trainer.max_steps is not None and trainer.max_steps > 0 else None
        max_epochs = trainer.max_epochs if trainer.max_epochs is not None and trainer.max_epochs >= 0 else None
        if isinstance(batches, (int, float)) and math.isfinite(batches) and batches >= 1:
            batches = int(batches)
            lengths = [] if max_epochs is None else [max_epochs * batches]
            if max_steps is not None:
                a0 = session.starting_accumulation
                epochs, rest = divmod(max_steps, math.ceil(batches / a0))
                lengths.append(epochs * batches + min(rest * a0, batches))
            if lengths:
                session.set_run_length(microbatches=min(lengths))
        elif max_steps is not None:
            session.set_run_length(steps=max_steps)

    def _convert_position(self, trainer: pl.Trainer) -> None:
        """A resume on another number of ranks: Lightning's batch counter in the epoch, moved to this run's ranks.

        Lightning saves how many loader batches of the epoch each rank ran (``m`` on ``D``
        ranks: the first ``m * D`` of the epoch's order under a ``DistributedSampler``) and
        resumes its counter there. On ``D'`` ranks that counter would mean ``m * D'`` batches:
        the epoch would run longer or shorter than the checkpoint's, and its first window
        would be cut where the counter is not a multiple of the accumulation. The counter is
        set to the same global position, ``m * D / D'`` (rounded down to a multiple of the
        accumulation when that is not one). A DataLoader that is not resumable (no
        ``state_dict``) restarts at the epoch's first batch anyway, at any number of ranks;
        the repeated and skipped batches are named in a warning.
        """
        session = self.session
        assert session is not None
        change = session.resumed_from
        loop = trainer.fit_loop.epoch_loop
        current = loop.batch_progress.current
        done = int(current.ready)
        if change is None or not loop.restarting or done <= 0:
            return
        per_rank = trainer.num_training_batches
        if not isinstance(per_rank, int) or self.max_microbatch is not None:
            session.warn_once(
                "position_ranks",
                f"CBSCallback: resumed on {_ranks(change.new_dp)} from a checkpoint of {change.old_dp} in the middle of "
                f"an epoch ({done} batches per rank run); Lightning's batch counter is left as saved "
                + ("(a CBSDataLoader's windows restart with the epoch)" if self.max_microbatch is not None
                   else "(the epoch's length is not known)") + ". Resume from a checkpoint saved at an epoch's end.",
            )
            return
        loader = trainer.fit_loop._combined_loader
        from lightning.fabric.utilities.types import _Stateful

        if loader is not None and loader.flattened and all(isinstance(x, _Stateful) for x in loader.flattened):
            session.warn_once(
                "position_ranks",
                f"CBSCallback: resumed on {_ranks(change.new_dp)} from a checkpoint of {change.old_dp} in the middle of "
                "an epoch with a resumable DataLoader: its saved state (rank 0's, of the old ranks) is the loader's "
                "own and is not converted; Lightning's batch counter is left as saved. Resume from a checkpoint "
                "saved at an epoch's end to be exact.",
            )
            return
        global_done = done * change.old_dp  # the epoch's first global batches run before the checkpoint
        acc = session.accumulation_steps
        position = min(change.position(done, acc), per_rank)
        if position == per_rank and global_done < per_rank * change.new_dp:
            position = (per_rank - 1) // acc * acc  # batches remain: the epoch is not over
        delta = position - done
        for name in ("ready", "started", "processed", "completed"):
            setattr(current, name, getattr(current, name) + delta)
        if position >= per_rank:
            return  # an epoch's end: the next epoch starts at its first batch, as the reference's
        total = per_rank * change.new_dp
        rerun = (per_rank - position) * change.new_dp  # the first global batches the rest of the epoch runs
        repeated, skipped = min(global_done, rerun), total - max(global_done, rerun)
        size = getattr(trainer.train_dataloader, "batch_size", None)
        samples = "" if not isinstance(size, int) else f" ({repeated * size} and {skipped * size} samples)"
        where = "" if position * change.new_dp == global_done else (
            f"; {global_done} global batches ({done} per rank) do not split into windows of {acc} on "
            f"{_ranks(change.new_dp)}, so the counter goes on at {position * change.new_dp}, "
            f"{global_done - position * change.new_dp} batches more in this epoch")
        session.warn_once(
            "position_ranks",
            f"CBSCallback: resumed on {_ranks(change.new_dp)} from a checkpoint of {change.old_dp} saved after "
            f"{global_done} of the epoch's {total} loader batches (all ranks); Lightning's batch counter goes on "
            f"there ({position} per rank){where}. The train DataLoader is not resumable, so Lightning restarts it at "
            f"the epoch's first batch: the rest of this epoch runs the epoch's first {rerun} batches instead of its "
            f"last {total - global_done}, {repeated} batches run a second time and {skipped} are not run in this "
            f"epoch{samples}. The next epoch is complete. To be exact, resume from a checkpoint saved at an epoch's "
            "end.",
        )

    def _link_loader(self, trainer: pl.Trainer) -> None:
        """Hand the train loader this callback's layout (checked at fit start; again when loaders reload)."""
        loader = trainer.train_dataloader
        if not isinstance(loader, CBSDataLoader):
            raise RuntimeError(
                f"CBSCallback(max_microbatch={self.max_microbatch}): the train dataloader is a "
                f"{type(loader).__name__}, not a cbs_tracker.CBSDataLoader (one loader, no CombinedLoader). Build "
                "it as CBSDataLoader(dataset, batch_size=..., ...) with the same arguments as a DataLoader: it "
                "joins its batches into microbatches of the size this callback sets."
            )
        loader._cbs_callback = self
        self._loader = loader
        session = self.session
        assert session is not None
        per_epoch = loader.base_batches()
        if per_epoch is not None and per_epoch >= 1 and self._can_grow():
            session.limit_to_epoch(per_epoch, "loader batches")

    def _layout(self, level: int) -> tuple[int, int]:
        assert self.session is not None
        group = microbatch_layout(level, self._max_group, self.session.dp_degree)
        return group, level // group

    def _window_layout(self, index: int, current: tuple[int, int, int]) -> tuple[int, int, int]:
        """The layout ``(group, accumulation, level)`` of the window the loader starts at microbatch ``index``.

        Lightning fetches a batch before it trains the previous one, so a decision reaches
        the loader one window late. The newest pending level (else the level handed out
        last) is taken at any ``index``: the callback keeps Lightning's zeroing and stepping
        on the window's bounds wherever it starts (see :meth:`_align`).
        """
        session = self.session
        assert session is not None
        level = session.pending_accumulation or current[2]
        group, acc = self._layout(level)
        if (group, acc) != current[:2] and (index != 1 or acc == 1):  # see _lightning_accumulation
            return group, acc, level
        return current

    def _attach_schedulers(self, trainer: pl.Trainer) -> None:
        session = self.session
        assert session is not None
        for config in trainer.lr_scheduler_configs:
            if getattr(config.scheduler, "optimizer", None) is not session.optimizer:
                continue
            if config.interval == "step" and session.timer is None:
                # Lightning steps it where (batch_idx + 1) % frequency == 0 at an optimizer step: at the
                # starting accumulation A0, once every lcm(A0, frequency) / A0 optimizer steps
                # (a0 is a fraction of a microbatch only after a resume on more ranks: then every `frequency`)
                a0, frequency = session.starting_accumulation, int(config.frequency)
                period = math.lcm(int(a0), frequency) // int(a0) if float(a0).is_integer() else frequency
                session.attach_scheduler(config.scheduler, period=period)
            elif config.interval == "epoch":
                # an epoch holds the same data at any batch size: stepped once per Lightning call (which,
                # by Lightning's version, comes at the epoch's last batch or after on_train_epoch_end)
                # a resumed run's groups hold the coupled LR: the schedule's own is that over the coupling
                # (exact unless the cap held the LR below it)
                self._epoch_timers.append(ScheduleTimer(config.scheduler, session.optimizer, owner="CBSCallback",
                                                        cap_at_peak=session.cap_lr_at_peak, per_call=True,
                                                        coupling=session.coupling))

    def _apply_restored(self, trainer: pl.Trainer) -> None:
        state, session = self._restored, self.session
        if state is None or session is None:
            return
        self._restored = None
        session.load_state_dict(state)
        trainer.accumulate_grad_batches = session.accumulation_steps

    # ------------------------------------------------------------------ per batch
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        timer = None if self.session is None else self.session.timer
        if timer is not None and timer.period > 1:
            timer.end_period_count()  # Lightning's frequency counts batch_idx, which restarts each epoch

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A window that never reached its step (the previous epoch was cut short) is discarded:
        # Lightning zeroes its gradients on the first batch of this epoch.
        if self.collector is not None and self.collector.num_microbatches:
            self.collector.reset_window()
        self._window_divisors.clear()
        self._window = None  # batch_idx restarts at 0: a window starts there
        if self.max_microbatch is not None:
            if self.session is not None:
                self._link_loader(trainer)  # the feed applies what the loader hands out
            return
        if self.session is not None and self.session.pending_accumulation is not None:
            self._apply_pending(trainer, batch_idx=-1)  # any value is safe: batch_idx restarts at 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._loader is not None and self.session is not None:
            feed = self._loader._cbs_feed
            if not feed:
                raise RuntimeError(
                    "CBSCallback(max_microbatch=...): a batch arrived that the CBSDataLoader did not hand out "
                    "(training_step with a dataloader_iter, or a second train loader, is not supported)"
                )
            layout, starts, index = feed.popleft()
            if index != batch_idx:
                raise RuntimeError(
                    f"CBSCallback(max_microbatch={self.max_microbatch}): Lightning's batch {batch_idx} is the "
                    f"loader's microbatch {index}: Lightning's counters and the loader's windows no longer line up "
                    "(a run resumed in the middle of an epoch, or limit_train_batches cut the loader). Resume from "
                    "checkpoints saved at epoch ends, or grow the accumulation only (max_microbatch=None)."
                )
            if starts and layout is not None:
                self._start_layout(trainer, batch_idx, *layout)
                self._window = (batch_idx, layout[1])
        if self.session is not None:
            self._align(trainer, batch_idx)
        size = self.batch_size_fn(batch)
        try:
            self._micro_size = check_size(size, owner="CBSCallback(batch_size_fn=...)")
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"CBSCallback(batch_size_fn=...) returned {size!r} for batch {batch_idx}: expected a number >= 0 "
                "or a one-element tensor"
            ) from err

    def _align(self, trainer: pl.Trainer, batch_idx: int) -> None:
        """Start a window where the last one ended, and set ``accumulate_grad_batches`` for this batch.

        Lightning zeroes the gradients where ``batch_idx % A == 0`` and steps where
        ``(batch_idx + 1) % A == 0`` (and on an epoch's last batch). A window that starts where
        its length does not divide the position gets, batch by batch, a value of ``A`` for which
        both hold exactly at its bounds (:func:`_lightning_accumulation`); Lightning divides the
        loss by that value, and :meth:`on_before_backward` scales it to ``1 / length``. So every
        window runs where the plain loop runs it, whole, with the mean of its gradients.
        """
        session = self.session
        assert session is not None
        left = self._batch_accumulation
        if left is not None and int(trainer.accumulate_grad_batches) != left:
            session.warn_once(
                "outside_accumulation",
                f"CBSCallback: trainer.accumulate_grad_batches was set to {trainer.accumulate_grad_batches} by "
                f"something else (the callback left {left}); the callback sets it at every batch so that each "
                "window is whole, and the change is not applied. Only CBSCallback should change it (its "
                "controller=, or a BatchSchedule, sets the batch).",
            )
        window = self._window
        if window is None or not window[0] <= batch_idx < window[0] + window[1]:
            if self._loader is None:
                pending = session.pending_accumulation
                # (batch 1 cannot start a window of 2 or more: Lightning would zero and step there at once)
                if pending is not None and (batch_idx != 1 or pending == 1):
                    self._apply_pending(trainer, batch_idx - 1)
                length = session.accumulation_steps
            else:  # the loader's first batches, before it was linked: the starting layout
                length = int(trainer.accumulate_grad_batches) if window is None else window[1]
            window = self._window = (batch_idx, length if batch_idx != 1 else 1 if length > 1 else length)
        self._batch_accumulation = _lightning_accumulation(batch_idx, *window)
        trainer.accumulate_grad_batches = self._batch_accumulation

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self.collector is None:
            return
        assert self.engine is not None
        if self.collector.num_microbatches == 0:
            self._refresh_params(pl_module)
            self.engine.start_window()
        window, applied = self._window, self._batch_accumulation
        if window is not None and applied is not None:
            if applied != window[1] and loss.requires_grad:
                # Lightning divided this loss by `applied` (the value that zeroes and steps on the window's
                # bounds); the window's microbatches are each divided by its length, as in an aligned window
                loss.mul_(applied / window[1])
            self._window_divisors.add(window[1])
            divisor = window[1]
        else:  # Lightning divided this microbatch's loss by the value it read
            divisor = int(trainer.accumulate_grad_batches)
            self._window_divisors.add(divisor)
        if self.engine.session.wants_loss():  # for hold_on_plateau: the microbatch's own mean loss
            scaler = getattr(trainer.precision_plugin, "scaler", None)  # the loss here is scaled by it
            scaled = scaler is not None and scaler.is_enabled()
            self.engine.session.observe_loss(loss.detach() * divisor / (loss_scale(scaler) if scaled else 1.0))
        self.engine.begin_microbatch(unsynced=self._unsynced)

    def _refresh_params(self, pl_module: pl.LightningModule) -> None:
        """At a window's first backward: hook parameters that became trainable (gradual unfreezing)."""
        assert self.collector is not None
        params = [p for p in pl_module.parameters() if p.requires_grad]
        for p in params:
            self.collector.hook(p)  # once per object
        self._params = params

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.engine is not None and self.collector is not None:
            self.engine.end_microbatch(self._micro_size)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        engine, session = self.engine, self.session
        if engine is None or self.collector is None or session is None:
            return
        self._stepped = True
        divisors = sorted(self._window_divisors)
        self._window_divisors.clear()
        divisor = divisors[-1] if divisors else int(trainer.accumulate_grad_batches)
        local_k = self.collector.num_microbatches
        stats, faults = engine.reduce(
            self._params,
            dp_group=self.dp_group,
            loss_divisor=float(divisor),
            normalization=self.loss_normalization,
            avg_ranks=self._avg_ranks,
            scale=self._loss_scale(trainer, optimizer),
        )
        if len(divisors) > 1:
            stats = dataclasses.replace(stats, finite=False)  # mixed 1/A factors: not measurable
            rank_zero_warn(
                f"CBSCallback: trainer.accumulate_grad_batches changed inside an accumulation window "
                f"(values {divisors}); the step is not measured. Only CBSCallback should change it.",
                category=UserWarning,
            )
        if self.rescale_short_window and 0 < local_k < divisor:
            grads = [p.grad for p in self._params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, divisor / local_k)
        record = engine.finish_step(
            stats, faults, window_accumulation=divisor, estimate_allowed=len(divisors) <= 1,
            lr=float(optimizer.param_groups[0]["lr"]) if optimizer.param_groups else None,
        )
        changed = session.changed_this_step
        if changed and self.max_microbatch is not None:
            rank_zero_info(
                f"CBSCallback step {record.step}: batch {session.accumulation_steps} -> {session.pending_accumulation} "
                "loader batches per window and rank, as microbatch x accumulate_grad_batches from the next window "
                f"the loader starts ({getattr(session.last_decision, 'reason', '')})"
            )
        elif changed:
            rank_zero_info(
                f"CBSCallback step {record.step}: accumulate_grad_batches {trainer.accumulate_grad_batches} -> "
                f"{session.pending_accumulation} ({getattr(session.last_decision, 'reason', '')})"
            )
        self._log(trainer, pl_module, record, force=changed)

    def _loss_scale(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is None or not scaler.is_enabled():
            return None
        # Lightning unscales before on_before_optimizer_step except for optimizers that unscale
        # inside step() (fused); unscale_and_get_scale unscales those here.
        return unscale_and_get_scale(scaler, optimizer)

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
        if self._batch_accumulation is not None:
            # Lightning reads it again after this hook (its scheduler step, its step counter): this batch's value
            trainer.accumulate_grad_batches = self._batch_accumulation
        stepped, self._stepped = self._stepped, False
        session = self.session
        if session is None or not stepped:
            return
        self._check_budget(trainer)
        # a pending accumulation takes effect where the next window starts (on_train_batch_start)

    def _start_layout(self, trainer: pl.Trainer, batch_idx: int, group: int, acc: int, level: int) -> None:
        """A window the loader handed out at ``level`` starts: Lightning accumulates ``acc`` microbatches of ``group``."""
        session = self.session
        assert session is not None
        if level != session.accumulation_steps:
            session.apply_level(level)
            self.applied_changes.append((session.step, batch_idx, acc))
            for timer in self._epoch_timers:
                timer.set_coupling(session.coupling)
        session.micro_group = group
        trainer.accumulate_grad_batches = acc

    def _check_budget(self, trainer: pl.Trainer) -> None:
        session = self.session
        assert session is not None
        if self.max_tokens is not None and session.units_seen >= self.max_tokens:
            trainer.should_stop = True
        max_steps = trainer.max_steps
        if self._can_grow() and max_steps is not None and max_steps > 0 and session.starting_batch_steps >= max_steps:
            trainer.should_stop = True

    def _apply_pending(self, trainer: pl.Trainer, batch_idx: int) -> None:
        session = self.session
        assert session is not None
        new = session.apply_pending()
        if new is None:
            return
        trainer.accumulate_grad_batches = new
        self.applied_changes.append((session.step, batch_idx, new))
        for timer in self._epoch_timers:
            timer.set_coupling(session.coupling)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._window is not None:
            trainer.accumulate_grad_batches = self._window[1]  # the last window's, not a value of its bounds
        self._window = self._batch_accumulation = None

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_hooks()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._remove_hooks()
            self._trainer = None

    def _remove_hooks(self) -> None:
        if self.engine is not None:
            self.engine.remove()
        for timer in self._epoch_timers:
            timer.detach()
        self._epoch_timers.clear()

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The engine's state (small, plain numbers, versioned); Lightning does not save the accumulation."""
        if self.session is None:
            if self._restored is not None:
                return dict(self._restored)
            return self._settings.scratch_session(1).state_dict()
        assert self.engine is not None
        return self.engine.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; ``trainer.accumulate_grad_batches`` is set at train start.

        Raises:
            KeyError / TypeError / ValueError: a missing key, a wrong type, an unknown version,
                another unit (see :meth:`~cbs_tracker.core.session.TrackingSession.load_state_dict`).
                A checkpoint of another data-parallel degree converts at fit start, keeping the
                global batch, and Lightning's position in the epoch moves with it.
        """
        if not state_dict:
            return
        if state_dict.get("unit", self.unit) != self.unit:
            raise ValueError(
                f"CBSCallback.load_state_dict: the checkpoint counts {state_dict.get('unit')} but this callback "
                f"counts {self.unit} (unit={self.unit!r}); the noise scale and batch sizes would mix units"
            )
        if self.engine is not None:
            self.engine.load_state_dict(state_dict)
            return
        # before fit: check everything now (on copies); the data-parallel degree is checked at fit
        dp = state_dict.get("dp_degree", 1)
        dp = dp if isinstance(dp, int) and not isinstance(dp, bool) and dp >= 1 else 1
        self._settings.check_state(dict(state_dict), dp)
        self._restored = dict(state_dict)


def _warn_on_rank_zero(message: str) -> None:
    """The session's warnings, once, from rank zero (a function: the callback is pickled to spawned ranks)."""
    rank_zero_warn(message, category=UserWarning)


def _check_logging_and_lr_options(*, prog_bar: Any, name: Any, lr_coupling: Any, cap_lr_at_peak: Any,
                                  retime_schedulers: Any, max_tokens: Any) -> None:
    """``CBSCallback``'s checks of its logging, learning-rate and stopping options (the message names the argument)."""
    if not isinstance(prog_bar, bool):
        raise TypeError(f"CBSCallback(prog_bar={prog_bar!r}): expected True or False")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"CBSCallback(name={name!r}): expected a str or None")
    if lr_coupling is not None and lr_coupling not in COUPLINGS:
        raise ValueError(f"CBSCallback(lr_coupling={lr_coupling!r}): expected one of {list(COUPLINGS)} or None")
    if cap_lr_at_peak is not None and not isinstance(cap_lr_at_peak, bool):
        raise TypeError(f"CBSCallback(cap_lr_at_peak={cap_lr_at_peak!r}): expected True, False or None")
    if not isinstance(retime_schedulers, bool):
        raise TypeError(f"CBSCallback(retime_schedulers={retime_schedulers!r}): expected True or False")
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, float)) or not max_tokens > 0
        or not math.isfinite(max_tokens)
    ):
        raise ValueError(f"CBSCallback(max_tokens={max_tokens!r}): must be a finite number > 0 or None")


def _ranks(n: int) -> str:
    return f"{n} rank" + ("" if n == 1 else "s")


def _lightning_accumulation(batch_idx: int, start: int, length: int) -> int:
    """The ``accumulate_grad_batches`` under which Lightning zeroes the gradients at batch ``start``, steps
    after batch ``start + length - 1`` and does neither in between, for batch ``batch_idx`` of that window.

    Lightning zeroes where ``batch_idx % A == 0`` and steps where ``(batch_idx + 1) % A == 0``. Where
    ``length`` divides ``start`` that is ``length`` itself; elsewhere the window's first batch takes
    ``A = batch_idx`` (it divides ``batch_idx``, not ``batch_idx + 1``; ``start >= 2``), its last
    ``batch_idx + 1`` and the ones between ``batch_idx + 2`` (dividing neither).
    """
    if length == 1 or start % length == 0:
        return length
    offset = batch_idx - start
    if offset == 0:
        return batch_idx
    return batch_idx + 1 if offset == length - 1 else batch_idx + 2


class CBSDataLoader(torch.utils.data.DataLoader):  # type: ignore[type-arg]
    """A ``DataLoader`` whose batches ``CBSCallback(max_microbatch=...)`` joins into larger microbatches.

    Build it with a ``DataLoader``'s arguments; ``batch_size`` is the smallest
    microbatch. Lightning injects its ``DistributedSampler`` as into any
    ``DataLoader``. Under the callback it joins consecutive batches (tensors, or tuples,
    lists and dicts of them) into microbatches of the size the callback sets, changing it
    only at a window start, so every sample is used once per epoch and no microbatch
    mixes two sizes. Since the microbatch may change inside an epoch it has no length
    (``base_batches()`` counts the underlying batches): Lightning then validates at each
    epoch's end (or every ``val_check_interval`` batches given as an int), shows no total
    in the progress bar and has no ``estimated_stepping_batches``. Without the callback it
    yields the underlying batches.
    """

    _cbs_callback: CBSCallback | None = None

    def base_batches(self) -> int | None:
        """The underlying batches per epoch (``None`` for an iterable dataset without a length)."""
        try:
            return torch.utils.data.DataLoader.__len__(self)
        except TypeError:
            return None

    def __len__(self) -> int:
        raise TypeError(
            "CBSDataLoader has no length: its microbatch grows inside an epoch, so its batches per epoch are not "
            "known in advance (base_batches() gives the underlying count)"
        )

    _cbs_feed: collections.deque[tuple[tuple[int, int, int] | None, bool, int]] | None = None

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return self._microbatches(super().__iter__())

    def _microbatches(self, batches: Iterator[Any]) -> Iterator[Any]:
        """Join the batches into the callback's microbatches; what was handed out is queued for it.

        Lightning creates the epoch's iterator and fetches its first batch before any
        training hook runs, so the callback may be linked only after the first batch:
        until then batches pass one by one (the starting layout). Each queued entry is
        the window's layout ``(group, accumulation, level)`` (``None`` before the link)
        and whether a window starts there.
        """
        callback = self._cbs_callback
        if callback is not None and callback._trainer is not None and not callback._trainer.training:
            yield from batches  # the same loader used for validation: its batches as they are, nothing queued
            return
        feed: collections.deque[tuple[tuple[int, int, int] | None, bool, int]] = collections.deque()
        self._cbs_feed = feed
        try:
            head = next(batches)
        except StopIteration:
            return
        rows = leading_rows(head)
        batches = itertools.chain([head], batches)
        index, in_window = 0, 0
        layout: tuple[int, int, int] | None = None
        while True:
            callback = self._cbs_callback
            if callback is not None and callback.session is not None and layout is None:
                # linked now: the batches so far ran one by one at the starting level
                assert callback.max_microbatch is not None
                callback._max_group = group_cap(callback.max_microbatch, rows)
                level = callback.session.accumulation_steps
                layout, in_window = (1, level, level), index % level
            if layout is not None and in_window == 0:
                assert callback is not None
                layout = callback._window_layout(index, layout)
            group = 1 if layout is None else layout[0]
            parts = list(itertools.islice(batches, group))
            if not parts:
                return
            feed.append((layout, in_window == 0, index))
            yield join_batches(parts)
            index += 1
            if layout is not None:
                in_window = (in_window + 1) % layout[1]


class CBSCalibration(Callback):
    """Measure the critical batch by branches at token marks during ``fit``, and hand ``kappa`` to the controller.

    At the first optimizer step at or after each mark it runs
    :func:`cbs_tracker.measure_critical_batch` on deep copies of the module and the first
    optimizer (the run itself is untouched) and, with ``apply=True``, gives the measured
    ``kappa`` to ``cbs.controller``; every Trainer logger gets the ``cbs_calibration/`` tags at
    x = units seen. Place it after the :class:`CBSCallback`.

    Args:
        cbs: the run's :class:`CBSCallback` (read for the batch, tokens, noise scale, coupling).
        marks: units seen at which to calibrate.
        apply: give each point's ``kappa`` to the controller (default ``True``).
        **measure: the arguments of :func:`~cbs_tracker.measure_critical_batch`: ``loss_fn(module,
            batch)``, ``data(replicate)`` (a loader of its own, not the Trainer's), ``evaluate(module)``,
            ``microbatch_size``, ``branch_tokens`` and the optional ones.

    Branches run on each rank alike, without communication; the measurement is tested on one process.
    """

    def __init__(self, cbs: CBSCallback, marks: list[float], *, apply: bool = True, **measure: Any) -> None:
        if not isinstance(cbs, CBSCallback):
            raise TypeError(f"CBSCalibration(cbs={cbs!r}): expected the run's CBSCallback")
        self.cbs = cbs
        self._at = CalibrateAt(marks, apply=apply, **measure)
        self._steps = 0

    @property
    def calibration(self) -> Any:
        """The :class:`~cbs_tracker.calibrate.Calibration` so far."""
        return self._at.calibration

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.cbs.steps == self._steps:
            return  # inside a window: no optimizer step since the last call
        self._steps = self.cbs.steps
        point = self._at.after_step(pl_module, trainer.optimizers[0], self.cbs)
        if point is not None:
            for logger in trainer.loggers:  # the cbs_calibration/ tags, x = units seen
                logger.log_metrics(calibration_scalars(point), step=int(round(point.tokens)))
            kappa = "-" if point.kappa is None else f"{point.kappa:.3g}"
            rank_zero_info(f"CBSCalibration at {point.tokens:,.0f} {self.cbs.unit}: critical batch "
                           f"[{point.critical.low:,.0f}, {point.critical.high:,.0f}), kappa {kappa}; "
                           f"{point.total_branch_tokens:,.0f} branch {self.cbs.unit}")
