"""The critical batch measured by branches from the run's own state, and ``kappa`` from it.

From a training state (model, optimizer state, learning rate) :func:`measure_critical_batch`
trains short branches at multiples ``k * B`` of the run's batch, each on a deep copy of the
model and optimizer, over the same samples grouped into steps of different size, with the
learning rate coupled as the tracker couples it (``sqrt(k)`` for Adam, ``k`` for SGD), and
evaluates every branch on the caller's fixed held-out set (Merrill et al. 2025, "Critical
Batch Size Revisited"). Replicates over data orders give each loss a standard error; a
control at the run's batch with the largest branch's learning rate keeps a better LR from
passing for an affordable batch. The main run is never touched: its model, optimizer,
gradients and random-number state are as before, so it continues bit for bit.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from cbs_tracker.policy.critical import BranchLosses, CriticalBatchInterval, critical_batch_interval
from cbs_tracker.policy.kappa import KappaSchedule
from cbs_tracker.policy.lr import coupling_factor, resolve_coupling

__all__ = ["CalibrateAt", "Calibration", "calibration_scalars", "CalibrationPoint", "FrozenNoiseScale", "branch_lr_factors",
           "cooldown_factor", "frozen_noise_scale", "measure_critical_batch"]

DEFAULT_MULTIPLES = (0.5, 1.0, 2.0, 4.0, 8.0)
_log = logging.getLogger(__name__)
_OWNER = "measure_critical_batch"


@dataclass(frozen=True)
class FrozenNoiseScale:
    """The noise scale of fixed weights from per-microbatch gradients (McCandlish et al. 2018, App. A).

    Attributes:
        noise_scale: ``tr(Sigma) / |G|^2`` in the microbatch's unit.
        stderr: its standard error over the groups of microbatches.
        preconditioned: the same with every gradient scaled by Adam's preconditioner
            ``P = 1 / (sqrt(v_hat) + eps)`` (``tr(P Sigma P) / |P G|^2``, the noise scale of the
            update direction, as the tracker's ``preconditioner="adam"`` measures it), ``None``
            when the optimizer keeps no second moment.
        preconditioned_stderr: its standard error (``None`` with it).
        microbatches: microbatch gradients taken.
    """

    noise_scale: float
    stderr: float
    preconditioned: float | None
    preconditioned_stderr: float | None
    microbatches: int


@dataclass(frozen=True)
class CalibrationPoint:
    """One branched measurement: the critical batch at ``tokens`` and ``kappa`` from it.

    Attributes:
        tokens: units the run had seen at the branch point.
        batch: the run's global batch there (the branches' ``k = 1``).
        critical: the measured critical batch (interval, comparisons).
        branches: each batch's replicate losses.
        control: the run's batch at the largest branch's LR factor (``None`` if not run).
        start_loss: the held-out loss at the branch point.
        branch_tokens: units each branch trained on.
        total_branch_tokens: units all branches and the control trained on together.
        seconds: wall-clock time of the whole measurement.
        noise_scale: the tracker's reported ``B_simple`` at the branch point (``None``
            without a tracker), with its 90% interval ``noise_scale_low``/``noise_scale_high``.
        frozen: the noise scale measured at the branch point's weights (``None`` if skipped).
        lr_coupling: the coupling the branches used.
        cooldown: the fraction of each branch over which its LR annealed before the evaluation
            (0: none), with ``cooldown_shape``.
    """

    tokens: float
    batch: float
    critical: CriticalBatchInterval
    branches: tuple[BranchLosses, ...]
    control: BranchLosses | None
    start_loss: float
    branch_tokens: float
    total_branch_tokens: float
    seconds: float
    noise_scale: float | None = None
    noise_scale_low: float | None = None
    noise_scale_high: float | None = None
    frozen: FrozenNoiseScale | None = None
    lr_coupling: str = "sqrt"
    cooldown: float = 0.0
    cooldown_shape: str = "sqrt"

    def _ratio(self, value: float | None) -> float | None:
        return None if value is None or not value > 0 else self.critical.low / value

    @property
    def kappa(self) -> float | None:
        """Measured critical batch (the interval's low end) over the tracker's ``B_simple``,
        or over the frozen one without a tracker; a lower bound when the interval is open."""
        return self._ratio(self.noise_scale if self.noise_scale is not None else
                           None if self.frozen is None else self.frozen.noise_scale)

    @property
    def kappa_frozen(self) -> float | None:
        return self._ratio(None if self.frozen is None else self.frozen.noise_scale)

    @property
    def kappa_preconditioned(self) -> float | None:
        return self._ratio(None if self.frozen is None else self.frozen.preconditioned)

    @property
    def lr_effect(self) -> float | None:
        """Control minus the run's batch (nats): negative when the larger LR alone lowers the loss."""
        if self.control is None:
            return None
        base = next((b for b in self.branches if b.batch == self.batch), None)
        return None if base is None else self.control.mean - base.mean

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(kappa=self.kappa, kappa_frozen=self.kappa_frozen,
                   kappa_preconditioned=self.kappa_preconditioned, lr_effect=self.lr_effect)
        out["critical"]["high"] = None if math.isinf(self.critical.high) else self.critical.high
        return out

    def apply_to(self, controller: Any) -> None:
        """Give ``controller`` this point's ``kappa`` (from its tokens on, in place of the constant)."""
        if self.kappa is None:
            raise ValueError("CalibrationPoint.apply_to: no noise scale to divide by (pass tracker= or "
                             "keep frozen_microbatches > 0)")
        controller.add_kappa_point(self.tokens, self.kappa)


@dataclass
class Calibration:
    """Calibration points of one run, in order of tokens."""

    points: list[CalibrationPoint] = field(default_factory=list)

    def kappa_schedule(self, source: str = "tracker") -> KappaSchedule:
        """``kappa`` against tokens for the controller: ``source`` is ``"tracker"`` (the reported
        noise scale, falling back to the frozen one), ``"frozen"`` or ``"preconditioned"``.

        Raises:
            ValueError: an unknown ``source``, or no point has that noise scale.
        """
        attr = {"tracker": "kappa", "frozen": "kappa_frozen", "preconditioned": "kappa_preconditioned"}.get(source)
        if attr is None:
            raise ValueError(f"Calibration.kappa_schedule(source={source!r}): expected 'tracker', 'frozen' "
                             "or 'preconditioned'")
        pts = [(p.tokens, getattr(p, attr)) for p in self.points if getattr(p, attr) is not None]
        if not pts:
            raise ValueError(f"Calibration.kappa_schedule(source={source!r}): no point measured that noise scale")
        return KappaSchedule(pts)

    def batch_schedule(self, start_batch: float) -> list[tuple[float, float]]:
        """``(tokens, global batch)`` marks: from ``start_batch``, double at each point where the
        measured critical batch (its low end) is at least twice the batch (OLMo's recipe).
        ``BatchSchedule(calibration.batch_schedule(B0))`` runs them."""
        if not (isinstance(start_batch, (int, float)) and start_batch > 0):
            raise ValueError(f"Calibration.batch_schedule(start_batch={start_batch!r}): must be a number > 0")
        batch, marks = float(start_batch), [(0.0, float(start_batch))]
        for p in sorted(self.points, key=lambda p: p.tokens):
            grew = False
            while p.critical.low >= 2 * batch:
                batch, grew = 2 * batch, True
            if grew:
                marks.append((p.tokens, batch))
        return marks

    def table(self, unit: str = "tokens") -> str:
        return format_table(self.points, unit=unit)

    def to_json(self) -> str:
        return json.dumps([p.to_dict() for p in self.points], indent=1)


def calibration_scalars(point: CalibrationPoint) -> dict[str, float]:
    """The ``cbs_calibration/`` scalars of one point, to be written at x = ``round(point.tokens)``:
    the critical batch's interval, the noise scales, each ``kappa``, the control's effect and the cost."""
    fz = point.frozen
    values = {
        "critical_batch_low": point.critical.low,
        "critical_batch_high": None if point.critical.lower_bound_only else point.critical.high,
        "resolved": float(point.critical.resolved),
        "noise_scale": point.noise_scale,
        "frozen_noise_scale": None if fz is None else fz.noise_scale,
        "preconditioned_noise_scale": None if fz is None else fz.preconditioned,
        "kappa": point.kappa, "kappa_frozen": point.kappa_frozen, "kappa_preconditioned": point.kappa_preconditioned,
        "lr_control_effect": point.lr_effect,
        "branch_units": point.total_branch_tokens,
    }
    return {f"cbs_calibration/{k}": float(v) for k, v in values.items() if v is not None and math.isfinite(v)}


def _fmt(x: float | None, spec: str = ",.0f") -> str:
    return "-" if x is None else format(x, spec)


def format_table(points: Sequence[CalibrationPoint], *, unit: str = "tokens") -> str:
    """A text table: tokens, critical batch interval, noise scales, kappa, cost."""
    head = (f"{unit:>10} {'batch':>7} {'critical batch':>18} {'B_simple':>9} {'frozen':>9} {'precond':>9} "
            f"{'kappa':>6} {'k_frz':>6} {'k_pre':>6} {'LR ctl':>7} {'branch ' + unit:>14}")
    lines = [head]
    for p in points:
        hi = "inf" if p.critical.lower_bound_only else f"{p.critical.high:,.0f}"
        crit = f"[{p.critical.low:,.0f}, {hi})" + ("" if p.critical.resolved else "?")
        fz = p.frozen
        lines.append(
            f"{p.tokens:>10,.0f} {p.batch:>7,.0f} {crit:>18} {_fmt(p.noise_scale):>9} "
            f"{_fmt(None if fz is None else fz.noise_scale):>9} {_fmt(None if fz is None else fz.preconditioned):>9} "
            f"{_fmt(p.kappa, '.2f'):>6} {_fmt(p.kappa_frozen, '.2f'):>6} {_fmt(p.kappa_preconditioned, '.2f'):>6} "
            f"{_fmt(p.lr_effect, '+.3f'):>7} {p.total_branch_tokens:>14,.0f}")
    lines.append("'?': a comparison not resolved by the replicates (within z=1.64 standard errors of epsilon); "
                 "'inf': every batch passed (a lower bound); LR ctl: the run's batch at the largest branch's LR "
                 "minus the run's batch, nats")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the branches


@contextmanager
def _rng_preserved() -> Iterator[None]:
    """Every random-number state a branch may draw from, restored afterwards."""
    cpu = torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    py = random.getstate()
    try:
        import numpy as np

        np_state: Any = np.random.get_state()
    except ImportError:  # pragma: no cover
        np, np_state = None, None
    try:
        yield
    finally:
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        random.setstate(py)
        if np is not None:
            np.random.set_state(np_state)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under a DDP (or ``torch.compile``) wrapper: branches run locally, without communication."""
    inner = getattr(model, "module", None)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and isinstance(inner, torch.nn.Module):
        return inner
    orig = getattr(model, "_orig_mod", None)
    return orig if isinstance(orig, torch.nn.Module) else model


def branch_copy(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 make_optimizer: Callable[[Iterable[Any]], torch.optim.Optimizer] | None
                 ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A deep copy of the model and of the optimizer's state, sharing no tensor with the run.

    ``Optimizer.load_state_dict`` keeps the tensors it is given, so the state dict is deep-copied
    first: otherwise the branch's steps would move the run's moments in place.
    """
    source = _unwrap(model)
    branch = copy.deepcopy(source)
    mapping = {id(p): q for p, q in zip(source.parameters(), branch.parameters())}
    groups = []
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in mapping]
        if missing:
            raise ValueError(f"{_OWNER}: the optimizer holds {len(missing)} parameter(s) that are not the model's; "
                             "pass the model the optimizer was built for")
        groups.append({**{k: copy.deepcopy(v) for k, v in group.items() if k != "params"},
                       "params": [mapping[id(p)] for p in group["params"]]})
    if make_optimizer is not None:
        branch_opt = make_optimizer(groups)
    else:
        try:
            branch_opt = type(optimizer)(groups)
        except TypeError as exc:
            raise TypeError(f"{_OWNER}: cannot rebuild {type(optimizer).__name__} from its param groups ({exc}); "
                            "pass make_optimizer=lambda param_groups: MyOptimizer(param_groups, ...)") from exc
    branch_opt.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for p in branch.parameters():
        p.grad = None  # the deep copy keeps each submodule's train/eval flag as the run has it
    return branch, branch_opt


