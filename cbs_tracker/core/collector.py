"""Per-microbatch and per-step squared gradient norms from parameter hooks (torch, no collectives).

A hook on each parameter sees that microbatch's local gradient (before it is added
into ``.grad`` and before DDP's all-reduce) and only files it into a bucket per
device and dtype; one fused ``torch._foreach_norm`` per bucket runs when the bucket
is full, when the backward ends and when the microbatch ends. A microbatch whose
gradients all land in empty ``.grad`` slots without a sync (a window's first one,
when the adapter says nothing syncs in it) needs no hook work at all: its norms are
read from ``.grad`` when it ends. Nothing is copied to the host on an accelerator:
the numbers stay on the device until the tracker reduces them once per optimizer
step, still carrying the loss factors (``1/A``, the AMP loss scale).
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# (param, local gradient) -> gradient to measure (e.g. Adam-preconditioned), or None to skip
GradTransform = Callable[[nn.Parameter, torch.Tensor], "torch.Tensor | None"]

_HOST_ZERO = torch.zeros((), dtype=torch.float32)
_INT64 = torch.int64
_TENSOR = torch.Tensor


class LabelCount:
    """A microbatch size still to be counted: its labels' tokens (``labels != ignore_index``),
    counted when the window reduces, all of the window's microbatches at once (a window the
    cadence does not measure runs no operator per microbatch). The labels' version is kept:
    labels changed in place before the count are noticed (:attr:`GradStatsCollector.labels_changed`)."""

    __slots__ = ("labels", "ignore_index", "version")

    def __init__(self, labels: torch.Tensor, ignore_index: int) -> None:
        self.labels, self.ignore_index, self.version = labels, ignore_index, labels._version

    def count(self) -> torch.Tensor:
        # (ne and count_nonzero as methods: a little cheaper on the host, where this runs after a backward)
        return self.labels.ne(self.ignore_index).count_nonzero()

class HostCopy:
    """A window's label counts on their way to the host: counted on the device, copied without a wait.

    On CUDA the int64 counts are copied with ``non_blocking=True`` into pinned host memory and an
    event is recorded after the copy; :meth:`ready` asks the event (no wait), :meth:`sizes` reads the
    host memory through a NumPy view (no tensor read), waiting on the event only if the copy has not
    finished. The stand-in on the CPU (a collector told to read as an accelerator does,
    ``read_each_on_cpu = False``) copies into host memory at once: ready when made.

    ``template``: the window's sizes in order, a host number where the loop gave one, ``None`` where a
    count of ``counts`` takes its place.
    """

    __slots__ = ("_array", "_host", "_event", "_template")

    def __init__(self, counts: torch.Tensor, template: list[float | None]) -> None:
        import numpy as np

        self._template = template
        self._event: Any = None
        if counts.device.type == "cuda":
            host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            host.copy_(counts, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            self._array = host.numpy()  # a view of the pinned memory: read once the event has passed
        else:
            self._array = np.empty(counts.shape, dtype=np.int64)
            host = torch.from_numpy(self._array)
            host.copy_(counts)
        self._host = host  # (kept alive until the copy into it has finished)

    def ready(self) -> bool:
        """The copy has reached the host (never waits)."""
        return self._event is None or bool(self._event.query())

    def wait(self) -> None:
        """Wait for the copy (a host synchronisation with the device's stream, if it has not finished)."""
        if self._event is not None:
            self._event.synchronize()

    def sizes(self) -> list[float]:
        """The window's sizes as host floats, in order (waits first unless :meth:`ready`)."""
        if not self.ready():
            self.wait()
        counts = iter(self._array.tolist())
        return [float(next(counts)) if v is None else v for v in self._template]


def count_labels(items: Sequence[LabelCount]) -> torch.Tensor:
    """``labels != ignore_index`` counted for each of ``items`` on their device, as one int64 vector: three
    operators for labels of one shape and dtype (stacked), else two per microbatch and a stack."""
    first = items[0].labels
    same = all(v.labels.shape == first.shape and v.labels.dtype == first.dtype for v in items)
    if same and first.numel() > 0:
        stacked = torch.stack([v.labels for v in items])
        return stacked.ne(items[0].ignore_index).reshape(len(items), -1).sum(1)
    return torch.stack([v.count() for v in items])


#: Default bucket bound, as a fraction of one copy of the hooked gradients.
BUCKET_FRACTION = 1 / 8
#: Default bucket bound in bytes, whatever the model size.
MAX_BUCKET_BYTES = 128 * 2**20
#: Default bucket bound at least (a small model's gradients fit one bucket: one norm per backward,
#: not one per eighth of it, for a few MiB held).
MIN_BUCKET_BYTES = 8 * 2**20

_NORM_DTYPE = {
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
    torch.float32: torch.float32,
    torch.float64: torch.float64,
}


@dataclass(frozen=True)
class StepStats:
    """One optimizer step's norms after the DP reduction, on one scale, as host numbers.

    Attributes:
        small_sq_norm: mean over the step's microbatches (all ranks) of ``|g_k|^2``,
            ``g_k`` the microbatch's mean-loss gradient (loss and AMP scale removed).
        big_sq_norm: ``|mean_k g_k|^2``, the squared norm of the step's mean gradient.
        num_microbatches: ``K``, microbatches in the step over all DP ranks.
        small_batch: harmonic mean of the microbatch sizes (``B_small``), in the unit.
        big_batch: the effective size of the step's mean gradient (``B_big``), in the unit:
            ``E|mean|^2 = |G|^2 + tr(Sigma)/B_big``. ``K * B_small`` when every microbatch
            carries the same weight (a mean loss divided by the accumulation), the window's
            units when each microbatch's summed loss is divided by the window's units.
        units: plain sum of the microbatch sizes (the step's global batch), in the unit.
        finite: every rank's gradients were finite.
        synced_sq_norm: ``|.grad|^2`` of the synced (and unscaled) step gradient as it
            stands, loss factors still in, over the whole model (shards summed); what
            ``clip_grad_norm_`` would compute. ``nan`` when it was not measured.
        measured: the window's norms were measured on every rank (``False``: a window the
            measuring cadence let pass; only the counts are meaningful).
        proposed_every: the ranks' mean proposal for the measuring cadence.
        own_seconds: host seconds this rank spent in the tracker's measurement of the window
            (hooks, norms, the reduction): what ``measure_every="auto"`` weighs.
    """

    small_sq_norm: float
    big_sq_norm: float
    num_microbatches: int
    small_batch: float
    big_batch: float
    units: float
    finite: bool
    synced_sq_norm: float = math.nan
    measured: bool = True
    proposed_every: float = math.nan
    own_seconds: float = 0.0

    @classmethod
    def _of(cls, **values: Any) -> StepStats:
        """``StepStats(**values)``, every field given, without the frozen dataclass's ``__setattr__``s
        (a window not measured builds one per step)."""
        stats = object.__new__(cls)
        stats.__dict__.update(values)
        return stats


class AdamPreconditioner:
    """Gradients divided by Adam's ``sqrt(v_hat) + eps`` (Kingma & Ba 2015).

    ``v_hat = exp_avg_sq / (1 - beta2^step)`` is read from the optimizer's state as
    it stands before this step's update (the preconditioner this step's update
    will almost use). Works for ``torch.optim.Adam``/``AdamW`` and any optimizer
    keeping ``exp_avg_sq`` and ``step`` per parameter and ``betas``/``eps`` per group.
    Computed in float32 (float64 for float64 gradients). Call it per parameter, or
    use :meth:`foreach` for a list (a few fused operators for the whole list).

    Args:
        optimizer: the Adam-like optimizer.

    Raises:
        ValueError: if a param group has no ``betas``/``eps`` (not an Adam-like optimizer).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._group_of: dict[int, dict[str, Any]] = {}
        for group in optimizer.param_groups:
            if "betas" not in group or "eps" not in group:
                raise ValueError(
                    f"CBSTracker(preconditioner='adam'): optimizer {type(optimizer).__name__} has a param "
                    "group without 'betas'/'eps'; use an Adam-like optimizer or preconditioner=None"
                )
            for p in group["params"]:
                self._group_of[id(p)] = group
        # id(param) -> (step object, its version, 1 - beta2^step): read once per optimizer step,
        # not once per microbatch (a tensor step is a host read each time).
        self._bias2: dict[int, tuple[Any, int, float]] = {}

    def _state(self, param: nn.Parameter) -> tuple[torch.Tensor, float, float] | None:
        """``(exp_avg_sq, 1 - beta2^step, eps)`` of ``param``, or ``None`` without state yet."""
        state = self.optimizer.state.get(param)
        group = self._group_of.get(id(param))
        if not state or group is None or "exp_avg_sq" not in state:
            return None
        step = state["step"]
        version = step._version if isinstance(step, torch.Tensor) else -1
        cached = self._bias2.get(id(param))
        if cached is not None and cached[0] is step and cached[1] == version and version >= 0:
            bias2 = cached[2]
        else:
            bias2 = 1.0 - group["betas"][1] ** float(step)
            self._bias2[id(param)] = (step, version, bias2)
        exp_avg_sq = state["exp_avg_sq"]
        if hasattr(exp_avg_sq, "to_local"):  # FSDP2: state is sharded like the parameter
            exp_avg_sq = exp_avg_sq.to_local()
        return exp_avg_sq, bias2, float(group["eps"])

    def __call__(self, param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor | None:
        """``grad / (sqrt(v_hat) + eps)`` for one parameter; ``None`` before its first step."""
        st = self._state(param)
        if st is None:
            return None
        exp_avg_sq, bias2, eps = st
        dtype = _norm_dtype(grad.dtype)
        denom = (exp_avg_sq.to(dtype) / bias2).sqrt_().add_(eps)
        return grad.to(dtype) / denom

    def foreach(self, params: list[nn.Parameter], grads: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """:meth:`__call__` for lists on one device with one gradient dtype (fused operators).

        Returns:
            The preconditioned gradients, or ``None`` if any parameter has no state yet.
        """
        states = [self._state(p) for p in params]
        if any(s is None for s in states):
            return None
        dtype = _norm_dtype(grads[0].dtype)
        exps = [s[0] if s[0].dtype == dtype else s[0].to(dtype) for s in states]  # type: ignore[index]
        denom = torch._foreach_div(exps, [s[1] for s in states])  # type: ignore[index]
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, [s[2] for s in states])  # type: ignore[index]
        return list(torch._foreach_div(grads, denom))


def adam_preconditioner(optimizer: torch.optim.Optimizer) -> AdamPreconditioner:
    """The :class:`AdamPreconditioner` of ``optimizer`` (a :data:`GradTransform` with a fused form).

    Raises:
        ValueError: if a param group has no ``betas``/``eps`` (not an Adam-like optimizer).
    """
    return AdamPreconditioner(optimizer)


class GradStatsCollector:
    """Sums the squared norms of per-microbatch local gradients, in buckets, without host syncs.

    Each hook only files the incoming gradient (a reference, no copy) into the
    bucket of its device and dtype. A bucket is reduced by one ``_foreach_norm``
    when adding a gradient would push the gradients held above ``bucket_bytes``,
    at the end of each backward (an autograd-engine callback) and at the end of
    the microbatch; a gradient of ``bucket_bytes`` or more is reduced at once.

    Args:
        params: parameters whose gradients are measured (the ones a hook sees:
            ``ddp.module.parameters()``, or FSDP2's unsharded parameters).
        transform: optional map applied to each gradient before its norm (e.g.
            :func:`adam_preconditioner`; one with a ``foreach(params, grads)``
            method is applied per bucket); a ``None`` result marks the
            microbatch as unmeasurable (e.g. no optimizer state yet).
        register: register hooks on ``params`` now (FSDP2 adapters register later).
        bucket_bytes: most bytes of gradients held at once (``None``: ``BUCKET_FRACTION``
            of the hooked parameters' bytes, kept between ``MIN_BUCKET_BYTES`` and
            ``MAX_BUCKET_BYTES``; ``0``: one norm per gradient, in its hook).

    Raises:
        TypeError: ``bucket_bytes`` is not an int.
        ValueError: ``bucket_bytes`` is negative.
    """

    #: on a CPU, read each tensor size as it is (no copy to save); ``False`` reads them as an accelerator
    #: does, in one copy (tests and the benchmark's operator count stand in for an accelerator so)
    read_each_on_cpu = True

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        *,
        transform: GradTransform | None = None,
        register: bool = True,
        bucket_bytes: int | None = None,
    ) -> None:
        if bucket_bytes is not None:
            if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int):
                raise TypeError(f"GradStatsCollector(bucket_bytes={bucket_bytes!r}): must be None or an int")
            if bucket_bytes < 0:
                raise ValueError(f"GradStatsCollector(bucket_bytes={bucket_bytes!r}): must be >= 0 bytes")
        self.transform = transform
        self._fused_transform = getattr(transform, "foreach", None)
        self._hook_transform = transform if self._fused_transform is None else None
        self._fixed_bucket_bytes = None if bucket_bytes is None else int(bucket_bytes)
        self._limit = 0 if bucket_bytes is None else int(bucket_bytes)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._hooked: set[int] = set()
        self._hooked_params: list[nn.Parameter] = []
        self._fns: list[Callable[[torch.Tensor], None]] = []
        # hooks detached for the windows the cadence does not measure: per hooked parameter,
        # the hook dict taken off it (None: left on, e.g. it holds other hooks too)
        self._detached: list[dict[Any, Any] | None] | None = None
        self._from_grad = False  # this microbatch's norms are read from .grad at its end
        self._param_bytes = 0
        self._lock = threading.Lock()  # hooks of several devices run on several autograd threads
        self._recording = False
        self._passive = False  # a microbatch of a window the cadence does not measure
        self.labels_changed = 0  # labels of this window changed in place before they were counted
        # the last labels counted on the CPU had none ignored: the next are tried with one min() first
        self._dense_labels = True
        self._skipped = False
        self._eager = False  # set after a held gradient was seen modified before its norm
        # the gradients held: (device, dtype) -> [(param, gradient, version if it may become .grad)]
        self._buckets: dict[tuple[torch.device, torch.dtype], list[tuple[nn.Parameter, torch.Tensor, int | None]]] = {}
        self._held_ids: set[int] = set()
        self._held_bytes = 0
        self._callback_queued = False
        # a measured microbatch's hooks only file (see begin_microbatch), into the bucket of this key
        self._fast = False
        self._fast_key: tuple[torch.device, torch.dtype] | None = None
        # the microbatch's partial norms: (device, norm dtype) -> 0-d tensors
        self._norms: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        self._hooks_this_microbatch = 0
        self._micro_sq: list[torch.Tensor] = []
        # sizes given as numbers stay on the host until the step (no copy per microbatch)
        self._micro_size: list[torch.Tensor | float] = []
        self.window_unmeasurable = False
        #: host seconds spent measuring the current window (hooks, norms), since reset_window
        self.own_seconds = 0.0
        #: time the measuring work into :attr:`own_seconds` (``measure_every="auto"`` reads it;
        #: without it no clock is read)
        self.timed = True
        #: hook calls seen by the last finished measured microbatch (0: its backward ran outside
        #: it, or nothing required grad)
        self.hooks_fired_in_last_microbatch = 0
        #: hook calls that arrived outside any microbatch since the last :meth:`reset_window`
        self.hooks_fired_outside = 0
        if register:
            for p in params:
                self.hook(p)

    # ------------------------------------------------------------------ hooks
    def hook(self, param: nn.Parameter) -> None:
        """Register the norm hook on ``param`` once (repeated calls are no-ops)."""
        if not param.requires_grad or id(param) in self._hooked:
            return
        self._hooked.add(id(param))
        self._hooked_params.append(param)
        self._fast_key = None
        self._param_bytes += param.numel() * param.element_size()
        self._limit = self.bucket_bytes
        fn = self._make_hook(param)
        self._fns.append(fn)
        self._handles.append(param.register_hook(fn))
        if self._detached is not None:  # hooked between two measured windows: detached like the others
            self._detached.append(self._take_off(param, self._handles[-1]))

    def hook_all(self, params: Iterable[nn.Parameter]) -> None:
        """:meth:`hook` each of ``params`` not hooked yet (one call for a model's list, every measured window)."""
        hooked = self._hooked
        for p in params:
            if id(p) not in hooked:
                self.hook(p)

    # A window the cadence does not measure, and a measured window's first microbatch read from
    # .grad, need no hook at all: autograd calls into Python for every parameter that has a hook
    # dict, even an empty one (several microseconds each right after a backward), so the dict
    # itself is taken off the parameter (``_backward_hooks = None``, as before any hook was
    # registered) and put back for the next microbatch that needs it. Only a dict that holds
    # nothing but this collector's hook is taken off; a parameter with other hooks keeps them all
    # (ours only counts its calls then). Both happen between backward passes.
    def _take_off(self, param: nn.Parameter, handle: torch.utils.hooks.RemovableHandle) -> dict[Any, Any] | None:
        hooks = param._backward_hooks
        if hooks is None or len(hooks) != 1 or handle.id not in hooks:
            return None
        param._backward_hooks = None
        return hooks

    def _detach_hooks(self) -> None:
        if self._detached is None:
            self._detached = [self._take_off(p, h) for p, h in zip(self._hooked_params, self._handles)]

    def _attach_hooks(self) -> None:
        detached, self._detached = self._detached, None
        if detached is None:
            return
        for i, hooks in enumerate(detached):
            if hooks is None:
                continue
            param = self._hooked_params[i]
            if param._backward_hooks is None:
                param._backward_hooks = hooks
            else:  # someone registered a hook meanwhile: ours joins theirs
                self._handles[i] = param.register_hook(self._fns[i])

    @property
    def hooks_attached(self) -> int:
        """Hooked parameters whose hook autograd calls now (0 for the whole model between measured windows)."""
        if self._detached is None:
            return len(self._handles)
        return sum(d is None for d in self._detached)

    @property
    def bucket_bytes(self) -> int:
        """The most bytes of incoming gradients held at once before their norms are taken."""
        if self._fixed_bucket_bytes is not None:
            return self._fixed_bucket_bytes
        return min(max(int(self._param_bytes * BUCKET_FRACTION), MIN_BUCKET_BYTES), MAX_BUCKET_BYTES)

    @property
    def held_bytes(self) -> int:
        """Bytes of incoming gradients held now, their norms not yet taken (at most :attr:`bucket_bytes`)."""
        return self._held_bytes

    def _make_hook(self, param: nn.Parameter) -> Callable[[torch.Tensor], None]:
        pid = id(param)

        def fn(grad: torch.Tensor) -> None:
            if self._fast and pid not in self._held_ids and param.grad is not None:
                # _file's work where it reduces to filing (see begin_microbatch): autograd adds this
                # gradient into .grad and only reads it, so it is held as it is
                t0 = time.perf_counter() if self.timed else 0.0
                with self._lock:
                    self._hooks_this_microbatch += 1
                    self._hold(self._fast_key, param, grad, None, grad.nbytes)  # type: ignore[arg-type]
                if self.timed:
                    self.own_seconds += time.perf_counter() - t0
                return
            if not self._recording:
                if self._passive:
                    self._hooks_this_microbatch += 1
                else:
                    self.hooks_fired_outside += 1
                return
            if self._from_grad:  # read from .grad when the microbatch ends
                self._hooks_this_microbatch += 1
                return
            if not self.timed:
                with self._lock:
                    self._hooks_this_microbatch += 1
                    self._file(param, grad)
                return
            t0 = time.perf_counter()
            with self._lock:
                self._hooks_this_microbatch += 1
                self._file(param, grad)
            self.own_seconds += time.perf_counter() - t0

        return fn

    def _file(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        g: torch.Tensor | None = grad
        if self._hook_transform is not None:
            g = self._hook_transform(param, grad)
            if g is None:
                self._skipped = True
                return
        nbytes = g.nbytes
        limit = self._limit
        if self._eager or nbytes >= limit:
            self._reduce([param], [g])
            return
        if id(param) in self._held_ids:
            # A second gradient of this parameter in one microbatch: take the held one's norm
            # before autograd accumulates into it (it may have become .grad).
            self._flush()
        elif self._held_bytes + nbytes > limit:
            self._flush()
        version = None
        if g is grad and param.grad is None:
            # Autograd steals an unreferenced gradient into .grad (no copy) and clones a
            # referenced one: hold ``.data`` (shares the storage, no reference to the tensor)
            # and check .grad's version before the norm. With .grad set, autograd adds
            # into it and the incoming tensor is only read, so it is held as it is.
            version = grad._version
            g = grad.data
        self._hold((g.device, g.dtype), param, g, version, nbytes)

    def _hold(self, key: tuple[torch.device, torch.dtype], param: nn.Parameter, g: torch.Tensor,
              version: int | None, nbytes: int) -> None:
        """Put a gradient in the bucket of ``key``; its norm is taken when the backward ends."""
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = []
        bucket.append((param, g, version))
        self._held_ids.add(id(param))
        self._held_bytes += nbytes
        if self._callback_queued:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
            self._callback_queued = True
        except RuntimeError:  # not inside an engine backward: end_microbatch flushes
            pass

    def _backward_end(self) -> None:
        with self._lock:
            self._callback_queued = False
            self._flush()

    def _flush(self) -> None:
        """Take the norms of every held gradient (one ``_foreach_norm`` per bucket)."""
        if not self._held_ids:
            return
        buckets = self._buckets
        self._buckets = {}
        self._held_ids = set()
        self._held_bytes = 0
        for entries in buckets.values():
            params = [e[0] for e in entries]
            grads = [e[1] for e in entries]
            modified = False
            for p, g, v in entries:
                if v is not None and _modified_through_grad(p, g, v):
                    modified = True
                    break
            if modified:
                self._aliasing_detected()
                continue
            self._reduce(params, grads)

    def _aliasing_detected(self) -> None:
        warnings.warn(
            "cbs-tracker: a held gradient was modified in place (through .grad) before its norm was "
            "taken; this window is not measured and the norms are now taken inside each hook",
            RuntimeWarning,
            stacklevel=2,
        )
        self._skipped = True
        self._eager = True
        self._fast = False

    def _reduce(self, params: list[nn.Parameter], grads: list[torch.Tensor]) -> None:
        with torch.no_grad():
            if self._fused_transform is not None:
                out = self._fused_transform(params, grads)
                if out is None:
                    self._skipped = True
                    return
                grads = out
            norm_dtype = _norm_dtype(grads[0].dtype)
            norms = torch._foreach_norm(grads, 2, dtype=norm_dtype)
        self._norms.setdefault((grads[0].device, norm_dtype), []).extend(norms)

    def _reduce_grads(self) -> int:
        """The norms of this microbatch's gradients as they stand in ``.grad`` (empty at its start);
        returns how many parameters have one."""
        found = 0
        groups = _grads_by_device_dtype(self._hooked_params)
        for ps, gs in groups.values():
            found += len(gs)
            if self._hook_transform is not None:  # a fused transform is applied by _reduce
                out = _apply_transform(self._hook_transform, ps, gs)
                if out is None:
                    self._skipped = True
                    return found
                gs = out
            self._reduce(ps, gs)
        if len(groups) == 1 and found == len(self._hooked_params) and self._param_bytes < self._limit \
                and self._hook_transform is None:
            # every gradient of the model on one device and dtype, all of them fit one bucket: the
            # window's later microbatches file their gradients straight into it (the fast hook path)
            self._fast_key = next(iter(groups))
        return found

    def remove(self) -> None:
        """Remove every hook (the model is left as it was)."""
        detached, self._detached = self._detached, None
        for i, h in enumerate(self._handles):
            h.remove()  # a detached dict is not on its parameter any more: it just empties
            param = self._hooked_params[i]
            if (detached is None or detached[i] is None) and param._backward_hooks is not None \
                    and len(param._backward_hooks) == 0:
                param._backward_hooks = None  # no dict left for autograd to call into
        self._handles.clear()
        self._fns.clear()
        self._hooked.clear()
        self._hooked_params.clear()
        self._param_bytes = 0
        self._limit = self.bucket_bytes

    @property
    def num_hooks(self) -> int:
        return len(self._handles)

    # ------------------------------------------------------------------ window
    def begin_microbatch(self, *, unsynced: bool = False, measure: bool = True) -> None:
        """Start recording the hooks of one microbatch's backward.

        Args:
            unsynced: the caller guarantees that no gradient sync or reshard runs in
                this microbatch's backward (one process; DDP under ``no_sync``), so
                each hooked parameter's ``.grad`` ends up as that microbatch's local
                gradient wherever it starts empty. If every hooked ``.grad`` is
                ``None`` now (and none has a post-accumulate-grad hook that could
                change it), the hooks only count and the norms are taken from
                ``.grad`` at :meth:`end_microbatch` (one fused norm per device and
                dtype, nothing held); otherwise the hooks measure as usual.
            measure: ``False`` for a window the measuring cadence lets pass: the hooks are
                taken off the parameters (autograd calls nothing of the tracker) until the
                next measured microbatch, and no norm is taken (the microbatch's size is kept).
        """
        if self._recording or self._passive:
            raise RuntimeError("GradStatsCollector.begin_microbatch: the previous microbatch was not ended")
        self._hooks_this_microbatch = 0
        if not measure:
            self._passive = True
            if self._handles:
                self._detach_hooks()
            return
        t0 = time.perf_counter() if self.timed else 0.0
        # a post-accumulate-grad hook may change .grad before it is read (per-parameter clipping,
        # an optimizer step in backward): those parameters keep the hooks' own checks
        self._from_grad = from_grad = unsynced and not self._eager and all(
            p.grad is None and not getattr(p, "_post_accumulate_grad_hooks", None) for p in self._hooked_params
        )
        # read from .grad, the microbatch needs no hook: autograd's call into Python costs a few
        # microseconds per parameter even for a hook that only counts, so they come off for its
        # backward (the gradients found at its end are what it counts) and back on at its end
        if from_grad:
            if self._handles:
                self._detach_hooks()
        elif self._detached is not None:
            self._attach_hooks()
        # the hooks only file what arrives (no transform, no bucket to cut, nothing that could become
        # .grad unseen) when this window's first microbatch found the model one bucket's worth
        self._fast = not from_grad and self._fast_key is not None and not self._eager
        self._recording = True
        self._norms = {}
        self._skipped = False
        self._hooks_this_microbatch = 0
        if self.timed:
            self.own_seconds += time.perf_counter() - t0

    def pause(self) -> None:
        """A window the cadence does not measure starts: the hooks come off the parameters until the
        next measured microbatch, and its microbatches are only counted (:meth:`count_microbatch`)."""
        if self._recording or self._passive:
            raise RuntimeError("GradStatsCollector.pause: a microbatch was not ended")
        if self._handles:
            self._detach_hooks()

    def count_microbatch(self, size: torch.Tensor | float | LabelCount) -> None:
        """A microbatch of a paused window: its size only (a number, a 0-d tensor or a :class:`LabelCount`)."""
        self._micro_sq.append(_HOST_ZERO)  # a placeholder: a window not measured takes no norm
        self._micro_size.append(size)

    def end_microbatch(self, size: torch.Tensor | float) -> None:
        """Close the microbatch; ``size`` is its loss-contributing units (tokens or samples).

        ``size`` may be a number or a 0-d tensor (left on its device); it is checked
        in :meth:`window_sums`.
        """
        if self._passive:
            self._passive = False  # (the hooks are off: hooks_fired_in_last_microbatch stays the measured one's)
            self._micro_sq.append(_HOST_ZERO)  # a placeholder: a window not measured takes no norm
            self._micro_size.append(size if isinstance(size, torch.Tensor) else float(size))
            return
        t0 = time.perf_counter() if self.timed else 0.0
        with self._lock:
            if self._from_grad:
                self._hooks_this_microbatch = self._reduce_grads()
                if self._detached is not None:  # back on: a backward outside any microbatch is still seen
                    self._attach_hooks()
            self._flush()
            self._recording = False
            self._from_grad = False
            self._fast = False
            self._callback_queued = False
            groups, self._norms = self._norms, {}
        if self._skipped:
            self.window_unmeasurable = True
        self.hooks_fired_in_last_microbatch = self._hooks_this_microbatch
        if not groups:
            # No hook fired (no backward in this microbatch, or no trainable params).
            sq = torch.zeros((), dtype=torch.float32)
        else:
            sq = _sq_total(groups.values())
        self._micro_sq.append(sq)
        self._micro_size.append(size if isinstance(size, torch.Tensor) else float(size))
        if self.timed:
            self.own_seconds += time.perf_counter() - t0

    @property
    def num_microbatches(self) -> int:
        """Microbatches ended in the current window on this rank (whatever their size)."""
        return len(self._micro_sq)

    def microbatch_sq_norms(self) -> list[torch.Tensor]:
        """The window's per-microbatch squared norms (0-d tensors, loss scale still in)."""
        return list(self._micro_sq)

    def window_sums(self, device: torch.device, extra: Sequence[float] = (), *, norms: bool = True) -> torch.Tensor:
        """This rank's window as ``[sum |h_k|^2, K, sum 1/b_k, sum b_k, invalid, sum |h_k|^2/b_k^2, *extra]``, float64 on ``device``.

        ``h_k`` are the hooked gradients as the backward produced them (loss
        division and AMP scale still in), ``b_k`` the sizes given to
        :meth:`end_microbatch`. The first four sums run over the microbatches with
        a valid positive size only: a microbatch of size 0 (every label ignored)
        is left out of all of them alike, so it neither counts as a microbatch
        nor adds a zero norm. ``invalid`` counts the microbatches whose size was
        negative, NaN or infinite (also left out); the caller raises on it after
        its reduction. The last sum serves losses normalised by units (a microbatch's
        hooked gradient proportional to its units). ``extra`` (host numbers) travel to
        the device in the same copy as the sizes given as numbers. ``norms=False``
        (a window not measured) takes no norm: those sums are 0. Checked on the
        device, without a host sync.
        """
        k = len(self._micro_size)
        # one host-to-device copy: the sizes given as numbers, then the caller's numbers
        packed = torch.tensor(
            [0.0 if isinstance(v, torch.Tensor) else v for v in self._micro_size] + [float(x) for x in extra],
            dtype=torch.float64,
        ).to(device)
        tail = packed[k:]
        if k == 0:
            return torch.cat([torch.zeros(6, dtype=torch.float64, device=device), tail])
        if all(not isinstance(v, torch.Tensor) for v in self._micro_size):
            size = packed[:k]
        else:
            size = _stack_float64(
                [v if isinstance(v, torch.Tensor) else packed[i] for i, v in enumerate(self._micro_size)], device
            )
        sq = _stack_float64(self._micro_sq, device) if norms else torch.zeros_like(size)
        ok = (size >= 0) & (size < math.inf)  # finite and >= 0: nan fails both comparisons
        valid = ok & (size > 0)
        inv = size.reciprocal()
        cols = torch.stack([sq, torch.ones_like(size), inv, size, sq * inv * inv], dim=1)
        sums = torch.where(valid.unsqueeze(1), cols, 0.0).sum(0)
        invalid = (~ok).sum(dtype=torch.float64)
        return torch.cat([sums[:4], invalid.reshape(1), sums[4:], tail])

    def host_sizes(self, extra: Sequence[torch.Tensor] = ()) -> tuple[list[float], list[float]]:
        """The window's microbatch sizes as host floats, and ``extra`` (0-d tensors) likewise.

        Sizes given as tensors (and ``extra``) on an accelerator are read in one stack and one
        copy (tokens counted from the labels); on the CPU each is read as it is. What a window the cadence does not measure needs: its counts only.
        """
        if not extra and self.read_each_on_cpu:
            sizes = self._cpu_sizes()
            if sizes is not None:
                return sizes, []
        if any(type(v) is LabelCount for v in self._micro_size):
            self._count_labels()
        tensors = [v for v in self._micro_size if isinstance(v, torch.Tensor)] + list(extra)
        if not tensors:
            return [float(v) for v in self._micro_size], []  # type: ignore[arg-type]
        if len(tensors) == 1 or (self.read_each_on_cpu and all(t.device.type == "cpu" for t in tensors)):
            read = [t.item() for t in tensors]  # no copy to make: a read each is the cheapest
        else:
            read = _read_at_once(tensors)
        it = iter(read)
        sizes = [float(next(it)) if isinstance(v, torch.Tensor) else float(v) for v in self._micro_size]
        return sizes, [float(v) for v in it]

    def deferred_sizes(self) -> HostCopy | None:
        """The window's sizes without a host read, when every one is a host number or ``labels=`` counted
        on a CUDA device (or on the CPU stand-in, :attr:`read_each_on_cpu` off): the labels counted on the
        device and copied to the host without a wait (:class:`HostCopy`). ``None`` otherwise (a size given
        as a tensor is read at once: it may be invalid, and that raises before the optimizer steps)."""
        items: list[LabelCount] = []
        template: list[float | None] = []
        for v in self._micro_size:
            kind = type(v)
            if kind is LabelCount:
                items.append(v)  # type: ignore[arg-type]
                template.append(None)
            elif kind is float or kind is int:
                template.append(float(v))  # type: ignore[arg-type]
            else:
                return None
        if not items:
            return None
        device = items[0].labels.device
        if device.type != "cuda" and not (device.type == "cpu" and not self.read_each_on_cpu):
            return None
        if any(v.labels.device != device for v in items):
            return None
        for v in items:
            if v.labels._version != v.version:
                self.labels_changed += 1
        return HostCopy(count_labels(items), template)

    def _cpu_sizes(self) -> list[float] | None:
        """:meth:`host_sizes` in one loop where every size is a number or lives on the CPU (labels counted
        and read one by one: on the CPU there is no copy to save); ``None`` (nothing counted) otherwise."""
        out: list[float] = []
        changed = self.labels_changed
        for v in self._micro_size:
            kind = type(v)
            if kind is LabelCount:
                labels = v.labels  # type: ignore[union-attr]
                if not labels.is_cpu:
                    break
                if labels._version != v.version:  # type: ignore[union-attr]
                    self.labels_changed += 1
                n = labels.numel()
                # (int64 only: labels != ignore_index compares in the labels' dtype, where -100 may wrap or round)
                if self._dense_labels and n and labels.dtype is _INT64 and labels.min().item() > v.ignore_index:  # type: ignore[union-attr]
                    out.append(float(n))  # no label ignored: the count is the size (one operator, not two)
                else:
                    counted = float(v.count().item())  # type: ignore[union-attr]
                    self._dense_labels = counted == n  # (a window with ignored labels counts them directly)
                    out.append(counted)
            elif kind is float or kind is int:
                out.append(float(v))  # type: ignore[arg-type]
            elif isinstance(v, torch.Tensor) and v.is_cpu:
                out.append(float(v.item()))
            else:
                break
        else:
            return out
        self.labels_changed = changed  # counted again by the general path
        return None

    def _count_labels(self) -> None:
        """Count the labels of the window's :class:`LabelCount` sizes (one operator pair each, run back to
        back); labels changed in place since their microbatch are counted as they are now, and noted."""
        sizes = self._micro_size
        for i, v in enumerate(sizes):
            if isinstance(v, LabelCount):
                if v.labels._version != v.version:
                    self.labels_changed += 1
                sizes[i] = v.count()

    def pulled_window_sums(self, extra: Sequence[torch.Tensor] = ()) -> tuple[list[float], list[float]]:
        """:meth:`host_window_sums` wherever the numbers live, and ``extra`` (0-d or one-element tensors) read
        with them: on an accelerator every norm, size and extra is copied to the host at once (one ``stack``
        per kind of number, one copy), and the sums are host additions, instead of a dozen small launches."""
        sizes = [v for v in self._micro_size if isinstance(v, torch.Tensor)]
        read = _read_at_once(list(self._micro_sq) + sizes + list(extra))
        k = len(self._micro_sq)
        sq, it = read[:k], iter(read[k : k + len(sizes)])
        size_values = [next(it) if isinstance(v, torch.Tensor) else float(v) for v in self._micro_size]
        return _sums(sq, size_values), read[k + len(sizes):]

    def host_window_sums(self) -> list[float] | None:
        """:meth:`window_sums` as Python floats when every value already lives on the host.

        On a CPU there is no device sync to avoid, and a handful of host additions
        costs less than the dozen small tensor operators of :meth:`window_sums`.
        Returns ``None`` when a norm or a size lives on an accelerator.
        """
        sq_values, size_values = [], []
        for sq, size in zip(self._micro_sq, self._micro_size, strict=True):
            if sq.device.type != "cpu":
                return None
            if isinstance(size, torch.Tensor):
                if size.device.type != "cpu":
                    return None
                size = size.item()
            b = float(size)
            size_values.append(b)
            sq_values.append(sq.item() if math.isfinite(b) and b > 0.0 else 0.0)
        return _sums(sq_values, size_values)

    def reset_window(self) -> None:
        self._fast_key = None
        self.labels_changed = 0
        self.own_seconds = 0.0
        self._micro_sq = []
        self._micro_size = []
        self.window_unmeasurable = False
        self.hooks_fired_outside = 0


def _sums(sq: Sequence[float], sizes: Sequence[float]) -> list[float]:
    """``[sum |h_k|^2, K, sum 1/b_k, sum b_k, invalid, sum |h_k|^2/b_k^2]`` over the valid positive sizes."""
    total_sq = count = inv_sum = units = invalid = per_unit_sq = 0.0
    for v, b in zip(sq, sizes, strict=True):
        if not (math.isfinite(b) and b >= 0.0):
            invalid += 1.0
        elif b > 0.0:
            total_sq += v
            count += 1.0
            inv_sum += 1.0 / b
            units += b
            per_unit_sq += v / (b * b)
    return [total_sq, count, inv_sum, units, invalid, per_unit_sq]


def _read_at_once(tensors: list[torch.Tensor]) -> list[float]:
    """The values of one-element tensors as host floats, in order: per device one ``stack`` of the floating
    ones and one of the integer ones, joined as float64 and copied to the host once."""
    out: list[float] = [0.0] * len(tensors)
    by_device: dict[torch.device, tuple[list[int], list[int]]] = {}
    for i, t in enumerate(tensors):
        fl, ints = by_device.setdefault(t.device, ([], []))
        (fl if t.is_floating_point() else ints).append(i)
    for fl, ints in by_device.values():
        order, parts = [], []
        for idx in (fl, ints):
            if idx:
                part = torch.stack([tensors[i] if tensors[i].dim() == 0 else tensors[i].reshape(()) for i in idx])
                parts.append(part if part.dtype == torch.float64 else part.to(torch.float64))
                order += idx
        joined = parts[0] if len(parts) == 1 else torch.cat(parts)
        for i, v in zip(order, joined.tolist(), strict=True):  # one copy to the host
            out[i] = v
    return out


def local_grad_sq_norm(
    params: Iterable[nn.Parameter], transform: GradTransform | None = None
) -> torch.Tensor | None:
    """This rank's ``sum_p |p.grad|^2`` as a 0-d float32/64 tensor (``None`` if no grads).

    A ``DTensor`` gradient (FSDP2) contributes its local shard, so summing the
    result over the shard group gives the global squared norm. With a
    ``transform`` the transformed gradients are measured; a ``None`` from it
    returns ``None`` (unmeasurable step).
    """
    groups = _grads_by_device_dtype(params)
    if not groups:
        return None
    norms = []
    with torch.no_grad():
        for ps, gs in groups.values():
            out = gs if transform is None else _apply_transform(transform, ps, gs)
            if out is None:
                return None
            # one fused pass per device and dtype; float32 so fp16 gradients cannot overflow
            norms.append(torch._foreach_norm(out, 2, dtype=_norm_dtype(out[0].dtype)))
    return _sq_total(norms)


def _grads_by_device_dtype(
    params: Iterable[nn.Parameter],
) -> dict[tuple[torch.device, torch.dtype], tuple[list[nn.Parameter], list[torch.Tensor]]]:
    """The parameters with a ``.grad`` and those gradients (a ``DTensor``'s local shard), per device and dtype."""
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[nn.Parameter], list[torch.Tensor]]] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        if type(g) is not _TENSOR and hasattr(g, "to_local"):  # (a plain tensor has none: no failed lookup)
            g = g.to_local()
        ps, gs = groups.setdefault((g.device, g.dtype), ([], []))
        ps.append(p)
        gs.append(g)
    return groups


def _apply_transform(
    transform: GradTransform, params: list[nn.Parameter], grads: list[torch.Tensor]
) -> list[torch.Tensor] | None:
    """``transform`` over one device's and dtype's gradients (its fused form if it has one); ``None``
    if any gradient cannot be transformed yet."""
    fused = getattr(transform, "foreach", None)
    if fused is not None:
        return fused(params, grads)
    out = [transform(p, g) for p, g in zip(params, grads, strict=True)]
    return None if any(t is None for t in out) else out  # type: ignore[return-value]


def _sq_total(norm_groups: Iterable[list[torch.Tensor]]) -> torch.Tensor:
    """``sum |norm|^2`` over groups of 0-d norms (one stack and one dot per group), promoted across groups."""
    total: torch.Tensor | None = None
    for norms in norm_groups:
        v = torch.stack(list(norms))
        part = torch.dot(v, v)
        if total is None:
            total = part
        else:  # several devices or norm dtypes: rare
            dtype = torch.promote_types(total.dtype, part.dtype)
            total = total.to(dtype) + part.to(total.device, dtype)
    assert total is not None
    return total


def _norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half/bf16/float32 gradients (no overflow), float64 for float64 (no narrowing)."""
    found = _NORM_DTYPE.get(dtype)
    return found if found is not None else torch.promote_types(dtype, torch.float32)


def _modified_through_grad(param: nn.Parameter, held: torch.Tensor, version: int) -> bool:
    """The held gradient became ``param.grad`` (autograd stole it) and was changed in place since."""
    current = param.grad
    return current is not None and current.data_ptr() == held.data_ptr() and current._version != version


def _stack_float64(values: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``values`` (0-d tensors) as one float64 vector on ``device`` (one stack when they agree)."""
    first = values[0]
    if all(v.dtype == first.dtype and v.device == first.device for v in values):
        return torch.stack(values).to(device=device, dtype=torch.float64)
    return torch.stack([v.to(device=device, dtype=torch.float64) for v in values])
