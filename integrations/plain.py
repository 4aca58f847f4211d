"""``CBSTracker``: the plain PyTorch loop API (measure -> estimate -> decide).

Usage::

    tracker = CBSTracker(model, optimizer, accumulation_steps=4)
    for step in range(num_steps):
        for _ in range(tracker.accumulation_steps):      # may change between windows
            x, y = next(batches)
            with tracker.microbatch(labels=y):           # DDP no_sync on all but the last
                loss = model(x, y) / tracker.accumulation_steps
                loss.backward()
        tracker.step()                                   # after unscale_, before clipping
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

Loss normalisation assumed: each microbatch loss is the **mean** over its own
loss-contributing units, divided by the window's accumulation steps (what
Lightning and most loops do); DDP then averages over ranks. The tracker undoes
both factors (and the AMP loss scale) so the small and big norms are on one
scale. With a token-weighted loss (sum over tokens / tokens of the whole
global batch) the per-microbatch gradients are weighted by ``b_k / B``
instead; set ``loss_divided_by_accumulation=False`` only if you do not divide
at all (plain sum over microbatches).
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, Literal

import torch
from torch import nn

from cbs_tracker.core import distributed as cbs_dist
from cbs_tracker.core.collector import (
    GradStatsCollector,
    GradTransform,
    StepStats,
    adam_preconditioner,
    local_grad_sq_norm,
)
from cbs_tracker.core.estimator import NoiseScaleEstimate, NoiseScaleEstimator
from cbs_tracker.core.record import StepRecord, Unit

TRACKER_STATE_VERSION = 1

_SINGLE_MICROBATCH_WARNING = (
    "cbs-tracker: each optimizer step has a single microbatch (accumulation_steps=1 on one "
    "data-parallel rank), so there is no second batch size and the noise scale is not measured. "
    "Use accumulation_steps >= 2 (e.g. halve the microbatch and double the accumulation) or "
    "more data-parallel ranks."
)


class CBSTracker:
    """Measures the gradient noise scale of a training loop and (with a controller) sets its accumulation.

    Args:
        model: the model as the loop calls it (a ``DistributedDataParallel`` wrapper is
            recognised: hooks go on ``model.module`` and ``no_sync`` is applied for you).
        optimizer: the optimizer (needed for ``preconditioner="adam"``, LR coupling
            and the logged LR); may be ``None`` to only measure.
        accumulation_steps: microbatches per rank in the first window (>= 1).
        unit: ``"tokens"`` or ``"samples"``: what the sizes given to
            :meth:`microbatch` count, and the unit of every reported size.
        ignore_index: label value excluded when counting tokens from ``labels=``.
        controller: a :class:`~cbs_tracker.policy.controller.BatchSizeController` (or anything
            with its ``update(...)`` signature); ``None`` measures only.
        process_group: the data-parallel group (default: the world, when distributed).
        device_mesh: alternatively, a ``DeviceMesh`` whose ``mesh_dim`` is data-parallel.
        mesh_dim: the DP dimension name(s) of ``device_mesh``.
        loss_divided_by_accumulation: the loop divides each microbatch loss by
            ``tracker.accumulation_steps`` (default ``True``).
        grads_averaged_over_ranks: the gradient sync averages over the DP ranks (DDP
            and FSDP do); ``None`` (default) means yes whenever there is more than one rank.
        grad_scaler: a ``torch.amp.GradScaler``; :meth:`step` unscales the optimizer's
            gradients if the loop has not, and removes the scale from the hooked norms.
        preconditioner: ``None`` (raw gradients) or ``"adam"``: measure
            ``g / (sqrt(v_hat) + eps)`` with the optimizer's second moments.
        estimator: a configured :class:`~cbs_tracker.core.estimator.NoiseScaleEstimator`.
        logger: anything with ``log(record: StepRecord)``, e.g. ``TensorBoardLogger``.
        lr_scheduler: the LR scheduler driving ``optimizer``, if any: a learning-rate
            coupling factor (``lr_scaling`` of the controller) then multiplies what the
            scheduler sets from then on, instead of being undone by it.

    Raises:
        ValueError / TypeError: on bad configuration (message names the argument).
    """

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
        grads_averaged_over_ranks: bool | None = None,
        grad_scaler: Any | None = None,
        preconditioner: Literal["adam"] | None = None,
        estimator: NoiseScaleEstimator | None = None,
        logger: Any | None = None,
        lr_scheduler: Any | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"CBSTracker(model={type(model).__name__}): expected a torch.nn.Module")
        fsdp = sys.modules.get("torch.distributed.fsdp")  # imported iff the user may have called fully_shard
        if not self.big_norm_is_sharded and fsdp is not None and isinstance(model, fsdp.FSDPModule):
            raise TypeError(
                f"CBSTracker(model={type(model).__name__}): an FSDP2 (fully_shard) model needs "
                "cbs_tracker.integrations.fsdp.FSDPTracker (the sharded parameters' hooks never fire)"
            )
        if optimizer is not None and not hasattr(optimizer, "param_groups"):
            raise TypeError(
                f"CBSTracker(optimizer={type(optimizer).__name__}): expected a torch.optim.Optimizer or None"
            )
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"CBSTracker(accumulation_steps={accumulation_steps!r}): must be an integer >= 1")
        if unit not in ("tokens", "samples"):
            raise ValueError(f"CBSTracker(unit={unit!r}): must be 'tokens' or 'samples'")
        if preconditioner not in (None, "adam"):
            raise ValueError(f"CBSTracker(preconditioner={preconditioner!r}): must be None or 'adam'")
        if preconditioner == "adam" and optimizer is None:
            raise ValueError("CBSTracker(preconditioner='adam', optimizer=None): the Adam preconditioner needs the optimizer")
        if controller is not None and not callable(getattr(controller, "update", None)):
            raise TypeError(
                f"CBSTracker(controller={type(controller).__name__}): expected a BatchSizeController "
                "(an object with update(...))"
            )
        if logger is not None and not callable(getattr(logger, "log", None)):
            raise TypeError(f"CBSTracker(logger={type(logger).__name__}): expected an object with log(record)")
        if grad_scaler is not None and not callable(getattr(grad_scaler, "unscale_", None)):
            raise TypeError(f"CBSTracker(grad_scaler={type(grad_scaler).__name__}): expected a torch.amp.GradScaler")

        self.model = model
        self.optimizer = optimizer
        self.unit: Unit = unit
        self.ignore_index = ignore_index
        self.controller = controller
        self.logger = logger
        self.grad_scaler = grad_scaler
        self.lr_scheduler = lr_scheduler
        self.loss_divided_by_accumulation = bool(loss_divided_by_accumulation)
        self.dp_group = cbs_dist.resolve_dp_group(process_group, device_mesh, mesh_dim)
        self.dp_degree = cbs_dist.group_size(self.dp_group)
        self.estimator = estimator if estimator is not None else NoiseScaleEstimator()

        self._ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        self._module = model.module if self._ddp else model
        if grads_averaged_over_ranks is None:
            if self._ddp:
                grads_averaged_over_ranks = True
            else:
                grads_averaged_over_ranks = self.dp_degree > 1
        # Ranks the gradient sync averages over (DDP's own group, else the DP group).
        if not grads_averaged_over_ranks:
            self._avg_ranks = 1
        elif self._ddp:
            self._avg_ranks = cbs_dist.group_size(getattr(model, "process_group", None))
        else:
            self._avg_ranks = self.dp_degree
        # DDP with static_graph=True fails on no_sync() before one synced iteration.
        self._needs_synced_first_step = self._ddp and bool(getattr(model, "static_graph", False))

        self._transform = adam_preconditioner(optimizer) if preconditioner == "adam" else None
        self.collector = GradStatsCollector(self._measured_params(), transform=self._transform, register=False)
        self._register_hooks()

        self._accumulation_steps = accumulation_steps
        self._window_index = 0
        self._window_divisor = accumulation_steps
        self._pending_lr_factor = 1.0
        self._step = 0
        self._tokens_seen = 0.0
        self._warned_single = False
        self._in_microbatch = False
        self.last_record: StepRecord | None = None
        self.last_stats: StepStats | None = None

    # ------------------------------------------------------------------ adapter points
    def _measured_params(self) -> list[nn.Parameter]:
        """Parameters whose hooks see per-microbatch local gradients."""
        return [p for p in self._module.parameters() if p.requires_grad]

    def _register_hooks(self) -> None:
        for p in self._measured_params():
            self.collector.hook(p)

    def _big_params(self) -> list[nn.Parameter]:
        """Parameters whose ``.grad`` holds the synced step gradient."""
        return self._measured_params()

    #: the big-norm partial of every rank is a shard of the gradient (sum over ranks) rather
    #: than a replica (take one rank's); FSDP2 adapters set this.
    big_norm_is_sharded = False

    # ------------------------------------------------------------------ public state
    @property
    def accumulation_steps(self) -> int:
        """Microbatches per rank in the current (or, between windows, the next) window."""
        return self._accumulation_steps

    @property
    def noise_scale(self) -> float | None:
        """Smoothed ``B_simple`` in :attr:`unit`; ``None`` until measurable."""
        return self.estimator.noise_scale

    @property
    def grad_sq_norm(self) -> float | None:
        """Smoothed ``|G|^2`` estimate."""
        return self.estimator.grad_sq_norm

    @property
    def trace_cov(self) -> float | None:
        """Smoothed ``tr(Sigma)`` estimate (squared-gradient units times :attr:`unit`)."""
        return self.estimator.trace_cov

    @property
    def global_batch_size(self) -> float | None:
        """Units (see :attr:`unit`) in the last optimizer step, over all DP ranks and the window."""
        return None if self.last_record is None else self.last_record.global_batch

    @property
    def tokens_seen(self) -> float:
        """Units consumed by all DP ranks so far (in :attr:`unit`)."""
        return self._tokens_seen

    @property
    def steps(self) -> int:
        """Optimizer steps recorded so far."""
        return self._step

    # ------------------------------------------------------------------ the loop
    @contextmanager
    def microbatch(
        self, size: float | int | torch.Tensor | None = None, *, labels: torch.Tensor | None = None
    ) -> Iterator[None]:
        """Wrap one microbatch's forward and backward.

        Args:
            size: units in this microbatch (tokens or samples, per :attr:`unit`);
                a number or a 0-d tensor (kept on the device: no host sync).
            labels: alternatively, the labels; tokens are counted as
                ``labels != ignore_index`` (on the device).

        Raises:
            TypeError: neither or both of ``size`` and ``labels``.
            RuntimeError: nested microbatches.
        """
        if (size is None) == (labels is None):
            raise TypeError(
                "CBSTracker.microbatch(): pass exactly one of size= (units in this microbatch) or "
                "labels= (tokens counted as labels != ignore_index)"
            )
        if self._in_microbatch:
            raise RuntimeError("CBSTracker.microbatch(): microbatches cannot be nested")
        if labels is not None:
            n: float | torch.Tensor = (labels != self.ignore_index).sum()
        else:
            if not isinstance(size, torch.Tensor) and not (isinstance(size, (int, float)) and size > 0):
                raise ValueError(f"CBSTracker.microbatch(size={size!r}): must be a positive number or a tensor")
            n = size  # type: ignore[assignment]
        if self._window_index == 0:
            self._begin_window()
        last = self._window_index >= self._accumulation_steps - 1
        sync_anyway = self._needs_synced_first_step and self._step == 0
        ctx = self.model.no_sync() if (self._ddp and not last and not sync_anyway) else nullcontext()
        self._in_microbatch = True
        self.collector.begin_microbatch()
        try:
            with ctx:
                yield
        finally:
            self.collector.end_microbatch(n)
            self._in_microbatch = False
            self._window_index += 1

    def _begin_window(self) -> None:
        self._window_divisor = self._accumulation_steps
        if self._pending_lr_factor != 1.0 and self.optimizer is not None:
            from cbs_tracker.policy.lr import apply_lr_factor

            apply_lr_factor(self.optimizer, self._pending_lr_factor, self.lr_scheduler)
        self._pending_lr_factor = 1.0

    def step(self) -> StepRecord:
        """Measure the step that just finished its backward passes; call before clipping.

        Reads the synced gradient's squared norm, reduces the window's sums and
        counts over the DP group in one ``all_reduce`` (every rank, every step),
        updates the estimate and, with a controller, sets :attr:`accumulation_steps`
        for the next window. With a ``grad_scaler`` it unscales the gradients first
        unless the loop already called ``scaler.unscale_(optimizer)``.

        Returns:
            The step's :class:`~cbs_tracker.core.record.StepRecord`.

        Raises:
            RuntimeError: no microbatch was run since the last step (with several DP
                ranks: on no rank; every rank raises it together, after the all_reduce).
        """
        if self._in_microbatch:
            raise RuntimeError("CBSTracker.step(): called inside tracker.microbatch()")
        no_microbatch = (
            "CBSTracker.step(): no microbatch since the last step; wrap each forward/backward "
            "in `with tracker.microbatch(...)`"
        )
        if self.collector.num_microbatches == 0:
            if self.dp_degree == 1:
                raise RuntimeError(no_microbatch)
            # This rank's data ran out: the other ranks already wait in this step's
            # all_reduce, so take part with zero counts (raising here would hang them).
            # Begin the empty window like the others did (same loss divisor, same LR factor).
            self._begin_window()
        scale = self._unscale_and_get_scale()
        stats = self._reduce_window(scale)
        self.collector.reset_window()
        if stats.num_microbatches == 0:
            raise RuntimeError(no_microbatch + " (on any data-parallel rank)")
        window_steps = self._accumulation_steps
        self._window_index = 0
        self._step += 1
        self._tokens_seen += stats.units
        self.last_stats = stats

        estimate = update_estimator(self.estimator, stats)
        if estimate is None and stats.finite and stats.num_microbatches < 2 and not self._warned_single:
            self._warned_single = True
            warnings.warn(_SINGLE_MICROBATCH_WARNING, UserWarning, stacklevel=2)

        critical = None
        if self.controller is not None:
            decision = self.controller.update(
                step=self._step,
                tokens_seen=self._tokens_seen,
                global_batch=stats.units,
                accumulation_steps=window_steps,
                noise_scale=self.estimator.noise_scale,
            )
            critical = decision.critical_batch
            if decision.changed:
                self._accumulation_steps = int(decision.accumulation_steps)
                self._pending_lr_factor *= float(decision.lr_factor)

        lr = None
        if self.optimizer is not None and self.optimizer.param_groups:
            lr = float(self.optimizer.param_groups[0]["lr"])
        record = build_record(
            stats, self.estimator, estimate, step=self._step, tokens_seen=self._tokens_seen, unit=self.unit,
            accumulation_steps=window_steps, dp_degree=self.dp_degree, critical_batch=critical, lr=lr,
            next_accumulation_steps=self._accumulation_steps,
        )
        self.last_record = record
        if self.logger is not None:
            self.logger.log(record)
        return record

    def _unscale_and_get_scale(self) -> torch.Tensor | None:
        if self.grad_scaler is None or not getattr(self.grad_scaler, "is_enabled", lambda: True)():
            return None
        if self.optimizer is None:
            raise RuntimeError("CBSTracker.step(): grad_scaler= needs optimizer= to unscale the gradients")
        return unscale_and_get_scale(self.grad_scaler, self.optimizer)

    def _reduce_window(self, scale: torch.Tensor | None) -> StepStats:
        divisor = float(self._window_divisor) if self.loss_divided_by_accumulation else 1.0
        return reduce_window(
            self.collector,
            self._big_params(),
            dp_group=self.dp_group,
            loss_divisor=divisor,
            avg_ranks=self._avg_ranks,
            scale=scale,
            transform=self._transform,
            big_norm_is_sharded=self.big_norm_is_sharded,
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the same schedule after a restart."""
        return {
            "version": TRACKER_STATE_VERSION,
            "step": self._step,
            "tokens_seen": self._tokens_seen,
            "accumulation_steps": self._accumulation_steps,
            "dp_degree": self.dp_degree,
            "pending_lr_factor": self._pending_lr_factor,
            "warned_single": self._warned_single,
            "estimator": self.estimator.state_dict(),
            "controller": None if self.controller is None else self.controller.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (call between windows, before the first microbatch).

        Raises:
            KeyError: a required key is missing.
            ValueError: the checkpoint's version is newer, or it was taken with a different
                data-parallel degree (the accumulation would no longer give the same global batch).
        """
        required = ("version", "step", "tokens_seen", "accumulation_steps", "dp_degree", "estimator")
        missing = [k for k in required if k not in state]
        if missing:
            raise KeyError(f"CBSTracker.load_state_dict: missing keys {missing}")
        if int(state["version"]) > TRACKER_STATE_VERSION:
            raise ValueError(
                f"CBSTracker.load_state_dict: state version {state['version']} is newer than "
                f"{TRACKER_STATE_VERSION}; upgrade cbs-tracker"
            )
        if int(state["dp_degree"]) != self.dp_degree:
            raise ValueError(
                f"CBSTracker.load_state_dict: the checkpoint was taken with dp_degree={state['dp_degree']} "
                f"but this run has dp_degree={self.dp_degree}; the accumulation steps "
                f"({state['accumulation_steps']}) would give a different global batch. Resume with the same "
                "number of data-parallel ranks."
            )
        if self._window_index != 0:
            raise RuntimeError("CBSTracker.load_state_dict: call it between windows, not inside one")
        self._step = int(state["step"])
        self._tokens_seen = float(state["tokens_seen"])
        self._accumulation_steps = int(state["accumulation_steps"])
        self._pending_lr_factor = float(state.get("pending_lr_factor", 1.0))
        self._warned_single = bool(state.get("warned_single", False))
        self.estimator.load_state_dict(state["estimator"])
        if self.controller is not None and state.get("controller") is not None:
            self.controller.load_state_dict(state["controller"])

    def remove_hooks(self) -> None:
        """Detach from the model (its gradients are never changed by the tracker)."""
        self.collector.remove()


def unscale_and_get_scale(grad_scaler: Any, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Unscale ``optimizer``'s gradients unless the loop already did; return the loss scale (0-d tensor).

    The scale is the one the backward passes of this window used (``update()`` runs
    after the optimizer step), read without a host sync where torch allows.
    """
    states = getattr(grad_scaler, "_per_optimizer_states", {})
    stage = states.get(id(optimizer), {}).get("stage")
    if stage is None or getattr(stage, "name", "") == "READY":
        grad_scaler.unscale_(optimizer)
    get_async = getattr(grad_scaler, "_get_scale_async", None)
    scale = get_async() if get_async is not None else None
    if scale is None:
        scale = torch.tensor(float(grad_scaler.get_scale()))
    return scale


def update_estimator(estimator: NoiseScaleEstimator, stats: StepStats) -> NoiseScaleEstimate | None:
    """Feed a reduced step to the estimator; ``None`` when the step cannot be measured.

    Not measured: non-finite gradients on some rank, or a single microbatch in the
    whole step (``K = 1``: no second batch size).
    """
    if stats.finite and stats.num_microbatches >= 2 and stats.small_batch > 0:
        return estimator.update(stats.small_sq_norm, stats.big_sq_norm, stats.small_batch, stats.big_batch, stats.units)
    return None


def build_record(
    stats: StepStats,
    estimator: NoiseScaleEstimator,
    estimate: NoiseScaleEstimate | None,
    *,
    step: int,
    tokens_seen: float,
    unit: Unit,
    accumulation_steps: int,
    dp_degree: int,
    critical_batch: float | None,
    lr: float | None,
    next_accumulation_steps: int,
) -> StepRecord:
    """The step's :class:`~cbs_tracker.core.record.StepRecord`, the same for every adapter."""
    step_est = estimate.step if estimate is not None else None
    return StepRecord(
        step=step,
        tokens_seen=tokens_seen,
        unit=unit,
        global_batch=stats.units,
        micro_batch=stats.units / max(stats.num_microbatches, 1),
        accumulation_steps=accumulation_steps,
        dp_degree=dp_degree,
        grad_sq_norm=estimator.grad_sq_norm,
        trace_cov=estimator.trace_cov,
        noise_scale=estimator.noise_scale,
        critical_batch=critical_batch,
        lr=lr,
        step_grad_sq_norm=None if step_est is None else step_est.grad_sq_norm,
        step_trace_cov=None if step_est is None else step_est.trace_cov,
        dropped=not stats.finite,
        next_accumulation_steps=next_accumulation_steps,
    )


def reduce_window(
    collector: GradStatsCollector,
    big_params: Iterable[nn.Parameter],
    *,
    dp_group: Any | None,
    loss_divisor: float,
    avg_ranks: int,
    scale: torch.Tensor | None = None,
    transform: GradTransform | None = None,
    big_norm_is_sharded: bool = False,
) -> StepStats:
    """One optimizer step's norms on one scale, reduced over the DP group (shared by all adapters).

    The hooked microbatch gradients are ``h_k = S g_k / a`` (``S`` the AMP loss scale,
    ``a = loss_divisor`` the factor each microbatch loss was divided by) and the
    synced, unscaled ``.grad`` is ``sum_k g_k / (a R)`` over the ``K`` microbatches of
    all ranks (``R = avg_ranks`` when the sync averages). So
    ``|g_k|^2 = |h_k|^2 a^2 / S^2`` and ``|mean_k g_k|^2 = |.grad|^2 (R a / K)^2``. ``K``
    is the number of microbatches really run, so a short window (fewer microbatches
    than ``a``, Lightning's last window of an epoch) is measured with its real size.
    One ``all_reduce`` of 7 float64 numbers and one host sync.

    Args:
        collector: the window's per-microbatch norms (not reset here).
        big_params: parameters whose ``.grad`` holds the synced, unscaled step gradient.
        dp_group: the data-parallel group (``None``: world, or no distribution).
        loss_divisor: ``a``, what each microbatch loss was divided by (1.0: not divided).
        avg_ranks: ``R``, ranks the gradient sync averages over (1: it sums, or one rank).
        scale: the AMP loss scale the hooked gradients carry (``None``: none); the big
            norm must already be unscaled.
        transform: the collector's gradient transform, applied to ``.grad`` as well.
        big_norm_is_sharded: every rank's ``.grad`` is a shard (sum the partial norms)
            rather than a replica (take rank 0's).

    Returns:
        The reduced :class:`~cbs_tracker.core.collector.StepStats` (identical on every rank).
    """
    big = local_grad_sq_norm(big_params, transform)
    ref = big if big is not None else (collector.microbatch_sq_norms() or [torch.zeros(())])[0]
    device = cbs_dist.reduction_device(dp_group, ref.device)
    sums = collector.window_sums(device)
    small_sum = sums[0]
    if scale is not None:
        small_sum = small_sum / scale.to(device).double().square()
    small_sum = small_sum * float(loss_divisor) ** 2
    unmeasurable = collector.window_unmeasurable or (big is None and transform is not None)
    big_val = torch.zeros((), dtype=torch.float64, device=device) if big is None else big.to(device).double()
    contributes = big_norm_is_sharded or cbs_dist.group_rank(dp_group) == 0
    if not contributes:
        big_val = torch.zeros_like(big_val)
    finite = torch.isfinite(small_sum) & torch.isfinite(big_val)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    vec = torch.stack(
        [
            torch.where(finite, small_sum, zero),
            sums[1],
            sums[2],
            sums[3],
            torch.where(finite, big_val, zero),
            (~finite).double(),
            torch.tensor(float(unmeasurable), dtype=torch.float64, device=device),
        ]
    )
    vec = cbs_dist.all_reduce_sum(vec, dp_group)
    small_total, count, inv_sum, units, big_total, nonfinite, unmeas = vec.tolist()  # the step's one host sync
    k = int(round(count))
    big_sq = big_total * (avg_ranks * float(loss_divisor) / max(k, 1)) ** 2
    return StepStats(
        small_sq_norm=small_total / max(k, 1),
        big_sq_norm=big_sq,
        num_microbatches=k,
        small_batch=(k / inv_sum) if inv_sum > 0 else 0.0,
        units=units,
        finite=nonfinite == 0 and unmeas == 0 and math.isfinite(big_sq),
    )
