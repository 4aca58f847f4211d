"""The hand-written training loop's side of the engine: ``microbatch()`` windows and ``step()``.

:class:`LoopTracker` is the base of the plain-loop adapter (``CBSTracker``, which adds
DDP) and the FSDP2 adapter (``FSDPTracker``); they override where the hooks go,
which ``.grad`` holds the step gradient, and how gradient sync is switched per
microbatch. A pending accumulation takes effect at the next window's start.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Literal

import torch
from torch import nn

from cbs_tracker._warn import warn_user
from cbs_tracker.core import distributed as cbs_dist
from cbs_tracker.core.collector import GradStatsCollector, LabelCount, StepStats
from cbs_tracker.core.engine import Engine, EngineSettings
from cbs_tracker.core.measure import LOSS_NORMALIZATIONS, unscale_and_get_scale
from cbs_tracker.core.record import StepRecord, Unit
from cbs_tracker.core.session import TrackingSession, check_size

__all__ = ["AUTO_MEMORY_FRACTION", "LoopTracker", "refuse_pipeline"]

#: ``max_microbatch="auto"`` keeps the predicted peak at or below this share of the device memory
AUTO_MEMORY_FRACTION = 0.85


class LoopTracker:
    """Measures the gradient noise scale of a hand-written loop and (with a controller) sets its accumulation.

    Args:
        model: the model as the loop calls it.
        optimizer: the optimizer (needed for ``preconditioner="adam"``, the LR coupling
            and the logged LR); may be ``None`` to only measure.
        accumulation_steps: microbatches per rank in the first window (>= 1).
        unit: ``"tokens"`` or ``"samples"``: what the sizes given to :meth:`microbatch`
            count, and the unit of every reported size.
        ignore_index: label value excluded when counting tokens from ``labels=``.
        controller: a :class:`~cbs_tracker.policy.controller.BatchSizeController`
            instance; ``None`` measures only.
        process_group: the data-parallel group (default: the world, when distributed).
        device_mesh: alternatively, a ``DeviceMesh`` whose ``mesh_dim`` is data-parallel.
        mesh_dim: the DP dimension name(s) of ``device_mesh``.
        loss_divided_by_accumulation: the loop divides each microbatch loss by
            ``tracker.accumulation_steps`` (default ``True``; with
            ``loss_normalization="mean"`` only).
        loss_normalization: how each microbatch's loss is normalised. ``"mean"``
            (default): the mean over its own units (then divided by the accumulation,
            see above). ``"window"``: the sum of its units' losses divided by the units
            of this rank's whole window (the Hugging Face ``Trainer``'s
            ``num_items_in_batch``; padded batches weigh every token alike). ``"group"``:
            the sum divided by the window's units on all data-parallel ranks, times the
            ranks the sync averages over (the synced gradient is the mean over every unit
            of the step). With either of the last two, the sizes given to
            :meth:`microbatch` must be the units the loss counts; the loop fetches the
            window first to know its count before the first backward.
        grads_averaged_over_ranks: the gradient sync averages over the DP ranks (DDP
            and FSDP do); ``None`` (default) means yes whenever there is more than one rank.
        grad_scaler: a ``torch.amp.GradScaler``; :meth:`step` unscales the optimizer's
            gradients if the loop has not, and removes the scale from the hooked norms.
        preconditioner: ``None`` (raw gradients) or ``"adam"``: measure
            ``g / (sqrt(v_hat) + eps)`` with the optimizer's second moments.
        estimator: a configured :class:`~cbs_tracker.core.estimator.NoiseScaleEstimator`.
        logger: anything with ``log(record: StepRecord)``, e.g. ``TensorBoardLogger``.
        lr_scheduler: the LR scheduler driving ``optimizer``, sized in optimizer steps at
            the starting batch. The tracker keeps it on its timing in units seen: each of
            your ``lr_scheduler.step()`` calls (once per optimizer step, as usual) advances it
            by the starting-batch steps the optimizer step held, and the learning rate it
            sets is multiplied by the batch-size coupling.
        lr_coupling: ``"auto"`` (default: LR x sqrt(B/B0) for Adam-family optimizers,
            x B/B0 for SGD), ``"keep"``, ``"sqrt"`` or ``"linear"``.
        cap_lr_at_peak: never let the coupling raise the learning rate above the
            schedule's peak. Default ``None``: ``True`` when the controller has a
            ``budget_tokens`` (its plan grows the batch whatever the measured noise scale
            says), else ``False``.
        measure_every: measure one window in ``n`` (default 1: every window); the others
            run without the tracker's hooks on the parameters, take no norm and read no
            clock, and still count for the units, the counters and the LR schedule.
            ``"auto"``: the smallest ``n`` that keeps the tracker's share of the step time at
            or below ``measure_target``, on the step clock (see :mod:`cbs_tracker.core.cadence`). The estimate's interval widens
            with fewer measured units; the controller decides on measured windows only.
        measure_target: the share of the step time ``"auto"`` allows (default 0.01).
        max_microbatch: grow the microbatch before the accumulation, up to this many
            sequences (the data loader's leading dimension) per microbatch and rank;
            ``None`` (default) keeps the microbatch and grows the accumulation only. The
            loop then takes its windows from :meth:`windows`, which joins the loader's
            batches into microbatches of the current size; with one rank at least two
            microbatches per window remain, so the noise scale stays measurable.
            ``"auto"`` (a model on a CUDA device): as large as the memory allows, from the
            peak memory measured in each window, extrapolated linearly in the microbatch
            and kept under ``AUTO_MEMORY_FRACTION`` of the device's memory. On one
            process, an out-of-memory error in the first window at a larger microbatch is
            caught: the window is redone from its start at the previous microbatch (the
            same loader batches, nothing lost or repeated) and the microbatch stays there.

    Raises:
        ValueError / TypeError: on bad configuration (the message names the argument).
    """

    #: the big-norm partial of every rank is a shard of the gradient (sum over ranks)
    #: rather than a replica (take one rank's)
    big_norm_is_sharded = False
    #: a failed window can be redone by dropping ``.grad`` (not under FSDP2, whose backward keeps
    #: unsharded gradients of its own, nor under DDP, whose reducer is left mid-iteration)
    oom_recoverable = True

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        accumulation_steps: int = 2,
        unit: Unit = "tokens",
        ignore_index: int = -100,
        controller: Any | None = None,
        process_group: Any | None = None,
        device_mesh: Any | None = None,
        mesh_dim: str | tuple[str, ...] | None = None,
        loss_divided_by_accumulation: bool = True,
        loss_normalization: str = "mean",
        grads_averaged_over_ranks: bool | None = None,
        grad_scaler: Any | None = None,
        preconditioner: Literal["adam"] | None = None,
        estimator: Any | None = None,
        logger: Any | None = None,
        lr_scheduler: Any | None = None,
        lr_coupling: str | None = "auto",
        cap_lr_at_peak: bool | None = None,
        measure_every: int | str = 1,
        measure_target: float = 0.01,
        max_microbatch: int | None = None,
    ) -> None:
        name = type(self).__name__
        refuse_pipeline(model, name)
        if not isinstance(model, nn.Module):
            raise TypeError(f"{name}(model={type(model).__name__}): expected a torch.nn.Module")
        if optimizer is not None and not hasattr(optimizer, "param_groups"):
            raise TypeError(f"{name}(optimizer={type(optimizer).__name__}): expected a torch.optim.Optimizer or None")
        if preconditioner not in (None, "adam"):
            raise ValueError(f"{name}(preconditioner={preconditioner!r}): must be None or 'adam'")
        if preconditioner == "adam" and optimizer is None:
            raise ValueError(f"{name}(preconditioner='adam', optimizer=None): the Adam preconditioner needs the optimizer")
        if grad_scaler is not None and not callable(getattr(grad_scaler, "unscale_", None)):
            raise TypeError(f"{name}(grad_scaler={type(grad_scaler).__name__}): expected a torch.amp.GradScaler")
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise TypeError(f"{name}(ignore_index={ignore_index!r}): expected an int")
        if not -(2**63) <= ignore_index < 2**63:
            raise ValueError(f"{name}(ignore_index={ignore_index!r}): must fit a torch.int64 (labels are compared with it)")
        if max_microbatch is not None and max_microbatch != "auto" and (
            isinstance(max_microbatch, bool) or not isinstance(max_microbatch, int) or max_microbatch < 1
        ):
            raise ValueError(
                f"{name}(max_microbatch={max_microbatch!r}): must be None, an integer >= 1 (sequences) or 'auto'"
            )
        if loss_normalization not in LOSS_NORMALIZATIONS:
            raise ValueError(
                f"{name}(loss_normalization={loss_normalization!r}): must be one of {LOSS_NORMALIZATIONS} "
                "('mean': each microbatch loss is its own mean; 'window': summed over its units and divided "
                "by this rank's window units; 'group': divided by the window units of all ranks)"
            )

        self.model = model
        self.optimizer = optimizer
        self.ignore_index = ignore_index
        self._labels_read = False  # the first labels= were looked at (their kind: token ids or not)
        self.grad_scaler = grad_scaler
        self.loss_divided_by_accumulation = bool(loss_divided_by_accumulation)
        self.loss_normalization = loss_normalization
        self.max_microbatch = max_microbatch
        self._cap_group = 1  # loader batches per microbatch allowed by the cap (windows(): rows; 'auto': memory)
        self._good_group = 1  # the largest microbatch (in loader batches) that completed a window
        self._oom_group: int | None = None  # the cap an out-of-memory error left
        self._memory = _cuda_memory_probe(model, name) if max_microbatch == "auto" else None
        self._memory_base = 0
        self._current_window: _Window | None = None
        self._restarted = False
        self.dp_group = cbs_dist.resolve_dp_group(process_group, device_mesh, mesh_dim)
        dp_degree = cbs_dist.group_size(self.dp_group)
        settings = EngineSettings(
            owner=name, unit=unit, estimator=estimator, controller=controller, lr_coupling=lr_coupling,
            cap_lr_at_peak=cap_lr_at_peak, logger=logger, measure_every=measure_every,
            measure_target=measure_target, preconditioner=preconditioner,
        )
        #: the collector, the reduction of each window, the session and their state
        self.engine = Engine(settings, starting_accumulation=accumulation_steps, dp_degree=dp_degree,
                             optimizer=optimizer, dp_group=self.dp_group)
        self.session.detect_outside_lr = optimizer is not None
        self._module = self._unwrap(model)
        self._all_params: list[nn.Parameter] = list(self._module.parameters())
        self.engine.give_model_size(self._module)
        self._avg_ranks = self._averaging_ranks(grads_averaged_over_ranks)
        self.engine.collect([], register=False)  # hooked below, and at each measured window's start
        self._window_params: list[nn.Parameter] = []
        self._register_hooks()
        if lr_scheduler is not None:
            self.session.attach_scheduler(lr_scheduler)
        self._window_index = 0
        self._window_divisor = self.session.accumulation_steps
        self._counting = False  # ... and if not, its microbatches are only counted (_CountedMicrobatch)
        self._lean = False  # ... and its step() is _step_counted
        self._counted = _CountedMicrobatch(self)  # the one context of a counted microbatch, reused
        self._counted_now: _CountedMicrobatch | None = None  # it, while the window only counts (no clock)
        # the first of the window's microbatches that takes it at once: 1, or 0 when the counted step before
        # found the next window to be one like its own (its start is then the same: nothing to redo)
        self._fast_from = 1
        # _sync_context is a nullcontext for every microbatch (a counted microbatch skips it)
        self._sync_free = type(self)._sync_context is LoopTracker._sync_context
        self._in_microbatch = False
        self._step_norm: float | None = None  # the synced gradient's norm, while .grad is as step() saw it
        self._batches_done = 0  # loader batches per rank of the windows stepped (the data position)
        self._resumed_batches: int | None = None  # the count a checkpoint carried, on its own ranks
        self._budget_given: tuple[str, float] | None = None  # done()'s budget as last given to the session
        # a run (or the tracker) that ends inside a window says what it left without an optimizer step
        self._end = {"done": False}  # done() said so: a microbatch run after it is the loop's own, not left out
        self._finalizer = weakref.finalize(self, self.engine.warn_unstepped, "the run ended", end=self._end)

    @property
    def session(self) -> TrackingSession:
        """The engine's session: counters, estimate, decision, LR coupling, record."""
        return self.engine.session

    @property
    def collector(self) -> GradStatsCollector:
        """The engine's collector: the hooks and the per-microbatch norms."""
        collector = self.engine.collector
        assert collector is not None
        return collector

    # ------------------------------------------------------------------ adapter points
    def _unwrap(self, model: nn.Module) -> nn.Module:
        """The module whose parameters get the hooks."""
        return model

    def _averaging_ranks(self, grads_averaged_over_ranks: bool | None) -> int:
        """Ranks the gradient sync averages over (1: it sums, or one rank)."""
        if grads_averaged_over_ranks is None:
            grads_averaged_over_ranks = self.session.dp_degree > 1
        return self.session.dp_degree if grads_averaged_over_ranks else 1

    def _trainable(self) -> list[nn.Parameter]:
        # the module's parameters are listed once; their requires_grad is read every window
        return [p for p in self._all_params if p.requires_grad]

    def _register_hooks(self) -> None:
        """Hook every trainable parameter; refuse a model with none."""
        params = self._trainable()
        if not params:
            raise ValueError(
                f"{type(self).__name__}(model={type(self.model).__name__}): the model has no parameter with "
                "requires_grad=True, so there is no gradient to measure"
            )
        for p in params:
            self.collector.hook(p)
        self._window_params = params

    def _refresh_params(self) -> None:
        """At a window start: hook parameters that became trainable since (gradual unfreezing).

        The small norms (hooks) and the big norm (``.grad``) then cover the same set: the
        parameters trainable when the window started.
        """
        params = self._trainable()
        self.collector.hook_all(params)  # once per object
        self._window_params = params

    def _big_params(self) -> list[nn.Parameter]:
        """Parameters whose ``.grad`` holds the synced step gradient."""
        return self._window_params

    def _sync_context(self, last: bool) -> AbstractContextManager[Any]:
        """Gradient sync for one microbatch (``last``: the window's last one)."""
        return nullcontext()

    def _skips_sync(self) -> bool:
        """The adapter skips the gradient sync on all but the last microbatch of a window."""
        return False

    def _unsynced(self, last: bool) -> bool:
        """No gradient sync or reshard runs inside this microbatch's backward (``.grad`` stays local).

        Only a single process can be sure: with several ranks a sync may run inside the
        backward (composable ``replicate()``, a hook that all-reduces) without this adapter
        knowing it.
        """
        return self.session.dp_degree == 1

    # ------------------------------------------------------------------ public state
    @property
    def unit(self) -> Unit:
        return self.session.unit

    @property
    def dp_degree(self) -> int:
        return self.session.dp_degree

    @property
    def estimator(self) -> Any:
        return self.session.estimator

    @property
    def controller(self) -> Any:
        return self.session.controller

    @property
    def accumulation_steps(self) -> int:
        """Microbatches per rank in the current (or, between windows, the next) window."""
        if self._in_microbatch or self._window_index > 0:
            return self._window_divisor  # the open window (a short last one from windows() says so)
        return self._level() // self._layout(self._level())

    @property
    def microbatch_batches(self) -> int:
        """The loader's batches joined into one microbatch in the current (or next) window (1 unless
        ``max_microbatch`` is set)."""
        return self._layout(self._level())

    def _level(self) -> int:
        """The batch level: the loader's batches per rank in the current (or next) window."""
        if self._window_index == 0 and self.session.pending_accumulation is not None:
            return self.session.pending_accumulation
        return self.session.accumulation_steps

    @property
    def _max_group(self) -> int:
        """Loader batches per microbatch at most: the cap, and never above what an out-of-memory error left."""
        return self._cap_group if self._oom_group is None else min(self._cap_group, self._oom_group)

    def _layout(self, level: int) -> int:
        return microbatch_layout(level, self._max_group, self.session.dp_degree)

    def windows(self, loader: Any) -> Iterator[list[Any]]:
        """The loader's batches as windows of microbatches of the current layout, each batch used once.

        Yields one list per optimizer step: ``tracker.accumulation_steps`` microbatches, each
        the concatenation (along the leading dimension) of ``tracker.microbatch_batches``
        consecutive loader batches (tensors, or tuples, lists and dicts of them). The layout
        changes only between windows, after the :meth:`step` that decided it; the loader's
        workers and prefetching are untouched. A last window or microbatch cut short by the
        end of the loader is yielded as it is.
        """
        it = iter(loader)
        first = True
        while True:
            if first and isinstance(self.max_microbatch, int):
                try:
                    head = next(it)
                except StopIteration:
                    return
                rows = leading_rows(head)
                self._cap_group = group_cap(self.max_microbatch, rows)
                it = itertools.chain([head], it)
            first = False
            group, count = self.microbatch_batches, self.accumulation_steps
            parts = list(itertools.islice(it, group * count))
            if not parts:
                return
            window = _Window(parts, group)
            self._current_window = window
            self._restarted = False
            self._fast_from = 1  # its layout is set when its first microbatch starts
            yield window

    @property
    def noise_scale(self) -> float | None:
        """Smoothed ``B_simple`` in :attr:`unit`; ``None`` until measurable."""
        return self.session.estimator.noise_scale

    @property
    def noise_scale_interval(self) -> tuple[float, float] | None:
        """90% confidence interval of :attr:`noise_scale` (``None`` until measurable)."""
        return getattr(self.session.estimator, "noise_scale_interval", None)

    @property
    def grad_sq_norm(self) -> float | None:
        """Smoothed ``|G|^2`` estimate."""
        return self.session.estimator.grad_sq_norm

    @property
    def trace_cov(self) -> float | None:
        """Smoothed ``tr(Sigma)`` estimate (squared-gradient units times :attr:`unit`)."""
        return self.session.estimator.trace_cov

    @property
    def global_batch_size(self) -> float | None:
        """Units in the last optimizer step, over all DP ranks and the window."""
        return None if self.last_record is None else self.last_record.global_batch

    @property
    def tokens_seen(self) -> float:
        """Units (see :attr:`unit`) consumed by all DP ranks so far (exact: label counts still on their way
        to the host, from a window not measured, are waited for)."""
        return self.session.units_seen

    @property
    def starting_batch_steps(self) -> int:
        """Optimizer steps counted at the starting batch: the position of a step-sized schedule.

        A run with growth that stops when this reaches ``N`` consumed the units of ``N``
        steps of the constant-batch run.
        """
        return self.session.starting_batch_steps

    @property
    def microbatches_seen(self) -> int:
        """Loader batches this rank has run: those of the windows stepped and of the open one.

        The data position of a loop that counts batches (LitGPT's ``iter_num``, a loader's
        batch index): a schedule or a stop written in microbatches per rank follows the data
        at any batch size. After :meth:`load_state_dict` it is the position of the last whole
        window the checkpoint holds (see :meth:`resume_position`).
        """
        return self._batches_done + self._window_index * self.session.micro_group

    def observe_loss(self, loss: Any) -> None:
        """Give the tracker this microbatch's loss, for a controller that reads the loss's fall (the default
        ``BatchSizeController()``'s hold on a loss plateau, until its verdict a quarter into the run); does nothing
        otherwise. Without it the default holds growth for that quarter, then says so and lets its rule decide.

        Call it once per microbatch, before :meth:`step`, with the loss as the model returned it (its
        mean over the microbatch's units, not divided by the accumulation). A tensor stays on its
        device and is read with the next measured step's reduction (no host sync of its own). Every
        rank gives its own; the controller fits each step's mean over the ranks.

        Raises:
            TypeError: ``loss`` is neither a number nor a one-element tensor.
        """
        self.session.observe_loss(loss)

    def done(self, steps: int | None = None, *, microbatches: int | None = None,
             tokens: float | None = None) -> bool:
        """Whether the run has consumed its data: the stop of a loop, checked between windows.

        Give the budget in the loop's own unit, exactly one of: ``steps``, optimizer steps of
        the constant-batch run (``max_train_steps``; compared with :attr:`starting_batch_steps`);
        ``microbatches``, loader batches per rank (LitGPT's ``max_iters``; compared with
        :attr:`microbatches_seen`); ``tokens``, units of all ranks (:attr:`tokens_seen`). The
        counts move at :meth:`step` only (a window's microbatches count once it is stepped), so
        a loop that checks it after every batch stops right after the optimizer step that
        reached the budget, within one window of the constant-batch run's data. ``tokens``
        waits for label counts still on their way to the host (a window not measured on an
        accelerator); ``steps`` and ``microbatches`` never wait. When it returns ``True``, the
        records still waiting for their counts are filled and logged.

        The budget is also the run's length for a controller's efficiency budget, kappa_rise and convert_until
        (:meth:`~cbs_tracker.policy.controller.BatchSizeController.set_run_length`, where the
        controller's ``total_tokens`` is ``None``): ``steps`` times the starting global batch,
        ``microbatches`` times the units of one loader batch and the ranks, ``tokens`` as is. The
        starting global batch is the first step's units (labels counted: known at the first
        :meth:`step`, and given to the controller before that step's decision).

        Raises:
            TypeError: none or several of the three given.
            ValueError: a value that is not a number >= 0 (an int for ``steps`` and ``microbatches``).
        """
        name = type(self).__name__
        given = [(k, v) for k, v in (("steps", steps), ("microbatches", microbatches), ("tokens", tokens))
                 if v is not None]
        if len(given) != 1:
            raise TypeError(
                f"{name}.done(): give exactly one budget, steps= (optimizer steps of the constant-batch run), "
                f"microbatches= (loader batches per rank) or tokens= (units of all ranks); got {dict(given) or 'none'}"
            )
        key, value = given[0]
        whole = key != "tokens"
        if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)) or not 0 <= value < math.inf:
            raise ValueError(
                f"{name}.done({key}={value!r}): must be {'an int' if whole else 'a finite number'} >= 0"
            )
        if (key, value) != self._budget_given and self.session.controller is not None:
            self._budget_given = (key, value)  # the run's length, for a controller that takes it
            self.session.set_run_length(**{"units" if key == "tokens" else key: value})
        if key == "steps":
            done = self.session.starting_batch_steps >= value
        elif key == "microbatches":
            done = self._batches_done >= value
        else:
            done = self.session.units_seen >= value
        self._end["done"] = self._end["done"] or done
        if done and self.session._deferred:  # the run ends: the last records are filled and logged now
            self.session.resolve_pending()
        return done

    @property
    def steps(self) -> int:
        """Optimizer steps recorded so far."""
        return self.session.step

    @property
    def last_record(self) -> StepRecord | None:
        return self.session.last_record

    @property
    def last_stats(self) -> StepStats | None:
        return self.session.last_stats

    @property
    def lr_coupling(self) -> float:
        """The factor the learning rate carries because of the batch growth (1.0 at the start)."""
        return self.session.coupling

    # ------------------------------------------------------------------ the loop
    def microbatch(
        self, size: float | int | torch.Tensor | None = None, *, labels: torch.Tensor | None = None
    ) -> AbstractContextManager[None]:
        """Wrap one microbatch's forward and backward (a context manager).

        Args:
            size: units in this microbatch (tokens or samples, per :attr:`unit`): a real
                number >= 0 or a one-element tensor (kept on the device, checked when the
                step reduces).
            labels: alternatively, the labels; tokens are counted as
                ``labels != ignore_index`` (on the device). In a window the cadence does
                not measure they are counted at :meth:`step` (no operator per microbatch):
                labels changed in place before then are counted as they are, with a warning.
                On one rank and a CUDA device that :meth:`step` does not wait for the count:
                it reaches the host behind an event, and the record's unit fields are filled
                (and the record logged) when it has arrived; reading them first waits.

        Raises:
            TypeError: neither or both of ``size`` and ``labels``; a bool or a tensor of
                several elements as ``size``; ``labels`` that are not a tensor.
            ValueError: a negative or non-finite ``size``.
            RuntimeError: nested microbatches.
        """
        if labels is not None and not self._labels_read:
            self.session.read_label_kind(labels, f"{type(self).__name__}.microbatch")
            self._labels_read = True
        counted = self._counted_now
        if counted is not None and self._window_index >= self._fast_from and not self._in_microbatch:
            # a window that only counts, past its start: the size is all there is to keep
            if labels is not None:
                if size is None:
                    counted._size = LabelCount(labels, self.ignore_index)
                    return counted
            elif type(size) in _PLAIN_NUMBERS and 0 <= size < math.inf:
                counted._size = size
                return counted
        timing = self.session.timing  # "auto" times the window before a measured one (no clock otherwise)
        t0 = time.perf_counter() if timing else 0.0
        if (size is None) == (labels is None):
            raise TypeError(
                f"{type(self).__name__}.microbatch(): pass exactly one of size= (units in this microbatch) or "
                "labels= (tokens counted as labels != ignore_index)"
            )
        if self._in_microbatch:
            raise RuntimeError(f"{type(self).__name__}.microbatch(): microbatches cannot be nested")
        if size is not None and not (type(size) in _PLAIN_NUMBERS and 0 <= size < math.inf):
            size = check_size(size, owner=f"{type(self).__name__}.microbatch")
        if self._window_index == 0 and not self._restarted:
            self._begin_window()
        self._restarted = False
        if self._counting and not timing:
            # a window not measured: the counts only, the labels' tokens counted at step()
            counted = self._counted
            counted._size = size if labels is None else LabelCount(labels, self.ignore_index)  # type: ignore[assignment]
            return counted
        n = (labels != self.ignore_index).sum() if labels is not None else size
        return self._microbatch(n, timing, t0, type(self).__name__)

    @contextmanager
    def _microbatch(self, n: float | torch.Tensor, timing: bool, t0: float, name: str) -> Iterator[None]:
        self._step_norm = None
        last = self._window_index >= self._window_divisor - 1
        self._in_microbatch = True
        self.engine.begin_microbatch(unsynced=self._unsynced(last))
        if timing:
            self.session.own_extra += time.perf_counter() - t0
        recovered = False
        try:
            with self._sync_context(last):
                yield
        except Exception as exc:
            if not self._recoverable(exc):
                raise
            recovered = True
        finally:
            t0 = time.perf_counter() if timing else 0.0
            self.engine.end_microbatch(n)
            self._in_microbatch = False
            self._window_index += 1
            if timing:
                self.session.own_extra += time.perf_counter() - t0
        if recovered:
            self._restart_window()
            return
        if self.engine.measure and getattr(self.collector, "hooks_fired_in_last_microbatch", 1) == 0:
            self.session.warn_once(
                "no_hook",
                f"{name}: no gradient reached the tracker during a microbatch: call loss.backward() inside "
                "`with tracker.microbatch(...)` (and make sure the loss depends on trainable parameters).",
            )

    def _begin_window(self) -> None:
        self.session.apply_pending()
        measure = self.engine.start_window()
        self._set_layout()
        if measure:  # a window not measured reads no gradient: parameters are looked at when one is
            self._refresh_params()
        self._counting = not measure and self.max_microbatch is None
        # the context its microbatches after the first take at once (microbatch() checks the window index)
        self._counted_now = self._counted if self._counting and not self.session.timing else None
        if self._counting:
            self.collector.pause()
        # ... and its step() can take the counted path (one rank, no clock due, ...): known now
        self._lean = self._counting and self.session.counted_step_ready(self._window_divisor)
        if self._memory is not None:
            self._memory_base = self._memory.allocated()
            self._memory.reset_peak()

    def _set_layout(self) -> None:
        if self.max_microbatch is None and self._current_window is None:  # one loader batch per microbatch
            self.session.micro_group = 1
            self._window_divisor = self.session.accumulation_steps
            return
        group = self._layout(self.session.accumulation_steps)
        self.session.micro_group = group
        self._window_divisor = self.session.accumulation_steps // group
        window = self._current_window
        if window is not None and window.iterating and 0 < len(window) < self._window_divisor:
            self._window_divisor = len(window)  # the loader ended inside this window: it runs what is there

    # ------------------------------------------------------------------ microbatch size
    def _recoverable(self, exc: BaseException) -> bool:
        """An out-of-memory error in the first window at a larger microbatch, handed out by :meth:`windows`."""
        if not _is_oom(exc) or self.max_microbatch is None or self.session.micro_group <= self._good_group:
            return False
        window = self._current_window
        if window is None or not window.iterating:
            return False
        if not self.oom_recoverable or self._skips_sync():
            why = "under DDP or FSDP2 the failed backward leaves state that dropping the gradients does not clear"
        elif self.session.dp_degree > 1:
            why = "on one of several ranks the other ranks cannot redo their window in step"
        else:
            return True
        warn_user(
            f"{type(self).__name__}: out of memory at a microbatch of {self.session.micro_group} loader batches; {why}, "
            f"so the error is raised. Set max_microbatch to at most {self._good_group} loader batches' sequences.")
        return False

    def _restart_window(self) -> None:
        """Drop the failed window's gradients and counts, and redo it at the last microbatch that fit."""
        failed = self.session.micro_group
        self._oom_group = self._good_group
        for p in self._all_params:
            p.grad = None
        self.collector.reset_window()
        self._window_index = 0
        assert self._current_window is not None
        self._current_window.resplit(self._layout(self.session.accumulation_steps))
        self._set_layout()
        self._restarted = True
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        warn_user(
            f"{type(self).__name__}: out of memory at a microbatch of {failed} loader batches; the window is redone "
            f"from its start at {self.session.micro_group} (nothing lost or repeated), and the microbatch stays there.")

    def _after_window(self) -> None:
        """At :meth:`step`: remember the microbatch that fit, and with ``"auto"`` the largest that will."""
        group = self.session.micro_group
        self._good_group = max(self._good_group, group)
        if self._memory is None:
            return
        peak, base = self._memory.peak(), self._memory_base
        per_group = max(peak - base, 0) / group
        room = AUTO_MEMORY_FRACTION * self._memory.total() - base
        fit = self._good_group
        while per_group * fit * 2 <= room:
            fit *= 2
        if self.session.dp_degree > 1:  # every rank must take the same layout: the smallest fit
            fit = cbs_dist.all_reduce_min(int(fit), self.dp_group, getattr(self._memory, "device", None))
        self._cap_group = fit

    def step(self) -> StepRecord:
        """Measure the step that just finished its backward passes; call before clipping.

        Reads the synced gradient's squared norm, reduces the window's sums and counts
        over the DP group in one ``all_reduce`` (every rank, every step), updates the
        estimate and, with a controller, decides :attr:`accumulation_steps` of the next
        window. With a ``grad_scaler`` it unscales the gradients first unless the loop
        already called ``scaler.unscale_(optimizer)``.

        Returns:
            The step's :class:`~cbs_tracker.core.record.StepRecord`.

        Raises:
            RuntimeError: inside a microbatch; no microbatch since the last step (on any
                rank); with several ranks, a window of another size than
                :attr:`accumulation_steps` (raised on every rank, before the optimizer can
                step on gradients that were never all-reduced).
        """
        if self.session._deferred:  # the records of windows whose counts have arrived (no wait)
            self.session.poll_pending()
        if self._lean and not self._in_microbatch and self.collector.num_microbatches \
                and not self.collector.hooks_fired_outside and self.session._record_current:
            return self._step_counted()
        self._fast_from = 1  # the next window starts in full
        t0 = time.perf_counter() if self.session.timing else None
        name = type(self).__name__
        if self._in_microbatch:
            raise RuntimeError(f"{name}.step(): called inside tracker.microbatch()")
        no_microbatch = f"{name}.step(): no microbatch since the last step; wrap each forward/backward in `with tracker.microbatch(...)`"
        if self.collector.num_microbatches == 0:
            if self.session.dp_degree == 1:
                raise RuntimeError(no_microbatch)
            # This rank's data ran out: the other ranks already wait in this step's all_reduce,
            # so take part with zero counts (raising here would hang them).
            self._begin_window()
        outside = getattr(self.collector, "hooks_fired_outside", 0)
        if outside:
            self.session.warn_once(
                "outside",
                f"{name}: gradients arrived outside `with tracker.microbatch(...)` (a backward ran outside "
                "it); they are in the step's gradient but not in the per-microbatch norms, so the noise "
                "scale is wrong. Run every backward inside microbatch().",
            )
        scale = self._loss_scale()
        mean = self.loss_normalization == "mean"
        divisor = float(self._window_divisor) if mean and self.loss_divided_by_accumulation else 1.0
        stats, faults = self.engine.reduce(
            self._big_params(),
            dp_group=self.dp_group,
            loss_divisor=divisor,
            avg_ranks=self._avg_ranks,
            scale=scale,
            big_norm_is_sharded=self.big_norm_is_sharded,
            expected_microbatches=self._window_divisor,
            normalization=self.loss_normalization,
            big_is_scaled=scale is not None and self._grads_still_scaled(),
        )
        self._batches_done += self._window_index * self.session.micro_group
        self._window_index = 0
        if self.max_microbatch is not None:
            self._after_window()
        if faults.microbatches_run == 0:
            raise RuntimeError(no_microbatch + " (on any data-parallel rank)")
        reusable = self.engine.transform is None and not self.big_norm_is_sharded and math.isfinite(stats.synced_sq_norm)
        self._step_norm = math.sqrt(max(stats.synced_sq_norm, 0.0)) if reusable else None
        if t0 is not None:
            self.session.own_extra += time.perf_counter() - t0
        return self.engine.finish_step(
            stats, faults, window_accumulation=self._window_divisor, mismatch_is_fatal=self._skips_sync()
        )

    def _step_counted(self) -> StepRecord:
        """:meth:`step` of a window the cadence does not measure, on one rank (the usual window of a
        cadence): the engine's counts-only reduction (:meth:`~cbs_tracker.core.engine.Engine.count_window`)
        and the session's :meth:`~cbs_tracker.core.session.TrackingSession.finish_counted`, without the
        general path's work for norms, ranks and clocks (what a window that measures nothing costs is this).
        Label counts still on their way to the host are not waited for: the record's four unit fields are
        filled when they arrive (the next :meth:`step`, a measured window's end, or whatever reads them
        first); the position, the LR schedule and the next window's size count microbatches."""
        if self.grad_scaler is not None:
            self._loss_scale()  # the gradients are unscaled at step() in every window
        divisor = float(self._window_divisor) if self.loss_normalization == "mean" and self.loss_divided_by_accumulation else 1.0
        stats, faults, deferred = self.engine.count_window(
            loss_divisor=divisor, avg_ranks=self._avg_ranks, expected_microbatches=self._window_divisor,
            normalization=self.loss_normalization,
        )
        self.engine.end_window()
        self._batches_done += self._window_index * self.session.micro_group
        self._window_index = 0
        self._step_norm = None
        session = self.session
        record = self.engine.finish_counted(stats, faults, window_accumulation=self._window_divisor,
                                            deferred=deferred)
        # the next window starts as this one did when nothing its start reads has moved: not measured, no
        # change of the batch pending, and its step() counted as this one's (counted_step_ready: no clock due,
        # the _lean its start would set); windows() and load_state_dict() start theirs in full
        self._fast_from = 0 if (
            session.pending_accumulation is None and not session.cadence.measure_next()
            and session.counted_step_ready(self._window_divisor)
        ) else 1
        return record

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of a loop that computes its own schedule: ``lr`` times the coupling.

        For loops that set the LR every iteration (nanoGPT-style): clock the schedule in
        starting-batch steps and hand its value here,
        ``tracker.set_lr(get_lr(tracker.starting_batch_steps))``; every param group gets
        ``lr * tracker.lr_coupling`` (scaled by each group's ratio to the first group's
        current LR, so per-group multipliers are kept). Writing ``param_group["lr"]``
        directly instead overwrites the batch-size coupling, which the tracker warns about
        once the batch has grown.

        Raises:
            ValueError: ``lr`` is negative or not finite; no optimizer was given.
        """
        name = type(self).__name__
        if self.optimizer is None:
            raise ValueError(f"{name}.set_lr({lr!r}): the tracker was built without an optimizer")
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
            raise ValueError(f"{name}.set_lr(lr={lr!r}): must be a finite number >= 0")
        groups = self.optimizer.param_groups
        first = float(groups[0]["lr"])
        for g in groups:
            ratio = float(g["lr"]) / first if first > 0 else 1.0
            g["lr"] = float(lr) * self.session.coupling * ratio
        self.session._note_lr()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the tracked parameters, reusing the norm :meth:`step` took.

        Call it right after :meth:`step`, where a loop clips. The synced gradient's total
        2-norm is the one the step already measured (over the whole DP group), so clipping
        costs one pass over the gradients (the scaling, only when it clips) instead of
        two. Where that norm cannot be reused (a preconditioner is set, FSDP2 shards or
        other ``DTensor`` gradients, the step was not finite, another ``norm_type``, a
        clip already ran, or no :meth:`step` since the last microbatch) this calls
        ``torch.nn.utils.clip_grad_norm_`` itself.

        Args:
            max_norm: the largest total norm allowed (a finite number >= 0).
            norm_type, error_if_nonfinite: as in ``torch.nn.utils.clip_grad_norm_``.

        Returns:
            The total norm before clipping, a 0-d tensor in the gradients' dtype and on their device.

        Raises:
            ValueError: ``max_norm`` not a finite number >= 0.
        """
        try:
            limit = float(max_norm)
        except (TypeError, ValueError, RuntimeError):
            limit = math.nan
        if isinstance(max_norm, bool) or not (0.0 <= limit < math.inf):
            raise ValueError(
                f"{type(self).__name__}.clip_grad_norm_(max_norm={max_norm!r}): expected a finite number >= 0"
            )
        params = self._trainable()  # every rank's own parameters (FSDP2: its shards, HSDP replicas included)
        grads = [p.grad for p in params if p.grad is not None]
        total = self._step_norm
        self._step_norm = None  # a second clip recomputes the norm of the clipped gradients
        reusable = total is not None and float(norm_type) == 2.0 and not any(hasattr(g, "to_local") for g in grads)
        if not reusable:  # DTensor gradients (tensor parallelism): torch reduces their norm over the mesh
            return torch.nn.utils.clip_grad_norm_(
                params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
            )
        coef = limit / (total + 1e-6)  # torch's clip coefficient, clamped at 1
        if coef < 1.0 and grads:
            with torch.no_grad():
                torch._foreach_mul_(grads, coef)
        if not grads:
            return torch.tensor(total, dtype=torch.float32)
        return torch.tensor(total, dtype=grads[0].dtype, device=grads[0].device)

    def _grads_still_scaled(self) -> bool:
        """``.grad`` still carries the loss scale when :meth:`step` reads it (an adapter whose framework
        unscales later, when the loop clips); the plain loop's :meth:`_loss_scale` unscales first."""
        return False

    def _loss_scale(self) -> torch.Tensor | None:
        if self.grad_scaler is None or not getattr(self.grad_scaler, "is_enabled", lambda: True)():
            return None
        if self.optimizer is None:
            raise RuntimeError(f"{type(self).__name__}.step(): grad_scaler= needs optimizer= to unscale the gradients")
        return unscale_and_get_scale(self.grad_scaler, self.optimizer)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the same run after a restart (plain numbers, versioned).

        The state is the one at the last optimizer step, with the data position there
        (:meth:`resume_position`). Taken inside a window it warns once: the window's
        microbatches so far are in no checkpoint, and a resume runs them again only if it
        starts the data at :meth:`resume_position`.
        """
        if self._in_microbatch or self._window_index > 0:
            self.engine.warn_unstepped("a checkpoint (state_dict()) was taken", key="checkpoint_in_window")
        state = {**self.engine.state_dict(), "microbatches_seen": self._batches_done}
        if self.max_microbatch is not None:  # what out-of-memory errors taught about the microbatch
            state = {**state, "microbatch_layout": {"good_group": self._good_group, "oom_group": self._oom_group}}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (between windows, before the first microbatch).

        Raises:
            RuntimeError: called inside a window.
            KeyError / TypeError / ValueError: see
                :meth:`~cbs_tracker.core.session.TrackingSession.load_state_dict`; on error
                nothing is changed.
        """
        if self._window_index != 0:
            raise RuntimeError(f"{type(self).__name__}.load_state_dict: call it between windows, not inside one")
        state = dict(state)
        layout = state.pop("microbatch_layout", None)
        seen = state.pop("microbatches_seen", None)
        if seen is not None and (isinstance(seen, bool) or not isinstance(seen, int) or seen < 0):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: 'microbatches_seen' must be an int >= 0, got {seen!r}"
            )
        groups = _read_layout(layout, f"{type(self).__name__}.load_state_dict")
        self.engine.load_state_dict(state)
        change = self.session.resumed_from
        self._resumed_batches = seen
        self._batches_done = 0 if seen is None else seen if change is None else change.position(seen)
        self._fast_from = 1  # the next window starts in full from the state loaded
        self._window_divisor = self.session.accumulation_steps
        if groups is not None and self.max_microbatch is not None:
            self._good_group, self._oom_group = groups

    @property
    def resumed_from(self) -> Any:
        """The :class:`~cbs_tracker.policy.ranks.RankChange` the last :meth:`load_state_dict` converted
        (``old_dp``, ``new_dp``, the accumulation before and after), or ``None``: the same ranks."""
        return self.session.resumed_from

    def resume_position(self, batches_per_rank: int | None = None) -> int:
        """Loader batches each rank skips at a resume, from the start of training.

        Without an argument: the position the checkpoint carries, the loader batches of the
        windows it holds (:attr:`microbatches_seen` when it was taken, less an open window's:
        those run again). A loop over epochs resumes with
        ``starting_epoch, skip = divmod(tracker.resume_position(), len(train_dataloader))``
        (``run_clm_no_trainer.py``'s ``resume_step``; not ``step * gradient_accumulation_steps``,
        which after growth counts too few). With ``batches_per_rank``: the loop's own count
        each rank had consumed when the checkpoint was taken (on the checkpoint's ranks).

        A ``DistributedSampler`` hands its ranks the epoch's batches in turn, so ``m`` batches on
        each of ``D`` ranks are the epoch's first ``D * m``; on ``D'`` ranks the same place is
        ``D * m / D'`` batches each. When ``D'`` does not divide ``D * m`` the count is rounded
        down and the batches in between are seen again: warned once, with their number. The same
        ranks: ``batches_per_rank`` unchanged.

        Raises:
            ValueError: ``batches_per_rank`` is not an integer >= 0.
        """
        name = type(self).__name__
        if batches_per_rank is None:
            if self._resumed_batches is None:
                return self._batches_done
            batches_per_rank = self._resumed_batches
        if isinstance(batches_per_rank, bool) or not isinstance(batches_per_rank, int) or batches_per_rank < 0:
            raise ValueError(f"{name}.resume_position(batches_per_rank={batches_per_rank!r}): must be an int >= 0")
        change = self.session.resumed_from
        if change is None:
            return batches_per_rank
        total = batches_per_rank * change.old_dp
        skip = change.position(batches_per_rank)
        repeated = total - skip * change.new_dp
        if repeated:
            self.session.warn_once(
                "resume_position",
                f"{name}: the checkpoint's {change.old_dp} ranks had consumed {batches_per_rank} loader batches "
                f"each, the first {total} of the epoch, which {change.new_dp} ranks cannot split evenly: each "
                f"skips {skip}, so {repeated} loader batch(es) of the epoch are seen again",
            )
        return skip

    def remove_hooks(self) -> None:
        """Detach from the model and the scheduler (gradients are never changed by the tracker)."""
        self.engine.warn_unstepped("the tracker was detached (remove_hooks())")
        self.session.resolve_pending()  # records whose counts are still on their way: filled and logged
        self.engine.remove(forget=False)


