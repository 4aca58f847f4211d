"""The noisy quadratic model (NQM): exact in expectation, Monte-Carlo, and an online driver.

After Zhang et al. 2019, "Which algorithmic choices matter at which batch sizes?";
``docs/design.md`` (Theory) gives the model and its default setting. :class:`ExactNQM`
evaluates any batch schedule in closed form (and steps for online policies),
:class:`MonteCarloNQM` draws real microbatch gradients, :func:`run_online` drives either
with a policy, and :func:`compare_schedules` reports the schedules at equal budget
(plus the rows other modules add with :func:`register_row`, e.g. ``nqm_online``).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from cbs_tracker.theory.schedule import doubling_plan_from_batches, integer_argmin, plan_doubling

__all__ = [
    "DEFAULT_BUDGET",
    "DEFAULT_B_MAX",
    "DEFAULT_B_MIN",
    "Comparison",
    "ExactNQM",
    "Exponents",
    "MonteCarloNQM",
    "NQMConfig",
    "NQMState",
    "OnlineObservation",
    "OnlinePolicy",
    "OnlineRun",
    "ROW_PLUGIN_MODULE",
    "RowContext",
    "ScheduleResult",
    "Trajectory",
    "compare_schedules",
    "load_row_plugins",
    "register_row",
    "registered_rows",
    "run_online",
    "unregister_row",
]

DEFAULT_BUDGET = 3e6
DEFAULT_B_MIN = 8.0
DEFAULT_B_MAX = 8192.0

# Fit windows of measure_exponents (steps). The signal S(T) is a power law only
# between the fastest and the slowest time scale 1/(2 eta h) in [1, 1e5]; its
# local slope rises from 0.3 (the continuum source exponent) at T ~ 10 to 0.66 at
# T ~ 1e4, so "s" depends on the window: [10, 1e5] gives s ~ 0.49. The kernel's
# local slope is flat (-1.49 .. -1.50) over [10, 1e3], which gives beta ~ 1.95.
S_WINDOW = (10.0, 1e5)
BETA_WINDOW = (10.0, 1e3)

ROW_PLUGIN_MODULE = "cbs_tracker.theory.nqm_online"

_KERNEL_BLOCK = 1024


# --------------------------------------------------------------------------- config


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}={value!r} has type {type(value).__name__}; expected a real number")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{name}={value!r} must be finite")
    return out


def _positive(name: str, value: object) -> float:
    out = _real(name, value)
    if out <= 0:
        raise ValueError(f"{name}={value!r} must be > 0")
    return out


@dataclass(frozen=True, kw_only=True)
class NQMConfig:
    """The spectrum and step size of the NQM (defaults: the reference setting of ``docs/design.md``, Theory).

    Attributes:
        dims: number of coordinates (curvatures), ``>= 1``.
        curvature_min: smallest curvature ``h``, ``> 0``.
        curvature_max: largest curvature, ``>= curvature_min`` and ``<= 2/lr`` (stability).
        lr: SGD step size ``eta``.
        source_exponent: ``v_{i,0} ∝ h_i^(source_exponent - 1)``.
        noise_exponent: ``sigma_i^2 ∝ h_i^noise_exponent``.
        initial_loss: ``L_0 = 1/2 sum h_i v_{i,0}``.
        noise_floor: ``L_inf(floor_batch)``, the loss floor of a constant ``floor_batch`` run.
        floor_batch: batch at which ``noise_floor`` is set.
    """

    dims: int = 1500
    curvature_min: float = 1e-5
    curvature_max: float = 1.0
    lr: float = 0.5
    source_exponent: float = 0.3
    noise_exponent: float = 0.5
    initial_loss: float = 1.0
    noise_floor: float = 0.5
    floor_batch: float = 8.0

    def __post_init__(self) -> None:
        if isinstance(self.dims, bool) or not isinstance(self.dims, (int, np.integer)):
            raise TypeError(f"NQMConfig(dims={self.dims!r}): expected an int")
        if self.dims < 1:
            raise ValueError(f"NQMConfig(dims={self.dims!r}): must be >= 1")
        for name in ("curvature_min", "curvature_max", "lr", "initial_loss", "noise_floor", "floor_batch"):
            _positive(f"NQMConfig({name}=...)", getattr(self, name))
        for name in ("source_exponent", "noise_exponent"):
            _real(f"NQMConfig({name}=...)", getattr(self, name))
        if self.curvature_max < self.curvature_min:
            raise ValueError(
                f"NQMConfig(curvature_max={self.curvature_max!r}): must be >= curvature_min={self.curvature_min!r}"
            )
        if self.lr * self.curvature_max >= 2.0:
            raise ValueError(
                f"NQMConfig(lr={self.lr!r}): lr * curvature_max must be < 2 for SGD to be stable "
                f"(got {self.lr * self.curvature_max!r})"
            )


class Spectrum:
    """Curvatures, initial second moments and noise variances of a config (shared by both models)."""

    def __init__(self, config: NQMConfig) -> None:
        self.config = config
        h = np.geomspace(config.curvature_min, config.curvature_max, config.dims)
        lr = config.lr
        v0 = h ** (config.source_exponent - 1.0)
        v0 *= config.initial_loss / (0.5 * np.sum(h * v0))
        sigma2 = h**config.noise_exponent
        decay = (1.0 - lr * h) ** 2
        # floor of coordinate i at batch B: v_inf = lr^2 sigma^2 / (B (1 - decay))
        unit_floor = 0.5 * np.sum(h * lr**2 * sigma2 / (config.floor_batch * (1.0 - decay)))
        sigma2 *= config.noise_floor / unit_floor
        self.h = h
        self.lr = lr
        self.v0 = v0
        self.sigma2 = sigma2
        self.decay = decay
        self.inject = lr**2 * sigma2  # added to v per step, divided by B
        self.trace_cov = float(np.sum(sigma2))
        self.trace_h_cov = float(np.sum(h * sigma2))


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class NQMState:
    """The exact model after ``step`` steps (expectations over the iterate distribution).

    Attributes:
        step: optimizer steps done.
        tokens_seen: samples consumed (the NQM's unit; "tokens" by the library's naming).
        batch: batch of the last step (``nan`` before the first).
        loss: ``L = 1/2 sum h_i v_i``.
        grad_sq_norm: ``E|G|^2 = sum h_i^2 v_i``.
        trace_cov: ``tr(Sigma) = sum sigma_i^2`` (constant).
        noise_scale: ``B_simple = tr(Sigma) / E|G|^2``.
        noise_scale_hessian: ``B_noise = tr(H Sigma) / E[G^T H G] = sum h sigma^2 / sum h^3 v``.
    """

    step: int
    tokens_seen: float
    batch: float
    loss: float
    grad_sq_norm: float
    trace_cov: float
    noise_scale: float
    noise_scale_hessian: float


@dataclass(frozen=True)
class Exponents:
    """FSL exponents measured on the NQM (see :meth:`ExactNQM.measure_exponents`).

    Attributes:
        s: minus the log-log slope of the signal ``S(T)`` over ``s_window``.
        beta: from the log-log slope ``q`` of ``kappa(j)`` over ``beta_window``: ``beta = 1/(q + 2)``.
        s_window: steps ``T`` fitted.
        beta_window: lags ``j`` fitted.
    """

    s: float
    beta: float
    s_window: tuple[float, float]
    beta_window: tuple[float, float]

    @property
    def regime(self) -> Literal["hard", "easy"]:
        """``"hard"`` when ``s <= 1 - 1/beta``."""
        return "hard" if self.s <= 1.0 - 1.0 / self.beta else "easy"


@dataclass(frozen=True)
class Trajectory:
    """Expected loss along a schedule, recorded at some steps.

    Attributes:
        steps: steps completed at each record (first record: 0).
        tokens: samples consumed at each record.
        loss: expected loss at each record.
        noise_scale: exact ``B_simple`` at each record.
        final_loss: expected loss after the last step.
    """

    steps: np.ndarray
    tokens: np.ndarray
    loss: np.ndarray
    noise_scale: np.ndarray
    final_loss: float


@dataclass(frozen=True)
class ScheduleResult:
    """One row of the comparison.

    Attributes:
        name: key in the JSON output (``constant``, ``two_stage``, ...).
        label: human-readable description for the table and the plot.
        final_loss: expected final loss on the exact model.
        steps: optimizer steps taken.
        batches: per-step batch sizes (sum = budget).
        note: one line on how the row was obtained.
    """

    name: str
    label: str
    final_loss: float
    steps: int
    batches: np.ndarray = field(repr=False)
    note: str = ""


@dataclass(frozen=True)
class Comparison:
    """Schedules at one budget. ``ratio_vs_constant = L_constant / L_row`` (10 = ten times lower).

    Attributes:
        budget: samples spent by every row.
        b_min: smallest batch.
        b_max: largest batch.
        exponents: ``s`` and ``beta`` measured on the model.
        rows: the rows in order (``constant`` first).
    """

    budget: float
    b_min: float
    b_max: float
    exponents: Exponents
    rows: tuple[ScheduleResult, ...]

    def row(self, name: str) -> ScheduleResult:
        """The row called ``name`` (``KeyError`` if absent)."""
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(f"no row {name!r}; rows are {[r.name for r in self.rows]}")

    def ratio_vs_constant(self, name: str) -> float:
        """``L_constant / L_name``: how many times lower than the best constant batch."""
        return self.row("constant").final_loss / self.row(name).final_loss

    def ratio_vs_optimal(self, name: str) -> float:
        """``L_name / L_optimal`` (1.0 = as good as the optimum, 1.1 = 10% higher loss)."""
        return self.row(name).final_loss / self.row("optimal").final_loss

    def to_dict(self) -> dict[str, dict[str, float | int]]:
        """``{name: {final_loss, ratio_vs_constant, ratio_vs_optimal, steps}}`` (JSON-ready)."""
        return {
            r.name: {
                "final_loss": float(r.final_loss),
                "ratio_vs_constant": float(self.ratio_vs_constant(r.name)),
                "ratio_vs_optimal": float(self.ratio_vs_optimal(r.name)),
                "steps": int(r.steps),
            }
            for r in self.rows
        }


# --------------------------------------------------------------------------- exact model


def _run_lengths(batches: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Values and lengths of the runs of equal consecutive batches."""
    if batches.size == 0:
        return batches, np.zeros(0, dtype=np.int64)
    starts = np.concatenate([[0], np.flatnonzero(np.diff(batches) != 0) + 1])
    lengths = np.diff(np.concatenate([starts, [batches.size]]))
    return batches[starts], lengths


