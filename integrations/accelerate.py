"""``AcceleratorTracker``: the tracker inside a Hugging Face Accelerate training loop (accelerate 1.16).

Usage (the shape of transformers' ``run_clm_no_trainer.py``)::

    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(model, optimizer, dl, lr_scheduler)
    tracker = AcceleratorTracker(accelerator, model, optimizer, lr_scheduler=lr_scheduler,
                                 controller=BatchSizeController())
    while tracker.starting_batch_steps < max_train_steps:       # the data of a constant-batch run
        for _ in range(tracker.accumulation_steps):             # the tracker sets each window's length
            batch = next(batches)
            with tracker.accumulate(labels=batch["labels"][..., 1:]):   # accelerator.accumulate(model), aligned
                loss = model(**batch).loss
                accelerator.backward(loss)                      # divided by the window's accumulation
                if accelerator.sync_gradients:                  # the window's last microbatch
                    tracker.step()                              # after the last backward, before clipping
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()                                # Accelerate steps only on sync
                lr_scheduler.step()
                optimizer.zero_grad()

Each window's first microbatch resets ``accelerator.step`` (the counter behind
``accelerator.accumulate``) and sets ``accelerator.gradient_accumulation_steps`` to the
window's accumulation, so ``accelerator.backward`` divides every loss by it,
``accelerator.sync_gradients`` is true exactly on the window's last microbatch, DDP's
``no_sync`` covers the others, and the wrapped optimizer steps once per window. The
end-of-dataloader sync is switched off while tracked (a window spans the loader's end). The
prepared scheduler stays on its timing in tokens, as many of its steps per starting-batch
step as Accelerate gives it (``num_processes`` unless ``split_batches``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch
from cbs_tracker.integrations.plain import CBSTracker
from torch import nn

from cbs_tracker._warn import warn_user
from cbs_tracker.core.measure import loss_scale

__all__ = ["AcceleratorTracker"]

#: Accelerate's distributed types under which the per-microbatch gradients are not seen, or
#: the accumulation is the engine's own
_REFUSED = {
    "DEEPSPEED": "DeepSpeed accumulates the gradients in its engine",
    "FSDP": "FSDP shards the gradients (use cbs_tracker.integrations.fsdp.FSDPTracker in a plain loop)",
    "MEGATRON_LM": "Megatron-LM runs its own microbatch schedule",
    "XLA": "XLA reduces the gradients in the optimizer step, not in the backward",
}
_STATE_KEY = "accelerate"


class AcceleratorTracker(CBSTracker):
    """Measures the noise scale of an Accelerate loop and (with a controller) sets its accumulation.

    A :class:`~cbs_tracker.integrations.plain.CBSTracker` whose windows are Accelerate's: each
    microbatch runs in :meth:`accumulate`, which enters ``accelerator.accumulate(model)`` with
    Accelerate's counter and ``gradient_accumulation_steps`` set from the tracker's window, so
    growth never leaves a window cut, synced or stepped in the wrong place. Call :meth:`step`
    inside ``if accelerator.sync_gradients:`` after ``accelerator.backward``, before clipping.

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared ``model`` and ``optimizer``.
        model: the model as ``accelerator.prepare`` returned it (DDP-wrapped with several processes).
        optimizer: the optimizer as ``accelerator.prepare`` returned it (an ``AcceleratedOptimizer``),
            or ``None`` to measure only.
        lr_scheduler: the scheduler as ``accelerator.prepare`` returned it (an ``AcceleratedScheduler``,
            stepped on every microbatch as Accelerate allows), or a plain torch scheduler of the
            optimizer stepped once per optimizer step. Sized as for a constant-batch Accelerate run; the
            tracker keeps it on its timing in units seen and multiplies the LR by the batch coupling.
        accumulation_steps: microbatches per process in the first window; default (and it must equal)
            ``accelerator.gradient_accumulation_steps``.
        checkpoint: register the tracker with ``accelerator.register_for_checkpointing`` (default
            ``True``), so ``accelerator.save_state``/``load_state`` carry it.
        **kwargs: the other arguments of :class:`~cbs_tracker.core.loop.LoopTracker` (``controller``,
            ``unit``, ``ignore_index``, ``estimator``, ``logger``, ``lr_coupling``, ``cap_lr_at_peak``,
            ``preconditioner``, ``measure_every``...). The loss normalisation is Accelerate's (each
            microbatch loss a mean, divided by the accumulation in ``accelerator.backward``); the AMP
            loss scale is read from ``accelerator.scaler``.

    Raises:
        TypeError: not an ``Accelerator``; a model or optimizer of another kind; an argument the
            adapter sets itself (``grad_scaler``, ``loss_normalization``...).
        ValueError: a model, optimizer or scheduler not prepared by this accelerator;
            ``accumulation_steps`` other than ``accelerator.gradient_accumulation_steps``; a scheduler
            Accelerate steps on every call (``step_scheduler_with_optimizer=False``).
        RuntimeError: DeepSpeed, FSDP, Megatron-LM, XLA or tensor/context parallelism.
    """

    def __init__(
        self,
        accelerator: Any,
        model: nn.Module,
        optimizer: Any | None = None,
        *,
        lr_scheduler: Any | None = None,
        accumulation_steps: int | None = None,
        checkpoint: bool = True,
        **kwargs: Any,
    ) -> None:
        name = type(self).__name__
        _check_accelerator(accelerator, name)
        for key, why in (
            ("grad_scaler", "the loss scale is read from accelerator.scaler"),
            (
                "loss_normalization",
                "accelerator.backward divides every microbatch loss by the accumulation",
            ),
            (
                "loss_divided_by_accumulation",
                "accelerator.backward divides every microbatch loss by the accumulation",
            ),
            (
                "max_microbatch",
                "growing the microbatch is not supported with Accelerate in this release (the "
                "accumulation grows)",
            ),
            ("process_group", "the data-parallel group is Accelerate's (all processes)"),
            ("device_mesh", "the data-parallel group is Accelerate's (all processes)"),
            ("mesh_dim", "the data-parallel group is Accelerate's (all processes)"),
            ("grads_averaged_over_ranks", "Accelerate's DDP averages over all processes"),
        ):
            if key in kwargs:
                raise TypeError(
                    f"{name}({key}={kwargs[key]!r}): not an argument of this adapter: {why}"
                )
        if not isinstance(checkpoint, bool):
            raise TypeError(f"{name}(checkpoint={checkpoint!r}): expected True or False")
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"{name}(model={type(model).__name__}): expected the torch.nn.Module accelerator.prepare returned"
            )
        ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        inside = model.module if ddp else model  # Accelerate keeps the module it wrapped in DDP
        if not any(m is model or m is inside for m in accelerator._models):
            raise ValueError(
                f"{name}(model={type(model).__name__}): not a model this accelerator prepared; pass the model "
                "`accelerator.prepare(model, ...)` returned (with several processes it is the DDP-wrapped one)"
            )
        if int(accelerator.num_processes) > 1 and not ddp:
            raise ValueError(
                f"{name}(model={type(model).__name__}): with {accelerator.num_processes} processes pass the "
                "DistributedDataParallel model accelerator.prepare returned, not the module inside it (the tracker "
                "must switch its gradient sync)"
            )
        inner = _inner_optimizer(accelerator, optimizer, name)
        ga = int(accelerator.gradient_accumulation_steps)
        if accumulation_steps is None:
            accumulation_steps = ga
        elif accumulation_steps != ga:
            raise ValueError(
                f"{name}(accumulation_steps={accumulation_steps!r}): the accelerator was built with "
                f"gradient_accumulation_steps={ga}; the tracker starts from it (leave accumulation_steps unset, or "
                "build the Accelerator with the starting value)"
            )
        scheduler, per_step = _scheduler(accelerator, lr_scheduler, inner, name)

        self.accelerator = accelerator
        self._inner_optimizer = inner
        self._accelerated_scheduler = lr_scheduler if scheduler is not lr_scheduler else None
        # the microbatch accumulate() holds open (step() may close it)
        self._open: ExitStack | None = None
        self._check_position = False  # the first microbatch after load_state_dict compares the loader's position
        state = accelerator.gradient_state
        self._saved_plugin = {
            k: state.plugin_kwargs.get(k) for k in ("num_steps", "sync_with_dataloader")
        }
        scaler = getattr(accelerator, "scaler", None)
        super().__init__(
            model,
            inner,
            accumulation_steps=accumulation_steps,
            grad_scaler=scaler,
            lr_scheduler=scheduler,
            **kwargs,
        )
        # from here on the tracker owns the window: Accelerate's end-of-dataloader sync would cut it
        state.plugin_kwargs["sync_with_dataloader"] = False
        accelerator.gradient_accumulation_steps = self.accumulation_steps
        self._split_batches = None
        if self._accelerated_scheduler is not None:
            # the inner scheduler is stepped once per sync call; the timer gives it `per_step` steps
            # per starting-batch step (Accelerate's num_processes steps per call), see _owe
            self._split_batches = self._accelerated_scheduler.split_batches
            self._accelerated_scheduler.split_batches = True
        timer = self.session.timer
        if timer is not None and per_step != 1:
            owe = timer.owe
            timer.owe = lambda steps: owe(int(steps) * per_step)  # type: ignore[method-assign]
        self._scheduler_steps_per_starting_step = per_step
        self._step_hook = (
            inner.register_step_pre_hook(self._before_optimizer_step) if inner is not None else None
        )
        if checkpoint:
            accelerator.register_for_checkpointing(self)

    # ------------------------------------------------------------------ the loop
    @contextmanager
    def accumulate(
        self, size: float | int | torch.Tensor | None = None, *, labels: torch.Tensor | None = None
    ) -> Iterator[None]:
        """One microbatch: ``accelerator.accumulate(model)`` with the counter set from the tracker's window.

        Wrap each microbatch's forward, ``accelerator.backward`` and the (conditional) optimizer and
        scheduler calls, as ``accelerator.accumulate(model)`` would. :meth:`step` may be called inside
        it on the window's last microbatch (where ``accelerator.sync_gradients`` is true). ``size`` /
        ``labels``: the microbatch's units, as in :meth:`~cbs_tracker.core.loop.LoopTracker.microbatch`
        (for a Hugging Face causal LM, whose loss shifts the labels, pass ``labels=batch["labels"][..., 1:]``).

        Raises:
            RuntimeError: the previous window's last microbatch ran without :meth:`step`; Accelerate's
                counter was moved by something else (an ``accelerator.accumulate`` nested in this one).
        """
        name = type(self).__name__
        if self._in_microbatch:
            raise RuntimeError(f"{name}.accumulate(): microbatches cannot be nested")
        if self._window_index >= self._window_divisor:
            raise RuntimeError(
                f"{name}.accumulate(): the window's {self._window_divisor} microbatches ran but tracker.step() was "
                "not called; call it inside `if accelerator.sync_gradients:` after accelerator.backward(loss), "
                "before clipping and optimizer.step()"
            )
        if self._check_position:
            self._check_position = False
            self._check_resumed_data()
        with ExitStack() as stack:
            stack.enter_context(super().microbatch(size, labels=labels))
            self._open = stack
            try:
                yield
            finally:
                self._open = None

    def microbatch(
        self, size: float | int | torch.Tensor | None = None, *, labels: torch.Tensor | None = None
    ) -> AbstractContextManager[None]:
        """The same as :meth:`accumulate` (the plain loop's name)."""
        return self.accumulate(size, labels=labels)

    def step(self) -> Any:
        """Measure the window that just ran its last backward; call before clipping and ``optimizer.step()``.

        Inside :meth:`accumulate` it must be the window's last microbatch (``accelerator.sync_gradients``
        true) and after ``accelerator.backward``: the microbatch is closed here. See
        :meth:`~cbs_tracker.core.loop.LoopTracker.step`.

        Raises:
            RuntimeError: inside a microbatch that is not the window's last; and as ``LoopTracker.step``.
        """
        if self._open is not None:
            index = self._window_index
            if index < self._window_divisor - 1:
                raise RuntimeError(
                    f"{type(self).__name__}.step(): called in microbatch {index + 1} of the window's "
                    f"{self._window_divisor}; call it only where accelerator.sync_gradients is True (the last)"
                )
            stack, self._open = self._open, None
            stack.close()  # ends the microbatch: its norms are in the window
        return super().step()

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the gradients after :meth:`step`, reusing its norm; unscales fp16 gradients first.

        ``accelerator.clip_grad_norm_(model.parameters(), max_norm)`` works as well (it computes the
        norm again). See :meth:`~cbs_tracker.core.loop.LoopTracker.clip_grad_norm_`.
        """
        if self._grads_still_scaled() and self._scaler_on():
            self.accelerator.unscale_gradients(self.optimizer)
        return super().clip_grad_norm_(
            max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )

    # ------------------------------------------------------------------ adapter points
    def _sync_context(self, last: bool) -> AbstractContextManager[Any]:
        return self._accelerate(last)

    @contextmanager
    def _accelerate(self, last: bool) -> Iterator[None]:
        acc, name = self.accelerator, type(self).__name__
        state = acc.gradient_state
        index = self._window_index
        if index == 0:
            acc.step = 0  # a window starts: Accelerate's counter starts with it
        elif acc.step != index:
            raise RuntimeError(
                f"{name}: Accelerate's counter (accelerator.step={acc.step}) disagrees with the window (microbatch "
                f"{index + 1} of {self._window_divisor}): something else advanced it; do not nest "
                "accelerator.accumulate(model) in tracker.accumulate() (it enters it itself)"
            )
        acc.gradient_accumulation_steps = self._window_divisor
        state.plugin_kwargs["sync_with_dataloader"] = False
        with acc.accumulate(self.model):
            if bool(acc.sync_gradients) != last:
                raise RuntimeError(
                    f"{name}: internal error, accelerator.sync_gradients={acc.sync_gradients} on microbatch "
                    f"{index + 1} of {self._window_divisor}"
                )
            if not last and state.end_of_dataloader:
                self.session.warn_once(
                    "accelerate_loader_end",
                    f"{name}: the data loader ended in microbatch {index + 1} of a window of {self._window_divisor}. "
                    "The window is not cut there (Accelerate's end-of-dataloader sync is off while tracked): it "
                    "continues with the next batches the loop fetches (the next epoch's). A loop that stops at the "
                    "loader's end leaves this window's microbatches without an optimizer step.",
                )
            yield

    def _unsynced(self, last: bool) -> bool:
        if not self._ddp:
            return super()._unsynced(last)
        # accelerator.accumulate() skips the sync (DDP no_sync) on every microbatch but the last,
        # unless the plugin's sync_each_batch asks for a sync on every one
        each = bool(self.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False))
        return not last and not each

    def _scaler_on(self) -> bool:
        scaler = self.grad_scaler
        return scaler is not None and bool(getattr(scaler, "is_enabled", lambda: True)())

    def _loss_scale(self) -> torch.Tensor | None:
        # not unscaled here: accelerator.clip_grad_norm_ unscales (a second unscale_ would raise)
        return loss_scale(self.grad_scaler) if self._scaler_on() else None

    def _grads_still_scaled(self) -> bool:
        if not self._scaler_on() or self.optimizer is None:
            return False
        states = getattr(self.grad_scaler, "_per_optimizer_states", {})
        stage = states.get(id(self.optimizer), {}).get("stage")
        return stage is None or getattr(stage, "name", "") == "READY"

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """A step pre-hook on the optimizer: stop a step on a window :meth:`step` has not measured."""
        if optimizer is not self._inner_optimizer or not (
            self._in_microbatch or self._window_index > 0
        ):
            return
        name = type(self).__name__
        last_open = self._in_microbatch and self._window_index == self._window_divisor - 1
        if last_open or self._window_index >= self._window_divisor:
            raise RuntimeError(
                f"{name}: optimizer.step() ran before tracker.step() for this window; call tracker.step() "
                "inside `if accelerator.sync_gradients:` right after accelerator.backward(loss), before clipping"
            )
        raise RuntimeError(
            f"{name}: the optimizer stepped in microbatch {self._window_index + int(self._in_microbatch)} of a window of "
            f"{self._window_divisor}; step the optimizer accelerator.prepare returned (it steps only where "
            "accelerator.sync_gradients is True)"
        )

    # ------------------------------------------------------------------ state
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (``accelerator.load_state`` calls it); between windows.

        After it, start the data at :meth:`resume_position`: ``starting_epoch, resume_step =
        divmod(tracker.resume_position(), len(train_dataloader))`` and
        ``accelerator.skip_first_batches(train_dataloader, resume_step)``. The first microbatch
        after it compares the position of the loader it comes from with the checkpoint's and
        warns once when they differ.
        """
        state = dict(state)
        extra = state.pop(_STATE_KEY, None) or {}  # the data position of the first release of this adapter
        if "microbatches_seen" not in state and "microbatches_seen" in extra:
            state["microbatches_seen"] = int(extra["microbatches_seen"])
        super().load_state_dict(state)
        self.accelerator.gradient_accumulation_steps = self.accumulation_steps
        self._check_position = True

    def _check_resumed_data(self) -> None:
        """Warn once when the loader the loop resumed with starts elsewhere than the checkpoint's data position."""
        loader = getattr(self.accelerator.gradient_state, "active_dataloader", None)
        position = _loader_position(loader)
        if position is None:
            return
        skip, total = position
        expected_total = self.resume_position()
        expected = expected_total % total
        name = type(self).__name__
        if expected > 0 and _draws_a_new_order(loader):
            self.session.warn_once(
                "resume_order",
                f"{name}: resumed inside an epoch ({expected} of its {total} loader batches run before the "
                "checkpoint) with a loader whose RandomSampler draws the epoch's order from the random state it "
                "finds (Accelerate's default sampler): the resumed epoch is a new permutation, so some samples "
                "trained before the checkpoint are trained again and others of the epoch never are, whatever "
                "batches are skipped. Build the Accelerator with "
                "`dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True)` (from accelerate.utils), "
                "whose sampler draws each epoch from its seed and is saved with accelerator.save_state, and call "
                "`active_dataloader.set_epoch(epoch)` at each epoch's start (a resumed process counts the loader's "
                "epochs from 0).",
            )
        if skip == expected:
            return
        differ = (f"{expected - skip} loader batches before it run a second time" if skip < expected else
                  f"{skip - expected} loader batches are skipped")
        differ += " (if the epoch is the same)"
        if skip == 0 and expected > 0:
            # run_clm_no_trainer's `epoch_{i}` resume starts the next epoch at its first batch
            differ += (f"; if the loop started the next epoch (run_clm_no_trainer's resume from `epoch_{{i}}`), "
                       f"the last {total - expected} loader batches of the checkpoint's epoch are never trained")
        self.session.warn_once(
            "resume_data",
            f"{name}: resumed with the data loader starting at batch {skip} of its epoch of {total}, but the "
            f"checkpoint's windows had run {expected_total} loader batches on this process, up to batch {expected} "
            f"of an epoch: {differ}. A count of optimizer steps times the starting "
            "accumulation (run_clm_no_trainer's `resume_step = step * gradient_accumulation_steps`) is not the data "
            "position once the batch has grown, nor is an epoch's end inside a window. Resume the data at "
            "`starting_epoch, resume_step = divmod(tracker.resume_position(), len(train_dataloader))` and "
            "`accelerator.skip_first_batches(train_dataloader, resume_step)`.",
        )

    def remove_hooks(self) -> None:
        """Detach from the model, the scheduler, the optimizer and Accelerate's settings (restored)."""
        super().remove_hooks()
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        if self._accelerated_scheduler is not None and self._split_batches is not None:
            self._accelerated_scheduler.split_batches = self._split_batches
            self._split_batches = None
        kwargs = self.accelerator.gradient_state.plugin_kwargs
        for key, value in self._saved_plugin.items():
            if value is None:
                kwargs.pop(key, None)
            else:
                kwargs[key] = value

    @property
    def scheduler_steps_per_starting_batch_step(self) -> int:
        """Scheduler steps per optimizer step of the starting batch (Accelerate's ``num_processes``
        for a prepared scheduler unless ``split_batches``; 1 for a plain one)."""
        return self._scheduler_steps_per_starting_step


def _loader_position(loader: Any) -> tuple[int, int] | None:
    """``(batches it skips at its start, batches of its whole epoch)`` of an Accelerate loader (what
    ``accelerator.skip_first_batches`` builds), or ``None`` when that is not known."""
    if loader is None:
        return None
    try:
        for sampler in (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None)):
            inner = getattr(sampler, "batch_sampler", None)
            if isinstance(getattr(sampler, "skip_batches", None), int) and inner is not None:
                return int(sampler.skip_batches), len(inner)
        skip = getattr(loader, "skip_batches", 0)
        skip = skip if isinstance(skip, int) and not isinstance(skip, bool) else 0
        length = len(loader)
        total = length + skip if type(loader).__name__ == "SkipDataLoader" else length
    except TypeError:  # no length (an iterable dataset)
        return None
    return (skip, total) if total > 0 else None


