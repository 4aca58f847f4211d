"""Hugging Face adapter: ``CBSTrainer``, a ``transformers.Trainer`` that measures the noise scale and grows the batch.

It overrides public ``Trainer`` methods (the window fetch, the training step, the
scheduler creation, the log) and two private ones (the checkpoint save and the resume
position); the step engine does the rest. A new accumulation takes
effect only where the Trainer's per-epoch microbatch counter stays aligned with it,
and schedules and ``max_steps`` stay in steps of the starting batch (transformers 5.24).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Literal

import torch
from torch import nn
from transformers import Trainer, TrainerCallback

from cbs_tracker._warn import warn_user
from cbs_tracker.calibrate import CalibrateAt, calibration_scalars
from cbs_tracker.core import distributed as cbs_dist
from cbs_tracker.core.collector import GradStatsCollector
from cbs_tracker.core.engine import Engine, EngineSettings
from cbs_tracker.core.estimator import NoiseScaleEstimator
from cbs_tracker.core.measure import loss_scale
from cbs_tracker.core.record import StepRecord, Unit
from cbs_tracker.core.session import TrackingSession, check_size
from cbs_tracker.core.tags import record_scalars, schedule_scalars, schedule_step
from cbs_tracker.core.units import BatchSizeFn, leading_dim
from cbs_tracker.policy.lr import COUPLINGS

__all__ = ["CBSCalibration", "CBSTrainer", "STATE_FILE", "TESTED_TRANSFORMERS", "check_transformers_version"]

#: file the tracker's state is written to in every Trainer checkpoint folder
STATE_FILE = "cbs_tracker.json"
_STATE_VERSION = 1
#: the transformers releases (major.minor) CBSTrainer is tested with; another one warns once
TESTED_TRANSFORMERS = ("5.24",)
_VERSION_WARNED = False


def installed_transformers() -> str:
    """The installed transformers release (its distribution's version)."""
    from importlib.metadata import version

    return version("transformers")


def check_transformers_version(version: str) -> str | None:
    """The warning for a transformers release outside :data:`TESTED_TRANSFORMERS`, or ``None`` inside it."""
    minor = ".".join(version.split("+")[0].split(".")[:2])
    if minor in TESTED_TRANSFORMERS:
        return None
    return (
        f"CBSTrainer is tested with transformers {', '.join(TESTED_TRANSFORMERS)}; this is {version}. "
        "It overrides Trainer methods whose behaviour it relies on (the window's batches, the loss "
        "normalisation, the step counters), so check a short run's windows and LR before relying on it, "
        "or install a tested release: pip install 'transformers>=5.24,<5.25'."
    )
# the Trainer's reporters that get the cbs/ scalars through Trainer.log (TensorBoard gets exact tags)
_NOT_TENSORBOARD = {"none", "tensorboard"}


class CBSTrainer(Trainer):
    """A ``transformers.Trainer`` that measures the gradient noise scale and grows the accumulation exactly.

    Use it in place of ``Trainer``; ``TrainingArguments(gradient_accumulation_steps=A0)``
    is the starting accumulation. Every other argument is the ``Trainer``'s.

    Args:
        controller: ``"auto"`` (default) builds a
            :class:`~cbs_tracker.policy.controller.BatchSizeController` with its defaults;
            pass a configured instance, or ``None`` to measure and log only.
        observe_only: never change the accumulation.
        unit: ``"tokens"`` (default: loss-contributing labels, ``ignore_index`` excluded,
            the first position of each row left out for causal LMs, whose loss shifts the
            labels) or ``"samples"`` (the leading dimension of the batch).
        batch_size_fn: ``fn(inputs) -> units`` of one microbatch (a number or a one-element
            tensor); replaces the counting ``unit`` implies.
        ignore_index: label value that contributes no loss (default -100).
        shift_labels: whether the loss predicts ``labels[..., 1:]``; ``None`` (default) asks
            the model class (causal LMs shift).
        estimator: a configured :class:`~cbs_tracker.core.estimator.NoiseScaleEstimator`.
        preconditioner: ``None`` or ``"adam"``: measure ``g / (sqrt(v_hat) + eps)``.
        lr_coupling: ``"auto"`` (LR x sqrt(B/B0) for Adam-family optimizers, x B/B0 for SGD),
            ``"keep"``, ``"sqrt"`` or ``"linear"``.
        cap_lr_at_peak: never let the coupling raise the LR above the schedule's peak
            (default ``None``: ``True`` when the controller has a ``budget_tokens``).
        measure_every: measure one window in ``n`` (default 1), or ``"auto"``: the smallest
            ``n`` keeping the measurement at or below ``measure_target`` of the step time.
            Windows not measured still count for the units, the counters and the schedule.
        measure_target: the share of the step time ``"auto"`` allows (default 0.01).

    Under growth the Trainer's learning-rate scheduler advances by the starting-batch
    steps each optimizer step held, and ``max_steps`` (given, or computed from the
    epochs) counts steps at the starting accumulation: the run ends at the same data as
    a run without growth, the last windows cut (to a divisor, which stays aligned) so as not to pass it.

    ``train(resume_from_checkpoint=...)`` on another number of processes, with the same
    ``gradient_accumulation_steps``, keeps the global batch (the tracker's state converts) and
    the position in the epoch (``m`` microbatches per process on ``D`` are ``m * D / D'`` here;
    rounded down with a warning where that does not split).

    Raises:
        TypeError / ValueError: a bad argument (the message names it).
        RuntimeError: a configuration the adapter cannot measure or grow exactly:
            DeepSpeed, FSDP, SageMaker model parallelism, ``nn.DataParallel`` (several GPUs
            in one process), tensor/context/sequence parallelism; and, when the batch may
            grow, samplers built from the accumulation (``group_by_length``,
            ``batch_rebalance``), ``auto_find_batch_size`` and a controller that may shrink.
    """

    def __init__(
        self,
        *args: Any,
        controller: Any = "auto",
        observe_only: bool = False,
        unit: Unit = "tokens",
        batch_size_fn: BatchSizeFn | None = None,
        ignore_index: int = -100,
        shift_labels: bool | None = None,
        estimator: NoiseScaleEstimator | None = None,
        preconditioner: Literal["adam"] | None = None,
        lr_coupling: str | None = "auto",
        cap_lr_at_peak: bool | None = None,
        measure_every: int | str = 1,
        measure_target: float = 0.01,
        max_microbatch: None = None,
        **kwargs: Any,
    ) -> None:
        if max_microbatch is not None:
            raise ValueError(
                f"CBSTrainer(max_microbatch={max_microbatch!r}): growing the microbatch is not supported by the "
                "Hugging Face Trainer in this release: its data loader is built once with "
                "per_device_train_batch_size and prefetched ahead of the step that decides, and its epoch and step "
                "counters assume that size, so a larger microbatch could not be exact. CBSTrainer grows "
                "gradient_accumulation_steps; to grow the microbatch, write the loop with CBSTracker(max_microbatch=...)"
            )
        from cbs_tracker.policy.controller import adapter_controller

        controller = adapter_controller("CBSTrainer", controller, observe_only)
        if getattr(controller, "allow_shrink", False):
            raise ValueError(
                f"CBSTrainer(controller={type(controller).__name__}(...)): it may shrink the batch (allow_shrink=True, or a "
                "BatchSchedule whose marks go down); shrinking is not supported; the "
                "Trainer's per-epoch counters and the data already consumed only stay exact when the batch grows"
            )
        if unit not in ("tokens", "samples"):
            raise ValueError(f"CBSTrainer(unit={unit!r}): must be 'tokens' or 'samples'")
        if batch_size_fn is not None and not callable(batch_size_fn):
            raise TypeError(f"CBSTrainer(batch_size_fn={batch_size_fn!r}): expected a function inputs -> units")
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise TypeError(f"CBSTrainer(ignore_index={ignore_index!r}): expected an int")
        if shift_labels not in (None, True, False):
            raise TypeError(f"CBSTrainer(shift_labels={shift_labels!r}): expected None, True or False")
        if preconditioner not in (None, "adam"):
            raise ValueError(f"CBSTrainer(preconditioner={preconditioner!r}): must be None or 'adam'")
        if lr_coupling is not None and lr_coupling not in COUPLINGS:
            raise ValueError(f"CBSTrainer(lr_coupling={lr_coupling!r}): expected one of {list(COUPLINGS)} or None")
        if cap_lr_at_peak is not None and not isinstance(cap_lr_at_peak, bool):
            raise TypeError(f"CBSTrainer(cap_lr_at_peak={cap_lr_at_peak!r}): expected True, False or None")
        # measure_every and measure_target are checked here, once (the engine is built with the scheduler)
        self._settings = EngineSettings(
            owner="CBSTrainer", unit=unit, estimator=estimator if estimator is not None else NoiseScaleEstimator(),
            controller=controller, lr_coupling=lr_coupling, cap_lr_at_peak=cap_lr_at_peak, warn=self._warn,
            measure_every=measure_every, measure_target=measure_target, preconditioner=preconditioner,
        )
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if getattr(training_args, "deepspeed", None):
            raise ValueError(
                f"CBSTrainer(args=TrainingArguments(deepspeed={training_args.deepspeed!r})): DeepSpeed is not "
                "supported: its ZeRO engine partitions and reduces the gradients itself (.grad is not the synced "
                "gradient the tracker reads) and steps the accumulation by its own gradient_accumulation_steps, "
                "so the noise scale would be measured wrong and the batch could not change. Use DDP (the "
                "default under torchrun) or write the loop with CBSTracker / FSDPTracker."
            )
        global _VERSION_WARNED
        version_warning = check_transformers_version(installed_transformers())
        if version_warning is not None and not _VERSION_WARNED:
            _VERSION_WARNED = True  # once per process
            warn_user(version_warning)
        super().__init__(*args, **kwargs)
        self.controller = controller
        self.unit: Unit = unit
        self.batch_size_fn = batch_size_fn
        self.ignore_index = ignore_index
        self._labels_read = False  # the first labels counted were looked at (their kind: token ids or not)
        self.shift_labels = shift_labels
        self.estimator = self._settings.estimator
        self.preconditioner = preconditioner
        self.lr_coupling = lr_coupling
        self.cap_lr_at_peak = cap_lr_at_peak
        self.measure_every, self.measure_target = measure_every, measure_target
        self._check_configuration()

        #: the collector, the reduction of each window, the session and their state (built with the scheduler)
        self.engine: Engine | None = None
        self.applied_changes: list[tuple[int, int, int, int]] = []  # (step, epoch, microbatch in epoch, new A)
        self._unsynced = False
        self._params: list[nn.Parameter] = []
        self._restored: dict[str, Any] | None = None
        self._clear_run()

    def _clear_run(self) -> None:
        self._starting_accumulation = int(self.args.gradient_accumulation_steps)
        self._steps_in_epoch: int | None = None
        self._run_length_given = False  # the run's length went to the session (_give_run_length)
        self._iterator: Any = None
        self._epoch = 0
        self._epoch_pos = 0  # microbatches fetched in this epoch (all run by the next fetch or save)
        self._resume_pos = 0
        self._window: list[Any] = []  # per-microbatch sizes of the fetched window
        self._window_index = 0
        self._window_setting = self._starting_accumulation
        self._units_divisor: torch.Tensor | float | None = None
        self._logged_step = 0
        #: the checkpoint's starting accumulation on this run's ranks, where it is not the command line's
        self._resume_start: int | float | None = None

    # ------------------------------------------------------------------ public state
    @property
    def session(self) -> TrackingSession | None:
        """The engine's session (``None`` before the first ``train``)."""
        return None if self.engine is None else self.engine.session

    @property
    def _collector(self) -> GradStatsCollector | None:
        return None if self.engine is None else self.engine.collector

    @property
    def noise_scale(self) -> float | None:
        """Smoothed ``B_simple`` in :attr:`unit`; ``None`` until measurable."""
        return self.estimator.noise_scale

    @property
    def tokens_seen(self) -> float:
        """Units (see :attr:`unit`) consumed by all ranks in measured steps."""
        return 0.0 if self.session is None else self.session.units_seen

    @property
    def accumulation_steps(self) -> int:
        """The accumulation in force (``TrainingArguments.gradient_accumulation_steps`` during training)."""
        return self._starting_accumulation if self.session is None else self.session.accumulation_steps

    @property
    def last_record(self) -> StepRecord | None:
        return None if self.session is None else self.session.last_record

    # ------------------------------------------------------------------ refusals
    def _can_grow(self) -> bool:
        return self.controller is not None and not getattr(self.controller, "observe_only", False)

    def _check_configuration(self) -> None:
        from transformers.utils import is_sagemaker_mp_enabled

        engine = (
            "DeepSpeed" if self.is_deepspeed_enabled
            else "FSDP" if self.is_fsdp_enabled or self.is_fsdp_xla_enabled
            else "SageMaker model parallelism" if is_sagemaker_mp_enabled()
            else None
        )
        if engine is not None:
            raise RuntimeError(
                f"CBSTrainer cannot be used with {engine}: it accumulates or shards the gradients itself, so "
                "the per-microbatch gradients are not seen and the accumulation cannot change between steps. "
                "Use DDP (torchrun), or cbs_tracker.integrations.fsdp.FSDPTracker in a plain loop for FSDP2."
            )
        if self.args.n_gpu > 1:
            raise RuntimeError(
                f"CBSTrainer: {self.args.n_gpu} GPUs in one process (nn.DataParallel) are not supported; "
                "launch one process per GPU with torchrun (DDP)"
            )
        sizes = {name: int(getattr(self, f"get_{name}_size")()) for name in ("tp", "cp", "sp")}
        sharded = {k: v for k, v in sizes.items() if v > 1}
        if sharded:
            raise RuntimeError(
                f"CBSTrainer does not support model parallelism ({sharded}): only data-parallel ranks may "
                "multiply the batch, and sharded parameters hide the per-microbatch gradients"
            )
        if not self._can_grow():
            return
        strategy = getattr(self.args, "train_sampling_strategy", None)
        if strategy in ("group_by_length", "batch_rebalance"):
            raise RuntimeError(
                f"CBSTrainer: TrainingArguments(train_sampling_strategy={strategy!r}) builds its sampler from "
                "gradient_accumulation_steps once, so a grown accumulation would no longer match it. Use "
                "'random' or 'sequential', or CBSTrainer(observe_only=True) to only measure."
            )
        if self.args.auto_find_batch_size:
            raise RuntimeError(
                "CBSTrainer: TrainingArguments(auto_find_batch_size=True) restarts the loop with another "
                "microbatch; set per_device_train_batch_size yourself, or use CBSTrainer(observe_only=True)"
            )

    # ------------------------------------------------------------------ the run
    def train(self, *args: Any, **kwargs: Any) -> Any:
        self._clear_run()
        self._resume_start = self._peek_start(kwargs.get("resume_from_checkpoint", args[0] if args else None))
        try:
            return super().train(*args, **kwargs)
        finally:
            # the caller's TrainingArguments keep the starting accumulation
            self.args.gradient_accumulation_steps = self._starting_accumulation
            self._iterator = None
            if self.engine is not None:
                self.engine.remove()

    def _peek_start(self, resume: Any) -> int | float | None:
        """The checkpoint's starting accumulation per rank on this run's ranks, where it is not the command line's.

        The ``Trainer`` sizes an epoch-based run (``max_steps``, the LR schedule's length, the
        windows per epoch) from ``gradient_accumulation_steps`` before the tracker's state is
        read: on ``D'`` ranks a checkpoint of ``D`` keeps its starting global batch at
        ``A0 * D / D'`` microbatches per rank (and a checkpoint of a run resumed so keeps it
        at any number of ranks), and the sizes must be those of that batch. ``None``: the
        command line's.
        """
        if isinstance(resume, bool) and resume:
            from transformers.trainer_utils import get_last_checkpoint

            resume = get_last_checkpoint(self.args.output_dir) if os.path.isdir(self.args.output_dir) else None
        if not isinstance(resume, (str, os.PathLike)) or not os.path.isfile(os.path.join(resume, STATE_FILE)):
            return None  # the Trainer or _init_training_state says what is wrong
        try:
            with open(os.path.join(resume, STATE_FILE)) as f:
                session = json.load(f)["session"]
            dp, start = int(session["dp_degree"]), session["starting_accumulation"]
            if isinstance(start, bool) or not isinstance(start, (int, float)) or not start > 0 or dp < 1:
                return None
        except (OSError, ValueError, KeyError, TypeError):
            return None  # _init_training_state reads it again and raises with the reason
        from cbs_tracker.policy.ranks import plain_number

        here = plain_number(float(start) * dp / cbs_dist.group_size(cbs_dist.resolve_dp_group(None)))
        return None if here == self._starting_accumulation else here

    def set_initial_training_values(self, args: Any, dataloader: Any) -> tuple:
        values = super().set_initial_training_values(args, dataloader)
        self._steps_in_epoch = values[5] if hasattr(dataloader, "__len__") else None
        start = self._resume_start
        if start is None or self._steps_in_epoch is None:
            return values
        # the Trainer's own sizes, in steps of the starting batch the session runs (it may be a fraction);
        # the windows it fetches per epoch: at least one microbatch each, since an uneven split may run
        # fewer microbatches than the starting batch
        epochs, _, examples, samples, total, steps_in_epoch, max_steps = values
        per_epoch = max(math.ceil(self._steps_in_epoch / start), 1)
        if args.max_steps > 0:
            epochs = max_steps // per_epoch + int(max_steps % per_epoch > 0)
        else:
            max_steps = math.ceil(args.num_train_epochs * per_epoch)
        return epochs, max(per_epoch, self._steps_in_epoch), examples, samples, total, steps_in_epoch, max_steps

    def _init_training_state(self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial):
        epochs, steps = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        self._restored = None
        if resume_from_checkpoint is None:
            return epochs, steps
        # The Trainer derives the position from global_step and the starting accumulation,
        # which a grown batch makes wrong: the saved position replaces it.
        path = os.path.join(resume_from_checkpoint, STATE_FILE)
        if not os.path.isfile(path):
            raise RuntimeError(
                f"CBSTrainer: the checkpoint {resume_from_checkpoint!r} has no {STATE_FILE} (it was not written by "
                "CBSTrainer, or with save_only_model=True), so the data position and the schedule cannot be "
                "restored exactly. Resume it with the Trainer that wrote it, or start a new run."
            )
        with open(path) as f:
            saved = json.load(f)
        if not isinstance(saved, dict) or saved.get("version") != _STATE_VERSION:
            raise ValueError(f"CBSTrainer: {path} is not a state file this cbs-tracker writes (version {_STATE_VERSION})")
        # the run's own command line (a file of an older release: the session's start, which was never moved)
        start = saved.get("gradient_accumulation_steps", saved["session"].get("starting_accumulation"))
        if start != self._starting_accumulation:
            dp = saved["session"].get("dp_degree")
            here = cbs_dist.group_size(cbs_dist.resolve_dp_group(None))
            moved = "" if dp == here else (
                f" (on {dp} processes; here on {here}, the tracker converts it to keep the global batch)")
            raise ValueError(
                f"CBSTrainer: the checkpoint started at gradient_accumulation_steps={start}{moved}, this run at "
                f"{self._starting_accumulation}; resume with the starting value (the tracker restores the grown one)"
            )
        self._restored = saved["session"]
        self._epoch = int(saved["epoch"])
        self._resume_pos = 0 if self.args.ignore_data_skip else self._convert_position(saved)
        return self._epoch, self._resume_pos

    def _convert_position(self, saved: dict[str, Any]) -> int:
        """The microbatches per rank to skip in the resumed epoch, on this run's ranks.

        The state file holds what each of the checkpoint's ``D`` ranks ran of the epoch, ``m``.
        The Trainer's sampler, sharded by accelerate, gives rank ``p`` the epoch's batches
        ``p, p + D, p + 2D, ...``: those ``m`` per rank are the epoch's first ``m * D``, and on
        ``D'`` ranks the same place is ``m * D / D'`` per rank. When that is not whole, or not
        a multiple of the accumulation the run goes on with (the Trainer steps where its
        counter is one), it is rounded down to one (no batch of the epoch is skipped) and a
        warning names the batches run a second time.
        """
        done = int(saved["microbatches_in_epoch"])
        session = saved["session"]
        dp, here = int(session.get("dp_degree", 1)), cbs_dist.group_size(cbs_dist.resolve_dp_group(None))
        if done == 0 or dp == here:
            return done
        from cbs_tracker.policy.ranks import RankChange

        change = RankChange.plan(dp, here, int(session["accumulation_steps"]))
        acc = change.new_accumulation
        position = change.position(done, acc)
        if self._steps_in_epoch is not None and position >= self._steps_in_epoch:
            position = (self._steps_in_epoch - 1) // acc * acc  # the epoch was not over: batches remain
        again = done * dp - position * here
        if again:
            rows = self.args.per_device_train_batch_size
            self._warn(
                f"CBSTrainer: resumed on {here} process{'es' if here > 1 else ''} from a checkpoint of {dp} saved "
                f"after {done * dp} of the epoch's batches (all processes, {done} per process); they do not split "
                f"into windows of {acc} per process here, so the epoch goes on after {position * here} "
                f"({position} per process) and {again} batches ({again * rows} samples, {rows} per batch) run a "
                "second time. To be exact, resume on a number of processes that divides the position, or from "
                "a checkpoint saved at an epoch's end."
            )
        return position

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        # The Trainer steps its scheduler once per optimizer step; built on the unwrapped
        # optimizer it can be timed by the session (the accelerate wrapper shares its groups).
        inner = optimizer if optimizer is not None else getattr(self.optimizer, "optimizer", self.optimizer)
        scheduler = super().create_scheduler(num_training_steps, optimizer=inner)
        self._start_session(getattr(scheduler, "optimizer", inner), scheduler)
        return scheduler

    def _start_session(self, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        dp_group = cbs_dist.resolve_dp_group(None)
        self._run_length_given = False
        if self.engine is not None:
            self.engine.remove()  # a run before this one's
        self.engine = engine = Engine(self._settings, starting_accumulation=self._starting_accumulation,
                                      dp_degree=cbs_dist.group_size(dp_group), optimizer=optimizer,
                                      dp_group=dp_group)
        if self._restored is not None:
            engine.load_state_dict(self._restored)
            self._restored = None
        if scheduler is not None:
            engine.session.attach_scheduler(scheduler)
        self.args.gradient_accumulation_steps = engine.session.accumulation_steps
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        if not self._params:
            raise ValueError("CBSTrainer: the model has no parameter with requires_grad=True")
        engine.collect(self._params)
        engine.give_model_size(self.model)
        # one process (FSDP and DeepSpeed are refused): a backward never syncs, so a window's
        # first gradients are read from .grad
        self._unsynced = cbs_dist.group_size(dp_group) == 1
        self._avg_ranks = cbs_dist.group_size(dp_group)  # DDP averages over all ranks
        if self._steps_in_epoch is not None and self._can_grow():
            self.session.limit_to_epoch(self._steps_in_epoch, "microbatches per rank")
        if self.session.starting_accumulation * self.session.dp_degree < 2:
            self.session.warn_once(
                "single_microbatch",
                "CBSTrainer: each optimizer step has a single microbatch (gradient_accumulation_steps=1 on one "
                "process), so there is no second batch size and the noise scale is not measured (nor the batch "
                "grown). Halve per_device_train_batch_size and set gradient_accumulation_steps=2.",
            )

    def _warn(self, message: str) -> None:
        if self.is_world_process_zero():
            warn_user(message)

    # ------------------------------------------------------------------ windows
    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, Any]:
        if self.session is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        if epoch_iterator is not self._iterator:  # the Trainer makes one iterator per epoch
            if self._iterator is not None:
                self._epoch += 1
            self._iterator = epoch_iterator
            self._epoch_pos, self._resume_pos = self._resume_pos, 0
        if not self._run_length_given:
            self._give_run_length()
        setting = self._next_window()
        batches, num_items = super().get_batch_samples(epoch_iterator, setting, device)
        self._window = [self._count(inputs) for inputs in batches]
        self.engine.start_window()  # type: ignore[union-attr]
        self._window_index = 0
        self._window_setting = setting
        self._epoch_pos += len(batches)
        self._units_divisor = self._normalisation(num_items)
        return batches, num_items

    def _give_run_length(self) -> None:
        """The run's length, for a controller's efficiency budget (``set_run_length``): the microbatches per
        process of ``state.max_steps`` steps at the starting accumulation (an epoch's short last step holds
        its microbatches, as in the run without growth), or ``max_steps`` times the starting global batch
        where the epoch's length is unknown. Given once, when the first window is fetched."""
        session = self.session
        assert session is not None
        self._run_length_given = True
        max_steps = self.state.max_steps
        if max_steps is None or max_steps <= 0:
            return
        per_epoch, start = self._steps_in_epoch, session.starting_accumulation
        if per_epoch:
            epochs, rest = divmod(max_steps, max(math.ceil(per_epoch / start), 1))
            session.set_run_length(microbatches=epochs * per_epoch + min(rest * start, per_epoch))
        else:
            session.set_run_length(steps=max_steps)

    def _next_window(self) -> int:
        """Microbatches of the next window, set in ``TrainingArguments`` (the Trainer reads it live).

        The Trainer steps when ``(microbatch in epoch + 1) % gradient_accumulation_steps == 0``:
        a new value takes effect only where it divides the microbatches run so far this epoch.
        """
        session = self.session
        assert session is not None
        if self._steps_in_epoch is not None and self._epoch_pos >= self._steps_in_epoch:
            return session.accumulation_steps  # the epoch's data is used up: the Trainer fetches nothing
        pending = session.pending_accumulation
        if pending is not None and self._epoch_pos % pending == 0:
            session.apply_pending()
            self.applied_changes.append((session.step, self._epoch, self._epoch_pos, pending))
        setting = session.accumulation_steps
        # Do not pass the budget (in starting-batch steps; the epoch's end may shorten the
        # window): the largest divisor of the setting that fits keeps the window aligned (it
        # divides the last one; for powers of two: halving).
        start, left = session.starting_accumulation, self.state.max_steps - session.starting_batch_steps
        if setting > start and -(-self._window_length(setting) // start) > left:
            setting = next(d for d in range(setting, 0, -1)
                           if setting % d == 0 and (-(-self._window_length(d) // start) <= left or d == 1))
        if self._epoch_pos % setting:
            raise RuntimeError(
                f"CBSTrainer: internal error, a window of {setting} microbatches would start at microbatch "
                f"{self._epoch_pos} of the epoch, where the Trainer would not step at its end"
            )
        self.args.gradient_accumulation_steps = setting
        return setting

    def _window_length(self, setting: int) -> int:
        if self._steps_in_epoch is None:
            return setting
        return min(setting, self._steps_in_epoch - self._epoch_pos)

    def _count(self, inputs: Any) -> Any:
        if self.batch_size_fn is not None:
            size = self.batch_size_fn(inputs)
        elif self.unit == "samples":
            size = leading_dim(inputs)
        else:
            labels = inputs.get("shift_labels") if hasattr(inputs, "get") else None
            if labels is None:
                labels = inputs.get("labels") if hasattr(inputs, "get") else None
                if not isinstance(labels, torch.Tensor):
                    raise ValueError(
                        "CBSTrainer(unit='tokens') counts the batch's 'labels' but found none; pass "
                        "unit='samples' or batch_size_fn="
                    )
                if self._loss_shifts():
                    labels = labels[..., 1:]
            if not self._labels_read and self.session is not None:
                self.session.read_label_kind(labels, "CBSTrainer(unit='tokens')")
                self._labels_read = True
            size = (labels != self.ignore_index).sum()
        return check_size(size, owner="CBSTrainer(batch_size_fn=...)")

    def _loss_shifts(self) -> bool:
        if self.shift_labels is not None:
            return self.shift_labels
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        model = self.accelerator.unwrap_model(self.model)
        config = getattr(model, "config", None)
        return type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() and not getattr(
            config, "is_encoder_decoder", False
        )

    def _normalisation(self, num_items: Any) -> Any:
        """``D``, the units each microbatch's summed loss is divided by, or ``None`` for a mean loss.

        Mirrors ``Trainer.training_step``/``compute_loss``: a loss normalised by
        ``num_items_in_batch`` is ``sum of unit losses / N``, times ``c`` ranks with
        ``average_tokens_across_devices`` (``N`` then counts every rank's window), so
        ``D = N / c``; otherwise it is a mean divided by the window's microbatches. Kept
        as the Trainer gave it (a tensor stays on its device: no host sync).
        """
        by_items = self.loss_is_scaled_for_ga
        if by_items is None:
            by_items = (self.model_accepts_loss_kwargs and num_items is not None) or self.compute_loss_func is not None
        if not by_items or num_items is None or not self._window:
            return None
        ranks = 1
        if self.args.average_tokens_across_devices:
            tp = self.get_tp_size() if hasattr(self, "get_tp_size") else 1
            ranks = self.accelerator.num_processes // tp
        if isinstance(num_items, torch.Tensor):
            return num_items.double().reshape(()) / ranks
        return float(num_items) / ranks

    # ------------------------------------------------------------------ microbatches and steps
    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        engine = self.engine
        if engine is None or engine.collector is None or self._window_index >= len(self._window):
            return super().training_step(model, inputs, num_items_in_batch)
        size = self._window[self._window_index]
        engine.begin_microbatch(unsynced=self._unsynced)
        loss = super().training_step(model, inputs, num_items_in_batch)
        if engine.session.wants_loss():  # the microbatch's mean loss, undoing the Trainer's division
            divisor = self._units_divisor
            engine.session.observe_loss(loss * len(self._window) if divisor is None else loss * divisor / size)
        engine.end_microbatch(size)
        self._window_index += 1
        if self._window_index == len(self._window):
            self._finish_window()  # the last backward of the window ran: gradients synced, not clipped
        return loss

    def _finish_window(self) -> None:
        engine, session = self.engine, self.session
        assert engine is not None and session is not None and engine.collector is not None
        k = len(self._window)
        # The Trainer divides a mean loss by K, or each microbatch's unit-sum loss by D = N / c
        # (then h_k = (b_k / D) g_k: each microbatch weighted by its units).
        if self._units_divisor is None:
            norm: dict[str, Any] = dict(loss_divisor=float(k))
        else:
            norm = dict(loss_divisor=1.0, normalization="window", units_divisor=self._units_divisor)
        scaler = getattr(self.accelerator, "scaler", None)
        scale = None
        if scaler is not None and scaler.is_enabled():
            # not unscaled yet (the Trainer unscales when it clips): the loss scale S is in the
            # hooked gradients and in .grad alike, removed from both (read without a host sync)
            scale = loss_scale(scaler)
        stats, faults = engine.reduce(
            self._params, dp_group=None, avg_ranks=self._avg_ranks, expected_microbatches=k, scale=scale,
            big_is_scaled=scale is not None, **norm,
        )
        engine.finish_step(stats, faults, window_accumulation=self._window_setting, mismatch_is_fatal=True)
        if session.changed_this_step:
            self.control.should_log = True  # write the step of a change whatever logging_steps says
        if self.state.max_steps > 0 and session.starting_batch_steps >= self.state.max_steps:
            self.control.should_training_stop = True
            if self.args.save_strategy == "steps":
                self.control.should_save = True

    # ------------------------------------------------------------------ logging
    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        record = self.last_record
        if record is not None and record.step > self._logged_step and self.is_in_train:
            self._logged_step = record.step
            if any(str(r) not in _NOT_TENSORBOARD for r in (self.args.report_to or [])):
                logs.update(record_scalars(record))
            self._write_tensorboard(record)
        super().log(logs, *args, **kwargs)

    def _write_tensorboard(self, record: StepRecord) -> None:
        """The exact ``cbs/`` tags (against the step) and ``cbs_tokens/`` (against units) in the Trainer's event file."""
        from transformers.integrations import TensorBoardCallback

        for callback in self.callback_handler.callbacks:
            writer = getattr(callback, "tb_writer", None)
            if isinstance(callback, TensorBoardCallback) and writer is not None and self.is_world_process_zero():
                for tag, value in record_scalars(record).items():
                    writer.add_scalar(tag, value, record.step)
                for tag, value in schedule_scalars(record).items():
                    writer.add_scalar(tag, value, schedule_step(record))

    # ------------------------------------------------------------------ checkpoints
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.engine is None or not self.args.should_save:
            return
        epoch, pos = self._epoch, self._epoch_pos
        if self._steps_in_epoch is not None and pos >= self._steps_in_epoch:
            epoch, pos = epoch + 1, 0
        state = {"version": _STATE_VERSION, "epoch": epoch, "microbatches_in_epoch": pos,
                 "gradient_accumulation_steps": self._starting_accumulation, "session": self.engine.state_dict()}
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, STATE_FILE), "w") as f:
            json.dump(state, f, allow_nan=True)


class CBSCalibration(TrainerCallback):
    """Measure the critical batch by branches at token marks during ``train``, and hand ``kappa`` to the controller.

    ``trainer.add_callback(CBSCalibration(trainer, marks=[...], loss_fn=..., data=..., evaluate=...,
    microbatch_size=..., branch_tokens=...))``. After the first optimizer step at or after each
    mark it runs :func:`cbs_tracker.measure_critical_batch` on deep copies of the model and the
    optimizer (the run itself is untouched) and, with ``apply=True``, gives the measured ``kappa``
    to the trainer's controller; the ``cbs_calibration/`` tags go through ``Trainer.log`` at the step.

    Args:
        trainer: the :class:`CBSTrainer`.
        marks: units seen at which to calibrate.
        apply: give each point's ``kappa`` to the controller (default ``True``).
        **measure: the arguments of :func:`~cbs_tracker.measure_critical_batch` (``loss_fn(model,
            batch)``, ``data(replicate)``, ``evaluate(model)``, ``microbatch_size``, ``branch_tokens``, ...).
    """

    def __init__(self, trainer: CBSTrainer, marks: list[float], *, apply: bool = True, **measure: Any) -> None:
        if not isinstance(trainer, CBSTrainer):
            raise TypeError(f"CBSCalibration(trainer={trainer!r}): expected the CBSTrainer")
        self.trainer = trainer
        self._at = CalibrateAt(marks, apply=apply, **measure)

    @property
    def calibration(self) -> Any:
        """The :class:`~cbs_tracker.calibrate.Calibration` so far."""
        return self._at.calibration

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        point = self._at.after_step(self.trainer.model, self.trainer.optimizer, self.trainer)
        if point is not None:  # the cbs_calibration/ tags through the Trainer's reporting, at this step
            self.trainer.log(calibration_scalars(point))
