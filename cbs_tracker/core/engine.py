"""The measuring engine every adapter constructs: the collector, the reduction of a window, the session.

:class:`EngineSettings` holds what an adapter is configured with that the engine uses (checked
once, when the adapter is built); :class:`Engine` is built from it when the run's layout is known
(the starting accumulation, the data-parallel ranks, the optimizer) and owns the three parts:

- the :class:`~cbs_tracker.core.collector.GradStatsCollector` (its hooks, its per-microbatch norms),
- the reduction of a window, measured (:func:`~cbs_tracker.core.measure.reduce_window`) or counted
  only (:func:`~cbs_tracker.core.measure.count_sizes`),
- the :class:`~cbs_tracker.core.session.TrackingSession` (counters, estimate, decision, LR, record)
  and with it the state (:meth:`Engine.state_dict`, the session's format).

An adapter keeps where the hooks go, how its framework's events map onto
:meth:`Engine.start_window`, :meth:`Engine.begin_microbatch`, :meth:`Engine.end_microbatch` and
:meth:`Engine.reduce`, and when a pending accumulation takes effect. See docs/design.md ("Adapt").
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from cbs_tracker.core.cadence import check_measure_every
from cbs_tracker.core.collector import GradStatsCollector, StepStats, adam_preconditioner
from cbs_tracker.core.distributed import mean_losses
from cbs_tracker.core.measure import WindowFaults, count_sizes, reduce_window
from cbs_tracker.core.record import StepRecord, Unit
from cbs_tracker.core.session import TrackingSession

__all__ = ["Engine", "EngineSettings"]


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """An adapter's configuration of the engine, independent of the run's layout.

    Built where the adapter is built, which is where ``measure_every`` and ``measure_target``
    are checked (once: the session built from these settings does not check them again).

    Args:
        owner: the adapter's name, used in messages (``"CBSTracker"``, ``"CBSCallback"``...).
        unit, estimator, controller, lr_coupling, cap_lr_at_peak, logger, warn, measure_every,
            measure_target: as in :class:`~cbs_tracker.core.session.TrackingSession`.
        preconditioner: ``None`` or ``"adam"``: measure the gradient through the optimizer's
            second moments (the adapter checks the value; the engine builds the transform).

    Raises:
        ValueError: a bad ``measure_every`` or ``measure_target`` (the message names the owner).
    """

    owner: str
    unit: Unit
    estimator: Any = None
    controller: Any = None
    lr_coupling: str | None = "auto"
    cap_lr_at_peak: bool | None = None
    logger: Any = None
    warn: Callable[[str], None] | None = None
    measure_every: int | str = 1
    measure_target: float = 0.01
    preconditioner: str | None = None

    def __post_init__(self) -> None:
        check_measure_every(self.measure_every, self.measure_target, owner=self.owner)

    def scratch_session(self, dp_degree: int) -> TrackingSession:
        """A session on copies of the estimator and controller, with nothing else attached: a state is
        checked on it before the run starts, or written from it before there is one."""
        return TrackingSession(
            owner=self.owner, unit=self.unit, starting_accumulation=1, dp_degree=dp_degree,
            estimator=copy.deepcopy(self.estimator), controller=copy.deepcopy(self.controller),
        )

    def check_state(self, state: dict[str, Any], dp_degree: int) -> None:
        """Load ``state`` on a scratch session (copies): it raises what the run's own load would, and its warnings
        are left to that load, which says them."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.scratch_session(dp_degree).load_state_dict(state)


def model_parameter_count(model: nn.Module) -> int:
    """The parameters of ``model``: each shared one once (``parameters()`` yields it once), a sharded one whole (a
    ``DTensor``'s ``numel`` is its global size), so every rank of a data-parallel or FSDP2 run counts alike."""
    return sum(int(p.numel()) for p in model.parameters())


