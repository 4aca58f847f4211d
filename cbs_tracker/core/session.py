"""The step's bookkeeping under every adapter: counters, estimate, decision, LR coupling, record, state.

:class:`~cbs_tracker.core.engine.Engine` builds the session beside the collector and hands it each
window's reduced norms (:meth:`TrackingSession.finish_step`); the adapter decides **when** a
pending accumulation takes effect (:meth:`TrackingSession.apply_pending`). Everything else is
here, once. See docs/design.md ("Adapt").
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable
from typing import Any

from cbs_tracker._warn import warn_user
from cbs_tracker.core.cadence import MeasureCadence
from cbs_tracker.core.collector import StepStats
from cbs_tracker.core.estimator import NoiseScaleEstimator
from cbs_tracker.core.measure import REPLICA_TOLERANCE, WindowFaults
from cbs_tracker.core.record import PENDING_FIELDS, StepRecord, Unit
from cbs_tracker.policy._state import StateReader
from cbs_tracker.policy.lr import ScheduleTimer, coupling_factor, resolve_coupling
from cbs_tracker.policy.ranks import RankChange, plain_number

__all__ = ["SESSION_STATE_VERSION", "TrackingSession", "check_size"]

#: version of :meth:`TrackingSession.state_dict`; 1 was the format of the first release
#: (read too: it lacks the LR and schedule keys, which then start fresh).
SESSION_STATE_VERSION = 2

# measured steps before the averaged-norm sanity checks may warn
_SANITY_STEPS = 20


def check_size(size: Any, *, owner: str) -> float | Any:
    """Validate a microbatch size: a real number >= 0 or a one-element tensor (checked later, on device).

    Returns the size as a float, or the tensor reshaped to 0-d (no host sync).

    Raises:
        TypeError: a bool, a non-number, or a tensor with more than one element.
        ValueError: a negative or non-finite number.
    """
    if isinstance(size, bool) or (hasattr(size, "dtype") and str(getattr(size, "dtype", "")) == "bool"):
        raise TypeError(f"{owner}(size={size!r}): a bool is not a size; pass the number of units")
    if hasattr(size, "numel") and hasattr(size, "reshape"):  # a tensor: checked on device when the step reduces
        if size.numel() != 1:
            raise TypeError(
                f"{owner}(size=<tensor of shape {tuple(size.shape)}>): expected a number or a one-element "
                "tensor (for labels, pass labels= to count the tokens)"
            )
        return size.reshape(())
    if isinstance(size, numbers.Real):
        value = float(size)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{owner}(size={size!r}): must be a finite number >= 0")
        return value
    raise TypeError(f"{owner}(size={size!r}): expected a real number or a one-element tensor")


class TrackingSession:
    """Framework-free bookkeeping of one tracked run, shared by every adapter.

    Args:
        owner: the adapter's name, used in messages (``"CBSTracker"``, ``"CBSCallback"``...).
        unit: ``"tokens"`` or ``"samples"``: the unit of every size.
        starting_accumulation: microbatches per rank of the first window (``A0``).
        dp_degree: data-parallel ranks.
        estimator: the noise-scale estimator (default: a new ``NoiseScaleEstimator``).
        controller: a ``BatchSizeController`` instance or ``None`` (measure only).
        optimizer: the optimizer whose learning rate the coupling scales (may be ``None``).
        lr_coupling: ``"auto"`` (default: ``sqrt`` for Adam-family optimizers, ``linear``
            for SGD), ``"keep"``, ``"sqrt"`` or ``"linear"``; a controller built with an
            explicit ``lr_scaling`` overrides ``"auto"``.
        cap_lr_at_peak: never let the coupling raise the learning rate above the
            schedule's peak (the param group's ``initial_lr``/``max_lr``). ``None``
            (default): ``True`` when the controller has a ``budget_tokens`` (its plan grows
            the batch whatever the measured noise scale says), else ``False``.
        logger: anything with ``log(record)``.
        warn: ``fn(message)`` for user warnings (rank-zero aware in Lightning).
        measure_every: measure one window in ``n`` (default 1: every window), or
            ``"auto"``: the smallest ``n`` that keeps the measurement's share of the step
            time at or below ``measure_target`` (see :mod:`cbs_tracker.core.cadence`).
        measure_target: that share for ``"auto"`` (default 0.01). Both are checked once, where the
            adapter is built (:class:`~cbs_tracker.core.engine.EngineSettings`), not here.

    Raises:
        TypeError / ValueError: on bad configuration (the message names the argument).
    """

    def __init__(
        self,
        *,
        owner: str,
        unit: Unit,
        starting_accumulation: int,
        dp_degree: int = 1,
        estimator: Any | None = None,
        controller: Any | None = None,
        optimizer: Any | None = None,
        lr_coupling: str | None = "auto",
        cap_lr_at_peak: bool | None = None,
        logger: Any | None = None,
        warn: Any | None = None,
        measure_every: int | str = 1,
        measure_target: float = 0.01,
    ) -> None:
        if unit not in ("tokens", "samples"):
            raise ValueError(f"{owner}(unit={unit!r}): must be 'tokens' or 'samples'")
        if (
            isinstance(starting_accumulation, bool)
            or not isinstance(starting_accumulation, numbers.Integral)
            or starting_accumulation < 1
        ):
            raise ValueError(f"{owner}(accumulation_steps={starting_accumulation!r}): must be an integer >= 1")
        if isinstance(controller, type):
            raise TypeError(
                f"{owner}(controller={controller.__name__}): pass an instance, e.g. "
                f"controller={controller.__name__}(), not the class"
            )
        if controller is not None and not all(
            callable(getattr(controller, m, None)) for m in ("update", "state_dict", "load_state_dict")
        ):
            raise TypeError(
                f"{owner}(controller={type(controller).__name__}): expected a BatchSizeController "
                "(an object with update(...), state_dict() and load_state_dict()) or None"
            )
        if isinstance(estimator, type):
            raise TypeError(f"{owner}(estimator={estimator.__name__}): pass an instance, not the class")
        if estimator is not None and not all(
            callable(getattr(estimator, m, None)) for m in ("update", "state_dict", "load_state_dict")
        ):
            raise TypeError(
                f"{owner}(estimator={type(estimator).__name__}): expected a NoiseScaleEstimator or None"
            )
        if logger is not None and not callable(getattr(logger, "log", None)):
            raise TypeError(f"{owner}(logger={type(logger).__name__}): expected an object with log(record)")
        if cap_lr_at_peak is not None and not isinstance(cap_lr_at_peak, bool):
            raise TypeError(f"{owner}(cap_lr_at_peak={cap_lr_at_peak!r}): expected True, False or None")
        budget = getattr(controller, "budget_tokens", None)
        if cap_lr_at_peak is None:
            cap_lr_at_peak = budget is not None
        configured = getattr(controller, "lr_scaling", None)
        if lr_coupling in (None, "auto") and configured is not None:
            lr_coupling = configured  # an explicit controller setting wins over "auto"
        self.owner = owner
        self.unit: Unit = unit
        self.starting_accumulation = int(starting_accumulation)
        self.dp_degree = int(dp_degree)
        self.estimator = estimator if estimator is not None else NoiseScaleEstimator()
        self.controller = controller
        self.optimizer = optimizer
        self.coupling_mode = resolve_coupling(lr_coupling, optimizer, owner=owner)
        self.cap_lr_at_peak = cap_lr_at_peak
        self.logger = logger
        self._warn_fn = warn
        if callable(getattr(controller, "bind", None)):  # a BatchSchedule checks its marks against the layout
            controller.bind(owner=owner, dp_degree=int(dp_degree), starting_accumulation=int(starting_accumulation))
        self.cadence = MeasureCadence(measure_every, measure_target)  # checked by EngineSettings
        self._last_finish: float | None = None  # the step clock at the last window's end, when read
        self._clock_due = self.cadence.clock_due()  # read the step clock when the current window ends
        #: the current window is an unmeasured one whose tracker work is timed (``"auto"``: the one
        #: before a measured window); an adapter adds its own timed work to :attr:`own_extra`
        self.timing = False
        self.own_extra = 0.0
        #: warn when the learning rate was changed between two steps by someone else (plain loops)
        self.detect_outside_lr = False
        self._lr_left: float | None = None  # the first group's LR as the tracker last left it
        # the loop wrote the LR itself over a coupling: the optimizer's LR over the coupling is no
        # longer the schedule's, so no scheduled LR is reported (a controller converts nothing)
        self._lr_from_outside = False
        self._timer_writes = 0
        self.timer: ScheduleTimer | None = None
        self._pending_schedule_state: dict[str, Any] | None = None
        self._update_kwargs: tuple[str, ...] | None = None

        self.step = 0
        self._units_known = 0.0  # units of the windows whose sizes have reached the host
        #: windows not measured whose sizes are still on their way to the host, oldest first
        self._deferred: list[_Deferred] = []
        self.starting_batch_steps = 0
        #: units of the first step (all ranks), a whole window at the starting accumulation: the starting
        #: global batch that converts a run length in steps or microbatches to units (``None``: not yet)
        self.starting_units: float | None = None
        self._run_length: tuple[str, float] | None = None  # set_run_length's (kind, value)
        self._run_length_sent: float | None = None  # the units last given to the controller
        #: microbatches per rank of the last whole windows not yet a whole starting-batch step
        self.starting_batch_carry = 0.0
        self.accumulation_steps = self.starting_accumulation
        #: the data loader's batches that make one microbatch in the current window (the plain
        #: loop's microbatch-first layout; 1 elsewhere): the batch level is in loader batches
        self.micro_group = 1
        self.pending_accumulation: int | None = None
        self.coupling = 1.0
        self.last_record: StepRecord | None = None
        self._record_current = False  # last_record tells the estimator's state (finish_counted may copy it)
        self._last_stats: StepStats | None = None
        self.last_decision: Any | None = None
        self._resumed_critical: float | None = None  # the saved run's last decided critical batch, on a resume
        #: the windows' mean losses (numbers, one-element tensors or ``None``: none given on this rank) as floats,
        #: each the mean over the ranks that gave one (``nan``: none did); the engine reads tensors in one transfer
        #: and, on several ranks, averages them in one small ``all_reduce``
        self.read_losses: Callable[[list[Any]], list[float]] = _local_losses
        self._window_loss: Any = None  # the current window's summed microbatch losses (a float or a tensor)
        self._window_losses = 0  # and how many
        #: ``(tokens or a record whose tokens arrive later, window's mean loss)`` not yet given to the controller
        self._losses: list[tuple[Any, Any]] = []
        self.changed_this_step = False
        self._warned: set[str] = set()
        #: the rank change the last load_state_dict converted (``None``: same ranks, or no resume)
        self.resumed_from: RankChange | None = None
        self._recouple = False
        self._sanity = [0, 0.0, 0.0, 0.0]  # measured steps, sum small, sum big, sum K
        if budget is not None and self.coupling_mode in ("sqrt", "linear") and not cap_lr_at_peak:
            self.warn_once(
                "budget_coupling",
                f"{owner}: the controller's budget_tokens={budget:g} with lr_coupling={self.coupling_mode!r} and "
                "cap_lr_at_peak=False: the budget's plan grows the batch whatever the measured noise scale says "
                "(up to max_batch), and the coupling raises the learning rate above its peak with every doubling, "
                "which can make the run unstable. Leave cap_lr_at_peak unset (it caps with a budget) or pass "
                "lr_coupling='keep'.",
            )

    # ------------------------------------------------------------------ counts still on the device
    @property
    def units_seen(self) -> float:
        """Units consumed by all ranks so far, exact: windows whose counts are still on their way to the
        host are waited for first (see :meth:`resolve_pending`)."""
        if self._deferred:
            self.resolve_pending()
        return self._units_known

    @units_seen.setter
    def units_seen(self, value: float) -> None:
        if self._deferred:
            self.resolve_pending()
        self._units_known = value

    @property
    def last_stats(self) -> StepStats | None:
        """The last step's :class:`StepStats` (waits for a window's counts still on their way)."""
        if self._deferred:
            self.resolve_pending()
        return self._last_stats

    @last_stats.setter
    def last_stats(self, value: StepStats | None) -> None:
        self._last_stats = value

    def poll_pending(self) -> None:
        """Fill (and log) the records of the windows whose counts have reached the host, oldest first;
        never waits."""
        deferred = self._deferred
        while deferred and deferred[0].copy.ready():
            self._fill(deferred.pop(0))

    def resolve_pending(self) -> None:
        """Fill (and log) every record whose counts are still on their way, waiting for them if needed
        (one host synchronisation at most: the copies were made in order on one stream)."""
        deferred = self._deferred
        while deferred:
            self._fill(deferred.pop(0))

    def _fill(self, window: _Deferred) -> None:
        stats = window.stats_of(window.copy.sizes())
        self._units_known += stats.units
        self._last_stats = stats
        values = window.record.__dict__
        values["tokens_seen"] = self._units_known
        values["global_batch"] = stats.units
        values["micro_batch"] = stats.units / max(stats.num_microbatches, 1)
        values["dropped"] = not stats.finite
        del values["_tokens"]
        if self.logger is not None:
            self.logger.log(window.record)

    # ------------------------------------------------------------------ warnings
    def read_label_kind(self, labels: Any, owner: str) -> None:
        """The first ``labels`` a run counts tokens from: a tensor (else a ``TypeError``), and where they are not token
        ids (floating point: a regression's targets, say) while the controller holds on a plateau by default, a warning
        that its threshold reads a language model's loss per token."""
        if not callable(getattr(labels, "is_floating_point", None)):  # not a tensor
            raise TypeError(f"{owner}(labels={type(labels).__name__}): expected a tensor of labels (tokens are counted "
                            "as labels != ignore_index)")
        if (labels.is_floating_point() or labels.is_complex()) and getattr(self.controller, "default_hold", False):
            self.warn_once("float_labels", f"{owner}: the labels are {labels.dtype}, not token ids: they are counted as "
                           "tokens where != ignore_index, and the default hold_on_plateau='auto' reads the loss as a "
                           "language model's cross-entropy per token (0.15 nats per e-fold of tokens). For another "
                           "loss pass BatchSizeController(hold_on_plateau=None), or a threshold of that loss, to say "
                           "which")

    def warn_once(self, key: str, message: str) -> None:
        """Warn ``message`` the first time ``key`` is seen (saved with the state)."""
        if key in self._warned:
            return
        self._warned.add(key)
        if self._warn_fn is not None:
            self._warn_fn(message)
        else:
            warn_user(message)

    # ------------------------------------------------------------------ learning rate
    def attach_scheduler(self, scheduler: Any, period: int = 1) -> None:
        """Time ``scheduler`` (sized in optimizer steps at the starting batch) in units seen.

        ``period``: starting-batch steps per scheduler step (1 unless the framework steps the
        scheduler only every few optimizer steps, as Lightning's ``frequency`` does).

        From now on each of its ``step()`` calls advances it by the starting-batch steps
        of the optimizer steps since the last call, and the learning rate it sets is
        multiplied by the coupling. See :class:`~cbs_tracker.policy.lr.ScheduleTimer`.
        """
        if self.optimizer is None:
            raise ValueError(f"{self.owner}(lr_scheduler=...): a scheduler needs optimizer= as well")
        self.timer = ScheduleTimer(scheduler, self.optimizer, owner=self.owner, cap_at_peak=self.cap_lr_at_peak,
                                   period=period, coupling=self.coupling)
        if self._pending_schedule_state is not None:
            # restored before the scheduler was attached (Lightning loads callbacks first)
            self.timer.load_state_dict(self._pending_schedule_state)
            self._pending_schedule_state = None

    def detach_scheduler(self) -> None:
        if self.timer is not None:
            self.timer.detach()
            self.timer = None

    def scheduled_lr(self) -> float | None:
        """The first param group's learning rate as the schedule sets it, before the coupling.

        ``None`` without an optimizer, and once a loop without a timed scheduler wrote the LR
        itself while the batch had grown (what it wrote is not known to hold the coupling).
        """
        if self.timer is not None:
            return self.timer.scheduled[0] if self.timer.scheduled else None
        if self.optimizer is None or not self.optimizer.param_groups or self._lr_from_outside:
            return None
        return float(self.optimizer.param_groups[0]["lr"]) / self.coupling

    def _set_coupling(self, factor: float) -> None:
        old, self.coupling = self.coupling, float(factor)
        if self.optimizer is None or old == self.coupling:
            return
        if self.timer is not None:
            self.timer.set_coupling(self.coupling)
            return
        from cbs_tracker.policy.lr import apply_lr_factor

        lr_now = float(self.optimizer.param_groups[0]["lr"]) if self.optimizer.param_groups else 0.0
        ratio = self.coupling / old
        if self.cap_lr_at_peak and ratio > 1.0 and self.optimizer.param_groups:
            group = self.optimizer.param_groups[0]
            peak = float(group.get("max_lr", group.get("initial_lr", lr_now / old)))
            ratio = min(ratio, max(1.0, peak / lr_now)) if lr_now > 0 else ratio
        apply_lr_factor(self.optimizer, ratio)
        self._note_lr()

    # ------------------------------------------------------------------ the run's length
    def set_run_length(self, *, steps: float | None = None, microbatches: float | None = None,
                       units: float | None = None) -> None:
        """The run's length as the adapter knows it, for a controller that takes it (``set_run_length``,
        the efficiency budget's ``total_tokens``); exactly one of:

        ``steps``: optimizer steps of the constant-batch run (those :attr:`starting_batch_steps`
        counts), ``steps x`` the starting global batch in units; ``microbatches``: loader batches per
        rank, times the units of one (the starting global batch over ``starting_accumulation`` and
        the ranks) times the ranks; ``units``: units of all ranks, as they are. The starting global
        batch is the first step's units (:attr:`starting_units`): until it is known the length waits,
        and it is given to the controller before that step's decision. A controller without
        ``set_run_length`` (a ``BatchSchedule``, a user's own) is left alone.

        Raises:
            TypeError: none or several of the three given.
            ValueError: a value that is not a finite number >= 0.
        """
        given = [(k, v) for k, v in (("steps", steps), ("microbatches", microbatches), ("units", units))
                 if v is not None]
        if len(given) != 1:
            raise TypeError(f"{self.owner}: set_run_length(): give exactly one of steps=, microbatches= or "
                            f"units=; got {dict(given) or 'none'}")
        key, value = given[0]
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < math.inf:
            raise ValueError(f"{self.owner}: set_run_length({key}={value!r}): must be a finite number >= 0")
        self._run_length = (key, float(value))
        self._push_run_length()

    def run_length_units(self) -> float | None:
        """The run's length in units of all ranks (``None``: none given, or the starting batch not yet known)."""
        if self._run_length is None:
            return None
        key, value = self._run_length
        if key == "units":
            return value
        if self.starting_units is None:
            return None
        if key == "steps":
            return value * self.starting_units
        # microbatches per rank: each rank's loader batch holds starting_units / (A0 x ranks), times the ranks
        return value * self.starting_units / self.starting_accumulation

    def _push_run_length(self) -> None:
        setter = getattr(self.controller, "set_run_length", None)
        if not callable(setter):
            return
        units = self.run_length_units()
        if units is None or units <= 0 or units == self._run_length_sent:
            return
        setter(units)
        self._run_length_sent = units

    # ------------------------------------------------------------------ the step
    def start_window(self) -> bool:
        """A window starts; returns whether it is measured (no clock is read here)."""
        self.timing = self.cadence.times_next()
        self.own_extra = 0.0
        if self._recouple:
            self._recouple = False
            self._set_coupling(coupling_factor(self.coupling_mode, self.accumulation_steps / self.starting_accumulation))
        return self.cadence.measure_next()

    def finish_step(
        self,
        stats: StepStats,
        faults: WindowFaults | None = None,
        *,
        window_accumulation: int,
        lr: float | None = None,
        estimate_allowed: bool = True,
        mismatch_is_fatal: bool = False,
    ) -> StepRecord:
        """Count, estimate, decide and record one optimizer step.

        Args:
            stats: the step's reduced norms (identical on every rank).
            faults: what the reduction found wrong; a mismatched window raises on a
                multi-rank run (before the optimizer can step on unsynced gradients).
            window_accumulation: microbatches per rank the window was set to run.
            lr: the learning rate the step used (default: the first param group's).
            estimate_allowed: ``False`` keeps this step out of the estimate (the adapter
                found it unmeasurable, e.g. mixed ``1/A`` factors).
            mismatch_is_fatal: the adapter skips the gradient sync on all but the window's
                last microbatch (DDP ``no_sync``, FSDP2), so a window of another size than
                set leaves gradients that were never all-reduced.

        Raises:
            RuntimeError: a rank ran a window of another size than the tracker set
                (multi-rank), or a microbatch size was negative or not finite.
        """
        self._check_outside_lr()
        # the step clock ("auto" only, and only around measured windows): from one window's end to the next
        now = time.perf_counter() if self._clock_due else None
        seconds = None if now is None or self._last_finish is None else now - self._last_finish
        self._last_finish = now
        faults = faults or WindowFaults()
        self._check_faults(stats, faults, window_accumulation, mismatch_is_fatal)
        run = faults.microbatches_run or stats.num_microbatches
        self._advance(stats, run, window_accumulation)
        self._close_window_loss(self.units_seen)
        measured = stats.measured
        if measured or (stats.finite and int(window_accumulation) * self.dp_degree < 2):
            estimate = self._estimate(stats, window_accumulation, estimate_allowed and measured)
        else:
            estimate = None  # a window not measured feeds nothing to the estimator
        interval = getattr(self.estimator, "noise_scale_interval", None)
        low, high = interval if interval is not None else (None, None)
        if measured or getattr(self.controller, "every_window", False):
            # a schedule decides at every window (it needs no measurement); a controller on measured ones
            critical = self._decide(stats, window_accumulation, low, high, measured=measured)
        else:
            self.changed_this_step = False
            critical = self._last_critical()
        if lr is None and self.optimizer is not None and self.optimizer.param_groups:
            lr = float(self.optimizer.param_groups[0]["lr"])
        step_est = None if estimate is None else estimate.step
        record = StepRecord._of(
            step=self.step,
            tokens_seen=self.units_seen,
            unit=self.unit,
            global_batch=stats.units,
            micro_batch=stats.units / max(stats.num_microbatches, 1),
            accumulation_steps=self._ran_per_rank(run, window_accumulation),
            dp_degree=self.dp_degree,
            grad_sq_norm=self.estimator.grad_sq_norm,
            trace_cov=self.estimator.trace_cov,
            noise_scale=self.estimator.noise_scale,
            critical_batch=critical,
            lr=lr,
            step_grad_sq_norm=None if step_est is None else step_est.grad_sq_norm,
            step_trace_cov=None if step_est is None else step_est.trace_cov,
            dropped=not stats.finite,
            measured=measured,
            kappa=getattr(self.controller, "kappa", None),
            next_accumulation_steps=(
                self.pending_accumulation if self.pending_accumulation is not None else self.accumulation_steps
            ),
            noise_scale_low=low,
            noise_scale_high=high,
            scheduled_lr=self.scheduled_lr(),
            lr_coupling=self.coupling if self.optimizer is not None else None,
            lr_conversions=self._conversions(),
        )
        self.last_record = record
        self._record_current = True
        if self.logger is not None:
            self.logger.log(record)
        self._note_lr()
        own = None
        if now is not None and (measured or self.timing):  # the tracker's own host work, and this bookkeeping
            own = stats.own_seconds + self.own_extra + (time.perf_counter() - now)
        self.cadence.window_done(measured, seconds, own)
        self.cadence.agree(stats.proposed_every)
        self._clock_due = self.cadence.clock_due()
        self.timing, self.own_extra = self.cadence.times_next(), 0.0  # known before the next window starts
        return record

    def counted_step_ready(self, window_accumulation: int) -> bool:
        """Whether :meth:`finish_counted` can finish the window that just ran (not measured, one rank):
        no clock is due, the controller decides on measured windows only, the window has two microbatches
        or more (one alone warns), and the last record still tells the estimator's state."""
        return (
            not self._clock_due and not self.timing and self.dp_degree == 1 and self._record_current
            and window_accumulation >= 2 and not getattr(self.controller, "every_window", False)
        )

    # ------------------------------------------------------------------ the training loss
    def wants_loss(self) -> bool:
        """The controller reads the training loss now (``hold_on_plateau`` before its verdict, or held with
        an exit, and the run's length known: without it there is no verdict); elsewhere :meth:`observe_loss` does
        nothing (on several ranks, no reduction of the loss either)."""
        plateau = getattr(self.controller, "plateau", None)
        known = getattr(self.controller, "total_tokens", None) is not None or self._run_length is not None
        return bool(getattr(plateau, "collecting", False)) and known

    def observe_loss(self, loss: Any) -> None:
        """One microbatch's loss on this rank (its mean over its units, not divided by the accumulation), for a
        controller that reads the loss; a tensor stays on its device (read with the next measured step's).
        The controller gets each window's mean before the step's decision."""
        if not self.wants_loss():
            return
        if callable(getattr(loss, "detach", None)):  # a tensor: kept on its device
            if loss.numel() != 1:
                raise TypeError(f"{self.owner}.observe_loss(loss=<a tensor of {loss.numel()} elements>): expected "
                                "a number or a one-element tensor (the microbatch's mean loss)")
            loss = loss.detach().float().reshape(())
        elif isinstance(loss, bool) or not isinstance(loss, numbers.Real):
            raise TypeError(f"{self.owner}.observe_loss(loss={loss!r}): expected a number or a one-element tensor")
        self._window_loss = loss if self._window_loss is None else self._window_loss + loss
        self._window_losses += 1

    def _close_window_loss(self, tokens: Any) -> None:
        """The window's mean loss, at ``tokens`` (a float, or a record whose ``tokens_seen`` comes later). On
        several ranks every window the controller reads is kept, ``None`` where this rank gave no loss, so that
        the ranks reduce the same windows."""
        if self._window_losses:
            self._losses.append((tokens, self._window_loss / self._window_losses))
        elif self.dp_degree > 1 and self.wants_loss():
            self._losses.append((tokens, None))
        self._window_loss, self._window_losses = None, 0

    def _give_losses(self) -> None:
        """The windows' losses to the controller, oldest first, each the mean over the ranks (at a decision:
        every rank runs it at the same step)."""
        losses, self._losses = self._losses, []
        if not losses or not self.wants_loss():
            return
        values = self.read_losses([v for _, v in losses])
        for (tokens, _), value in zip(losses, values, strict=True):
            self.controller.observe_loss(_units_of(tokens), value)

    def _pending_losses(self) -> list[list[float | None]]:
        """The windows' losses not yet given to the controller, this rank's, as ``[tokens, loss]`` (saved with
        the state: a resumed run gives them at its first decision, on every rank alike)."""
        if not self._losses or not self.wants_loss():
            return []
        values = _local_losses([v for _, v in self._losses])
        return [[_units_of(t), None if math.isnan(v) else v] for (t, _), v in zip(self._losses, values, strict=True)]

    def finish_counted(self, stats: StepStats | None, faults: WindowFaults | None, *, window_accumulation: int,
                       deferred: tuple[Any, Callable[[list[float]], StepStats], float] | None = None) -> StepRecord:
        """:meth:`finish_step` of a window not measured, when :meth:`counted_step_ready`: the same record and
        state with what such a window changes only (the counts, the position, the learning rate); the
        estimate and its interval are the last record's, which no window since has changed. ``faults``:
        ``None`` for a window that ran ``window_accumulation`` microbatches of valid sizes.

        ``deferred``: the window's sizes are still on their way to the host (``stats`` is ``None``):
        ``(copy, stats_of, proposed_every)``, a :class:`~cbs_tracker.core.collector.HostCopy`, what makes
        the window's stats of its sizes, and the cadence's proposal. Everything but the units is known now
        (the position, the schedule and the decisions count microbatches); the record's ``tokens_seen``,
        ``global_batch``, ``micro_batch`` and ``dropped`` are filled when the copy arrives (read early,
        they wait for it), and the record is logged then."""
        self._check_outside_lr()
        if faults is None:
            run = int(window_accumulation)
        else:
            if faults.invalid_sizes or faults.mismatched_ranks:
                self._check_faults(stats, faults, window_accumulation, False)  # type: ignore[arg-type]
            run = faults.microbatches_run or stats.num_microbatches  # type: ignore[union-attr]
        self._advance(stats, run, window_accumulation)
        self.changed_this_step = False
        groups = self.optimizer.param_groups if self.optimizer is not None else None
        if deferred is not None:
            record = self._deferred_record(deferred, run, window_accumulation, groups)
            self._close_window_loss(record)  # its units arrive later
            self._clock_due, self.timing = self.cadence.unmeasured_done(deferred[2])
            return record
        self._close_window_loss(self.units_seen)
        record = StepRecord._like(self.last_record, {  # type: ignore[arg-type]
            "tokens_seen": self.units_seen,
            "global_batch": stats.units,  # type: ignore[union-attr]
            "micro_batch": stats.units / max(stats.num_microbatches, 1),  # type: ignore[union-attr]
            "dropped": not stats.finite,  # type: ignore[union-attr]
            **self._unmeasured_fields(run, window_accumulation, groups),
        })
        self.last_record = record
        if self.logger is not None:
            self.logger.log(record)
        self._note_lr()
        self._clock_due, self.timing = self.cadence.unmeasured_done(stats.proposed_every)  # type: ignore[union-attr]
        return record

    def _unmeasured_fields(self, run: int, window_accumulation: int, groups: Any) -> dict[str, Any]:
        """The fields of a window not measured's record that its units do not make."""
        return {
            "step": self.step,
            "accumulation_steps": self._ran_per_rank(run, window_accumulation),
            "lr": float(groups[0]["lr"]) if groups else None,
            "step_grad_sq_norm": None,
            "step_trace_cov": None,
            "measured": False,
            "next_accumulation_steps": (
                self.pending_accumulation if self.pending_accumulation is not None else self.accumulation_steps
            ),
            "scheduled_lr": self.scheduled_lr(),
            "lr_coupling": self.coupling if self.optimizer is not None else None,
            "critical_batch": self._last_critical(),
            "kappa": getattr(self.controller, "kappa", None),
            "lr_conversions": self._conversions(),
        }

    def _last_critical(self) -> float | None:
        """The critical batch a window not measured's record shows: the last decision's, or before this process's
        first decision (a resume whose first windows are not measured) the one the saved run decided last."""
        if self.controller is None:
            return None
        if self.last_decision is not None:
            return getattr(self.last_decision, "critical_batch", None)
        return self._resumed_critical

    def _conversions(self) -> int | None:
        """The LR-decay conversions a record shows: the last decision's, or before this process's first decision
        (a resume whose first windows are not measured) the controller's own count."""
        if self.controller is None:
            return None
        source = self.last_decision if self.last_decision is not None else self.controller
        value = getattr(source, "lr_conversions", 0)
        return int(value) if isinstance(value, numbers.Integral) else 0

    def _deferred_record(self, deferred: tuple[Any, Callable[[list[float]], StepStats], float], run: int,
                         window_accumulation: int, groups: Any) -> StepRecord:
        """:meth:`finish_counted`'s record of a window whose sizes are on their way: every field but the four
        the units make, which :meth:`_fill` writes (and the record is logged then)."""
        window = _Deferred(deferred[0], deferred[1], self)
        record = StepRecord._like(self.last_record, {  # type: ignore[arg-type]
            **self._unmeasured_fields(run, window_accumulation, groups),
            "_tokens": window,
        })
        values = record.__dict__
        for key in PENDING_FIELDS:
            values.pop(key, None)
        window.record = record
        self._deferred.append(window)
        self.last_record = record
        self._note_lr()
        return record

    def _note_lr(self) -> None:
        """Remember the learning rate as the tracker leaves it (after a step, a coupling, a timed schedule)."""
        groups = getattr(self.optimizer, "param_groups", None)
        self._lr_left = float(groups[0]["lr"]) if groups else None
        self._timer_writes = 0 if self.timer is None else self.timer.writes

    def _check_outside_lr(self) -> None:
        """Warn once when a loop set the learning rate itself while the batch has grown (plain loops)."""
        if not self.detect_outside_lr or self._lr_left is None or self.optimizer is None:
            return
        if self.timer is not None and self.timer.writes != self._timer_writes:
            self._note_lr()  # the timed schedule stepped: what it wrote is the tracker's
            return
        lr = float(self.optimizer.param_groups[0]["lr"])
        grown = self.accumulation_steps != self.starting_accumulation or self.coupling != 1.0
        if grown and not math.isclose(lr, self._lr_left, rel_tol=1e-6, abs_tol=0.0):
            self._lr_from_outside = True
            self.warn_once(
                "outside_lr",
                f"{self.owner}: the learning rate was set from outside the tracker between two steps ({lr:.4g}; "
                f"the tracker left {self._lr_left:.4g}) while the batch is {self.accumulation_steps} microbatches per "
                f"rank instead of {self.starting_accumulation}, so the batch-size coupling (x{self.coupling:.4g}) is "
                "overwritten; and a schedule clocked in optimizer steps now falls behind the data (one clocked in "
                "microbatches, like LitGPT's iter_num, does not). Either pass lr_scheduler= to the tracker (and call "
                "scheduler.step() once per optimizer step), or replace the assignment by `tracker.set_lr(schedule(t))` "
                "(the schedule's value times tracker.lr_coupling) with t in the schedule's own unit: "
                "tracker.starting_batch_steps for one written in optimizer steps (nanoGPT's get_lr(it)), "
                "tracker.microbatches_seen for one written in microbatches per rank (LitGPT's get_lr(iter_num)); and "
                "end the loop in the same unit: tracker.done(max_steps) or tracker.done(microbatches=max_iters).",
            )


    def _ran_per_rank(self, run: int, window_accumulation: int) -> int:
        """Microbatches per rank the window really ran, in the loader's batches (a short or mis-sized
        window says so); the set accumulation when the ranks ran different numbers."""
        if run <= 0 or run % max(self.dp_degree, 1):
            return int(window_accumulation) * self.micro_group
        return run // max(self.dp_degree, 1) * self.micro_group

    def _check_faults(self, stats: StepStats, faults: WindowFaults, window_accumulation: int, fatal: bool) -> None:
        """Raise on invalid sizes and (multi-rank, sync skipped) on a window of another size; else warn."""
        if faults.invalid_sizes:
            raise ValueError(
                f"{self.owner}: {faults.invalid_sizes} microbatch size(s) of this step were negative or not "
                "finite (size= must be a number >= 0; labels= counts labels != ignore_index)"
            )
        if not faults.mismatched_ranks:
            self._check_ranks(faults)
            return
        per_rank = (faults.microbatches_run or stats.num_microbatches) / max(self.dp_degree, 1)
        message = (
            f"{self.owner}: the window ran {per_rank:g} microbatches per rank on average but the tracker set "
            f"accumulation_steps={window_accumulation}. Run exactly `tracker.accumulation_steps` "
            "microbatches between two optimizer steps (it changes when the batch grows)."
        )
        if fatal and self.dp_degree > 1:
            raise RuntimeError(
                message + " With several data-parallel ranks the gradients of this window were not "
                "all-reduced (no_sync), so stepping now would make the replicas diverge; stopped."
            )
        self._check_ranks(faults)
        self.warn_once("window_mismatch", message + " This step is measured with the microbatches it ran.")

    def _check_ranks(self, faults: WindowFaults) -> None:
        """Raise when the ranks ran the same data, or when their synced gradients differ."""
        if faults.shared_data and self.dp_degree > 1:
            raise RuntimeError(
                f"{self.owner}: the {self.dp_degree} ranks of the data-parallel group ran the same data (their "
                "microbatch gradients agree exactly), so the global batch and the noise scale would be counted "
                f"{self.dp_degree} times too large. Give the tracker only the ranks that see different data: "
                "tensor-, pipeline- and context-parallel ranks share their tokens (device_mesh=..., "
                "mesh_dim='dp', or process_group= the data-parallel group), and each data-parallel rank needs "
                "its own shard of the data (a DistributedSampler or a loader split by rank)."
            )
        if faults.replica_spread > REPLICA_TOLERANCE and self.dp_degree > 1:
            raise RuntimeError(
                f"{self.owner}: the synchronised gradient differs across the {self.dp_degree} data-parallel "
                f"ranks (its squared norm spreads by {faults.replica_spread:.3g} of its mean across them), so "
                "the optimizer would step the replicas apart; stopped before it steps (the parameters are "
                "still identical). Likely causes: the last microbatch of the window did not all-reduce (a loop "
                "that sets model.require_backward_grad_sync or enters no_sync() from its own accumulation "
                "count: let `with tracker.microbatch(...)` handle the sync, it runs tracker.accumulation_steps "
                "microbatches and syncs the last), a backward outside the tracker's microbatches, parameters "
                "left out of DDP, a gradient hook that changes gradients on one rank only, a custom "
                "data-parallel wrapper that does not average the gradients, or ranks that are not replicas "
                "(pipeline stages or tensor-parallel shards given as the data-parallel group: pass "
                "process_group= or device_mesh=..., mesh_dim='dp')."
            )

    def _advance(self, stats: StepStats | None, run: int, window_accumulation: int) -> None:
        """Count the step, its units and the starting-batch steps it held (the schedule's position).

        A whole window of ``k`` microbatches holds ``floor((carry + k) / A0)`` starting-batch steps
        and carries the rest (a batch that is not a multiple of the starting one, a gradual ramp, a
        batch below the starting one: the position is the constant run's at the same data, to
        within one of its steps; a step may then hold none); a short window (an epoch's last)
        rounds up, as the constant run's own short step does.
        """
        a0 = self.starting_accumulation
        k_per_rank = run / max(self.dp_degree, 1) * self.micro_group
        whole = k_per_rank >= int(window_accumulation) * self.micro_group - 1e-9
        if whole:
            total = self.starting_batch_carry + k_per_rank
            held = int(math.floor(total / a0 + 1e-9))
            self.starting_batch_carry = max(0.0, total - held * a0) if abs(total - held * a0) > 1e-9 else 0.0
        elif k_per_rank >= a0 - 1e-9 or (k_per_rank > 0 and self.starting_batch_carry > 0):
            held = max(1, math.ceil((self.starting_batch_carry + k_per_rank) / a0 - 1e-9))
            self.starting_batch_carry = 0.0
        else:
            held = 1
        # the first step is a measured one (finish_step), never a window whose sizes are on their way
        if self.step == 0 and whole and stats is not None and self.starting_units is None and stats.units > 0:
            self.starting_units = float(stats.units)
        self.step += 1
        self.starting_batch_steps += held
        if self.timer is not None:
            self.timer.owe(held)
        if stats is not None:  # (None: a window whose sizes are still on their way, see finish_counted)
            self.units_seen += stats.units
            self._last_stats = stats

    def _estimate(self, stats: StepStats, window_accumulation: int, allowed: bool) -> Any | None:
        """Feed a measurable step to the estimator (and the sanity checks); warn once on K = 1."""
        measurable = allowed and stats.finite and stats.num_microbatches >= 2 and stats.small_batch > 0
        if measurable and stats.units > 0:
            estimate = self.estimator.update(
                stats.small_sq_norm, stats.big_sq_norm, stats.small_batch, stats.big_batch, stats.units
            )
            self._check_sanity(stats)
            return estimate
        if stats.finite and int(window_accumulation) * self.dp_degree < 2 and stats.units > 0:
            self.warn_once(
                "single_microbatch",
                f"{self.owner}: each optimizer step has a single microbatch (accumulation_steps=1 on one "
                "data-parallel rank), so there is no second batch size and the noise scale is not measured "
                "(nor the batch grown). Use 2 or more microbatches per step (e.g. halve the microbatch and "
                "double the accumulation) or more data-parallel ranks.",
            )
        return None

    def _decide(self, stats: StepStats, window_accumulation: int, low: float | None, high: float | None, *,
                measured: bool = True) -> float | None:
        """Ask the controller (not on a step without units); a change becomes pending. Returns its target.

        A window that was not measured (a schedule decides at every window) passes no noise scale."""
        self.changed_this_step = False
        if self.controller is None or stats.units <= 0:
            return None
        self._give_losses()
        if self._run_length is not None:
            self._push_run_length()
        decision = self.controller.update(
            step=self.step,
            tokens_seen=self.units_seen,
            global_batch=stats.units,
            accumulation_steps=int(window_accumulation) * self.micro_group,
            noise_scale=self.estimator.noise_scale if measured else None,
            **self._optional_update_kwargs(low if measured else None, high if measured else None),
        )
        self.last_decision = decision
        warning = getattr(decision, "warning", None)
        if warning:
            self.warn_once("controller_warning", warning)
        if decision.changed and not getattr(self.controller, "observe_only", False):
            new = int(decision.accumulation_steps)
            self.pending_accumulation = new if new != self.accumulation_steps else None
            self.changed_this_step = new != self.accumulation_steps
        return decision.critical_batch

    def _optional_update_kwargs(self, low: float | None, high: float | None) -> dict[str, Any]:
        """Keyword arguments newer controllers accept (older ones and user doubles may not)."""
        if self._update_kwargs is None:
            import inspect

            try:
                params = inspect.signature(self.controller.update).parameters
            except (TypeError, ValueError):
                params = {}
            accepts_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
            self._update_kwargs = tuple(
                n for n in ("scheduled_lr", "noise_scale_low", "noise_scale_high") if accepts_all or n in params
            )
        values = {"scheduled_lr": self.scheduled_lr, "noise_scale_low": lambda: low, "noise_scale_high": lambda: high}
        return {name: values[name]() for name in self._update_kwargs}

    def _check_sanity(self, stats: StepStats) -> None:
        """Warn once when the averaged norms say the big norm is not the mean of the small ones."""
        s = self._sanity
        s[0] += 1
        s[1] += stats.small_sq_norm
        s[2] += stats.big_sq_norm
        s[3] += stats.num_microbatches
        if s[0] < _SANITY_STEPS:
            return
        k_mean = s[3] / s[0]
        # E|g_k|^2 = |G|^2 + tr/b and E|mean_k g_k|^2 = |G|^2 + tr/(K b): their ratio is at most K.
        if s[2] <= 0 or s[1] > 2.0 * k_mean * s[2]:
            self.warn_once(
                "norm_mismatch",
                f"{self.owner}: over {s[0]} steps the per-microbatch gradients were {s[1] / max(s[2], 1e-300):.3g}x "
                f"larger (squared) than the step's gradient, where at most {k_mean:.3g}x is possible. The step "
                "gradient was probably read after clipping or zero_grad() (call tracker.step() right after the "
                "last backward, before clipping), or the loss scale of a GradScaler is in the per-microbatch "
                "gradients (pass grad_scaler=). The noise scale is not meaningful.",
            )
        grad_sq = self.estimator.grad_sq_norm
        if grad_sq is not None and grad_sq <= 0 and s[0] >= 5 * _SANITY_STEPS:
            self.warn_once(
                "nonpositive",
                f"{self.owner}: after {s[0]} measured steps the averaged |G|^2 is still {grad_sq:.3g} <= 0, so no "
                "noise scale is reported. Either the gradient noise dominates completely (a larger batch or a "
                "longer horizon is needed), or the norms are read wrongly (clipping or zero_grad() before "
                "tracker.step(), a GradScaler not passed).",
            )

    # ------------------------------------------------------------------ growth
    def apply_pending(self) -> int | None:
        """Make the pending accumulation the current one (the adapter calls this when it is safe).

        Applies the learning-rate coupling of the new batch. Returns the new value, or
        ``None`` when nothing was pending.
        """
        new = self.pending_accumulation
        if new is None:
            return None
        self.pending_accumulation = None
        self.accumulation_steps = int(new)
        self._set_coupling(coupling_factor(self.coupling_mode, new / self.starting_accumulation))
        return new

    def apply_level(self, level: int) -> int | None:
        """Make ``level`` current: what an adapter whose data runs ahead already handed out.

        The pending value is cleared when it is ``level``; a newer one stays pending.
        Returns ``level`` when it changed anything, else ``None``.
        """
        if self.pending_accumulation == level:
            return self.apply_pending()
        if level == self.accumulation_steps:
            return None
        self.accumulation_steps = int(level)
        self._set_coupling(coupling_factor(self.coupling_mode, level / self.starting_accumulation))
        return level

    def limit_to_epoch(self, per_epoch: int, what: str) -> None:
        """Never grow a window beyond an epoch of ``per_epoch`` ``what`` (a window never spans two epochs).

        The cap is the largest power-of-two multiple of the starting accumulation that fits.
        """
        cap = self.starting_accumulation
        while cap * 2 <= per_epoch:
            cap *= 2
        self.limit_accumulation(
            max(cap, self.accumulation_steps),
            f"an epoch holds {per_epoch} {what}, and a window never spans two epochs",
        )

    def limit_accumulation(self, cap: int, reason: str) -> None:
        """Never grow beyond ``cap`` microbatches per rank (tells the controller, says why once)."""
        if self.controller is None or getattr(self.controller, "observe_only", False):
            return
        current = getattr(self.controller, "max_accumulation_steps", None)
        if current is None or current > cap:
            try:
                self.controller.max_accumulation_steps = int(cap)
            except AttributeError:
                return
            self.warn_once("accumulation_cap", f"{self.owner}: growth is capped at accumulation {cap}: {reason}")

    # ------------------------------------------------------------------ state
    def _convert_ranks(self, state: dict[str, Any], dp: int, where: str) -> tuple[dict[str, Any], RankChange]:
        """``state`` of a run on ``dp`` data-parallel ranks, for this run's ``dp_degree`` (the global batch kept).

        See :mod:`cbs_tracker.policy.ranks`. Warns once when the global batch cannot be split
        evenly over the new ranks, naming both batches.
        """
        r = StateReader(state, where)
        accumulation = r.integer("accumulation_steps", minimum=1)
        pending = r.integer("pending_accumulation_steps", minimum=0, default=0)
        controller_state = state.get("controller")
        if self.controller is not None and controller_state is not None and not callable(
            getattr(self.controller, "convert_ranks", None)
        ):
            raise ValueError(
                f"{where}: the checkpoint was taken with dp_degree={dp} but this run has "
                f"dp_degree={self.dp_degree}, and the controller {type(self.controller).__name__} has no "
                "convert_ranks(state, change) to move its per-rank accumulation; resume with the same number "
                "of data-parallel ranks, or give the controller that method (BatchSizeController and "
                "BatchSchedule have it)"
            )
        change = RankChange.plan(dp, self.dp_degree, accumulation)
        out = dict(state)
        out["dp_degree"] = self.dp_degree
        out["accumulation_steps"] = change.new_accumulation
        new_pending = change.accumulation(pending) if pending > 0 else None
        out["pending_accumulation_steps"] = 0 if new_pending is None or new_pending == change.new_accumulation \
            else new_pending
        start = _count(r, "starting_accumulation", default=self.starting_accumulation)
        out["starting_accumulation"] = plain_number(start * change.per_rank)
        carry = r.number("starting_batch_carry", minimum=0.0, default=0.0)
        out["starting_batch_carry"] = carry * change.per_rank
        if self.controller is not None and controller_state is not None:
            out["controller"] = self.controller.convert_ranks(controller_state, change,
                                                              pending=pending if pending > 0 else None)
        if not change.exact:
            micro = _micro_units(controller_state, dp)
            self._resume_warning = (
                f"uneven_ranks_{dp}_{self.dp_degree}",
                f"{self.owner}: resumed on {self.dp_degree} data-parallel ranks from a checkpoint of {dp}: "
                + change.describe(micro, self.unit)
                + ("" if new_pending is None or pending == accumulation else
                   f"; the change decided before the checkpoint, to {pending * dp} microbatches, runs as "
                   f"{new_pending * self.dp_degree} ({new_pending} per rank), the same doubling")
                + f"; the learning-rate coupling follows the batch that runs ({self.coupling_mode}). To keep the batch "
                "exactly, resume on a number of ranks that divides "
                f"{change.old_microbatches}.",
            )
        return out, change

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers and a version: everything needed to continue the same run."""
        pending, critical = self._pending_losses(), self._last_critical()
        return {**({"pending_losses": pending} if pending else {}),  # only with hold_on_plateau collecting
            # the last decision's critical batch, shown by the records of a resumed run's first unmeasured windows
            **({"critical_batch": float(critical)} if critical is not None and math.isfinite(critical) else {}),
            "version": SESSION_STATE_VERSION,
            "unit": self.unit,
            "dp_degree": self.dp_degree,
            "step": self.step,
            "tokens_seen": self.units_seen,
            "starting_batch_steps": self.starting_batch_steps,
            "starting_batch_carry": self.starting_batch_carry,
            "starting_accumulation": self.starting_accumulation,
            "starting_units": 0.0 if self.starting_units is None else self.starting_units,
            "accumulation_steps": self.accumulation_steps,
            "pending_accumulation_steps": 0 if self.pending_accumulation is None else self.pending_accumulation,
            "lr_coupling": self.coupling,
            "schedule": None if self.timer is None else self.timer.state_dict(),
            "warned": sorted(self._warned),
            "cadence": self.cadence.state_dict(),
            # an uneven resume whose LR coupling has not been re-set yet (no window since): the next load does it
            "recouple": int(self._recouple),
            "estimator": self.estimator.state_dict(),
            "controller": None if self.controller is None else self.controller.state_dict(),
        }

    def load_state_dict(self, state: Any) -> None:
        """Restore :meth:`state_dict` output; validates everything before changing anything.

        The keys are read by :func:`_read_state` (the session's state schema, with the defaults
        of keys added after version 1).

        Raises:
            TypeError: ``state`` is not a mapping, or a value has the wrong type.
            KeyError: a required key is missing.
            ValueError: unknown version, another unit or data-parallel degree, or a value
                out of range. On any error the session (and its estimator and controller)
                is left as it was.
        """
        where = f"{self.owner}.load_state_dict"
        if not isinstance(state, dict):
            raise TypeError(f"{where}: expected the dict from state_dict(), got {type(state).__name__}")
        self._record_current = False  # the estimator is about to change: the next record reads it again
        _check_header(state, where, self.unit)
        dp = StateReader(state, where).integer("dp_degree", minimum=1)
        change = None
        self._resume_warning: tuple[str, str] | None = None
        if dp != self.dp_degree:
            state, change = self._convert_ranks(state, dp, where)
        read = _read_state(state, where, self.starting_accumulation)
        self._load_parts(state)  # the estimator and the controller, atomically
        self.step = read["step"]
        self.units_seen = read["tokens_seen"]
        self.resumed_from = change
        # an uneven split: the LR follows the batch that runs, set when the next window starts (after a
        # pending change, and over an optimizer loaded after the tracker with the saved coupling in its LR)
        self._recouple = (change is not None and not change.exact) or read["recouple"]
        self.starting_batch_steps = read["starting_batch_steps"]
        self.starting_batch_carry = read["starting_batch_carry"]
        self.starting_units = read["starting_units"] or _starting_units(state, read) or self.starting_units
        self._run_length_sent = None  # the controller loaded its own: given again at the next decision
        self.starting_accumulation = read["starting_accumulation"]
        self.accumulation_steps = read["accumulation_steps"]
        pending = read["pending_accumulation_steps"]
        self.pending_accumulation = pending if pending > 0 else None
        self.coupling = read["lr_coupling"]
        self._warned = set(read["warned"])
        self._losses = list(read["pending_losses"])  # given to the controller at the next decision
        self.last_decision, self._resumed_critical = None, read["critical_batch"]  # the loaded run's, until it decides
        self._window_loss, self._window_losses = None, 0
        if self._resume_warning is not None:
            key, message = self._resume_warning
            self._resume_warning = None
            self.warn_once(key, message)
        if read["cadence"] is not None:
            self.cadence.load_state_dict(read["cadence"], windows=self.step)
        schedule = read["schedule"]
        if self.timer is not None:
            self.timer.coupling = read["lr_coupling"]
            if schedule is not None:
                self.timer.load_state_dict(schedule)
        else:
            self._pending_schedule_state = schedule

    def _load_parts(self, state: dict[str, Any]) -> None:
        """Load the nested estimator and controller states, restoring both if either fails."""
        est_before = self.estimator.state_dict()
        ctl_before = None if self.controller is None else self.controller.state_dict()
        try:
            self.estimator.load_state_dict(state["estimator"])
            if self.controller is not None and state.get("controller") is not None:
                self.controller.load_state_dict(state["controller"])
        except Exception:
            self.estimator.load_state_dict(est_before)
            if self.controller is not None and ctl_before is not None:
                self.controller.load_state_dict(ctl_before)
            raise


# ---------------------------------------------------------------------- the session's state schema
# What TrackingSession.state_dict() holds, read through policy/_state.py's StateReader.
# Version 1 (the first release) lacked "starting_batch_steps", "starting_batch_carry",
# "lr_coupling", "schedule", "warned" (it had "warned_single"), "cadence" and "recouple": each
# has the default below, so a version-1 state starts those fresh. Version 2 also dropped
# "pending_lr_factor" (still checked when present). A key added later takes a default here and
# leaves the version as it is; a key whose meaning changes raises SESSION_STATE_VERSION.
_REQUIRED_KEYS = ("version", "step", "tokens_seen", "accumulation_steps", "dp_degree", "estimator")


def _check_header(state: dict[str, Any], where: str, unit: str) -> None:
    """The required keys, the version and the unit."""
    missing = [k for k in _REQUIRED_KEYS if k not in state]
    if missing:
        raise KeyError(f"{where}: missing keys {missing}")
    version = state["version"]
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= SESSION_STATE_VERSION:
        newer = isinstance(version, int) and not isinstance(version, bool) and version > SESSION_STATE_VERSION
        raise ValueError(
            f"{where}: state version {version!r} is "
            + (f"newer than {SESSION_STATE_VERSION}; upgrade cbs-tracker" if newer
               else f"not a version this cbs-tracker writes (an int from 1 to {SESSION_STATE_VERSION})")
        )
    saved = state.get("unit", unit)
    if saved != unit:
        raise ValueError(
            f"{where}: the checkpoint counts {saved!r} but this run counts {unit!r} (unit=); "
            "the noise scale and batch sizes would mix units"
        )


def _read_state(state: dict[str, Any], where: str, starting_accumulation: float) -> dict[str, Any]:
    """Every top-level value of a session state, checked (nothing assigned): the session's schema."""
    r = StateReader(state, where)
    step = r.integer("step", minimum=0)
    read = {
        "step": step,
        "tokens_seen": r.number("tokens_seen", minimum=0.0),
        "accumulation_steps": r.integer("accumulation_steps", minimum=1),
        "pending_accumulation_steps": r.integer("pending_accumulation_steps", minimum=0, default=0),
        "starting_accumulation": _count(r, "starting_accumulation", default=starting_accumulation),
        "starting_batch_steps": r.integer("starting_batch_steps", minimum=0, default=step),
        "starting_batch_carry": r.number("starting_batch_carry", minimum=0.0, default=0.0),
        "starting_units": r.number("starting_units", minimum=0.0, default=0.0),
        "lr_coupling": r.number("lr_coupling", positive=True, default=1.0),
    }
    if "pending_lr_factor" in state:  # version 1: a factor waiting for the next window
        r.number("pending_lr_factor", positive=True)
    warned = state.get("warned", ["single_microbatch"] if state.get("warned_single") else [])
    if not isinstance(warned, (list, tuple)) or not all(isinstance(w, str) for w in warned):
        raise TypeError(f"{where}: 'warned' must be a list of str, got {warned!r}")
    cadence = state.get("cadence")
    if isinstance(cadence, dict):  # the measuring cadence's counters (older states may lack either)
        c = StateReader(cadence, f"{where} (its 'cadence')")
        c.integer("every_now", minimum=1, default=1)
        c.integer("since_measured", minimum=0, default=0)
    return {
        **read,
        "warned": list(warned),
        "schedule": _read_schedule(state.get("schedule"), where),
        "cadence": cadence if isinstance(cadence, dict) else None,
        "recouple": bool(state.get("recouple", 0)),
        "pending_losses": _read_pending_losses(state.get("pending_losses", []), where),
        "critical_batch": None if state.get("critical_batch") is None else r.number("critical_batch", minimum=0.0),
    }


def _read_pending_losses(pending: Any, where: str) -> list[tuple[float, float | None]]:
    """The windows' losses a state saved before its controller read them: ``[tokens > 0, loss or None]`` pairs."""
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    if not isinstance(pending, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and number(p[0]) and p[0] > 0
            and (p[1] is None or number(p[1])) for p in pending):
        raise TypeError(f"{where}: 'pending_losses' must be a list of [tokens > 0, loss or None] pairs, "
                        f"got {pending!r}")
    return [(float(t), None if v is None else float(v)) for t, v in pending]


def _read_schedule(schedule: Any, where: str) -> dict[str, Any] | None:
    """The LR schedule's timer state (``None``: no scheduler was attached), checked."""
    if schedule is None:
        return None
    if not isinstance(schedule, dict) or not isinstance(schedule.get("scheduled_lrs"), (list, tuple)):
        raise TypeError(f"{where}: 'schedule' must be None or a dict with 'scheduled_lrs', got {schedule!r}")
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in schedule["scheduled_lrs"]):
        raise ValueError(f"{where}: 'schedule.scheduled_lrs' must hold finite numbers >= 0")
    r = StateReader(schedule, where + " schedule")
    r.integer("owed", minimum=0)
    r.integer("carry", minimum=0, default=0)
    r.integer("due", minimum=0, default=0)
    return schedule