def _draws_a_new_order(loader: Any) -> bool:
    """The loader shuffles with a ``RandomSampler`` that is not Accelerate's ``SeedableRandomSampler``: its
    order comes from the generator state it finds at the epoch's start, which a resume does not reproduce."""
    from torch.utils.data import RandomSampler

    seen: set[int] = set()
    todo = [loader]
    while todo:
        obj = todo.pop()
        if obj is None or id(obj) in seen or len(seen) > 16:
            continue
        seen.add(id(obj))
        if isinstance(obj, RandomSampler):
            return type(obj).__name__ != "SeedableRandomSampler"
        for attr in ("batch_sampler", "sampler", "base_dataloader"):
            todo.append(getattr(obj, attr, None))
    return False


def _check_accelerator(accelerator: Any, name: str) -> None:
    if not all(
        hasattr(accelerator, a) for a in ("gradient_state", "accumulate", "backward", "_models")
    ):
        raise TypeError(
            f"{name}(accelerator={type(accelerator).__name__}): expected an accelerate.Accelerator"
        )
    kind = getattr(
        getattr(accelerator, "distributed_type", None), "name", str(accelerator.distributed_type)
    )
    if kind in _REFUSED:
        raise RuntimeError(
            f"{name}(accelerator=<distributed_type={kind}>): not supported: {_REFUSED[kind]}, so the per-microbatch "
            "gradients or the accumulation are not the tracker's. Use DDP (multi-GPU/multi-CPU) or one process."
        )
    config = getattr(accelerator, "parallelism_config", None)
    sharded = (
        {d: getattr(config, f"{d}_size", 1) for d in ("tp", "cp", "sp")}
        if config is not None
        else {}
    )
    sharded = {k: v for k, v in sharded.items() if isinstance(v, int) and v > 1}
    if sharded:
        raise RuntimeError(
            f"{name}(accelerator=<parallelism_config {sharded}>): only data-parallel processes may multiply the "
            "batch, and sharded parameters hide the per-microbatch gradients"
        )