_PLAIN_NUMBERS = (int, float)


class _CountedMicrobatch:
    """:meth:`LoopTracker.microbatch` in a window the cadence does not measure: no hook is on the
    parameters, so the microbatch only counts (its gradient sync is switched as in any window).
    One per tracker, reused: :meth:`LoopTracker.microbatch` sets the size of the microbatch it opens
    (microbatches do not nest)."""

    __slots__ = ("_tracker", "_size", "_sync")

    def __init__(self, tracker: LoopTracker) -> None:
        self._tracker: LoopTracker = tracker
        self._size: float | torch.Tensor | LabelCount = 0.0
        self._sync: AbstractContextManager[Any] | None = None

    def __enter__(self) -> None:
        t = self._tracker
        t._step_norm = None
        t._in_microbatch = True
        if t._sync_free:
            self._sync = None
        else:
            self._sync = t._sync_context(t._window_index >= t._window_divisor - 1)
            self._sync.__enter__()

    def __exit__(self, kind: Any, value: Any, tb: Any) -> bool | None:
        t = self._tracker
        t.collector.count_microbatch(self._size)  # (counted whatever the sync context's exit does)
        t._in_microbatch = False
        t._window_index += 1
        return None if self._sync is None else self._sync.__exit__(kind, value, tb)


