"""OLMo-core adapter: ``CBSOlmoCallback`` measures the noise scale inside OLMo-core's ``Trainer`` and grows its batch.

Usage::

    trainer = TrainerConfig(
        save_folder=..., max_duration=Duration.tokens(...),
        callbacks={"cbs": CBSOlmoCallback(), "checkpointer": CheckpointerCallback(save_async=False)},
    ).build(train_module, data_loader)
    trainer.fit()

OLMo-core's ``TransformerTrainModule`` splits each global batch into microbatches of
``rank_microbatch_size`` tokens per rank and calls ``backward()`` on each; the callback
brackets every microbatch with a forward-pre-hook on the model and reads its gradient from
parameter hooks (under FSDP on the unsharded parameters FSDP gathers for the forward), reads
the step's gradient before clipping, and sets ``trainer.data_loader.global_batch_size`` at
the first batch where OLMo-core's loader allows the new size (an increase by ``r`` where
``batches_processed % r == 0``). The learning rate follows the batch through each param
group's ``initial_lr``, the base OLMo-core's scheduler multiplies, as OLMo-core's own
``BatchSizeSchedulerCallback`` does; the schedule stays on the data because it counts tokens.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from olmo_core.train.callbacks import Callback
from torch import nn

from cbs_tracker.core import distributed as cbs_dist
from cbs_tracker.core.collector import GradStatsCollector
from cbs_tracker.core.engine import Engine, EngineSettings
from cbs_tracker.core.estimator import NoiseScaleEstimator
from cbs_tracker.core.measure import WindowFaults
from cbs_tracker.core.record import StepRecord
from cbs_tracker.core.session import TrackingSession
from cbs_tracker.core.tags import record_scalars
from cbs_tracker.policy.lr import ADAPTIVE_OPTIMIZERS, COUPLINGS, SGD_OPTIMIZERS, coupling_factor

__all__ = ["CBSOlmoCallback"]

log = logging.getLogger(__name__)

#: OLMo-core's own optimizers whose coupling "auto" knows (besides torch's, by class name)
_OLMO_ADAPTIVE = {"SkipStepAdamW", "SkipStepLion"}
#: the state format of :meth:`CBSOlmoCallback.state_dict`
STATE_VERSION = 1
#: the metrics the callback adds to OLMo-core's ``ConsoleLoggerCallback`` (which prints only those it names)
CONSOLE_METRICS = ["cbs/noise_scale", "cbs/noise_scale_low", "cbs/critical_batch", "cbs/global_batch_tokens",
                   "cbs/accumulation_steps", "cbs/lr_coupling"]


class CBSOlmoCallback(Callback):
    """Measures the gradient noise scale of an OLMo-core run and grows its global batch.

    Args:
        controller: ``"auto"`` (default) builds a
            :class:`~cbs_tracker.policy.controller.BatchSizeController` with its defaults;
            pass a configured instance, a :class:`~cbs_tracker.policy.batch_schedule.BatchSchedule`
            (a fixed plan, measured all the same), or ``None`` to measure and log only.
        observe_only: never change the batch (with ``controller="auto"`` the controller is
            built with ``observe_only=True`` and still reports its target).
        lr_coupling: ``"auto"`` (default: each param group's ``initial_lr`` x sqrt(B/B0) for
            Adam-family optimizers, x B/B0 for SGD), ``"keep"``, ``"sqrt"`` or ``"linear"``.
        estimator: a configured :class:`~cbs_tracker.core.estimator.NoiseScaleEstimator`.
        measure_every: measure one step in ``n`` (default 1), or ``"auto"``: the smallest
            ``n`` keeping the measurement at or below ``measure_target`` of the step time.
        measure_target: the share of the step time ``"auto"`` allows (default 0.01).

    Sizes are the tokens the loss counts (``labels != label_ignore_index``), the ones each
    microbatch's summed loss is divided by; a ``BatchSchedule``'s marks count them too.
    The batch changes by whole factors of the current one (OLMo-core's loader allows no
    other), in multiples of ``rank_microbatch_size`` x the data-parallel ranks. The tags
    ``cbs/...`` reach the trainer's metrics at every step.

    Raises:
        TypeError / ValueError: on bad arguments (the message names the argument).
        RuntimeError / ValueError: when attached, for a configuration it cannot handle: a train
            module other than ``TransformerTrainModule``, OLMo-core's ``BatchSizeSchedulerCallback``
            in the same trainer, an asynchronous ``CheckpointerCallback`` on gloo, an optimizer the
            coupling does not know, an LR schedule timed in optimizer steps, a plan whose batches
            OLMo-core cannot reach by whole factors.
    """

    #: before OLMo-core's ``CheckpointerCallback`` (1), which saves in ``post_train_batch``: the step is
    #: recorded (and its decision made) there first, so a checkpoint holds the step it was taken after
    priority = 2

    def __init__(
        self,
        *,
        controller: Any = "auto",
        observe_only: bool = False,
        lr_coupling: str = "auto",
        estimator: NoiseScaleEstimator | None = None,
        measure_every: int | str = 1,
        measure_target: float = 0.01,
    ) -> None:
        owner = "CBSOlmoCallback"
        from cbs_tracker.policy.controller import adapter_controller

        controller = adapter_controller(owner, controller, observe_only)
        if lr_coupling not in COUPLINGS:
            raise ValueError(f"{owner}(lr_coupling={lr_coupling!r}): expected one of {list(COUPLINGS)}")
        if isinstance(estimator, type) or (estimator is not None and not callable(getattr(estimator, "update", None))):
            raise TypeError(
                f"{owner}(estimator={getattr(estimator, '__name__', type(estimator).__name__)}): expected a "
                "NoiseScaleEstimator or None"
            )
        # measure_every and measure_target are checked here, once (the engine is built when attached)
        self._settings = EngineSettings(
            owner=owner, unit="tokens", estimator=estimator if estimator is not None else NoiseScaleEstimator(),
            controller=controller, lr_coupling=lr_coupling, warn=_log_warning,
            measure_every=measure_every, measure_target=measure_target,
        )
        self.controller = controller
        self.observe_only = observe_only
        self.lr_coupling = lr_coupling
        self.estimator = self._settings.estimator
        self.measure_every, self.measure_target = measure_every, measure_target
        #: the collector, the reduction of each window, the session and their state (built when attached)
        self.engine: Engine | None = None
        #: ``(step, global batch in tokens)`` of every batch change the callback made
        self.applied_changes: list[tuple[int, int]] = []
        self._restored: dict[str, Any] | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._params: list[nn.Parameter] = []
        self._big_params: list[nn.Parameter] = []
        self._sharded = False
        self._sharded_ids: set[int] = set()
        self._base_lrs: list[float] = []
        self._in_step = False
        self._open = False  # a microbatch's backward is being recorded
        self._size: Any = None
        self._divisor: Any = None
        self._window: tuple[Any, WindowFaults, int] | None = None
        self._warned_divide: set[int] = set()
        self._warned_stop = False
        self._warned_steps = False

    # ------------------------------------------------------------------ properties
    @property
    def session(self) -> TrackingSession | None:
        """The engine's session (``None`` until the callback is attached)."""
        return None if self.engine is None else self.engine.session

    @property
    def collector(self) -> GradStatsCollector | None:
        """The engine's collector while the hooks are on the model, else ``None``."""
        return None if self.engine is None else self.engine.collector

    @property
    def last_record(self) -> StepRecord | None:
        return None if self.session is None else self.session.last_record

    @property
    def accumulation_steps(self) -> int:
        """Microbatches per rank of the current step."""
        return 0 if self.session is None else self.session.accumulation_steps

    def _can_grow(self) -> bool:
        return self.controller is not None and not getattr(self.controller, "observe_only", False)

    # ------------------------------------------------------------------ attach
    def post_attach(self) -> None:
        trainer = self.trainer
        module = trainer.train_module
        self._check_configuration(trainer, module)
        optim = module.optim
        self._dp_group = trainer.dp_process_group
        dp = cbs_dist.group_size(self._dp_group)
        self._micro_tokens = int(module.rank_microbatch_size)
        slot = self._micro_tokens * dp
        start = int(trainer.data_loader.global_batch_size)
        if start % slot:
            raise ValueError(
                f"CBSOlmoCallback: the data loader's global_batch_size={start} is not a multiple of "
                f"rank_microbatch_size x data-parallel ranks = {self._micro_tokens} x {dp} = {slot} tokens; "
                "OLMo-core needs a whole number of microbatches per rank"
            )
        self._check_plan(start, slot)
        if self.session is not None:
            self._remove_hooks()
        self.engine = Engine(self._settings, starting_accumulation=start // slot, dp_degree=dp, optimizer=optim,
                             dp_group=self._dp_group)
        self._base_lrs = [float(g.get("initial_lr") or g["lr"]) for g in optim.param_groups]
        self._give_run_length(trainer, start)
        self._attach_hooks(module.model)
        self.engine.give_model_size(module.model)
        if self.session.starting_accumulation * dp < 2:
            self.session.warn_once(
                "single_microbatch",
                f"CBSOlmoCallback: each step has a single microbatch (global_batch_size={start} tokens = "
                f"rank_microbatch_size={self._micro_tokens} on one rank), so the noise scale is not measured "
                "(nor the batch grown). Halve rank_microbatch_size or run more data-parallel ranks.",
            )
        self._show_on_console(trainer)
        if self._restored is not None:  # a state loaded before the callback was attached
            state, self._restored = self._restored, None
            self.load_state_dict(state)

    def _give_run_length(self, trainer: Any, start: int) -> None:
        """The run's length, for a controller's efficiency budget (``set_run_length``): ``max_duration`` in
        tokens is ``ceil(tokens / global_batch_size)`` steps of the starting batch (OLMo-core stops on the
        first step that reaches it), in steps as it is; each is that many times the starting step's units (the
        tokens the loss counts, which the callback's sizes are). A duration in epochs gives none."""
        duration = trainer.max_duration
        unit = str(duration.unit).split(".")[-1]
        if unit == "tokens":
            self.engine.session.set_run_length(steps=math.ceil(int(duration.value) / start))  # type: ignore[union-attr]
        elif unit == "steps":
            self.engine.session.set_run_length(steps=int(duration.value))  # type: ignore[union-attr]

    def _show_on_console(self, trainer: Any) -> None:
        """Add :data:`CONSOLE_METRICS` to OLMo-core's ``ConsoleLoggerCallback``, which prints only the metrics
        it names; a console logger that already names a ``cbs/`` metric is left as configured."""
        from olmo_core.train.callbacks import ConsoleLoggerCallback

        for cb in trainer.callbacks.values():
            if isinstance(cb, ConsoleLoggerCallback) and isinstance(cb.metrics, list):
                if not any(str(m).startswith("cbs") for m in cb.metrics):
                    cb.metrics.extend(CONSOLE_METRICS)

    def _check_configuration(self, trainer: Any, module: Any) -> None:
        from olmo_core.train.callbacks import BatchSizeSchedulerCallback
        from olmo_core.train.train_module import TransformerTrainModule

        if not isinstance(module, TransformerTrainModule):
            raise TypeError(
                f"CBSOlmoCallback: the trainer's train module is a {type(module).__name__}; the callback supports "
                "TransformerTrainModule (one optimizer, microbatches of rank_microbatch_size tokens)"
            )
        for name, cb in trainer.callbacks.items():
            if isinstance(cb, BatchSizeSchedulerCallback) and cb.enabled and cb.schedule:
                raise RuntimeError(
                    f"CBSOlmoCallback cannot share the trainer with BatchSizeSchedulerCallback (callbacks[{name!r}], "
                    f"batch_sizes={cb.batch_sizes}): both set trainer.data_loader.global_batch_size and scale the "
                    "learning rate. Remove it, or give its plan to this callback as "
                    "controller=BatchSchedule([(tokens, batch), ...]) (measured as well), or disable it "
                    "(enabled=False)."
                )
        self._check_async_checkpoint(trainer, module)
        optim = module.optim
        if optim is None:
            raise RuntimeError("CBSOlmoCallback: the train module has no optimizer (eval_only=True)")
        mode = self.lr_coupling
        if mode == "auto" and getattr(self.controller, "lr_scaling", None) is not None:
            mode = self.controller.lr_scaling  # an explicit controller setting wins over "auto"
        if mode == "auto":
            names = {cls.__name__ for cls in type(optim).__mro__}
            if not names & (ADAPTIVE_OPTIMIZERS | SGD_OPTIMIZERS | _OLMO_ADAPTIVE):
                raise ValueError(
                    f"CBSOlmoCallback(lr_coupling='auto'): the optimizer {type(optim).__name__} is not one the "
                    "coupling knows (Adam-family: LR x sqrt(B/B0); SGD: x B/B0). Pass lr_coupling='sqrt', "
                    "'linear' or 'keep'."
                )
        scheduler = module.scheduler
        if scheduler is not None and self._can_grow():
            from olmo_core.optim.scheduler import ConstantScheduler

            units = str(getattr(scheduler, "units", "steps"))
            if not isinstance(scheduler, ConstantScheduler) and units.endswith("steps"):
                raise ValueError(
                    f"CBSOlmoCallback: the LR scheduler {type(scheduler).__name__}(units='steps') is timed in "
                    "optimizer steps, and a grown batch makes each step hold more tokens, so the schedule would "
                    "run ahead of the data. Pass units='tokens' (its warmup and t_max in tokens too), or "
                    "controller=None to measure only."
                )
            if (not isinstance(scheduler, ConstantScheduler) and getattr(scheduler, "t_max", None) is None
                    and str(trainer.max_duration.unit).split(".")[-1] != "tokens"):
                raise ValueError(
                    f"CBSOlmoCallback: the LR scheduler {type(scheduler).__name__} takes its end from the trainer's "
                    f"max_duration={trainer.max_duration}, which counts {trainer.max_duration.unit}: OLMo-core "
                    "converts it to tokens at the current batch, so the schedule's end would move as the batch "
                    "grows. Give max_duration in tokens (Duration.tokens(...)) or the scheduler's t_max."
                )

    def _check_async_checkpoint(self, trainer: Any, module: Any) -> None:
        """Refuse an asynchronous ``CheckpointerCallback`` where the training device's tensors go through gloo."""
        from olmo_core.train.callbacks import CheckpointerCallback

        if not cbs_dist.is_distributed():
            return
        backend = str(torch.distributed.get_backend())
        device = torch.device(getattr(module, "device", None) or "cpu")
        if _backend_for(backend, device) != "gloo":
            return
        for name, cb in trainer.callbacks.items():
            if isinstance(cb, CheckpointerCallback) and cb.enabled and cb.save_async is not False:
                raise RuntimeError(
                    f"CBSOlmoCallback: callbacks[{name!r}] is CheckpointerCallback(save_async={cb.save_async!r}) "
                    f"on the backend {backend!r}, whose {device.type} tensors go through gloo, where OLMo-core's "
                    "asynchronous checkpoint hangs at the save a SIGTERM asks for (None means True on a backend "
                    "with CPU support). Pass CheckpointerCallback(save_async=False)."
                )

    def _check_plan(self, start: int, slot: int) -> None:
        """A ``BatchSchedule``'s batches: whole microbatches on every rank, each a whole factor of the last."""
        marks = getattr(self.controller, "marks", None)
        if marks is None or not self._can_grow():
            return
        ratio = float(getattr(self.controller, "microbatch", None) or 0) * cbs_dist.group_size(self._dp_group)
        previous = None
        for tokens, batch in marks:
            # marks count the loss's tokens; the plan's layout is batch / (microbatch x ranks)
            acc = batch / ratio if ratio > 0 else None
            if acc is None:
                raise ValueError(
                    f"CBSOlmoCallback(controller=BatchSchedule(...)): pass the schedule's microbatch= (the loss "
                    f"tokens of one microbatch on one rank: {self._micro_tokens} tokens less the ignored labels), "
                    "so its batches can be checked against OLMo-core's layout when the trainer is built"
                )
            if abs(acc - round(acc)) > 1e-9 or round(acc) < 1:
                raise ValueError(
                    f"CBSOlmoCallback(controller=BatchSchedule(...)): the mark ({tokens:g}, {batch:g}) is not a whole "
                    f"number of microbatches on every rank ({ratio:g} tokens each)"
                )
            acc = int(round(acc))
            current = previous if previous is not None else start // slot
            if acc % current and current % acc:
                raise ValueError(
                    f"CBSOlmoCallback(controller=BatchSchedule(...)): the mark ({tokens:g}, {batch:g}) would take the "
                    f"batch from {current} to {acc} microbatches per rank, and OLMo-core changes "
                    "global_batch_size by whole factors only (x2, x3, /2...); give a batch that "
                    f"{current} divides or that divides {current}"
                )
            previous = acc

    def _attach_hooks(self, model: nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        trainable = [p for p in model.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("CBSOlmoCallback: the model has no parameter with requires_grad=True")
        self._sharded = any(isinstance(p, DTensor) for p in trainable)
        self._big_params = trainable
        if self._sharded:
            # FSDP2: the microbatch gradients arrive on the unsharded parameters it gathers for the
            # forward (hooked after its own forward-pre-hook); .grad holds the reduce-scattered shard
            self._sharded_ids = {id(p) for p in trainable}
            self.engine.collect([], register=False)  # type: ignore[union-attr]
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    self._handles.append(m.register_forward_pre_hook(self._hook_unsharded))
        else:
            self.engine.collect(trainable)  # type: ignore[union-attr]
        self._handles.append(model.register_forward_pre_hook(self._microbatch_starts, with_kwargs=True))
        self._handles.append(model.register_forward_hook(self._microbatch_loss, with_kwargs=True))

    def _hook_unsharded(self, module: nn.Module, args: Any) -> None:
        engine = self.engine
        if engine is None or not (self._in_step and engine.measure) or engine.collector is None:
            return
        for p in module.parameters():
            if p.requires_grad and id(p) not in self._sharded_ids:
                engine.collector.hook(p)  # once per object

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.engine is not None:
            self.engine.remove()

    # ------------------------------------------------------------------ microbatches
    def _microbatch_starts(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        """A forward of the train module's model: one microbatch starts (the previous one's backward ran)."""
        if not self._in_step or not torch.is_grad_enabled() or self.collector is None:
            return
        self._end_microbatch()
        labels = kwargs.get("labels")
        if labels is None:
            raise RuntimeError(
                "CBSOlmoCallback: a training forward without labels=; TransformerTrainModule passes the "
                "microbatch's labels to the model (a subclass that does not is not supported)"
            )
        ignore = kwargs.get("ignore_index", self.trainer.train_module.label_ignore_index)
        self._size = labels.ne(ignore).sum()
        self._divisor = kwargs.get("loss_div_factor")
        self.engine.begin_microbatch(unsynced=not cbs_dist.is_distributed())  # type: ignore[union-attr]
        self._open = True

    def _microbatch_loss(self, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        """The microbatch's mean cross-entropy, for a controller that reads the loss (``hold_on_plateau``): the
        model's ``ce_loss`` (summed over the loss's tokens and divided by ``loss_div_factor``) over its tokens."""
        session = self.session
        if not self._open or session is None or not session.wants_loss():
            return
        ce = getattr(output, "ce_loss", None)
        reduction = kwargs.get("loss_reduction", "mean")
        if ce is None or reduction == "none":
            return
        ce = ce.detach()
        if reduction == "sum":
            ce = ce * (1.0 if self._divisor is None else self._divisor) / self._size
        session.observe_loss(ce)

    def _end_microbatch(self) -> None:
        if self._open and self.engine is not None and self.engine.collector is not None:
            self._open = False
            self.engine.end_microbatch(self._size)

    # ------------------------------------------------------------------ the step
    def pre_load_batch(self) -> None:
        self._apply_pending()

    def _apply_pending(self) -> None:
        """The pending batch, at the first batch OLMo-core's loader allows it."""
        session = self.session
        if session is None or session.pending_accumulation is None:
            return
        loader = self.trainer.data_loader
        current, new = session.accumulation_steps, int(session.pending_accumulation)
        if new % current and current % new:
            if new not in self._warned_divide:
                self._warned_divide.add(new)
                log.warning(
                    f"CBSOlmoCallback: the decided batch of {new} microbatches per rank is not a whole factor of "
                    f"the current {current}, and OLMo-core changes global_batch_size by whole factors only; the "
                    "batch stays (give the controller a growth factor of 2, or a schedule of whole factors)"
                )
            return
        if new > current and loader.batches_processed % (new // current):
            return  # OLMo-core would duplicate or skip data: wait for a batch it allows
        session.apply_pending()
        loader.global_batch_size = new * self._micro_tokens * session.dp_degree
        duration = self.trainer.max_duration
        if new > current and not self._warned_steps and str(duration.unit).split(".")[-1] == "steps":
            self._warned_steps = True
            log.warning(
                f"CBSOlmoCallback: max_duration={duration} counts optimizer steps, and from step "
                f"{self.trainer.global_step} each step holds {new / session.starting_accumulation:g}x the starting "
                "batch's tokens, so the run will train on more tokens than its plan of steps at the starting batch. "
                "To stop on the data, give max_duration=Duration.tokens(...) (the steps times the starting "
                "global_batch_size)."
            )
        self.applied_changes.append((int(self.trainer.global_step), int(loader.global_batch_size)))
        log.info(
            f"CBSOlmoCallback step {self.trainer.global_step}: global_batch_size -> {loader.global_batch_size:,d} "
            f"tokens ({new} microbatches per rank), LR x{session.coupling:.4g} of the starting batch's"
        )

    def pre_step(self, batch: dict[str, Any]) -> None:
        engine = self.engine
        if engine is None or engine.collector is None:
            return
        if engine.collector.num_microbatches:
            engine.collector.reset_window()  # a step that never reached its optimizer step
        engine.start_window()
        self._in_step = True
        self._window = None

    def pre_optim_step(self) -> None:
        engine = self.engine
        if engine is None or engine.collector is None or not self._in_step:
            return
        session = engine.session
        self._end_microbatch()
        self._in_step = False
        stats, faults = engine.reduce(
            self._big_params, dp_group=self._dp_group, loss_divisor=1.0, avg_ranks=session.dp_degree,
            big_norm_is_sharded=self._sharded, expected_microbatches=session.accumulation_steps,
            normalization="window", units_divisor=self._divisor,
        )
        self._window = (stats, faults, session.accumulation_steps)

    def post_train_batch(self) -> None:
        session = self.session
        window, self._window = self._window, None
        self._in_step = False
        if session is None or window is None:
            return
        stats, faults, acc = window
        groups = self.trainer.train_module.optim.param_groups
        lr = float(groups[0]["lr"]) if groups else None
        record = self.engine.finish_step(stats, faults, window_accumulation=acc, lr=lr)  # type: ignore[union-attr]
        if session.changed_this_step:
            log.info(
                f"CBSOlmoCallback step {self.trainer.global_step}: {acc} -> {session.pending_accumulation} "
                f"microbatches per rank decided ({getattr(session.last_decision, 'reason', '')})"
            )
        for name, value in record_scalars(record).items():
            self.trainer.record_metric(name, float(value), reduce_type=None)

    # ------------------------------------------------------------------ the end
    def post_train(self) -> None:
        """Warn once when ``fit()`` returned before ``max_duration``, saying how much of the plan ran.

        OLMo-core's ``Trainer`` turns SIGTERM/SIGINT (a ``timeout``, a scheduler's preemption,
        Ctrl-C) into a cancel that stops the run at its next cancel check (every
        ``cancel_check_interval`` steps), saves a checkpoint and returns from ``fit()`` without an
        error, so a script prints its results as if the run had finished.
        """
        session, trainer = self.session, self.trainer
        if session is None or session.step == 0:
            return
        duration = trainer.max_duration
        step, tokens, epoch = int(trainer.global_step), int(trainer.global_train_tokens_seen), int(trainer.epoch)
        try:
            if duration.due(step=step, tokens=tokens, epoch=epoch):
                return
        except NotImplementedError:
            return
        unit = str(duration.unit).split(".")[-1]
        if unit == "tokens":
            planned = int(duration.value)
            short = (f"after {tokens:,d} of its planned {planned:,d} tokens ({tokens / planned:.0%}; "
                     f"{planned - tokens:,d} tokens short)")
        elif unit == "steps":
            left = int(duration.value) - step
            short = (f"after {step:,d} of its planned {int(duration.value):,d} steps ({tokens:,d} tokens; {left:,d} "
                     f"steps short, {left * int(trainer.data_loader.global_batch_size):,d} tokens at the current batch)")
        else:
            short = f"in epoch {epoch} of its planned {duration.value} ({tokens:,d} tokens)"
        if trainer.is_canceled:
            reason = getattr(trainer, "_cancel_reason", None) or "no reason given"
            why = f"OLMo-core's Trainer canceled it ({reason})"
        elif trainer.hard_stop is not None and trainer.hard_stop.due(step=step, tokens=tokens, epoch=epoch):
            why = f"the trainer's hard_stop={trainer.hard_stop} came first"
        else:
            why = "the trainer stopped it"
        if self._warned_stop:
            return
        self._warned_stop = True  # not in the saved state: a resumed run that stops short again says so again
        log.warning(
            f"CBSOlmoCallback: the run ended at step {step:,d} {short}: {why}, and fit() returned without an "
            f"error. The tracker's record covers the {session.units_seen:,.0f} loss tokens of the steps that ran "
            f"(global batch {int(trainer.data_loader.global_batch_size):,d} tokens at the end). A "
            "CheckpointerCallback saved that step; the same command resumes from it, at that batch and LR.",
        )

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The engine's state (small, plain numbers, versioned); OLMo-core does not save the batch size."""
        if self.engine is None:
            return dict(self._restored) if self._restored is not None else {}
        return {"version": STATE_VERSION, "session": self.engine.state_dict(),
                "applied_changes": [list(c) for c in self.applied_changes]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; the batch and the LR are set again when the checkpoint is loaded.

        Raises:
            KeyError / TypeError / ValueError: a missing key, a wrong type, an unknown version
                (see :meth:`~cbs_tracker.core.session.TrackingSession.load_state_dict`).
        """
        if not state_dict:
            return
        version = state_dict.get("version")
        if version != STATE_VERSION or not isinstance(state_dict.get("session"), dict):
            raise ValueError(
                f"CBSOlmoCallback.load_state_dict: expected the dict from state_dict() (version {STATE_VERSION}), "
                f"got version {version!r}"
            )
        if self.engine is None:  # check it now, on copies
            dp = int(state_dict["session"].get("dp_degree", 1))
            self._settings.check_state(dict(state_dict["session"]), dp)
            self._restored = dict(state_dict)
            return
        self.engine.load_state_dict(dict(state_dict["session"]))
        self.applied_changes = [(int(s), int(b)) for s, b in state_dict.get("applied_changes", [])]
        self._reapply()

    def post_checkpoint_loaded(self, path: Any) -> None:
        self._reapply()
        self._say_restored()

    def _say_restored(self) -> None:
        """One line after a load: the batch, the accumulation and the LR the restored state set (OLMo-core's
        own line on the data loader gives the position in batches of the size it was built with)."""
        session, trainer = self.session, self.trainer
        if session is None or session.step == 0:
            return
        module, loader = trainer.train_module, trainer.data_loader
        size = int(loader.global_batch_size)
        group = module.optim.param_groups[0] if module.optim.param_groups else {}
        field = getattr(module.scheduler, "initial_lr_field", "initial_lr")
        peak = group.get(field) if module.scheduler is not None else group.get("lr")
        lr = peak
        tokens = int(trainer.global_train_tokens_seen)
        try:  # the LR the scheduler gives the next step (OLMo-core sets it with that step's tokens counted)
            if module.scheduler is not None and peak is not None and trainer.max_tokens is not None:
                lr = float(module.scheduler.get_lr(float(peak), tokens + size, int(trainer.max_tokens)))
        except Exception:  # a scheduler of another kind: the coupled base alone
            lr = peak
        lr_text = "?" if lr is None else f"{float(lr):.4g}"
        log.info(
            f"CBSOlmoCallback: restored at step {int(trainer.global_step):,d} ({tokens:,d} tokens): global_batch_size "
            f"{size:,d} tokens, {session.accumulation_steps} microbatches per rank on {session.dp_degree} rank(s) "
            f"(starting {session.starting_accumulation:g}), LR {lr_text} for the next step (the schedule's x"
            f"{session.coupling:.4g} for the batch); the data continue at batch {int(loader.batches_processed):,d} "
            f"of {size:,d} tokens"
        )

    def _reapply(self) -> None:
        """The batch and the LR coupling of the restored state, on the loader and the optimizer.

        A text loader restores its position from the tokens it processed, counted in batches of the
        size it was built with; at the restored size that position is ``tokens_processed // size``
        (whole: OLMo-core grows a batch only where the tokens so far are a multiple of the new size).
        Each param group's ``initial_lr`` is the configured one times the coupling (OLMo-core's
        optimizer state does not keep the coupled value).
        """
        session = self.session
        if session is None:
            return
        loader = self.trainer.data_loader
        size = session.accumulation_steps * self._micro_tokens * session.dp_degree
        tokens = getattr(loader, "tokens_processed", None)
        if isinstance(tokens, int) and not isinstance(tokens, bool):
            loader._global_batch_size = size
            loader.batches_processed = tokens // size
        elif loader.global_batch_size != size:
            loader.global_batch_size = size
        module = self.trainer.train_module
        factor = coupling_factor(session.coupling_mode, session.accumulation_steps / session.starting_accumulation)
        session.coupling = factor
        field = getattr(module.scheduler, "initial_lr_field", "initial_lr")
        lr_field = getattr(module.scheduler, "lr_field", "lr")
        for group, base in zip(module.optim.param_groups, self._base_lrs):
            group[field] = base * factor
            if module.scheduler is None:
                group[lr_field] = base * factor

    def close(self) -> None:
        self._in_step = False
        self._open = False


def _log_warning(message: str) -> None:
    """The session's warnings, to this module's logger (a function: the callback stays picklable)."""
    log.warning(message)


def _backend_for(backend: str, device: torch.device) -> str:
    """The backend of a ``torch.distributed.get_backend()`` string that carries ``device``'s tensors.

    ``"gloo"`` (one backend for every device), ``"cpu:gloo"`` and ``"cpu:gloo,cuda:nccl"`` (a backend per
    device type, as OLMo-core's ``prepare_training_environment`` sets them) all give ``"gloo"`` on the CPU;
    the last gives ``"nccl"`` on a CUDA device. ``""`` when the string names none for that device.
    """
    default = ""
    for part in str(backend).lower().split(","):
        part = part.strip()
        if ":" in part:
            kind, name = (x.strip() for x in part.split(":", 1))
            if kind == device.type:
                return name
        elif part:
            default = part
    return default