def _fuse(items: list[Any]) -> Any:
    """Concatenate microbatches along their first dimension (tensors, or tuples/lists/dicts of them)."""
    first = items[0]
    if len(items) == 1:
        return first
    if isinstance(first, torch.Tensor):
        return torch.cat(items)
    if isinstance(first, (tuple, list)):
        return type(first)(_fuse([it[i] for it in items]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _fuse([it[k] for it in items]) for k in first}
    raise TypeError(f"{_OWNER}(fuse_microbatches>1): cannot concatenate a microbatch of type {type(first).__name__}")


def _group_lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    return [float(g["lr"]) for g in optimizer.param_groups]


def _run_branch(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, loss_fn: Callable[[Any, Any], Any],
                microbatches: Iterator[Any], steps: int, accumulation: int, fuse: int, lr_at: Callable[[int], float],
                base_lrs: list[float], clip: float | None) -> None:
    """``steps`` optimizer steps of ``accumulation`` microbatches each (``fuse`` concatenated per forward)."""
    calls = accumulation // fuse
    for step in range(steps):
        factor = lr_at(step)
        for group, lr in zip(optimizer.param_groups, base_lrs):
            group["lr"] = lr * factor
        for _ in range(calls):
            try:
                batch = _fuse([next(microbatches) for _ in range(fuse)])
            except StopIteration:
                raise ValueError(f"{_OWNER}: the data ran out during a branch; data(replicate) must give at "
                                 "least branch_tokens / microbatch_size microbatches") from None
            loss = loss_fn(model, batch)
            (loss / calls).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _flat_grad(params: list[torch.Tensor], loss: torch.Tensor) -> torch.Tensor:
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1).double() for p, g in zip(params, grads)])