def _read_layout(layout: Any, owner: str) -> tuple[int, int | None] | None:
    """A saved ``microbatch_layout``: ``good_group`` an int >= 1, ``oom_group`` ``None`` or an int >= 1."""
    if layout is None:
        return None
    if not isinstance(layout, dict) or "good_group" not in layout or "oom_group" not in layout:
        raise ValueError(f"{owner}: 'microbatch_layout' must be a dict with 'good_group' and 'oom_group', "
                         f"got {layout!r}")
    for key, optional in (("good_group", False), ("oom_group", True)):
        value = layout[key]
        if not (optional and value is None) and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{owner}: 'microbatch_layout'[{key!r}] must be an int >= 1"
                             + (" or None" if optional else "") + f", got {value!r}")
    return layout["good_group"], layout["oom_group"]


def microbatch_layout(level: int, max_group: int, dp_degree: int) -> int:
    """Loader batches per microbatch for a window of ``level`` loader batches per rank: the largest power
    of two up to ``max_group`` that divides it and, on one rank, leaves at least two microbatches."""
    least = 2 if dp_degree == 1 else 1
    group = 1
    while group * 2 <= max_group and level % (group * 2) == 0 and level // (group * 2) >= least:
        group *= 2
    return group


def group_cap(max_microbatch: int, rows: int) -> int:
    """Loader batches of ``rows`` rows that fit in a microbatch of ``max_microbatch`` rows (at least one)."""
    return max(1, max_microbatch // max(rows, 1))


def join_batches(parts: list[Any]) -> Any:
    """``parts[0]`` when alone, else the loader batches joined into one (see :func:`_join`)."""
    return parts[0] if len(parts) == 1 else _join(parts)


class _Window(list):  # type: ignore[type-arg]
    """One optimizer step's microbatches, handed out by :meth:`LoopTracker.windows`.

    Holds the loader batches it was built from, so that after an out-of-memory error it
    is re-split at a smaller microbatch and iterated again from its start.
    """

    def __init__(self, parts: list[Any], group: int) -> None:
        super().__init__()
        self._parts = parts
        self._restart = False
        self.iterating = False
        self.resplit(group, restart=False)

    def resplit(self, group: int, *, restart: bool = True) -> None:
        chunks = [self._parts[i : i + group] for i in range(0, len(self._parts), group)]
        self[:] = [join_batches(c) for c in chunks]
        self._restart = restart

    def __iter__(self) -> Iterator[Any]:
        self.iterating = True
        try:
            i = 0
            while i < len(self):
                yield list.__getitem__(self, i)
                if self._restart:
                    self._restart, i = False, 0
                else:
                    i += 1
        finally:
            self.iterating = False


class _CudaMemory:
    """The CUDA device's allocated and peak memory, what ``max_microbatch="auto"`` reads."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def total(self) -> int:
        return int(torch.cuda.get_device_properties(self.device).total_memory)


def _cuda_memory_probe(model: nn.Module, owner: str) -> _CudaMemory:
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type != "cuda":
        raise ValueError(
            f"{owner}(max_microbatch='auto'): reads CUDA memory, but the model is on {device}; "
            "pass an integer cap (sequences per microbatch) instead"
        )
    return _CudaMemory(device)


def _is_oom(exc: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None)
    if oom is not None and isinstance(exc, oom):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def leading_rows(batch: Any) -> int:
    """Rows of a batch: the leading dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else 1
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for v in values:
        n = leading_rows(v)
        if n:
            return n
    return 0


def _join(parts: list[Any]) -> Any:
    """Consecutive loader batches as one: tensors concatenated along dim 0, containers joined per field."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, dict):
        return {k: _join([p[k] for p in parts]) for k in first}
    if isinstance(first, (list, tuple)):
        joined = [_join([p[i] for p in parts]) for i in range(len(first))]
        if hasattr(first, "_fields"):  # a named tuple
            return type(first)(*joined)
        return tuple(joined) if isinstance(first, tuple) else joined
    raise TypeError(f"cannot join loader batches of type {type(first).__name__} (tensors, tuples, lists, dicts)")


def refuse_pipeline(model: Any, name: str) -> None:
    """Refuse a ``torch.distributed.pipelining`` stage or schedule, with the reason."""
    pipelining = sys.modules.get("torch.distributed.pipelining")  # imported iff the user built a pipeline
    if pipelining is None:
        return
    stage = getattr(getattr(pipelining, "stage", None), "_PipelineStageBase", ())
    schedule = getattr(getattr(pipelining, "schedules", None), "_PipelineSchedule", ())
    if isinstance(model, (stage, schedule)):
        raise TypeError(
            f"{name}(model={type(model).__name__}): pipeline parallelism is not supported. The schedule splits "
            "each batch into its own microbatches and accumulates their gradients inside one step() call, so "
            "the tracker cannot see a microbatch's gradient or set the window, and each stage holds different "
            "parameters. Measure the noise scale in a data-parallel run of the same model (it is a property of "
            "the gradient, not of how the model is split across devices)."
        )
