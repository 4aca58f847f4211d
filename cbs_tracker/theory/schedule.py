"""The optimal batch-size schedule under a functional scaling law (FSL): pure numpy.

After Wang, Li, Zhou, ..., Wu, *Fast Catch-Up, Late Switching: Optimal Batch Size
Scheduling via Functional Scaling Laws* (2026): the clipped power-law optimum, the
choice of ``T``, the two-stage optimum, the power-of-two doubling plan and the
easy/hard regime test; ``docs/design.md`` (Theory) gives the equations. An online
controller calls ``plan_doubling(budget, b_min, b_max, s, beta)`` once, then
``plan.batch_at_tokens(tokens_seen)`` at each step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import numpy as np

__all__ = [
    "DoublingPlan",
    "PowerLawSchedule",
    "ScalingLaw",
    "SwitchRule",
    "TwoStageSchedule",
    "best_two_stage",
    "doubling_plan",
    "doubling_plan_from_batches",
    "is_hard_regime",
    "optimal_schedule",
    "optimal_steps_exponent",
    "plan_doubling",
    "power_law_exponent",
    "power_law_schedule",
    "regime",
    "solve_batch_scale",
    "two_stage_optimum",
]

SwitchRule = Literal["geometric_mean", "reach"]
_SWITCH_RULES = ("geometric_mean", "reach")

# Power sums sum_{m=1}^{n} m^q are tabulated up to this n and continued with
# Euler-Maclaurin beyond it (error of order n^(q-5)/30240: far below float64 eps
# relative to the sum), so budgets of any size cost O(1) memory.
_TABLE_SIZE = 1 << 16


# --------------------------------------------------------------------------- checks


def _check_real(name: str, value: object, *, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}={value!r} has type {type(value).__name__}; expected a real number ({allowed})")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{name}={value!r} is not finite; expected {allowed}")
    return out


def _check_positive(name: str, value: object) -> float:
    out = _check_real(name, value, allowed="a finite number > 0")
    if out <= 0:
        raise ValueError(f"{name}={value!r} must be > 0")
    return out


def _check_exponents(s: object, beta: object) -> tuple[float, float]:
    s_ = _check_positive("s", s)
    beta_ = _check_real("beta", beta, allowed="a finite number > 1")
    if beta_ <= 1:
        raise ValueError(f"beta={beta!r} must be > 1 (the FSL capacity exponent; the noise kernel must be summable)")
    return s_, beta_


def _check_bounds(budget: object, b_min: object, b_max: object) -> tuple[float, float, float]:
    d = _check_positive("budget", budget)
    lo = _check_positive("b_min", b_min)
    hi = _check_positive("b_max", b_max)
    if hi < lo:
        raise ValueError(f"b_max={b_max!r} must be >= b_min={b_min!r}")
    if d < lo:
        raise ValueError(f"budget={budget!r} is smaller than one step of b_min={b_min!r}")
    return d, lo, hi


# --------------------------------------------------------------------------- exponents


def power_law_exponent(beta: float) -> float:
    """Exponent ``p = 1/(2 beta) - 1`` of the optimum ``b*(t) ∝ (T - t + 1)^p``.

    ``sqrt(K(tau)) = (tau + 1)^((1/beta - 2)/2)``; ``p`` is in ``(-1, -1/2)`` for ``beta > 1``.
    """
    _, beta_ = _check_exponents(1.0, beta)
    return 0.5 / beta_ - 1.0


def optimal_steps_exponent(s: float, beta: float) -> float:
    """Scaling of the optimal number of steps, ``T* ≍ D^(beta / (1 + s beta))``.

    Only the exponent: the constant needs the ratio ``C/A`` (see :func:`optimal_schedule`).
    """
    s_, beta_ = _check_exponents(s, beta)
    return beta_ / (1.0 + s_ * beta_)


def regime(s: float, beta: float) -> Literal["hard", "easy"]:
    """``"hard"`` when ``s <= 1 - 1/beta`` (hold ``B_min``, ramp late; LLMs), else ``"easy"``.

    In the easy regime the optimum grows throughout; in the hard one
    the unconstrained optimum wants ever more steps and the lower batch bound
    makes it "stable, then growth" (the batch-size analogue of WSD).
    """
    s_, beta_ = _check_exponents(s, beta)
    return "hard" if s_ <= 1.0 - 1.0 / beta_ else "easy"


def is_hard_regime(s: float, beta: float) -> bool:
    """``True`` when ``s <= 1 - 1/beta`` (see :func:`regime`)."""
    return regime(s, beta) == "hard"


# --------------------------------------------------------------------------- power sums


@lru_cache(maxsize=32)
def _power_table(q: float) -> np.ndarray:
    """``table[n] = sum_{m=1}^{n} m^q`` for ``n = 0.._TABLE_SIZE`` (cached per exponent)."""
    m = np.arange(1, _TABLE_SIZE + 1, dtype=np.float64)
    table = np.empty(_TABLE_SIZE + 1)
    table[0] = 0.0
    np.cumsum(m**q, out=table[1:])
    table.setflags(write=False)
    return table


def _power_sum(q: float, n: np.ndarray | int) -> np.ndarray:
    """``sum_{m=1}^{n} m^q`` for integer ``n >= 0`` (vectorised); exact table, then Euler-Maclaurin."""
    n_arr = np.asarray(n, dtype=np.int64)
    table = _power_table(q)
    small = n_arr <= _TABLE_SIZE
    out = np.empty(n_arr.shape, dtype=np.float64)
    out[small] = table[n_arr[small]]
    if not np.all(small):
        b = n_arr[~small].astype(np.float64)
        a = float(_TABLE_SIZE + 1)
        if q == -1.0:
            integral = np.log(b / a)
        else:
            integral = (b ** (q + 1) - a ** (q + 1)) / (q + 1)
        d1 = q * (b ** (q - 1) - a ** (q - 1))
        d3 = q * (q - 1) * (q - 2) * (b ** (q - 3) - a ** (q - 3))
        out[~small] = table[-1] + integral + 0.5 * (a**q + b**q) + d1 / 12.0 - d3 / 720.0
    return out


# --------------------------------------------------------------------------- the law


@dataclass(frozen=True, kw_only=True)
class ScalingLaw:
    """The FSL excess loss ``E[T, b] = A T^(-s) + C sum_t K(T - t)/b(t)``.

    ``K(tau) = (tau + 1)^(1/beta - 2)`` (Li, Wang, ..., Wu 2026). Only
    the ratio ``C/A`` changes which schedule is optimal; ``A`` sets the loss scale.

    Attributes:
        s: source exponent, ``> 0``.
        beta: capacity exponent, ``> 1``.
        signal_coef: ``A``, the signal term's scale (loss units), ``> 0``.
        noise_coef: ``C``, the noise term's scale (loss units times batch units), ``> 0``.
            A constant batch ``B`` run long enough ends on the noise floor
            ``C zeta(2 - 1/beta) / B``.
    """

    s: float
    beta: float
    signal_coef: float = 1.0
    noise_coef: float = 1.0

    def __post_init__(self) -> None:
        _check_exponents(self.s, self.beta)
        _check_positive("signal_coef", self.signal_coef)
        _check_positive("noise_coef", self.noise_coef)

    @property
    def kernel_exponent(self) -> float:
        """``q = 1/beta - 2`` in ``K(tau) = (tau + 1)^q``."""
        return 1.0 / self.beta - 2.0

    def kernel(self, tau: np.ndarray | float) -> np.ndarray:
        """``K(tau) = (tau + 1)^(1/beta - 2)``."""
        return (np.asarray(tau, dtype=np.float64) + 1.0) ** self.kernel_exponent

    def noise_floor(self, batch: float) -> float:
        """Loss floor of an infinitely long constant-batch run: ``C sum_{j>=0} K(j) / B``."""
        q = self.kernel_exponent
        # zeta(-q) via the power sum at a large n plus the integral tail n^(q+1)/(-(q+1)).
        n = 1 << 40
        zeta = float(_power_sum(q, n)) + (n + 0.5) ** (q + 1) / (-(q + 1))
        return self.noise_coef * zeta / float(batch)

    def excess_loss(self, batches: np.ndarray) -> float:
        """``E[T, b]`` of a per-step schedule (``batches[t-1] = b(t)``, ``T = len(batches)``)."""
        b = np.asarray(batches, dtype=np.float64)
        if b.ndim != 1 or b.size == 0 or np.any(b <= 0):
            raise ValueError("batches must be a non-empty 1-D array of positive batch sizes")
        t_total = b.size
        # K(T - t) for t = 1..T is (T - t + 1)^q = m^q with m = T..1.
        kern = np.arange(t_total, 0, -1, dtype=np.float64) ** self.kernel_exponent
        return float(self.signal_coef * t_total ** (-self.s) + self.noise_coef * np.sum(kern / b))

    def constant_batch_loss(self, batch: float, budget: float) -> float:
        """``E`` of the constant batch ``B`` for ``T = budget / B`` steps (``T`` rounded down, >= 1)."""
        t_total = max(1, int(math.floor(budget / batch + 1e-9)))
        noise = float(_power_sum(self.kernel_exponent, t_total)) / batch
        return float(self.signal_coef * t_total ** (-self.s) + self.noise_coef * noise)

    @classmethod
    def from_noise_floor(
        cls, *, s: float, beta: float, b_min: float, floor_ratio: float = 0.5, signal_coef: float = 1.0
    ) -> ScalingLaw:
        """The law whose constant-``b_min`` noise floor is ``floor_ratio * A`` (``A`` = initial excess loss).

        ``C = floor_ratio * A * b_min / zeta(2 - 1/beta)``. The default NQM has
        ``floor_ratio = 0.5`` (loss 1 at the start, floor 0.5 at ``B_min = 8``).
        """
        _check_positive("floor_ratio", floor_ratio)
        unit = cls(s=s, beta=beta, signal_coef=signal_coef, noise_coef=1.0)
        noise_coef = floor_ratio * signal_coef / unit.noise_floor(_check_positive("b_min", b_min))
        return cls(s=s, beta=beta, signal_coef=signal_coef, noise_coef=noise_coef)

    @classmethod
    def from_reference_batch(
        cls, *, s: float, beta: float, reference_batch: float, budget: float, signal_coef: float = 1.0
    ) -> ScalingLaw:
        """The law whose best constant batch at ``budget`` is ``reference_batch``.

        Use the best constant batch a sweep found, or a batch derived from the
        critical batch a run measured where it no longer follows the batch. Solved by
        bisection on ``log(C/A)``: a larger ``C/A`` moves the best constant up.
        """
        s_, beta_ = _check_exponents(s, beta)
        ref = _check_positive("reference_batch", reference_batch)
        d = _check_positive("budget", budget)
        if ref > d:
            raise ValueError(f"reference_batch={reference_batch!r} exceeds budget={budget!r}")

        def best_constant(log_ratio: float) -> float:
            law = cls(s=s_, beta=beta_, signal_coef=1.0, noise_coef=math.exp(log_ratio))
            return _best_constant_batch(law, d, 1e-12 * d, d)

        lo, hi = -80.0, 80.0
        for _ in range(100):
            mid = 0.5 * (lo + hi)
            if best_constant(mid) < ref:
                lo = mid
            else:
                hi = mid
        return cls(s=s_, beta=beta_, signal_coef=signal_coef, noise_coef=signal_coef * math.exp(0.5 * (lo + hi)))


def _best_constant_batch(law: ScalingLaw, budget: float, b_min: float, b_max: float) -> float:
    """Continuous minimiser of the constant-batch loss, ``T = budget/B`` steps (golden section on log B)."""
    q = law.kernel_exponent

    def loss(log_b: float) -> float:
        b = math.exp(log_b)
        t_total = budget / b
        n = max(1, int(t_total))
        # linear interpolation of the power sum between integer step counts keeps it smooth in B
        frac = t_total - n if t_total >= 1 else 0.0
        noise = float(_power_sum(q, n)) + frac * (n + 1) ** q
        return law.signal_coef * max(t_total, 1.0) ** (-law.s) + law.noise_coef * noise / b

    return math.exp(_golden_min(loss, math.log(b_min), math.log(b_max), tol=1e-7))


def _golden_min(f, a: float, b: float, *, tol: float) -> float:  # noqa: ANN001
    """Minimiser of a unimodal ``f`` on ``[a, b]`` by golden-section search (preceded by a coarse scan)."""
    grid = np.linspace(a, b, 65)
    vals = [f(float(x)) for x in grid]
    i = int(np.argmin(vals))
    a, b = float(grid[max(i - 1, 0)]), float(grid[min(i + 1, len(grid) - 1)])
    g = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    while b - a > tol:
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return 0.5 * (a + b)


# --------------------------------------------------------------------------- budget solve


def solve_batch_scale(weights: np.ndarray, budget: float, b_min: float, b_max: float) -> float:
    """The ``c`` with ``sum_k clip(c w_k, b_min, b_max) = budget`` exactly (any positive weights).

    ``sum clip(c w)`` is continuous, piecewise linear and non-decreasing in ``c``:
    bisection on ``log c`` finds the linear piece, then the piece is solved
    exactly, so the budget is met to rounding.

    Raises:
        ValueError: the budget is outside ``[n b_min, n b_max]`` for ``n`` weights.
    """
    w = np.asarray(weights, dtype=np.float64)
    d, lo, hi = _check_bounds(budget, b_min, b_max)
    if w.ndim != 1 or w.size == 0 or np.any(w <= 0) or not np.all(np.isfinite(w)):
        raise ValueError("weights must be a non-empty 1-D array of finite positive numbers")
    n = w.size
    if not (n * lo <= d * (1 + 1e-12) and d <= n * hi * (1 + 1e-12)):
        raise ValueError(
            f"budget={budget!r} cannot be spent in {n} steps with batches in [{b_min!r}, {b_max!r}]"
        )

    def total(c: float) -> float:
        return float(np.clip(c * w, lo, hi).sum())

    c_lo, c_hi = lo / w.max(), hi / w.min()
    for _ in range(200):
        c_mid = math.sqrt(c_lo * c_hi)
        if total(c_mid) < d:
            c_lo = c_mid
        else:
            c_hi = c_mid
        if c_hi <= c_lo * (1 + 1e-15):
            break
    c = math.sqrt(c_lo * c_hi)
    at_hi = c * w >= hi
    at_lo = c * w <= lo
    free = ~(at_hi | at_lo)
    w_free = float(w[free].sum())
    if w_free > 0:
        c_exact = (d - hi * at_hi.sum() - lo * at_lo.sum()) / w_free
        if c_exact > 0:
            c = c_exact
    return c


# --------------------------------------------------------------------------- the optimum


@dataclass(frozen=True)
class PowerLawSchedule:
    """The clipped power law ``b(t) = clip(c (T - t + 1)^p, b_min, b_max)``, ``t = 1..T``.

    ``c`` meets the budget exactly: ``sum_t b(t) = budget``.

    Attributes:
        budget: total tokens (or samples), ``sum_t b(t)``.
        steps: ``T``.
        scale: ``c``.
        exponent: ``p = 1/(2 beta) - 1``.
        b_min: lower clip.
        b_max: upper clip.
        excess_loss: ``E`` under the law it was optimised for, or ``nan`` when built
            for a given ``T`` without a law.
    """

    budget: float
    steps: int
    scale: float
    exponent: float
    b_min: float
    b_max: float
    excess_loss: float = math.nan

    def batch(self, t: np.ndarray | float) -> np.ndarray:
        """``b(t)`` for steps ``t`` (1-indexed, may be fractional)."""
        tt = np.asarray(t, dtype=np.float64)
        return np.clip(self.scale * (self.steps - tt + 1.0) ** self.exponent, self.b_min, self.b_max)

    def batches(self) -> np.ndarray:
        """``b(1..T)`` as an array of length ``T``; sums to ``budget``."""
        return self.batch(np.arange(1, self.steps + 1, dtype=np.float64))

    def tokens_before(self, t: int) -> float:
        """``sum_{u < t} b(u)``: what the schedule has consumed before step ``t`` (1-indexed)."""
        t = int(min(max(t, 1), self.steps + 1))
        return self.budget - _tail_tokens(self, self.steps - t + 1)

    def first_step_at_least(self, batch: float) -> int:
        """First step ``t`` with ``b(t) >= batch`` (``T + 1`` if never).

        From ``t_j = T + 1 - (batch / c)^(1/p)`` rounded up to a step.
        """
        if batch <= self.b_min:
            return 1
        if batch > self.b_max or self.scale <= 0:
            return self.steps + 1
        t_real = self.steps + 1 - (batch / self.scale) ** (1.0 / self.exponent)
        t = max(1, math.ceil(t_real - 1e-9))
        # guard the rounding of the power at an exact boundary
        while t <= self.steps and float(self.batch(t)) < batch * (1 - 1e-12):
            t += 1
        while t > 1 and float(self.batch(t - 1)) >= batch * (1 - 1e-12):
            t -= 1
        return t

    @property
    def hold_steps(self) -> int:
        """Steps at ``b_min`` before the ramp starts (the "stable" part of stable-growth)."""
        return self.first_step_at_least(self.b_min * (1 + 1e-9)) - 1


def _counts(sched_steps: int, scale: float, exponent: float, b_min: float, b_max: float) -> tuple[int, int]:
    """``(n_hi, n_top)``: the last ``n_hi`` steps sit at ``b_max``, the last ``n_top`` are above ``b_min``.

    Counted from the end: ``m = T - t + 1``; ``c m^p >= b_max`` iff ``m <= (c/b_max)^(-1/p)``.
    """
    inv = -1.0 / exponent
    x_hi = (scale / b_max) ** inv if scale > 0 else 0.0
    x_lo = (scale / b_min) ** inv if scale > 0 else 0.0
    n_hi = int(min(sched_steps, math.floor(x_hi)))
    n_top = int(min(sched_steps, math.floor(x_lo)))
    return max(n_hi, 0), max(n_top, n_hi, 0)


def _tail_tokens(sched: PowerLawSchedule, m: int) -> float:
    """Tokens of the last ``m`` steps, ``sum_{m'=1}^{m} clip(c m'^p)`` in closed form."""
    m = int(min(max(m, 0), sched.steps))
    n_hi, n_top = _counts(sched.steps, sched.scale, sched.exponent, sched.b_min, sched.b_max)
    a, b = min(m, n_hi), min(m, n_top)
    p = sched.exponent
    ramp = sched.scale * float(_power_sum(p, b) - _power_sum(p, a))
    return sched.b_max * a + ramp + sched.b_min * (m - b)


def _solve_power_law_scale(steps: int, budget: float, b_min: float, b_max: float, p: float) -> float:
    """Exact ``c`` for ``sum_{m=1}^{T} clip(c m^p) = budget`` in O(log) power-sum calls."""

    def total(c: float) -> tuple[float, int, int]:
        n_hi, n_top = _counts(steps, c, p, b_min, b_max)
        ramp = c * float(_power_sum(p, n_top) - _power_sum(p, n_hi))
        return b_max * n_hi + ramp + b_min * (steps - n_top), n_hi, n_top

    c_lo, c_hi = b_min, b_max * steps ** (-p)
    if total(c_lo)[0] >= budget:
        return c_lo
    for _ in range(400):
        c_mid = math.sqrt(c_lo * c_hi)
        if total(c_mid)[0] < budget:
            c_lo = c_mid
        else:
            c_hi = c_mid
        if c_hi <= c_lo * (1 + 4e-16):
            break
    c = math.sqrt(c_lo * c_hi)
    _, n_hi, n_top = total(c)
    ramp_w = float(_power_sum(p, n_top) - _power_sum(p, n_hi))
    if ramp_w > 0:
        c_exact = (budget - b_max * n_hi - b_min * (steps - n_top)) / ramp_w
        # accept the exact piece only if it keeps the same clip pattern
        if c_exact > 0 and _counts(steps, c_exact, p, b_min, b_max) == (n_hi, n_top):
            c = c_exact
    return c


def power_law_schedule(
    budget: float, b_min: float, b_max: float, beta: float, *, steps: int
) -> PowerLawSchedule:
    """The clipped power law over ``steps`` optimizer steps with ``c`` fixed by the budget.

    ``b(t) = clip(c (T - t + 1)^(1/(2 beta) - 1), b_min, b_max)`` with
    ``sum_{t=1}^{T} b(t) = budget`` exactly (optimal for a fixed ``T``
    by Cauchy-Schwarz).

    Raises:
        ValueError: the budget cannot be spent in ``steps`` steps within the bounds.
        TypeError: ``steps`` is not an integer.
    """
    d, lo, hi = _check_bounds(budget, b_min, b_max)
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)):
        raise TypeError(f"steps={steps!r} has type {type(steps).__name__}; expected an int")
    t_total = int(steps)
    if t_total < 1 or not (t_total * lo <= d * (1 + 1e-12) and d <= t_total * hi * (1 + 1e-12)):
        raise ValueError(
            f"steps={steps!r} cannot spend budget={budget!r} with batches in [{b_min!r}, {b_max!r}]; "
            f"allowed steps are {math.ceil(d / hi)}..{math.floor(d / lo)}"
        )
    p = power_law_exponent(beta)
    c = _solve_power_law_scale(t_total, d, lo, hi, p)
    return PowerLawSchedule(budget=d, steps=t_total, scale=c, exponent=p, b_min=lo, b_max=hi)


def _schedule_loss(law: ScalingLaw, sched: PowerLawSchedule) -> float:
    """``E`` of a clipped power law in closed form (``K/b = sqrt(K)/c`` on the ramp)."""
    q, p = law.kernel_exponent, sched.exponent
    n_hi, n_top = _counts(sched.steps, sched.scale, p, sched.b_min, sched.b_max)
    noise = float(_power_sum(q, n_hi)) / sched.b_max
    noise += float(_power_sum(p, n_top) - _power_sum(p, n_hi)) / sched.scale
    noise += float(_power_sum(q, sched.steps) - _power_sum(q, n_top)) / sched.b_min
    return law.signal_coef * sched.steps ** (-law.s) + law.noise_coef * noise


def optimal_schedule(
    law: ScalingLaw, budget: float, b_min: float, b_max: float, *, steps: int | None = None
) -> PowerLawSchedule:
    """The FSL optimum: the clipped power law at the ``T`` that minimises ``E``.

    For each integer ``T`` in ``[ceil(D/b_max), floor(D/b_min)]`` the budget fixes
    ``c`` exactly and ``E(T)`` is a closed form (power sums); ``T`` is chosen by
    a log-spaced scan and an integer golden-section refinement. ``T*`` scales as
    ``D^(beta/(1 + s beta))`` (:func:`optimal_steps_exponent`).

    Args:
        law: exponents and the ratio ``C/A``.
        budget: tokens (or samples) to spend.
        b_min: smallest batch, same unit.
        b_max: largest batch, same unit.
        steps: use this ``T`` instead of optimising it.
    """
    d, lo, hi = _check_bounds(budget, b_min, b_max)
    p = power_law_exponent(law.beta)
    t_lo, t_hi = max(1, math.ceil(d / hi * (1 - 1e-12))), max(1, math.floor(d / lo * (1 + 1e-12)))

    def build(t: int) -> PowerLawSchedule:
        c = _solve_power_law_scale(t, d, lo, hi, p)
        sched = PowerLawSchedule(budget=d, steps=t, scale=c, exponent=p, b_min=lo, b_max=hi)
        return PowerLawSchedule(
            budget=d, steps=t, scale=c, exponent=p, b_min=lo, b_max=hi, excess_loss=_schedule_loss(law, sched)
        )

    if steps is not None:
        return build(power_law_schedule(d, lo, hi, law.beta, steps=steps).steps)
    t_best = integer_argmin(lambda t: build(t).excess_loss, t_lo, t_hi)
    return build(t_best)


def integer_argmin(f, lo: int, hi: int) -> int:  # noqa: ANN001
    """Argmin of ``f`` over the integers ``lo..hi``: log-spaced scan, then integer golden section."""
    if hi - lo <= 64:
        ts = list(range(lo, hi + 1))
        return ts[int(np.argmin([f(t) for t in ts]))]
    grid = np.unique(np.round(np.geomspace(lo, hi, 257)).astype(np.int64))
    vals = np.array([f(int(t)) for t in grid])
    i = int(np.argmin(vals))
    a, b = int(grid[max(i - 1, 0)]), int(grid[min(i + 1, len(grid) - 1)])
    cache: dict[int, float] = {}

    def g(t: int) -> float:
        if t not in cache:
            cache[t] = f(t)
        return cache[t]

    while b - a > 4:
        m1 = a + (b - a) // 3
        m2 = b - (b - a) // 3
        if g(m1) <= g(m2):
            b = m2
        else:
            a = m1
    ts = list(range(a, b + 1))
    return ts[int(np.argmin([g(t) for t in ts]))]


# --------------------------------------------------------------------------- two stages


@dataclass(frozen=True)
class TwoStageSchedule:
    """One switch ``B_1 -> B_2`` after ``switch_tokens`` tokens (continuous time).

    Attributes:
        budget: ``D``.
        b1: first batch.
        b2: second batch.
        switch_tokens: ``D_1``, tokens spent at ``b1``.
        steps: ``S = D_1/B_1 + (D - D_1)/B_2`` (real-valued).
        stage2_steps: ``R = (D - D_1)/B_2``.
        excess_loss: ``E`` with the integrated kernel.
        interior: the optimum is inside ``(0, D)`` (then the balance equation holds).
        balance_residual: ``(lhs - rhs)/lhs`` of ``A s S^(-s-1) = C [K(S)/B_1 + K(R)/B_2]``.
    """

    budget: float
    b1: float
    b2: float
    switch_tokens: float
    steps: float
    stage2_steps: float
    excess_loss: float
    interior: bool
    balance_residual: float

    @property
    def switch_step(self) -> float:
        """``t_s = D_1 / B_1``."""
        return self.switch_tokens / self.b1

    def batches(self) -> np.ndarray:
        """A per-step schedule: ``round(t_s)`` steps at ``b1``, then ``b2``, the last step takes the rest."""
        n1 = int(round(self.switch_step))
        rest = self.budget - n1 * self.b1
        n2 = max(int(math.floor(rest / self.b2 + 1e-9)), 0)
        tail = rest - n2 * self.b2
        parts = [np.full(n1, self.b1), np.full(n2, self.b2)]
        if tail > 1e-9 * self.b2:
            parts.append(np.array([tail]))
        return np.concatenate(parts)


def two_stage_optimum(law: ScalingLaw, budget: float, b1: float, b2: float) -> TwoStageSchedule:
    """The best switch point for ``B_1 -> B_2`` under the continuous-time FSL.

    ``E(D_1) = A S^(-s) + (C/B_1) int_R^S K + (C/B_2) int_0^R K``, so
    ``dE/dD_1 = (1/B_1 - 1/B_2) [C K(S)/B_1 + C K(R)/B_2 - A s S^(-s-1)]``: an
    interior minimum is a sign change of the bracket from - to + (the balance
    equation). Scans ``D_1`` on a grid, refines each such sign change
    by bisection and keeps the smallest ``E`` among them and the two ends.
    """
    d = _check_positive("budget", budget)
    b1_ = _check_positive("b1", b1)
    b2_ = _check_positive("b2", b2)
    if b2_ <= b1_:
        raise ValueError(f"b2={b2!r} must be > b1={b1!r}")
    a_coef, c_coef, s, q = law.signal_coef, law.noise_coef, law.s, law.kernel_exponent

    def parts(d1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        big_s = d1 / b1_ + (d - d1) / b2_
        r = (d - d1) / b2_
        return big_s, r

    def int_k(x: np.ndarray) -> np.ndarray:
        return ((x + 1.0) ** (q + 1.0) - 1.0) / (q + 1.0)

    def loss(d1: np.ndarray) -> np.ndarray:
        big_s, r = parts(d1)
        return a_coef * big_s ** (-s) + c_coef * ((int_k(big_s) - int_k(r)) / b1_ + int_k(r) / b2_)

    def bracket(d1: np.ndarray) -> np.ndarray:
        big_s, r = parts(d1)
        return c_coef * ((big_s + 1) ** q / b1_ + (r + 1) ** q / b2_) - a_coef * s * big_s ** (-s - 1)

    grid = d * np.linspace(0.0, 1.0, 4097)
    sign = np.sign(bracket(grid))
    candidates = [0.0, d]
    for i in np.nonzero((sign[:-1] < 0) & (sign[1:] > 0))[0]:
        lo, hi = float(grid[i]), float(grid[i + 1])
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if bracket(np.array(mid)) < 0:
                lo = mid
            else:
                hi = mid
        candidates.append(0.5 * (lo + hi))
    losses = [float(loss(np.array(x))) for x in candidates]
    k = int(np.argmin(losses))
    d1 = candidates[k]
    big_s, r = (float(v) for v in parts(np.array(d1)))
    lhs = a_coef * s * big_s ** (-s - 1)
    rhs = c_coef * ((big_s + 1) ** q / b1_ + (r + 1) ** q / b2_)
    return TwoStageSchedule(
        budget=d,
        b1=b1_,
        b2=b2_,
        switch_tokens=d1,
        steps=big_s,
        stage2_steps=r,
        excess_loss=losses[k],
        interior=k >= 2,
        balance_residual=(lhs - rhs) / lhs,
    )


def best_two_stage(
    law: ScalingLaw, budget: float, b_min: float, b_max: float, *, factor: float = 2.0
) -> TwoStageSchedule:
    """The best :func:`two_stage_optimum` over rungs ``B_1 < B_2`` in ``b_min * factor^j <= b_max``."""
    _, lo, hi = _check_bounds(budget, b_min, b_max)
    rungs = _rungs(lo, hi, factor)
    best: TwoStageSchedule | None = None
    for i, b1 in enumerate(rungs):
        for b2 in rungs[i + 1 :]:
            cand = two_stage_optimum(law, budget, b1, b2)
            if best is None or cand.excess_loss < best.excess_loss:
                best = cand
    if best is None:
        raise ValueError(f"b_min={b_min!r} and b_max={b_max!r} leave no two batch sizes a factor {factor!r} apart")
    return best


# --------------------------------------------------------------------------- doubling


def _rungs(b_min: float, b_max: float, factor: float) -> list[float]:
    factor = _check_real("factor", factor, allowed="a finite number > 1")
    if factor <= 1:
        raise ValueError(f"factor={factor!r} must be > 1")
    out = [b_min]
    while out[-1] * factor <= b_max * (1 + 1e-12):
        out.append(out[-1] * factor)
    return out


@dataclass(frozen=True)
class DoublingPlan:
    """A power-of-two (``factor``) staircase taken from a continuous optimum.

    The batch is ``batches[0]`` from the start and becomes ``batches[j]`` once
    ``switch_tokens[j-1]`` tokens have been consumed (``z_j``);
    :meth:`batches_per_step` is that schedule in whole steps spending the budget
    exactly (each change at the step boundary nearest to ``z_j``).

    Attributes:
        budget: total tokens (or samples).
        batches: the rungs used, increasing (``B_0 = b_min`` unless the optimum starts above it).
        switch_tokens: ``z_1 < z_2 < ...``: tokens consumed when ``batches[j]`` starts.
        switch_steps: the optimum's step at which it crosses the threshold of ``batches[j]``.
        source_steps: ``T`` of the optimum the plan was taken from.
        steps: optimizer steps the staircase takes to spend the budget.
        factor: ratio of consecutive rungs.
        switch_at: ``"geometric_mean"`` or ``"reach"``.
    """

    budget: float
    batches: tuple[float, ...]
    switch_tokens: tuple[float, ...]
    switch_steps: tuple[int, ...]
    source_steps: int
    steps: int
    factor: float = 2.0
    switch_at: SwitchRule = "geometric_mean"

    def batch_at_tokens(self, tokens: np.ndarray | float) -> np.ndarray | float:
        """The plan's batch once ``tokens`` have been consumed (scalar in, scalar out).

        This is the call an online controller makes before each step:
        ``batch = plan.batch_at_tokens(tokens_seen)``.
        """
        idx = np.searchsorted(np.asarray(self.switch_tokens, dtype=np.float64), tokens, side="right")
        out = np.asarray(self.batches, dtype=np.float64)[idx]
        return float(out) if np.ndim(out) == 0 else out

    def next_switch_tokens(self, tokens: float) -> float | None:
        """Token position of the next change after ``tokens`` (``None`` after the last one)."""
        for z in self.switch_tokens:
            if z > tokens:
                return float(z)
        return None

    @property
    def switch_fractions(self) -> tuple[float, ...]:
        """``z_j / budget``: where in the run each change happens."""
        return tuple(z / self.budget for z in self.switch_tokens)

    def batches_per_step(self) -> np.ndarray:
        """The staircase as a per-step array summing to ``budget`` exactly.

        Every stage after the first is a whole number of steps at its rung and
        starts within half a step of its ``z_j``; see ``_staircase`` for the rounding.
        """
        return _staircase(self.batches, self.switch_tokens, self.budget)


def _staircase(batches: tuple[float, ...], switch_tokens: tuple[float, ...], budget: float) -> np.ndarray:
    """Per-step batches of a staircase that spends ``budget`` exactly, every rung kept exact.

    Built backwards from the end: stage ``j`` (``j >= 1``) takes
    ``n_j = round((e_j - z_j) / B_j)`` whole steps of ``B_j`` ending at ``e_j``
    (``e_last = budget``), so it starts within ``B_j / 2`` tokens of ``z_j``; the
    first stage fills what is left with ``B_0`` steps. When that rest is not a
    multiple of ``B_0`` (a budget that is not a multiple of the smallest
    batch), the remainder ``r < B_0`` is spread over the first stage
    (``B_0 + r / n_0`` per step), where the noise it adds is forgotten by the end.
    """
    ends = budget
    tail: list[np.ndarray] = []
    for b, z in zip(reversed(batches[1:]), reversed(switch_tokens[: len(batches) - 1]), strict=True):
        n = max(int(round((ends - z) / b)), 0)
        n = min(n, int(math.floor(ends / b + 1e-9)))
        if n:
            tail.append(np.full(n, b))
            ends -= n * b
    b0 = batches[0]
    n0 = int(math.floor(ends / b0 + 1e-9))
    rest = ends - n0 * b0
    if n0 >= 1:
        head = np.full(n0, b0 + max(rest, 0.0) / n0)
    elif ends > 0:
        head = np.array([ends])
    else:
        head = np.zeros(0)
    return np.concatenate([head, *reversed(tail)])


def _thresholds(rungs: list[float], switch_at: str) -> list[float]:
    if switch_at not in _SWITCH_RULES:
        raise ValueError(f"switch_at={switch_at!r} is not one of {list(_SWITCH_RULES)}")
    if switch_at == "reach":
        return rungs[1:]
    return [math.sqrt(a * b) for a, b in zip(rungs[:-1], rungs[1:], strict=True)]


def _make_plan(
    budget: float,
    rungs: list[float],
    first_steps: list[int],
    tokens_before: list[float],
    source_steps: int,
    factor: float,
    switch_at: SwitchRule,
) -> DoublingPlan:
    batches = [rungs[0]]
    switch_tokens: list[float] = []
    switch_steps: list[int] = []
    for rung, t, z in zip(rungs[1:], first_steps, tokens_before, strict=True):
        if t > source_steps:
            break
        if z <= 0:
            batches[0] = rung  # the optimum already starts above this threshold
            continue
        batches.append(rung)
        switch_tokens.append(z)
        switch_steps.append(t)
    steps = _staircase(tuple(batches), tuple(switch_tokens), budget).size
    return DoublingPlan(
        budget=budget,
        batches=tuple(batches),
        switch_tokens=tuple(switch_tokens),
        switch_steps=tuple(switch_steps),
        source_steps=source_steps,
        steps=steps,
        factor=factor,
        switch_at=switch_at,
    )


def doubling_plan(
    schedule: PowerLawSchedule, *, factor: float = 2.0, switch_at: SwitchRule = "geometric_mean"
) -> DoublingPlan:
    """Discretise a clipped power law onto rungs ``b_min * factor^j <= b_max``.

    The switch to rung ``B_j`` happens at the first step ``t_j`` where the optimum
    ``b*(t)`` reaches the threshold ``theta_j``, at token position
    ``z_j = sum_{t < t_j} b*(t)`` (``t_j = T + 1 - (theta_j/c)^(1/p)``).

    * ``switch_at="geometric_mean"`` (default): ``theta_j = sqrt(B_(j-1) B_j)``.
      With the budget's Lagrange multiplier ``lambda``, the optimum has
      ``K/b*^2 = lambda``; moving a staircase boundary from ``B`` to ``2B`` by
      one token changes ``E`` by ``K (1/B - 1/(2B)) / ... - lambda (2B - B)/...``,
      zero where ``K = 2 lambda B^2``, i.e. where ``b* = sqrt(2) B``.
    * ``switch_at="reach"``: ``theta_j = B_j`` (the closed form read literally;
      the staircase then stays below the optimum).
    """
    rungs = _rungs(schedule.b_min, schedule.b_max, factor)
    firsts = [schedule.first_step_at_least(th) for th in _thresholds(rungs, switch_at)]
    tokens = [schedule.tokens_before(t) if t <= schedule.steps else schedule.budget for t in firsts]
    return _make_plan(schedule.budget, rungs, firsts, tokens, schedule.steps, factor, switch_at)


def doubling_plan_from_batches(
    batches: np.ndarray,
    b_min: float,
    b_max: float,
    *,
    factor: float = 2.0,
    switch_at: SwitchRule = "geometric_mean",
    budget: float | None = None,
) -> DoublingPlan:
    """The same discretisation for any non-decreasing per-step optimum (e.g. the NQM's exact one).

    Args:
        batches: ``b*(1..T)``, non-decreasing; its sum is the budget.
        b_min: first rung.
        b_max: rungs stop at ``b_max``.
        factor: ratio of consecutive rungs.
        switch_at: see :func:`doubling_plan`.
        budget: the budget to spend (default ``sum(batches)``; pass the exact
            number to avoid the rounding of the sum).
    """
    b = np.asarray(batches, dtype=np.float64)
    if b.ndim != 1 or b.size == 0 or np.any(np.diff(b) < -1e-9 * b[1:]):
        raise ValueError("batches must be a non-empty, non-decreasing 1-D array")
    _, lo, hi = _check_bounds(float(b.sum()), b_min, b_max)
    rungs = _rungs(lo, hi, factor)
    cum = np.concatenate([[0.0], np.cumsum(b)])
    firsts, tokens = [], []
    for th in _thresholds(rungs, switch_at):
        idx = int(np.searchsorted(b, th * (1 - 1e-12), side="left"))  # 0-based first index >= th
        firsts.append(idx + 1)
        tokens.append(float(cum[idx]))
    total = float(cum[-1]) if budget is None else _check_positive("budget", budget)
    return _make_plan(total, rungs, firsts, tokens, b.size, factor, switch_at)


def plan_doubling(
    budget: float,
    b_min: float,
    b_max: float,
    s: float,
    beta: float,
    *,
    reference_batch: float | None = None,
    floor_ratio: float = 0.5,
    steps: int | None = None,
    law: ScalingLaw | None = None,
    factor: float = 2.0,
    switch_at: SwitchRule = "geometric_mean",
) -> DoublingPlan:
    """The doubling plan of the FSL optimum: the planner an online controller calls.

    ``plan_doubling(budget_tokens, b_min, b_max, s, beta).batch_at_tokens(tokens_seen)``
    is the batch the theory prescribes at ``tokens_seen``; ``plan.switch_tokens``
    are the token positions of the doublings. All sizes share one unit (tokens
    or samples).

    The exponents fix the *shape*; the one scale the FSL leaves free (``C/A``,
    hence ``T`` and where the ramp starts) comes from, in this order:

    0. ``law``: a :class:`ScalingLaw` fitted elsewhere (e.g. to the run's own
       loss curve); its ``s`` and ``beta`` must equal the arguments;
    1. ``steps``: use this ``T`` (with the law of 2. or 3. for nothing else);
    2. ``reference_batch``: the best constant batch at this budget (a sweep's
       winner, or a measured critical batch that no longer follows the batch):
       :meth:`ScalingLaw.from_reference_batch`;
    3. ``floor_ratio`` (default 0.5): a constant ``b_min`` run would level off at
       ``floor_ratio`` times the initial excess loss
       (:meth:`ScalingLaw.from_noise_floor`; the default NQM has 0.5).

    Args:
        budget: total tokens (or samples) the run will consume.
        b_min: smallest (starting) batch.
        b_max: largest batch.
        s: source exponent, ``> 0``.
        beta: capacity exponent, ``> 1``.
        reference_batch: see above.
        floor_ratio: see above.
        steps: see above.
        law: see above.
        factor: ratio of consecutive rungs (2 for doubling).
        switch_at: ``"geometric_mean"`` or ``"reach"`` (:func:`doubling_plan`).
    """
    d, lo, hi = _check_bounds(budget, b_min, b_max)
    _thresholds(_rungs(lo, hi, factor), switch_at)  # check factor and switch_at before the work
    if law is not None:
        if not isinstance(law, ScalingLaw):
            raise TypeError(f"law={law!r} has type {type(law).__name__}; expected ScalingLaw or None")
        if (law.s, law.beta) != (float(s), float(beta)):
            raise ValueError(f"law has s={law.s!r}, beta={law.beta!r} but plan_doubling got s={s!r}, beta={beta!r}")
    elif reference_batch is not None:
        law = ScalingLaw.from_reference_batch(s=s, beta=beta, reference_batch=reference_batch, budget=d)
    else:
        law = ScalingLaw.from_noise_floor(s=s, beta=beta, b_min=lo, floor_ratio=floor_ratio)
    sched = optimal_schedule(law, d, lo, hi, steps=steps)
    return doubling_plan(sched, factor=factor, switch_at=switch_at)