def _preconditioner(params: list[torch.Tensor], optimizer: torch.optim.Optimizer,
                    originals: list[torch.Tensor]) -> torch.Tensor | None:
    """Adam's ``1 / (sqrt(v_hat) + eps)`` per coordinate, flattened like the gradients (``None``: no second moment)."""
    where = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    parts = []
    for p in originals:
        state, group = optimizer.state.get(p, {}), where.get(id(p))
        v = state.get("exp_avg_sq")
        if v is None or group is None or "betas" not in group:
            return None
        step = float(state.get("step", 0))
        if step <= 0:
            return None
        beta2, eps = group["betas"][1], group.get("eps", 1e-8)
        v_hat = v.detach().double() / (1.0 - beta2 ** step)
        parts.append((1.0 / (v_hat.sqrt() + eps)).reshape(-1))
    return torch.cat(parts).to(params[0].device)


def _ratio_and_stderr(gs: list[float], ts: list[float]) -> tuple[float, float]:
    n = len(gs)
    mg, mt = sum(gs) / n, sum(ts) / n
    vg = sum((x - mg) ** 2 for x in gs) / (n - 1) / n
    vt = sum((x - mt) ** 2 for x in ts) / (n - 1) / n
    cgt = sum((x - mg) * (y - mt) for x, y in zip(gs, ts)) / (n - 1) / n
    if mg == 0:
        return math.inf, math.inf
    ratio = mt / mg
    rel = vt / mt**2 + vg / mg**2 - 2 * cgt / (mt * mg) if mt else 0.0
    return ratio, abs(ratio) * math.sqrt(max(rel, 0.0))