def _inner_optimizer(accelerator: Any, optimizer: Any, name: str) -> Any:
    """The torch optimizer inside the prepared one (the tracker couples and times its param groups)."""
    if optimizer is None:
        return None
    inner = getattr(optimizer, "optimizer", None)
    if not hasattr(optimizer, "gradient_state") or not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(
            f"{name}(optimizer={type(optimizer).__name__}): expected the optimizer accelerator.prepare returned "
            "(an AcceleratedOptimizer), or None to measure only"
        )
    if not any(o is optimizer for o in accelerator._optimizers):
        raise ValueError(
            f"{name}(optimizer={type(inner).__name__}): not an optimizer this accelerator prepared; pass the one "
            "`accelerator.prepare(..., optimizer, ...)` returned"
        )
    return inner


def _scheduler(accelerator: Any, scheduler: Any, inner: Any, name: str) -> tuple[Any, int]:
    """The torch scheduler the tracker times, and its steps per starting-batch step."""
    if scheduler is None:
        return None, 1
    if inner is None:
        raise ValueError(
            f"{name}(lr_scheduler={type(scheduler).__name__}, optimizer=None): a scheduler needs the optimizer"
        )
    from accelerate.scheduler import AcceleratedScheduler

    if not isinstance(scheduler, AcceleratedScheduler):
        return scheduler, 1  # a plain one, stepped by the loop once per optimizer step
    wrapped = scheduler.scheduler
    if not any(s is scheduler for s in accelerator._schedulers):
        raise ValueError(
            f"{name}(lr_scheduler=AcceleratedScheduler): not a scheduler this accelerator prepared"
        )
    if not scheduler.step_with_optimizer:
        raise ValueError(
            f"{name}(lr_scheduler=AcceleratedScheduler(step_with_optimizer=False)): the accelerator was built with "
            "step_scheduler_with_optimizer=False, so the scheduler steps on every call, counting microbatches, not "
            "optimizer steps; build it with the default (True), or pass the plain scheduler and step it once per "
            "optimizer step"
        )
    if getattr(wrapped, "optimizer", None) is not inner:
        raise ValueError(
            f"{name}(lr_scheduler={type(wrapped).__name__}): the scheduler drives another optimizer than optimizer="
        )
    steps = 1 if scheduler.split_batches else int(accelerator.num_processes)
    if getattr(wrapped, "total_steps", None) is not None and steps > 1:
        warn_user(
            f"{name}: a {type(wrapped).__name__} with total_steps is stepped {steps} times per starting-batch step "
            "(as Accelerate does); Accelerate's guard against stepping past total_steps is not applied")
    return wrapped, steps