def _starting_units(state: dict[str, Any], read: dict[str, Any]) -> float | None:
    """A state saved before ``starting_units`` existed: the first step's units from the controller's counts
    (units per accumulation step times the starting accumulation; exact where every microbatch slot holds the
    same units), so that steps and microbatches still convert to units for the run's length."""
    per_slot = _micro_units(state.get("controller"), 1)
    return None if per_slot is None else per_slot * read["starting_accumulation"]


def _micro_units(controller_state: Any, dp: int) -> float | None:
    """Units of one microbatch from a controller's counts (``None`` when it has none)."""
    try:
        units, accum = float(controller_state["units_sum"]), float(controller_state["accumulation_sum"])
    except (KeyError, TypeError, ValueError):
        return None
    return units / (accum * dp) if accum > 0 and units > 0 else None


def _count(r: StateReader, key: str, *, default: float) -> int | float:
    """A positive count: an int, or a fraction of a microbatch per rank after a resume on more ranks;
    ``default`` (this session's own, possibly a fraction) where the state has none."""
    if key not in r.state:
        return default
    if isinstance(r.state.get(key), float):
        return plain_number(r.number(key, positive=True))
    return r.integer(key, minimum=1)


class _Deferred:
    """A window not measured whose sizes are on their way to the host: its copy, what makes its stats of
    the sizes, and its record (the record's ``_tokens``; reading a pending field resolves it)."""

    __slots__ = ("copy", "stats_of", "session", "record")

    def __init__(self, copy: Any, stats_of: Callable[[list[float]], StepStats], session: TrackingSession) -> None:
        self.copy, self.stats_of, self.session = copy, stats_of, session
        self.record: StepRecord | None = None

    def resolve(self) -> None:
        self.session.resolve_pending()


def _local_losses(values: list[Any]) -> list[float]:
    """Losses as floats (``None``: ``nan``), this rank's alone."""
    return [math.nan if v is None else float(v) for v in values]


def _units_of(tokens: Any) -> float:
    """A window's units: a number, or its record's (filled when its counts arrived)."""
    return float(tokens) if isinstance(tokens, (int, float)) else float(tokens.tokens_seen)