class Engine:
    """The collector, the reduction of a window and the session of one tracked run.

    Args:
        settings: the adapter's :class:`EngineSettings`.
        starting_accumulation: microbatches per rank of the first window.
        dp_degree: data-parallel ranks.
        optimizer: the optimizer (the LR coupling, the logged LR, the Adam preconditioner); may be ``None``.

    The collector is made by :meth:`collect`, once the adapter knows the parameters it hooks.
    """

    def __init__(self, settings: EngineSettings, *, starting_accumulation: int, dp_degree: int = 1,
                 optimizer: Any | None = None, dp_group: Any | None = None) -> None:
        self.settings = settings
        self.session = TrackingSession(
            owner=settings.owner,
            unit=settings.unit,
            starting_accumulation=starting_accumulation,
            dp_degree=dp_degree,
            estimator=settings.estimator,
            controller=settings.controller,
            optimizer=optimizer,
            lr_coupling=settings.lr_coupling,
            cap_lr_at_peak=settings.cap_lr_at_peak,
            logger=settings.logger,
            warn=settings.warn,
            measure_every=settings.measure_every,
            measure_target=settings.measure_target,
        )
        # the windows' losses a controller reads (hold_on_plateau): each the mean over the ranks
        self.session.read_losses = functools.partial(mean_losses, group=dp_group)
        #: the map applied to each gradient before its norm (``preconditioner="adam"``), else ``None``
        self.transform = adam_preconditioner(optimizer) if settings.preconditioner == "adam" else None
        self.collector: GradStatsCollector | None = None
        #: the current window is measured (the cadence decides at its start, :meth:`start_window`)
        self.measure = True
        # the last counted window's sizes, the arguments they were counted with and its stats (count_window)
        self._last_count: tuple[list[float], tuple[object, ...], StepStats] | None = None

    @property
    def owner(self) -> str:
        return self.settings.owner

    # ------------------------------------------------------------------ the collector
    def collect(self, params: Iterable[nn.Parameter], *, register: bool = True) -> GradStatsCollector:
        """Make the collector, hooking ``params`` (``register=False``: the adapter hooks them later,
        with ``collector.hook``), and return it; a collector made before is removed first."""
        if self.collector is not None:
            self.collector.remove()
        collector = GradStatsCollector(list(params), transform=self.transform, register=register)
        collector.timed = self.session.cadence.auto  # no clock read unless "auto" weighs the time
        self.collector = collector
        return collector

    def give_model_size(self, model: nn.Module) -> None:
        """The parameter count of ``model`` and the run's unit to a controller that reads them (``hold_on_plateau``'s
        tokens per parameter, read only where the units are tokens): each shared parameter once, a sharded one (a
        ``DTensor``) whole, so every data-parallel rank gives the same count."""
        setter = getattr(self.session.controller, "set_model_parameters", None)
        count = model_parameter_count(model)
        if setter is not None and count > 0:
            setter(count, unit=self.settings.unit)

    def remove(self, *, forget: bool = True) -> None:
        """Remove the collector's hooks and detach the session from the LR scheduler.

        ``forget``: drop the collector too (an adapter between runs has none); ``False`` keeps it,
        its last window's counts readable.
        """
        if self.collector is not None:
            self.collector.remove()
            if forget:
                self.collector = None
        self.session.detach_scheduler()

    # ------------------------------------------------------------------ a window
    def start_window(self) -> bool:
        """A window starts: the cadence says whether it is measured (:attr:`measure`)."""
        self.measure = self.session.start_window()
        return self.measure

    def begin_microbatch(self, *, unsynced: bool) -> None:
        """A microbatch's backward starts (``unsynced``: no gradient sync runs inside it)."""
        assert self.collector is not None
        self.collector.begin_microbatch(unsynced=unsynced, measure=self.measure)

    def end_microbatch(self, size: Any) -> None:
        """The microbatch's backward ran; ``size``: its units (a number, a tensor or a label count)."""
        assert self.collector is not None
        self.collector.end_microbatch(size)

    def reduce(self, big_params: list[nn.Parameter], **options: Any) -> tuple[StepStats, WindowFaults]:
        """The window's norms and counts reduced over the DP group (:func:`~cbs_tracker.core.measure.reduce_window`,
        with the engine's collector, transform, measured flag and the cadence's proposal; ``options`` are its
        other arguments), then the window closed (:meth:`end_window`)."""
        assert self.collector is not None
        stats, faults = reduce_window(
            self.collector, big_params, transform=self.transform, measured=self.measure,
            proposed_every=self.session.cadence.proposal(), **options,
        )
        self.end_window()
        return stats, faults

    def count_window(self, *, loss_divisor: float, avg_ranks: int, expected_microbatches: int,
                     normalization: str) -> tuple[StepStats | None, WindowFaults | None, Any]:
        """A window not measured, on one rank: its counts reduced as :func:`reduce_window` reduces them
        (:func:`~cbs_tracker.core.measure.count_sizes`), without the work for norms, ranks and clocks.

        Returns ``(stats, faults, deferred)``: ``faults`` is ``None`` for a window of the expected
        size and valid sizes. Where the sizes are label counts on an accelerator, their copy to the host
        is not waited for: ``stats`` is ``None`` and ``deferred`` is what
        :meth:`~cbs_tracker.core.session.TrackingSession.finish_counted` takes to fill the record when
        they arrive (a label count is a whole number >= 0, never invalid; how many microbatches ran is
        known on the host). The window is not closed here (see :meth:`end_window`).
        """
        collector = self.collector
        assert collector is not None
        key = (loss_divisor, avg_ranks, expected_microbatches, normalization, self.session.cadence.proposal())
        copy_ = collector.deferred_sizes()
        if copy_ is not None:  # labels= on the device: their counts reach the host later, read without a wait
            ran = collector.num_microbatches
            if ran == key[2]:
                faults = None
            else:  # as count_sizes finds it: a window of another size than set (warned), no invalid size
                faults = WindowFaults._of(mismatched_ranks=1, invalid_sizes=0, microbatches_run=ran,
                                          replica_spread=0.0, shared_data=False)

            def stats_of(sizes: list[float]) -> StepStats:
                return count_sizes(sizes, loss_divisor=key[0], avg_ranks=key[1], expected_microbatches=key[2],
                                   normalization=key[3], proposed_every=key[4])[0]

            return None, faults, (copy_, stats_of, key[4])
        sizes, _ = collector.host_sizes()
        last = self._last_count
        if last is not None and last[1] == key and last[0] == sizes:
            return last[2], None, None  # the sizes and the arguments of the window before: its stats (equal)
        stats, faults = count_sizes(
            sizes, loss_divisor=loss_divisor, avg_ranks=avg_ranks, expected_microbatches=expected_microbatches,
            normalization=normalization, proposed_every=key[4],
        )
        self._last_count = (sizes, key, stats) if faults is None else None
        return stats, faults, None

    def end_window(self) -> None:
        """Close the window: warn when labels counted late were changed in place, and reset the collector."""
        collector = self.collector
        assert collector is not None
        if collector.labels_changed:
            self.session.warn_once(
                "labels_changed",
                f"{self.owner}: the labels of {collector.labels_changed} microbatch(es) of this window were "
                "changed in place before step() (a reused label buffer?). In a window the tracker does not "
                "measure, labels= are counted at step(), so their tokens were counted as the labels are now. "
                "Pass a fresh tensor per microbatch, or size= (the microbatch's units).",
            )
        collector.reset_window()

    def finish_step(self, stats: StepStats, faults: WindowFaults | None = None, **options: Any) -> StepRecord:
        """Count, estimate, decide and record the step (:meth:`TrackingSession.finish_step`)."""
        return self.session.finish_step(stats, faults, **options)

    def finish_counted(self, stats: StepStats | None, faults: WindowFaults | None, **options: Any) -> StepRecord:
        """The step of a counted window (:meth:`TrackingSession.finish_counted`)."""
        return self.session.finish_counted(stats, faults, **options)

    def warn_unstepped(self, what: str, *, key: str = "unstepped", end: dict[str, bool] | None = None) -> None:
        """Warn once when ``what`` happened inside a window: its microbatches ran forward and backward without
        an optimizer step (a loop that ends, or checkpoints, between two of its steps). Not at the end of a run
        whose loop was told it was done (a loop that checks after each batch runs one more before it looks)."""
        collector, session = self.collector, self.session
        ran = 0 if collector is None else collector.num_microbatches
        if not ran or (end is not None and end["done"]):
            return
        assert collector is not None
        try:
            units = f"{sum(collector.host_sizes()[0]):,.0f} {session.unit}"
        except Exception:  # at interpreter exit the device may be gone: the count alone
            units = f"their {session.unit}"
        window = session.accumulation_steps
        if key == "checkpoint_in_window":
            fix = ("The checkpoint holds the state at the last optimizer step: their gradients are in no checkpoint. "
                   "Resume the data at tracker.resume_position() (the window's start, so they run again), or save "
                   "after tracker.step(); a resume that starts the data after them (e.g. at the next epoch) drops "
                   "them.")
        else:
            fix = ("End the loop between windows: `while not tracker.done(max_steps)` (or done(microbatches=...), "
                   "done(tokens=...)) around `for _ in range(tracker.accumulation_steps)`, or `if tracker.done(...): "
                   "break` after each batch. A loop that already breaks after each batch ended here because its data "
                   "did (its last epoch ran out inside the window): let the epochs run on until tracker.done(...) is "
                   "true (`for epoch in itertools.count(starting_epoch):`, leaving it when tracker.done(...) is; "
                   "run_clm_no_trainer's max_train_steps is then num_train_epochs x its steps per epoch), so this "
                   f"window finishes on the next epoch's first {window - ran:g} batch(es) and the run stops on the "
                   "data of its budget.")
        session.warn_once(
            key,
            f"{self.owner}: {what} inside a window: {ran} of its {window} microbatches per rank ({units} on this "
            f"rank) ran forward and backward after the last optimizer step, and were never stepped. {fix}",
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The session's state (its format, :data:`~cbs_tracker.core.session.SESSION_STATE_VERSION`)."""
        return self.session.state_dict()

    def load_state_dict(self, state: Any) -> None:
        """Restore :meth:`state_dict` output (see :meth:`TrackingSession.load_state_dict`)."""
        self.session.load_state_dict(state)