def _check_batches(batches: object) -> np.ndarray:
    b = np.asarray(batches, dtype=np.float64)
    if b.ndim != 1 or b.size == 0 or not np.all(np.isfinite(b)) or np.any(b <= 0):
        raise ValueError("batches must be a non-empty 1-D array of finite positive batch sizes")
    return b


class ExactNQM:
    """The NQM in expectation: closed forms, schedule evaluation and a steppable state.

    Args:
        config: the spectrum (default: :class:`NQMConfig`).

    The steppable part starts at ``L_0`` and moves by :meth:`step`;
    :meth:`reset` returns to the start. Evaluation methods
    (:meth:`final_loss`, :meth:`trajectory`, ...) do not touch that state.
    """

    def __init__(self, config: NQMConfig | None = None) -> None:
        if config is not None and not isinstance(config, NQMConfig):
            raise TypeError(f"config={config!r} has type {type(config).__name__}; expected NQMConfig or None")
        self.config = config or NQMConfig()
        self._spec = Spectrum(self.config)
        self._kernel = np.zeros(0)
        self._kernel_block: np.ndarray | None = None
        self._signal_cache: dict[int, float] = {}
        self._prefix: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None
        self.reset()

    # ---- spectrum --------------------------------------------------------
    @property
    def curvatures(self) -> np.ndarray:
        """``h_i`` (read-only view)."""
        return self._spec.h

    @property
    def initial_second_moment(self) -> np.ndarray:
        """``v_{i,0} = E[theta_{i,0}^2]``."""
        return self._spec.v0

    @property
    def noise_variance(self) -> np.ndarray:
        """Per-example gradient noise variances ``sigma_i^2``."""
        return self._spec.sigma2

    @property
    def lr(self) -> float:
        """Step size ``eta``."""
        return self._spec.lr

    @property
    def trace_cov(self) -> float:
        """``tr(Sigma) = sum sigma_i^2``."""
        return self._spec.trace_cov

    # ---- closed forms ----------------------------------------------------
    def noise_floor(self, batch: float) -> float:
        """``L_inf(B) = 1/2 sum h_i eta^2 sigma_i^2 / (B (1 - (1 - eta h_i)^2))``; exactly ``∝ 1/B``."""
        sp = self._spec
        return float(0.5 * np.sum(sp.h * sp.inject / (1.0 - sp.decay)) / _positive("batch", batch))

    def signal(self, steps: int) -> float:
        """``S(T) = 1/2 sum h_i v_{i,0} (1 - eta h_i)^(2T)``: the loss without noise after ``T`` steps."""
        t = int(steps)
        if t not in self._signal_cache:
            sp = self._spec
            self._signal_cache[t] = float(0.5 * np.sum(sp.h * sp.v0 * sp.decay**t))
        return self._signal_cache[t]

    def kernel(self, lags: np.ndarray | int) -> np.ndarray:
        """``kappa(j) = 1/2 eta^2 sum_i h_i sigma_i^2 (1 - eta h_i)^(2j)`` for integer lags ``j >= 0``."""
        j = np.asarray(lags, dtype=np.int64)
        if j.size and j.min() < 0:
            raise ValueError("kernel lags must be >= 0")
        n = int(j.max()) + 1 if j.size else 0
        return self._kernel_upto(n)[j]

    def _kernel_upto(self, n: int) -> np.ndarray:
        """``kappa(0..n-1)``, cached; blocks of ``a^j`` times a matrix-vector product."""
        have = self._kernel.size
        if n > have:
            sp = self._spec
            weights = 0.5 * sp.h * sp.inject
            if self._kernel_block is None:
                self._kernel_block = sp.decay[:, None] ** np.arange(_KERNEL_BLOCK, dtype=np.float64)[None, :]
            block = self._kernel_block
            size = max(n, 2 * have)
            out = np.empty(size)
            out[:have] = self._kernel
            for j0 in range(have, size, _KERNEL_BLOCK):
                k = min(_KERNEL_BLOCK, size - j0)
                out[j0 : j0 + k] = (weights * sp.decay**j0) @ block[:, :k]
            out.setflags(write=False)
            self._kernel = out
        return self._kernel[:n]

    def constant_loss(self, batch: float, steps: int) -> float:
        """Expected loss after ``steps`` steps at a constant ``batch`` (closed form)."""
        sp = self._spec
        a_t = sp.decay ** int(steps)
        v = sp.v0 * a_t + sp.inject / batch * (1.0 - a_t) / (1.0 - sp.decay)
        return float(0.5 * np.sum(sp.h * v))

    def final_loss(self, batches: np.ndarray) -> float:
        """``L_T = S(T) + sum_k kappa(T-1-k)/B_k`` for a per-step schedule (O(T) with the cached kernel)."""
        b = _check_batches(batches)
        t_total = b.size
        kern = self._kernel_upto(t_total)[::-1]
        return self.signal(t_total) + float(np.dot(kern, 1.0 / b))

    def trajectory(self, batches: np.ndarray, *, num_points: int = 600) -> Trajectory:
        """Expected loss and exact noise scale along a schedule by the recursion (independent of the kernel).

        Runs of equal batches advance in closed form, ``v <- v a^n + eta^2 sigma^2/B (1-a^n)/(1-a)``;
        records land on ``num_points`` steps spaced both geometrically and linearly in tokens.
        """
        b = _check_batches(batches)
        sp = self._spec
        cum = np.cumsum(b)
        targets = np.concatenate(
            [np.geomspace(b[0], cum[-1], num_points // 2), np.linspace(b[0], cum[-1], num_points - num_points // 2)]
        )
        record = np.unique(np.clip(np.searchsorted(cum, targets * (1 - 1e-12)) + 1, 1, b.size))
        record_set = np.concatenate([record, [b.size]])
        values, lengths = _run_lengths(b)
        v = sp.v0.copy()
        steps_out, tokens_out, loss_out, scale_out = [0], [0.0], [self._loss(v)], [self._scale(v)]
        done = 0
        r = 0
        one_minus = 1.0 - sp.decay
        for val, length in zip(values, lengths, strict=True):
            end = done + int(length)
            while done < end:
                while r < record_set.size and record_set[r] <= done:
                    r += 1
                stop = min(end, int(record_set[r])) if r < record_set.size else end
                n = stop - done
                if n == 1:
                    v = sp.decay * v + sp.inject / val
                else:
                    a_n = sp.decay**n
                    v = v * a_n + sp.inject / val * (1.0 - a_n) / one_minus
                done = stop
                if r < record_set.size and done == record_set[r]:
                    steps_out.append(done)
                    tokens_out.append(float(cum[done - 1]))
                    loss_out.append(self._loss(v))
                    scale_out.append(self._scale(v))
        return Trajectory(
            steps=np.asarray(steps_out),
            tokens=np.asarray(tokens_out),
            loss=np.asarray(loss_out),
            noise_scale=np.asarray(scale_out),
            final_loss=self._loss(v),
        )

    def _loss(self, v: np.ndarray) -> float:
        return float(0.5 * np.dot(self._spec.h, v))

    def _scale(self, v: np.ndarray) -> float:
        return self._spec.trace_cov / float(np.dot(self._spec.h**2, v))

    # ---- exponents ---------------------------------------------------------
    def measure_exponents(
        self,
        *,
        s_window: tuple[float, float] = S_WINDOW,
        beta_window: tuple[float, float] = BETA_WINDOW,
        points: int = 200,
    ) -> Exponents:
        """``s`` and ``beta`` by least-squares lines in log-log on log-spaced points.

        ``s = -slope of log S(T)`` over ``T`` in ``s_window``; ``q`` = slope of
        ``log kappa(j)`` against ``log j`` over ``beta_window`` and
        ``beta = 1/(q + 2)`` (FSL: ``K(tau) ≍ tau^(1/beta - 2)``). With the default
        windows the default setting gives ``s = 0.495``, ``beta = 1.954``; the
        continuum limits of this spectrum are ``s = source_exponent = 0.3`` and
        ``beta = 1/(1 - noise_exponent) = 2`` (see ``S_WINDOW`` for why ``s`` moves).
        """
        ts = np.unique(np.round(np.geomspace(s_window[0], s_window[1], points)).astype(np.int64))
        sig = np.array([self.signal(int(t)) for t in ts])
        s = -float(np.polyfit(np.log(ts), np.log(sig), 1)[0])
        js = np.unique(np.round(np.geomspace(beta_window[0], beta_window[1], points)).astype(np.int64))
        q = float(np.polyfit(np.log(js), np.log(self.kernel(js)), 1)[0])
        return Exponents(s=s, beta=1.0 / (q + 2.0), s_window=tuple(s_window), beta_window=tuple(beta_window))

    # ---- optimal schedules ---------------------------------------------------
    def _prefix_sums(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._prefix is None or self._prefix[0] < n:
            kern = self._kernel_upto(n)
            w = np.sqrt(kern)
            kc = np.concatenate([[0.0], np.cumsum(kern)])
            wc = np.concatenate([[0.0], np.cumsum(w)])
            self._prefix = (n, w, kc, wc)
        _, w, kc, wc = self._prefix
        return w, kc, wc

    def _optimum_at(self, steps: int, budget: float, b_min: float, b_max: float) -> tuple[float, float, int, int]:
        """``(loss, c, n_hi, n_top)`` of ``B_j = clip(c sqrt(kappa_j))`` over lags ``j < steps``."""
        w, kc, wc = self._prefix_sums(steps)
        neg = -w[:steps]

        def counts(c: float) -> tuple[int, int]:
            n_hi = int(np.searchsorted(neg, -b_max / c, side="right"))
            n_top = int(np.searchsorted(neg, -b_min / c, side="right"))
            return n_hi, n_top

        def total(c: float) -> float:
            n_hi, n_top = counts(c)
            return b_max * n_hi + c * (wc[n_top] - wc[n_hi]) + b_min * (steps - n_top)

        c_lo, c_hi = b_min / w[0], b_max / w[steps - 1]
        for _ in range(200):
            mid = math.sqrt(c_lo * c_hi)
            if total(mid) < budget:
                c_lo = mid
            else:
                c_hi = mid
            if c_hi <= c_lo * (1 + 1e-15):
                break
        c = math.sqrt(c_lo * c_hi)
        n_hi, n_top = counts(c)
        ramp = wc[n_top] - wc[n_hi]
        if ramp > 0:
            c_exact = (budget - b_max * n_hi - b_min * (steps - n_top)) / ramp
            if c_exact > 0 and counts(c_exact) == (n_hi, n_top):
                c = c_exact
        noise = kc[n_hi] / b_max + (ramp / c if ramp > 0 else 0.0) + (kc[steps] - kc[n_top]) / b_min
        return self.signal(steps) + float(noise), c, n_hi, n_top

    def optimal_batches(
        self, budget: float = DEFAULT_BUDGET, b_min: float = DEFAULT_B_MIN, b_max: float = DEFAULT_B_MAX,
        *, steps: int | None = None,
    ) -> np.ndarray:
        """The exact optimum at equal budget: ``B_k = clip(c sqrt(kappa(T-1-k)), b_min, b_max)``.

        ``c`` meets ``sum_k B_k = budget`` exactly; ``T`` (unless given) minimises
        the final loss over the integers in ``[ceil(D/b_max), floor(D/b_min)]``
        (log scan + integer golden section; every ``T`` costs O(log T) with
        prefix sums of ``kappa`` and ``sqrt(kappa)``). Continuous batch sizes.
        """
        d, lo, hi = _positive("budget", budget), _positive("b_min", b_min), _positive("b_max", b_max)
        t_lo, t_hi = max(1, math.ceil(d / hi - 1e-9)), max(1, math.floor(d / lo + 1e-9))
        if steps is None:
            self._prefix_sums(t_hi)
            steps = integer_argmin(lambda t: self._optimum_at(t, d, lo, hi)[0], t_lo, t_hi)
        elif not t_lo <= steps <= t_hi:
            raise ValueError(f"steps={steps!r} must be in {t_lo}..{t_hi} to spend budget={budget!r}")
        _, c, _, _ = self._optimum_at(int(steps), d, lo, hi)
        w, _, _ = self._prefix_sums(int(steps))
        return np.clip(c * w[: int(steps)], lo, hi)[::-1].copy()

    def best_constant(
        self, budget: float = DEFAULT_BUDGET, b_min: float = DEFAULT_B_MIN, b_max: float = DEFAULT_B_MAX
    ) -> np.ndarray:
        """The best constant batch on the fine grid ``B = D/T`` (every integer ``T``; budget exact)."""
        d, lo, hi = _positive("budget", budget), _positive("b_min", b_min), _positive("b_max", b_max)
        t_lo, t_hi = max(1, math.ceil(d / hi - 1e-9)), max(1, math.floor(d / lo + 1e-9))
        t = integer_argmin(lambda t: self.constant_loss(d / t, t), t_lo, t_hi)
        return np.full(t, d / t)

    def best_two_stage(
        self, budget: float = DEFAULT_BUDGET, b_min: float = DEFAULT_B_MIN, b_max: float = DEFAULT_B_MAX
    ) -> np.ndarray:
        """The best single switch ``B_1 -> B_2`` (continuous ``B_1 < B_2`` in the bounds, any switch point).

        Start: the best pair of powers of two times ``b_min`` with the switch
        optimised; then coordinate descent (golden section in ``log B_1``,
        ``log B_2`` and the switch fraction) on the closed form. Realised with
        integer steps: ``n_1 = round(D_1/B_1)`` steps at ``B_1``, then ``n_2`` steps
        at ``B_2' = (D - n_1 B_1)/n_2`` so the budget is exact.
        """
        d, lo, hi = _positive("budget", budget), _positive("b_min", b_min), _positive("b_max", b_max)
        sp = self._spec
        one_minus = 1.0 - sp.decay

        def loss(b1: float, b2: float, frac: float) -> float:
            n1 = frac * d / b1
            n2 = (1.0 - frac) * d / b2
            a1, a2 = sp.decay**n1, sp.decay**n2
            v = sp.v0 * a1 + sp.inject / b1 * (1 - a1) / one_minus
            v = v * a2 + sp.inject / b2 * (1 - a2) / one_minus
            return float(0.5 * np.dot(sp.h, v))

        def best_frac(b1: float, b2: float) -> float:
            return _golden(lambda f: loss(b1, b2, f), 0.0, 1.0)

        rungs = [lo * 2.0**k for k in range(64) if lo * 2.0**k <= hi * (1 + 1e-12)]
        start = None
        for i, b1 in enumerate(rungs):
            for b2 in rungs[i + 1 :]:
                f = best_frac(b1, b2)
                cand = (loss(b1, b2, f), b1, b2, f)
                if start is None or cand[0] < start[0]:
                    start = cand
        if start is None:
            raise ValueError(f"b_min={b_min!r}, b_max={b_max!r}: no two batch sizes a factor 2 apart")
        _, b1, b2, f = start
        for _ in range(6):
            b1 = math.exp(_golden(lambda x, b2=b2, f=f: loss(math.exp(x), b2, f), math.log(lo), math.log(b2)))
            b2 = math.exp(_golden(lambda x, b1=b1, f=f: loss(b1, math.exp(x), f), math.log(b1), math.log(hi)))
            f = best_frac(b1, b2)
        n1 = int(round(f * d / b1))
        rest = d - n1 * b1
        n2 = max(1, int(round(rest / b2)))
        while rest / n2 > hi:
            n2 += 1
        return np.concatenate([np.full(n1, b1), np.full(n2, rest / n2)])

    # ---- steppable state -----------------------------------------------------
    def reset(self) -> NQMState:
        """Back to ``theta_0`` (``v = v_0``, no steps, no samples)."""
        self._v = self._spec.v0.copy()
        self._steps = 0
        self._tokens = 0.0
        self._last_batch = math.nan
        return self.state()

    def state(self) -> NQMState:
        """The current expected loss and exact noise scale."""
        v, sp = self._v, self._spec
        grad_sq = float(np.dot(sp.h**2, v))
        return NQMState(
            step=self._steps,
            tokens_seen=self._tokens,
            batch=self._last_batch,
            loss=self._loss(v),
            grad_sq_norm=grad_sq,
            trace_cov=sp.trace_cov,
            noise_scale=sp.trace_cov / grad_sq,
            noise_scale_hessian=sp.trace_h_cov / float(np.dot(sp.h**3, v)),
        )

    def step(self, batch: float) -> NQMState:
        """One SGD step with ``batch`` samples (any positive real); returns the new :class:`NQMState`."""
        b = _positive("batch", batch)
        self._v = self._spec.decay * self._v + self._spec.inject / b
        self._steps += 1
        self._tokens += b
        self._last_batch = b
        return self.state()


def _golden(f: Callable[[float], float], a: float, b: float, *, iters: int = 40) -> float:
    """Minimiser of ``f`` on ``[a, b]``: a 17-point scan, then golden section in the best bracket."""
    grid = np.linspace(a, b, 17)
    vals = [f(float(x)) for x in grid]
    i = int(np.argmin(vals))
    a, b = float(grid[max(i - 1, 0)]), float(grid[min(i + 1, 16)])
    g = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return 0.5 * (a + b)


# --------------------------------------------------------------------------- Monte Carlo


class MonteCarloNQM:
    """One sampled NQM run: real minibatch gradients for the library's estimator.

    ``theta_{i,0} ~ N(0, v_{i,0})``; the gradient of a microbatch of ``m``
    examples is ``h * theta + xi`` with ``xi_i ~ N(0, sigma_i^2 / m)`` (the mean
    of ``m`` independent per-example noises). Averaged over seeds the loss
    follows :class:`ExactNQM` exactly.

    Typical loop (what :func:`run_online` does)::

        mc = MonteCarloNQM(seed=0)
        g = mc.microbatch_gradients(num_micro, micro_batch)   # (K, dims)
        small = (g**2).sum(1).mean(); big = (g.mean(0)**2).sum()
        mc.apply(g.mean(0))
        mc.loss()

    Args:
        config: the spectrum (default: :class:`NQMConfig`).
        seed: seed of the generator (initial point and all gradient noise).
    """

    def __init__(self, config: NQMConfig | None = None, *, seed: int = 0) -> None:
        if config is not None and not isinstance(config, NQMConfig):
            raise TypeError(f"config={config!r} has type {type(config).__name__}; expected NQMConfig or None")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"seed={seed!r} has type {type(seed).__name__}; expected an int")
        self.config = config or NQMConfig()
        self._spec = Spectrum(self.config)
        self._rng = np.random.default_rng(int(seed))
        self._sigma = np.sqrt(self._spec.sigma2)
        self.theta = np.sqrt(self._spec.v0) * self._rng.standard_normal(self.config.dims)
        self.steps = 0
        self.tokens_seen = 0.0
        self._drawn = False

    @property
    def trace_cov(self) -> float:
        """``tr(Sigma) = sum sigma_i^2`` (per-example)."""
        return self._spec.trace_cov

    def microbatch_gradients(self, num_micro: int, micro_batch: float) -> np.ndarray:
        """``num_micro`` microbatch gradients at the current iterate, shape ``(num_micro, dims)``.

        Each is the mean gradient of ``micro_batch`` fresh examples. Counts
        ``num_micro * micro_batch`` samples into :attr:`tokens_seen`.
        """
        if isinstance(num_micro, bool) or not isinstance(num_micro, (int, np.integer)):
            raise TypeError(f"num_micro={num_micro!r} has type {type(num_micro).__name__}; expected an int")
        if num_micro < 1:
            raise ValueError(f"num_micro={num_micro!r} must be >= 1")
        m = _positive("micro_batch", micro_batch)
        noise = self._rng.standard_normal((int(num_micro), self.config.dims)) * (self._sigma / math.sqrt(m))
        self.tokens_seen += num_micro * m
        self._drawn = True
        return noise + self._spec.h * self.theta

    def apply(self, mean_gradient: np.ndarray, lr: float | None = None) -> None:
        """``theta <- theta - lr * mean_gradient`` (``lr`` defaults to the config's ``eta``)."""
        g = np.asarray(mean_gradient, dtype=np.float64)
        if g.shape != self.theta.shape:
            raise ValueError(f"mean_gradient has shape {g.shape}; expected {self.theta.shape}")
        if not self._drawn:
            raise RuntimeError("apply() called before microbatch_gradients(): no gradient was drawn for this step")
        step = self._spec.lr if lr is None else _positive("lr", lr)
        self.theta = self.theta - step * g
        self.steps += 1
        self._drawn = False

    def loss(self) -> float:
        """``1/2 sum h_i theta_i^2`` at the current iterate."""
        return float(0.5 * np.dot(self._spec.h, self.theta**2))

    def grad_sq_norm(self) -> float:
        """True ``|G|^2 = sum h_i^2 theta_i^2`` at the current iterate."""
        return float(np.dot(self._spec.h**2, self.theta**2))

    def noise_scale(self) -> float:
        """True ``B_simple = tr(Sigma)/|G|^2`` at the current iterate."""
        return self._spec.trace_cov / self.grad_sq_norm()


# --------------------------------------------------------------------------- online runner


@dataclass(frozen=True)
class OnlineObservation:
    """What an online policy sees after each step (all sizes in samples).

    Attributes:
        step: steps done (1 after the first).
        tokens_seen: samples consumed so far.
        budget: total samples of the run.
        batch: batch of the step just done (``B_big``).
        loss: exact model: expected loss; Monte Carlo: the sampled run's loss.
        grad_sq_norm: exact ``E|G|^2`` (exact model) or the true ``|G|^2`` at the sampled iterate.
        trace_cov: ``tr(Sigma)``.
        noise_scale: ``trace_cov / grad_sq_norm`` (the truth, not an estimate).
        micro_sq_norms: Monte Carlo only: ``|g_k|^2`` of the step's ``K`` microbatch gradients.
        big_sq_norm: Monte Carlo only: ``|mean_k g_k|^2``.
        micro_batch: Monte Carlo only: samples per microbatch (``B_small``).
    """

    step: int
    tokens_seen: float
    budget: float
    batch: float
    loss: float
    grad_sq_norm: float
    trace_cov: float
    noise_scale: float
    micro_sq_norms: np.ndarray | None = field(default=None, repr=False)
    big_sq_norm: float | None = None
    micro_batch: float | None = None

    @property
    def remaining(self) -> float:
        """Samples left in the budget."""
        return self.budget - self.tokens_seen

    @property
    def small_sq_norm(self) -> float | None:
        """Mean of :attr:`micro_sq_norms` (the estimator's ``small_sq_norm``), or ``None``."""
        return None if self.micro_sq_norms is None else float(np.mean(self.micro_sq_norms))


class OnlinePolicy(Protocol):
    """Picks the next batch: ``policy(observation) -> float`` (samples; ``None`` keeps the batch)."""

    def __call__(self, observation: OnlineObservation) -> float | None: ...


@dataclass(frozen=True)
class OnlineRun:
    """The result of :func:`run_online`.

    Attributes:
        model: ``"exact"`` or ``"monte_carlo"``.
        final_loss: the model's loss at the end (sampled for Monte Carlo).
        expected_final_loss: the exact model's expected loss of the same batch sequence.
        steps: steps taken.
        batches: per-step batches (sum = budget).
        losses: per-step loss (as in :attr:`OnlineObservation.loss`).
        noise_scales: per-step true noise scale.
    """

    model: Literal["exact", "monte_carlo"]
    final_loss: float
    expected_final_loss: float
    steps: int
    batches: np.ndarray = field(repr=False)
    losses: np.ndarray = field(repr=False)
    noise_scales: np.ndarray = field(repr=False)

    def as_row(self, name: str, label: str, note: str = "") -> ScheduleResult:
        """A comparison row (its ``final_loss`` is :attr:`expected_final_loss`, comparable to the others)."""
        return ScheduleResult(
            name=name, label=label, final_loss=self.expected_final_loss, steps=self.steps,
            batches=self.batches, note=note,
        )


def run_online(
    policy: OnlinePolicy,
    *,
    budget: float = DEFAULT_BUDGET,
    initial_batch: float = DEFAULT_B_MIN,
    model: Literal["exact", "monte_carlo"] = "exact",
    config: NQMConfig | None = None,
    seed: int = 0,
    micro_batch: float | None = None,
) -> OnlineRun:
    """Spend ``budget`` samples on an NQM, asking ``policy`` for the batch after every step.

    The first step uses ``initial_batch``. After each step the policy gets an
    :class:`OnlineObservation` and returns the next batch (``None``: keep it).
    The last step is cut to what is left of the budget, so the total is exact.

    ``model="exact"``: the expected dynamics (:meth:`ExactNQM.step`); the policy
    sees the exact loss and noise scale, no sampled norms (any positive real
    batch is allowed). ``model="monte_carlo"``: one sampled run
    (:class:`MonteCarloNQM`, ``seed``); each step draws
    ``K = max(1, round(batch / micro_batch))`` microbatch gradients, so the
    batch is rounded to a multiple of ``micro_batch`` (default
    ``initial_batch / 4``: ``K = 4`` at the start); the policy also sees the
    ``K`` squared microbatch norms and the big-batch norm, ready for
    ``NoiseScaleEstimator.update(obs.small_sq_norm, obs.big_sq_norm,
    obs.micro_batch, obs.batch)``.

    Raises:
        ValueError: bad budget/batch/model, or the policy returns a non-positive
            or non-finite batch.
    """
    d = _positive("budget", budget)
    b = _positive("initial_batch", initial_batch)
    if model not in ("exact", "monte_carlo"):
        raise ValueError(f"model={model!r} is not one of ['exact', 'monte_carlo']")
    exact = ExactNQM(config)
    batches: list[float] = []
    losses: list[float] = []
    scales: list[float] = []
    tokens = 0.0
    if model == "exact":
        while tokens < d * (1 - 1e-12):
            b_step = min(b, d - tokens)
            st = exact.step(b_step)
            tokens = st.tokens_seen
            batches.append(b_step)
            losses.append(st.loss)
            scales.append(st.noise_scale)
            obs = OnlineObservation(
                step=st.step, tokens_seen=tokens, budget=d, batch=b_step, loss=st.loss,
                grad_sq_norm=st.grad_sq_norm, trace_cov=st.trace_cov, noise_scale=st.noise_scale,
            )
            b = _next_batch(policy, obs, b)
        final = losses[-1]
    else:
        m = _positive("micro_batch", micro_batch) if micro_batch is not None else b / 4.0
        mc = MonteCarloNQM(config, seed=seed)
        while tokens < d * (1 - 1e-12):
            k = max(1, int(round(b / m)))
            b_step, m_step = k * m, m
            rest = d - tokens
            if b_step >= rest * (1 - 1e-12):
                b_step = rest
                k = max(1, int(round(rest / m)))
                m_step = rest / k
            g = mc.microbatch_gradients(k, m_step)
            micro_sq = np.einsum("kd,kd->k", g, g)
            mean = g.mean(axis=0)
            mc.apply(mean)
            tokens = mc.tokens_seen
            loss = mc.loss()
            grad_sq = mc.grad_sq_norm()
            batches.append(b_step)
            losses.append(loss)
            scales.append(mc.trace_cov / grad_sq)
            obs = OnlineObservation(
                step=mc.steps, tokens_seen=tokens, budget=d, batch=b_step, loss=loss,
                grad_sq_norm=grad_sq, trace_cov=mc.trace_cov, noise_scale=mc.trace_cov / grad_sq,
                micro_sq_norms=micro_sq, big_sq_norm=float(np.dot(mean, mean)), micro_batch=m_step,
            )
            b = _next_batch(policy, obs, b)
        final = losses[-1]
    arr = np.asarray(batches)
    return OnlineRun(
        model=model,
        final_loss=float(final),
        expected_final_loss=exact.final_loss(arr),
        steps=arr.size,
        batches=arr,
        losses=np.asarray(losses),
        noise_scales=np.asarray(scales),
    )


def _next_batch(policy: OnlinePolicy, obs: OnlineObservation, current: float) -> float:
    out = policy(obs)
    if out is None:
        return current
    value = float(out)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"the policy returned batch={out!r} at step {obs.step}; expected a finite number > 0")
    return value


# --------------------------------------------------------------------------- comparison


@dataclass(frozen=True)
class RowContext:
    """What a registered row function gets (see :func:`register_row`).

    Attributes:
        model: the exact model (fresh state; :meth:`ExactNQM.reset` it if you step it).
        budget: samples every row must spend.
        b_min: smallest batch.
        b_max: largest batch.
        exponents: measured ``s`` and ``beta``.
        rows: the rows computed so far, by name (``constant``, ``two_stage``,
            ``doubling``, ``optimal``, ``planner`` and earlier registered rows).
    """

    model: ExactNQM
    budget: float
    b_min: float
    b_max: float
    exponents: Exponents
    rows: dict[str, ScheduleResult]


RowFunction = Callable[[RowContext], "ScheduleResult | Iterable[ScheduleResult] | None"]
_EXTRA_ROWS: dict[str, RowFunction] = {}


def register_row(name: str, fn: RowFunction | None = None):  # noqa: ANN201
    """Add a row producer to :func:`compare_schedules` (usable as a decorator).

    ``fn(ctx: RowContext)`` returns a :class:`ScheduleResult` (or several, or
    ``None`` to add nothing); its ``final_loss`` must be the exact model's
    expected loss (``ctx.model.final_loss(batches)``; :meth:`OnlineRun.as_row`
    does it). Rows are added in registration order after the built-in ones;
    registering a name again replaces the function. The command
    ``cbs-tracker nqm`` imports ``cbs_tracker.theory.nqm_online`` (if it exists) before
    comparing, so that module can call ``register_row`` at import time::

        from cbs_tracker.theory.nqm import register_row, run_online

        @register_row("online_exact")
        def _online_exact(ctx):
            run = run_online(my_policy, budget=ctx.budget, initial_batch=ctx.b_min)
            return run.as_row("online_exact", "controller, exact noise scale")
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name={name!r}: expected a non-empty str")

    def deco(f: RowFunction) -> RowFunction:
        if not callable(f):
            raise TypeError(f"register_row({name!r}): {f!r} is not callable")
        _EXTRA_ROWS[name] = f
        return f

    return deco if fn is None else deco(fn)


def unregister_row(name: str) -> None:
    """Remove a registered row (no error if absent)."""
    _EXTRA_ROWS.pop(name, None)


def registered_rows() -> dict[str, RowFunction]:
    """A copy of the registered row functions, in order."""
    return dict(_EXTRA_ROWS)


def load_row_plugins() -> bool:
    """Import ``cbs_tracker.theory.nqm_online`` if it exists (it registers its rows); ``True`` if it did.

    Only that module's absence is tolerated; an error inside it propagates.
    """
    try:
        importlib.import_module(ROW_PLUGIN_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name == ROW_PLUGIN_MODULE:
            return False
        raise
    return True


def compare_schedules(
    budget: float = DEFAULT_BUDGET,
    b_min: float = DEFAULT_B_MIN,
    b_max: float = DEFAULT_B_MAX,
    *,
    model: ExactNQM | None = None,
    extra_rows: bool = True,
) -> Comparison:
    """The schedules at equal budget on the exact NQM.

    Built-in rows: ``constant`` (best ``B = D/T`` over every integer ``T``),
    ``two_stage`` (:meth:`ExactNQM.best_two_stage`), ``doubling`` (the exact
    optimum discretised to ``b_min * 2^j`` at the geometric-mean crossings,
    :func:`cbs_tracker.theory.schedule.doubling_plan_from_batches`), ``optimal``
    (:meth:`ExactNQM.optimal_batches`), ``planner`` (what the FSL planner
    :func:`cbs_tracker.theory.schedule.plan_doubling` prescribes from the measured
    ``s``, ``beta`` and the model's floor ratio alone). Then every registered
    row (after :func:`load_row_plugins`) when ``extra_rows``.
    """
    nqm = model or ExactNQM()
    d, lo, hi = _positive("budget", budget), _positive("b_min", b_min), _positive("b_max", b_max)
    if hi < lo:
        raise ValueError(f"b_max={b_max!r} must be >= b_min={b_min!r}")
    if d < hi:
        raise ValueError(f"budget={budget!r} must be at least one step of b_max={b_max!r}")
    exps = nqm.measure_exponents()
    rows: dict[str, ScheduleResult] = {}

    def add(name: str, label: str, batches: np.ndarray, note: str) -> None:
        rows[name] = ScheduleResult(
            name=name, label=label, final_loss=nqm.final_loss(batches), steps=int(batches.size),
            batches=batches, note=note,
        )

    const = nqm.best_constant(d, lo, hi)
    add("constant", f"best constant B={const[0]:.4g}", const, "B = D/T, best integer T")
    two = nqm.best_two_stage(d, lo, hi)
    add("two_stage", f"two-stage {two[0]:.4g}->{two[-1]:.4g}", two, "best B_1, B_2 and switch")
    opt = nqm.optimal_batches(d, lo, hi)
    plan = doubling_plan_from_batches(opt, lo, hi, budget=d)
    add("doubling", f"doubling {plan.batches[0]:.4g}->{plan.batches[-1]:.4g}", plan.batches_per_step(),
        "optimum's crossings of sqrt(B_j B_j+1)")
    add("optimal", "clipped power law (optimum)", opt, "clip(c sqrt(kappa(T-1-k)))")
    cfg = nqm.config
    floor_ratio = cfg.noise_floor * cfg.floor_batch / lo / cfg.initial_loss
    planned = plan_doubling(d, lo, hi, exps.s, exps.beta, floor_ratio=floor_ratio)
    add("planner", f"FSL planner (s={exps.s:.2f}, beta={exps.beta:.2f})", planned.batches_per_step(),
        "plan_doubling from s, beta, floor ratio only")
    if extra_rows:
        load_row_plugins()
        for name, fn in registered_rows().items():
            ctx = RowContext(model=nqm, budget=d, b_min=lo, b_max=hi, exponents=exps, rows=dict(rows))
            nqm.reset()
            out = fn(ctx)
            if out is None:
                results = []
            elif isinstance(out, ScheduleResult):
                results = [out]
            elif isinstance(out, Iterable):
                results = list(out)
            else:
                results = [out]
            for r in results:
                if not isinstance(r, ScheduleResult):
                    raise TypeError(f"row function {name!r} returned {type(r).__name__}; expected ScheduleResult")
                rows[r.name] = r
        nqm.reset()
    return Comparison(budget=d, b_min=lo, b_max=hi, exponents=exps, rows=tuple(rows.values()))