def frozen_noise_scale(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
                       loss_fn: Callable[[Any, Any], Any], microbatches: Iterator[Any], microbatch_size: float,
                       count: int = 32, group: int = 4) -> FrozenNoiseScale:
    """Measure ``B_simple`` (raw and Adam-preconditioned) of ``model``'s current weights, changing nothing.

    ``count`` microbatch gradients (float64, through ``autograd.grad``) in groups of ``group``;
    each group's two batch sizes (``b`` and ``group * b``) give unbiased ``|G|^2`` and
    ``tr(Sigma)``; the ratio of their means over the groups is the noise scale.
    """
    if isinstance(group, bool) or not isinstance(group, int) or group < 2 or count < 2 * group:
        raise ValueError(f"frozen_noise_scale(count={count!r}, group={group!r}): need group >= 2 and count >= "
                         "2 * group (two groups at least, for a standard error)")
    source = _unwrap(model)
    originals = [p for p in source.parameters() if p.requires_grad]
    pre = None if optimizer is None else _preconditioner(originals, optimizer, originals)
    b = float(microbatch_size)
    raw_g: list[float] = []
    raw_t: list[float] = []
    pre_g: list[float] = []
    pre_t: list[float] = []
    for _ in range(count // group):
        total = total_p = None
        small = small_p = 0.0
        for _ in range(group):
            try:
                batch = next(microbatches)
            except StopIteration:
                raise ValueError("frozen_noise_scale: the data ran out; give at least count microbatches") from None
            g = _flat_grad(originals, loss_fn(source, batch))
            small += float(g @ g) / group
            total = g if total is None else total + g
            if pre is not None:
                pg = pre * g
                small_p += float(pg @ pg) / group
        big = float(total @ total) / group**2  # type: ignore[operator]
        raw_g.append((group * big - small) / (group - 1))
        raw_t.append((small - big) / (1.0 / b - 1.0 / (group * b)))
        if pre is not None:
            total_p = pre * total  # type: ignore[operator]
            big_p = float(total_p @ total_p) / group**2
            pre_g.append((group * big_p - small_p) / (group - 1))
            pre_t.append((small_p - big_p) / (1.0 / b - 1.0 / (group * b)))
    ns, se = _ratio_and_stderr(raw_g, raw_t)
    pns, pse = _ratio_and_stderr(pre_g, pre_t) if pre is not None else (None, None)
    return FrozenNoiseScale(ns, se, pns, pse, (count // group) * group)


def _check(name: str, value: Any, *, positive: bool = True, integer: bool = False, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    kind = "an int" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise TypeError(f"{_OWNER}({name}={value!r}): expected {kind}")
    if not math.isfinite(value) or (value <= 0 if positive else value < 0):
        raise ValueError(f"{_OWNER}({name}={value!r}): must be finite and {'> 0' if positive else '>= 0'}")


def _next_window(tracker: Any) -> tuple[float | None, float]:
    """The global batch of the tracker's next window, and the LR factor that window will run at
    relative to the LR in the optimizer now (a doubling decided but not yet applied raises it).

    Both sides count the loader's batches per rank: ``rec.accumulation_steps`` (what ran) and the
    session's level (a pending change first), so joined microbatches need no special case.
    """
    rec = getattr(tracker, "last_record", None)
    session = getattr(tracker, "session", None)
    if rec is None:
        return None, 1.0
    if session is None or not rec.accumulation_steps:
        return rec.global_batch, 1.0
    pending = getattr(session, "pending_accumulation", None)
    level = session.accumulation_steps
    nxt = pending if pending is not None else level
    batch = rec.global_batch if nxt == rec.accumulation_steps else rec.global_batch * nxt / rec.accumulation_steps
    factor = 1.0
    if nxt != level and getattr(session, "coupling", 0) > 0:
        factor = coupling_factor(session.coupling_mode, nxt / session.starting_accumulation) / session.coupling
    return batch, factor


class CalibrateAt:
    """Calibrate at token marks during a run (the framework callbacks' engine).

    Args:
        marks: units seen at which to calibrate (each at the first step boundary at or after it).
        apply: give each point's ``kappa`` to the tracker's controller.
        **measure: the arguments of :func:`measure_critical_batch` (``loss_fn``, ``data``,
            ``evaluate``, ``microbatch_size``, ``branch_tokens``, ...).
    """

    def __init__(self, marks: Sequence[float], *, apply: bool = True, **measure: Any) -> None:
        try:
            self.marks = sorted(float(m) for m in marks)
        except (TypeError, ValueError):
            raise TypeError(f"calibrate marks={marks!r}: expected a sequence of token counts") from None
        if not self.marks or any(not (math.isfinite(m) and m >= 0) for m in self.marks):
            raise ValueError(f"calibrate marks={marks!r}: expected one or more finite token counts >= 0")
        import inspect

        allowed = set(inspect.signature(measure_critical_batch).parameters) - {"model", "optimizer", "tracker"}
        unknown = sorted(set(measure) - allowed)
        if unknown:
            raise TypeError(f"calibrate: {unknown} are not arguments of measure_critical_batch (the tracker, model "
                            f"and optimizer come from the run); allowed: {sorted(allowed)}")
        for key in ("loss_fn", "data", "evaluate", "microbatch_size", "branch_tokens"):
            if key not in measure:
                raise TypeError(f"calibrate: missing the measure_critical_batch argument {key!r}")
        for key in ("loss_fn", "data", "evaluate"):
            if not callable(measure[key]):
                raise TypeError(f"calibrate: {key}={measure[key]!r}: expected a callable")
        for key in ("microbatch_size", "branch_tokens", "epsilon"):
            if key in measure:
                _check(key, measure[key])
        if "replicates" in measure:
            _check("replicates", measure["replicates"], integer=True)
        self.apply = bool(apply)
        self.measure = measure
        self.calibration = Calibration()
        self._last_tokens: float | None = None

    def after_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, tracker: Any) -> CalibrationPoint | None:
        """Call after each optimizer step: calibrates when this step passed the next mark.

        A mark passed before the first call (a resumed run) is skipped, not measured late.
        """
        rec = getattr(tracker, "last_record", None)
        if rec is None:
            return None
        tokens = float(tracker.tokens_seen)
        before = tokens - rec.global_batch if self._last_tokens is None else self._last_tokens
        self._last_tokens = tokens
        while self.marks and self.marks[0] < before:  # passed before this run started (a resume)
            self.marks.pop(0)
        if not self.marks or tokens < self.marks[0]:
            return None
        while self.marks and tokens >= self.marks[0]:
            self.marks.pop(0)
        point = measure_critical_batch(model, optimizer, tracker=tracker, **self.measure)
        self.calibration.points.append(point)
        spent = sum(p.total_branch_tokens for p in self.calibration.points)
        _log.info("calibration at %.0f units: critical batch [%.0f, %s), kappa %s; %.0f branch units (all "
                  "calibrations so far: %.1f%% of the run's units)", point.tokens, point.critical.low,
                  "inf" if point.critical.lower_bound_only else f"{point.critical.high:.0f}",
                  "-" if point.kappa is None else f"{point.kappa:.3g}", point.total_branch_tokens,
                  100.0 * spent / max(tokens, 1.0))
        if self.apply and point.kappa is not None and getattr(tracker, "controller", None) is not None:
            point.apply_to(tracker.controller)
        return point


COOLDOWN_SHAPES = ("sqrt", "linear")


def cooldown_factor(position: float, *, cooldown: float, shape: str = "sqrt", floor: float = 0.0) -> float:
    """The LR multiplier of a branch's cooldown at ``position`` in ``[0, 1]`` of the branch.

    1 before the last ``cooldown`` fraction of the branch; over it the LR falls from 1 to
    ``floor``: ``1 - sqrt(s)`` (``shape="sqrt"``, the WSD cooldown of Hägele et al. 2024) or
    ``1 - s`` (``"linear"``) of the way, ``s`` the share of the cooldown passed. ``cooldown=0``
    is no cooldown (always 1).
    """
    if cooldown <= 0.0:
        return 1.0
    s = (position - (1.0 - cooldown)) / cooldown
    if s <= 0.0:
        return 1.0
    s = min(s, 1.0)
    fall = math.sqrt(s) if shape == "sqrt" else s
    return 1.0 - (1.0 - floor) * fall


def branch_lr_factors(steps: int, *, step_units: float, tokens: float, lr_mult: float,
                      lr_schedule: Callable[[float], float] | None = None, cooldown: float = 0.0,
                      cooldown_shape: str = "sqrt", cooldown_to: float = 0.0, base_lr: float | None = None,
                      max_lr: float | None = None) -> list[float]:
    """The factor on the run's LR at each of a branch's ``steps`` steps of ``step_units`` units.

    The run's schedule at the step's end over its value at the branch point (``tokens``), times
    the batch coupling ``lr_mult``, capped so that ``base_lr * factor <= max_lr``, then times
    the cooldown's multiplier at the step's middle (:func:`cooldown_factor`), so that branches
    of every batch anneal over the same units.
    """
    lr0 = 1.0 if lr_schedule is None else float(lr_schedule(tokens))
    out = []
    for step in range(steps):
        sched = 1.0 if lr_schedule is None else float(lr_schedule(tokens + (step + 1) * step_units)) / lr0
        factor = sched * lr_mult
        if max_lr is not None and base_lr is not None and base_lr > 0 and base_lr * factor > max_lr:
            factor = max_lr / base_lr
        out.append(factor * cooldown_factor((step + 0.5) / steps, cooldown=cooldown, shape=cooldown_shape,
                                            floor=cooldown_to))
    return out


def _from_tracker(tracker: Any, batch: float | None, tokens: float | None,
                  lr_coupling: str | None) -> tuple[float, float, str | None, float]:
    """The batch, units seen and coupling the tracker gives where the caller gave none, and the LR
    factor of a doubling decided but not applied (1 without one)."""
    pending_factor = 1.0
    if tracker is not None:
        if batch is None:
            batch, pending_factor = _next_window(tracker)
        tokens = tracker.tokens_seen if tokens is None else tokens
        session = getattr(tracker, "session", None)
        if lr_coupling in (None, "auto") and getattr(session, "optimizer", None) is not None:
            lr_coupling = getattr(session, "coupling_mode", None)
    if batch is None:
        raise ValueError(f"{_OWNER}(batch=None): give the run's global batch, or a tracker that has taken a step")
    return batch, 0.0 if tokens is None else tokens, lr_coupling, pending_factor


def _checked_multiples(*, batch: float, tokens: float, microbatch_size: float, branch_tokens: float,
                       replicates: int, epsilon: float, max_lr: float | None, clip_grad_norm: float | None,
                       fuse_microbatches: int, frozen_microbatches: int, cooldown: float, cooldown_shape: str,
                       cooldown_to: float, callables: dict[str, Any], multiples: Sequence[float]) -> list[float]:
    """:func:`measure_critical_batch`'s argument checks; the sorted multiples, ``1`` included."""
    _check("batch", batch)
    _check("tokens", tokens, positive=False)
    _check("microbatch_size", microbatch_size)
    _check("branch_tokens", branch_tokens)
    _check("replicates", replicates, integer=True)
    _check("epsilon", epsilon)
    _check("max_lr", max_lr, allow_none=True)
    _check("clip_grad_norm", clip_grad_norm, allow_none=True)
    _check("fuse_microbatches", fuse_microbatches, integer=True)
    _check("frozen_microbatches", frozen_microbatches, positive=False, integer=True)
    if isinstance(cooldown, bool) or not isinstance(cooldown, (int, float)) or not 0.0 <= cooldown <= 1.0:
        raise ValueError(f"{_OWNER}(cooldown={cooldown!r}): must be a fraction of the branch in [0, 1] (0: none)")
    if cooldown_shape not in COOLDOWN_SHAPES:
        raise ValueError(f"{_OWNER}(cooldown_shape={cooldown_shape!r}): must be one of {COOLDOWN_SHAPES}")
    if isinstance(cooldown_to, bool) or not isinstance(cooldown_to, (int, float)) or not 0.0 <= cooldown_to <= 1.0:
        raise ValueError(f"{_OWNER}(cooldown_to={cooldown_to!r}): must be a fraction of the LR in [0, 1]")
    if 0 < frozen_microbatches < 8:
        raise ValueError(f"{_OWNER}(frozen_microbatches={frozen_microbatches}): 0 (skip) or >= 8 (two groups of 4)")
    for name, fn in callables.items():
        if not callable(fn):
            raise TypeError(f"{_OWNER}({name}={fn!r}): expected a callable")
    if isinstance(multiples, (str, bytes)) or not all(
            isinstance(m, (int, float)) and not isinstance(m, bool) for m in multiples):
        raise TypeError(f"{_OWNER}(multiples={multiples!r}): expected a sequence of numbers > 0")
    for m in multiples:
        _check("multiples", m)
    return sorted({float(m) for m in multiples} | {1.0})


def _branch_steps(mults: list[float], multiples: Sequence[float], *, batch: float, microbatch_size: float,
                  branch_tokens: float) -> tuple[dict[float, int], dict[float, int], float]:
    """Microbatches per step and steps of each multiple's branch, and the units every branch trains on
    (the same samples for every batch)."""
    accum: dict[float, int] = {}
    for m in mults:
        micro = m * batch / microbatch_size
        if micro < 1 or abs(micro - round(micro)) > 1e-9:
            raise ValueError(f"{_OWNER}(multiples={list(multiples)}): {m:g} x batch {batch:g} = {m * batch:g} is not "
                             f"a whole number of microbatches of {microbatch_size:g}; allowed: multiples whose batch "
                             "is a multiple of microbatch_size")
        accum[m] = int(round(micro))
    top = accum[max(mults)]
    uneven = [m for m in mults if top % accum[m]]
    if uneven:
        raise ValueError(f"{_OWNER}(multiples={list(multiples)}): the largest batch is not a whole number of "
                         f"steps of {[f'{m:g}' for m in uneven]} x batch; allowed: multiples that each divide the "
                         "largest (powers of two, say), so every branch trains on the same samples")
    largest = max(mults) * batch
    steps_of = {m: int(branch_tokens // largest) * accum[max(mults)] // accum[m] for m in mults}
    if steps_of[max(mults)] < 1:
        raise ValueError(f"{_OWNER}(branch_tokens={branch_tokens:g}): less than one step of the largest "
                         f"batch {largest:g}")
    return accum, steps_of, int(branch_tokens // largest) * largest


def _branch_base_lrs(optimizer: torch.optim.Optimizer, tracker: Any, max_lr: float | None,
                     pending_factor: float) -> tuple[list[float], float | None]:
    """The param groups' LRs a branch starts from (a pending doubling's coupling in them), and the cap on
    group 0's coupled LR (the tracker's peak when it caps there and the caller gave none)."""
    base_lrs = _group_lrs(optimizer)
    session = getattr(tracker, "session", None)
    if max_lr is None and getattr(session, "cap_lr_at_peak", False) and optimizer.param_groups:
        group = optimizer.param_groups[0]  # the tracker caps the coupled LR at its peak: so do the branches
        max_lr = float(group.get("max_lr", group.get("initial_lr", base_lrs[0])))
    if pending_factor != 1.0:  # the next window's batch runs at its own coupling, not the last window's
        capped = pending_factor if max_lr is None or base_lrs[0] <= 0 else min(
            pending_factor, max(1.0, max_lr / base_lrs[0]))
        base_lrs = [lr * capped for lr in base_lrs]
    return base_lrs, max_lr


def measure_critical_batch(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    data: Callable[[int], Iterable[Any]],
    evaluate: Callable[[torch.nn.Module], float],
    microbatch_size: float,
    branch_tokens: float,
    batch: float | None = None,
    tokens: float | None = None,
    tracker: Any | None = None,
    multiples: Sequence[float] = DEFAULT_MULTIPLES,
    replicates: int = 2,
    epsilon: float = 0.01,
    lr_coupling: str | None = None,
    lr_schedule: Callable[[float], float] | None = None,
    max_lr: float | None = None,
    clip_grad_norm: float | None = None,
    control: bool = True,
    fuse_microbatches: int = 1,
    frozen_microbatches: int = 32,
    seed: int = 0,
    make_optimizer: Callable[[Iterable[Any]], torch.optim.Optimizer] | None = None,
    log: Callable[[str], None] | None = None,
    cooldown: float = 0.0,
    cooldown_shape: str = "sqrt",
    cooldown_to: float = 0.0,
) -> CalibrationPoint:
    """Measure the critical batch at the run's current state by short branches at ``k * batch``.

    Every branch starts from a deep copy of ``model`` and ``optimizer`` (its state deep-copied),
    trains ``branch_tokens`` units of ``data(r)`` (replicate ``r``: the same samples for every
    batch, grouped into steps of ``k * batch``), with each group's learning rate times
    ``lr_schedule(t) / lr_schedule(tokens)`` (the run's schedule in units, ``t`` at the step's
    end; constant without one) times the coupling of ``k`` (capped at ``max_lr``), and is then
    evaluated by ``evaluate``. The run's model, optimizer, gradients and random-number states
    are left exactly as they were.

    Args:
        model: the run's model (a DDP wrapper is unwrapped; branches run locally).
        optimizer: the run's optimizer (rebuilt for each branch as ``type(optimizer)(param_groups)``
            unless ``make_optimizer`` is given).
        loss_fn: ``loss_fn(model, microbatch)``: the mean loss of one microbatch (a scalar tensor).
        data: ``data(replicate)``: a fresh iterable of microbatches of ``microbatch_size`` units
            each, the same for the same ``replicate`` every time it is called, and a source of
            its own (not the run's loader). Replicate ``replicates`` feeds the frozen measurement.
        evaluate: ``evaluate(model)``: the loss on one fixed held-out set (a float).
        microbatch_size: units (tokens or samples) in one microbatch of ``data``.
        branch_tokens: units each branch trains on (rounded down to a multiple of the largest batch).
        batch: the run's global batch (``k = 1``). Default: the tracker's next window's (the last
            step's, scaled by a doubling decided at it).
        tokens: units the run has seen (the branch point). Default: the tracker's, else 0.
        tracker: a :class:`~cbs_tracker.CBSTracker` (or any object with ``global_batch_size``,
            ``tokens_seen``, ``noise_scale``, ``noise_scale_interval``): read, never changed.
        multiples: the batch multiples ``k`` (default ``1/2, 1, 2, 4, 8``); ``1`` is added if absent.
        replicates: branches per batch over other data orders (``>= 1``; two or more give
            standard errors).
        epsilon: tolerance in nats: a batch is affordable while its loss is within ``epsilon``
            of every smaller batch's best.
        lr_coupling: ``"sqrt"``, ``"linear"``, ``"keep"``; ``None``/``"auto"``: from the optimizer
            (Adam-like: sqrt, SGD: linear), or the tracker's.
        lr_schedule: ``lr(units)``: the run's learning rate against units seen, before coupling.
        max_lr: cap on group 0's coupled LR (the others keep their ratio to it). Default: none, or
            the peak LR when the tracker caps the coupled LR at its peak (``cap_lr_at_peak``).
        clip_grad_norm: the run's gradient clipping (``None``: none).
        control: also run the run's batch at the largest branch's LR factor.
        fuse_microbatches: concatenate up to this many microbatches into one forward (faster on
            small microbatches; exact when each microbatch's mean loss has the same weight).
        frozen_microbatches: microbatch gradients for the frozen noise scale (0: skip it).
        seed: the torch seed of each branch is ``seed + replicate`` (dropout and the like).
        make_optimizer: builds a branch optimizer from param groups.
        log: called with a line after each branch.
        cooldown: the fraction of each branch (``[0, 1]``) over which its LR anneals before the
            evaluation (0, the default: none). Short branches without one favour the larger
            batch, whose lower gradient noise lowers the loss at once the way an LR decay does;
            an annealed branch compares the models with their noise removed, as the run's own
            final decay will (Hägele et al. 2024).
        cooldown_shape: ``"sqrt"`` (``1 - sqrt(s)``, the default) or ``"linear"``.
        cooldown_to: the LR the cooldown ends at, as a fraction of the branch's LR where it
            starts (default 0; the schedule's final ratio to anneal as the run will).

    Returns:
        The :class:`CalibrationPoint`.

    Raises:
        TypeError / ValueError: an argument of the wrong type or out of range, a multiple whose
            batch is not a whole number of microbatches, data that ran out.
    """
    started = time.perf_counter()
    inner = getattr(optimizer, "optimizer", None)  # Accelerate's wrapper: the optimizer it steps
    if isinstance(inner, torch.optim.Optimizer):
        optimizer = inner
    batch, tokens, lr_coupling, pending_factor = _from_tracker(tracker, batch, tokens, lr_coupling)
    mults = _checked_multiples(
        batch=batch, tokens=tokens, microbatch_size=microbatch_size, branch_tokens=branch_tokens,
        replicates=replicates, epsilon=epsilon, max_lr=max_lr, clip_grad_norm=clip_grad_norm,
        fuse_microbatches=fuse_microbatches, frozen_microbatches=frozen_microbatches, cooldown=cooldown,
        cooldown_shape=cooldown_shape, cooldown_to=cooldown_to,
        callables={"loss_fn": loss_fn, "data": data, "evaluate": evaluate}, multiples=multiples,
    )
    coupling = resolve_coupling(lr_coupling, optimizer, owner=_OWNER)
    accum, steps_of, per_branch = _branch_steps(mults, multiples, batch=batch, microbatch_size=microbatch_size,
                                                branch_tokens=branch_tokens)
    if lr_schedule is not None:
        lr0 = float(lr_schedule(tokens))
        if not (math.isfinite(lr0) and lr0 > 0):
            raise ValueError(f"{_OWNER}: lr_schedule(tokens={tokens:g}) = {lr0!r}; the schedule must be > 0 "
                             "at the branch point")
    base_lrs, max_lr = _branch_base_lrs(optimizer, tracker, max_lr, pending_factor)

    def lr_factor_at(m: float, lr_mult: float) -> Callable[[int], float]:
        factors = branch_lr_factors(steps_of[m], step_units=m * batch, tokens=tokens, lr_mult=lr_mult,
                                    lr_schedule=lr_schedule, cooldown=cooldown, cooldown_shape=cooldown_shape,
                                    cooldown_to=cooldown_to, base_lr=base_lrs[0] if base_lrs else None,
                                    max_lr=max_lr)
        return factors.__getitem__

    def branch(m: float, lr_mult: float, replicate: int) -> float:
        fuse = math.gcd(accum[m], fuse_microbatches)
        b_model, b_opt = branch_copy(model, optimizer, make_optimizer)
        torch.manual_seed(seed + replicate)
        _run_branch(b_model, b_opt, loss_fn=loss_fn, microbatches=iter(data(replicate)), steps=steps_of[m],
                    accumulation=accum[m], fuse=fuse, lr_at=lr_factor_at(m, lr_mult), base_lrs=base_lrs,
                    clip=clip_grad_norm)
        return float(evaluate(b_model))

    results: list[BranchLosses] = []
    control_losses: list[float] = []
    top_factor = coupling_factor(coupling, max(mults))
    total = 0.0
    with _rng_preserved():
        eval_copy, eval_opt = branch_copy(model, optimizer, make_optimizer)
        frozen = None
        if frozen_microbatches:  # before evaluate, which may leave the copy in eval mode
            frozen = frozen_noise_scale(eval_copy, eval_opt, loss_fn=loss_fn, microbatches=iter(data(replicates)),
                                        microbatch_size=microbatch_size, count=frozen_microbatches)
        start_loss = float(evaluate(eval_copy))
        del eval_copy, eval_opt
        for m in mults:
            factor = coupling_factor(coupling, m)
            losses = []
            for r in range(replicates):
                losses.append(branch(m, factor, r))
                total += per_branch
                if log is not None:
                    log(f"  branch {m:g} x {batch:,.0f} = {m * batch:,.0f} (LR x {factor:.3g}), replicate {r}: "
                        f"held-out loss {losses[-1]:.4f}")
            results.append(BranchLosses(m * batch, m, factor, tuple(losses)))
        if control and max(mults) > 1:
            for r in range(replicates):
                control_losses.append(branch(1.0, top_factor, r))
                total += per_branch
                if log is not None:
                    log(f"  control {batch:,.0f} at LR x {top_factor:.3g}, replicate {r}: "
                        f"held-out loss {control_losses[-1]:.4f}")
    ctl = (BranchLosses(float(batch), 1.0, top_factor, tuple(control_losses), label="control")
           if control_losses else None)
    interval = critical_batch_interval(results, epsilon=epsilon, control=ctl)
    ns = lo = hi = None
    if tracker is not None:
        ns = tracker.noise_scale
        iv = getattr(tracker, "noise_scale_interval", None)
        if iv is not None:
            lo, hi = iv
    return CalibrationPoint(
        tokens=float(tokens), batch=float(batch), critical=interval, branches=tuple(results), control=ctl,
        start_loss=start_loss, branch_tokens=float(per_branch), total_branch_tokens=total,
        seconds=time.perf_counter() - started, noise_scale=ns, noise_scale_low=lo, noise_scale_high=hi,
        frozen=frozen, lr_coupling=coupling, cooldown=float(cooldown), cooldown_shape=cooldown_shape)
