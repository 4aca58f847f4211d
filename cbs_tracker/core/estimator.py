"""The gradient noise scale from small- and big-batch squared gradient norms (pure math).

McCandlish et al. 2018, App. A: ``E|G_B|^2 = |G|^2 + tr(Sigma)/B``, so one step's
``K`` microbatch norms and their mean's norm give unbiased estimates of ``|G|^2``
and ``tr(Sigma)`` (:func:`estimate_from_norms`). :class:`NoiseScaleEstimator`
averages the two separately with a decay per unit, divides, reports a 90%
confidence interval of the ratio, and by default sets its memory from the
measured noise so that the ratio reaches a target relative error.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from cbs_tracker.core.intervals import Z as _Z
from cbs_tracker.core.intervals import fieller_interval
from cbs_tracker.core.intervals import student_quantile as _student_quantile
from cbs_tracker.core.window import DriftWindow

ESTIMATOR_STATE_VERSION = 3
# Weight the steps without second moments (a state of version 1) may still hold before an
# interval is reported again.
_MAX_UNCOVERED_WEIGHT = 0.05

Memory = Literal["window", "adaptive", "fixed"]


@dataclass(frozen=True)
class StepEstimate:
    """One optimizer step's own unbiased estimates (noisy; either may be negative).

    Attributes:
        grad_sq_norm: estimate of ``|G|^2``.
        trace_cov: estimate of ``tr(Sigma)``, in squared-gradient units times the size unit.
        small_batch: ``B_small`` used (harmonic mean of the microbatch sizes).
        big_batch: ``B_big = K * B_small``.
    """

    grad_sq_norm: float
    trace_cov: float
    small_batch: float
    big_batch: float


def estimate_from_norms(
    small_sq_norm: float, big_sq_norm: float, small_batch: float, big_batch: float
) -> StepEstimate:
    """Unbiased ``|G|^2`` and ``tr(Sigma)`` from one small and one big batch norm.

    McCandlish et al. 2018, App. A, eqs. A.1–A.2::

        |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
        tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)

    With microbatch sizes ``b_k`` and the usual "mean loss per microbatch, divided
    by A" weighting, ``E|g_k|^2 = |G|^2 + tr(Sigma)/b_k``, so ``B_small`` is the
    harmonic mean of the ``b_k`` and ``B_big = K * B_small``.

    Args:
        small_sq_norm: ``|G_small|^2``; with ``K`` microbatches, the mean of their
            squared norms (all on the same scale as ``big_sq_norm``).
        big_sq_norm: ``|G_big|^2``, squared norm of the mean gradient of the step.
        small_batch: ``B_small`` (harmonic mean of the microbatch sizes), in any unit.
        big_batch: ``B_big`` (``K * B_small``), in the same unit; must exceed ``small_batch``.

    Returns:
        The step's estimates; ``trace_cov`` is in the unit of the sizes given.

    Raises:
        ValueError: if the sizes are not positive or ``big_batch <= small_batch``.
    """
    if not (small_batch > 0 and big_batch > small_batch):
        raise ValueError(
            f"estimate_from_norms(small_batch={small_batch!r}, big_batch={big_batch!r}): "
            "need 0 < small_batch < big_batch (at least two microbatches per step)"
        )
    grad_sq = (big_batch * big_sq_norm - small_batch * small_sq_norm) / (big_batch - small_batch)
    trace = (small_sq_norm - big_sq_norm) / (1.0 / small_batch - 1.0 / big_batch)
    return StepEstimate(grad_sq, trace, small_batch, big_batch)


@dataclass(frozen=True)
class NoiseScaleEstimate:
    """The smoothed state after an update.

    Attributes:
        grad_sq_norm: bias-corrected moving average of the ``|G|^2`` estimates
            (``None`` before the first accepted step).
        trace_cov: bias-corrected moving average of the ``tr(Sigma)`` estimates.
        noise_scale: ``B_simple = trace_cov / grad_sq_norm`` in the unit of the sizes
            given; ``None`` until ``min_steps`` steps were averaged and the averaged
            ``|G|^2`` is positive.
        step: the step's own estimates (``None`` when the step was dropped).
        accepted: whether this update changed the state.
        steps: number of accepted steps so far.
        noise_scale_low: lower end of the 90% confidence interval of ``noise_scale``
            (``None`` when ``noise_scale`` is ``None``).
        noise_scale_high: upper end (``inf`` while ``|G|^2`` is not distinguishable from 0).
    """

    grad_sq_norm: float | None
    trace_cov: float | None
    noise_scale: float | None
    step: StepEstimate | None
    accepted: bool
    steps: int
    noise_scale_low: float | None = None
    noise_scale_high: float | None = None


@runtime_checkable
class NoiseScaleEstimatorProtocol(Protocol):
    """What the tracking engine needs from a noise-scale estimator.

    :class:`NoiseScaleEstimator` implements it; a second estimator (another
    smoothing, another statistic) can be passed to the adapters if it has these
    members. Sizes and the reported noise scale are in one unit (tokens or samples).
    """

    def update(
        self,
        small_sq_norm: float,
        big_sq_norm: float,
        small_batch: float,
        big_batch: float,
        units: float | None = None,
    ) -> NoiseScaleEstimate:
        """Add one optimizer step (see :meth:`NoiseScaleEstimator.update`)."""
        ...

    @property
    def noise_scale(self) -> float | None:
        """``B_simple``, or ``None`` while not supported by the data."""
        ...

    @property
    def noise_scale_interval(self) -> tuple[float, float] | None:
        """90% confidence interval of ``noise_scale`` (``None`` exactly when it is ``None``)."""
        ...

    @property
    def grad_sq_norm(self) -> float | None:
        """Smoothed ``|G|^2`` estimate."""
        ...

    @property
    def trace_cov(self) -> float | None:
        """Smoothed ``tr(Sigma)`` estimate."""
        ...

    def state_dict(self) -> dict[str, object]:
        """Plain values that restore the estimator."""
        ...

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore :meth:`state_dict` output; on error leave the estimator untouched."""
        ...


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class NoiseScaleEstimator:
    """Moving averages of the ``|G|^2`` and ``tr(Sigma)`` estimates, a ratio and its interval.

    **Averages.** After a step of ``n`` units each average moves by
    ``alpha = 1 - exp(-n / H)`` (``H``, the horizon, in units): the memory is the
    same per token whatever the batch. Startup bias is removed by dividing by
    ``1 - prod(1 - alpha)`` (as in Adam); the result is ``B = T / G`` with ``T``, ``G``
    the averaged ``tr(Sigma)`` and ``|G|^2`` estimates, in the unit of the sizes,
    corrected to second order for the bias of a ratio (see :attr:`noise_scale`).

    **Interval.** The per-step weights ``w_t`` of the averages are known, so the
    variances of ``T``, ``G`` and their covariance are estimated from the spread
    of the per-step estimates (``sum w_t^2 (x_t - mean)^2``, which allows each
    step its own variance). The 90% interval is Fieller's interval for a ratio of
    two normal means: the ``B`` with ``|T - B G| <= t * sd(T - B G)``, with ``t`` a
    Student quantile on the effective number of steps ``1 / sum w_t^2``. It is
    skewed like the ratio, and unbounded above (``inf``) when ``G`` is not
    distinguishable from 0.

    **Window** (the default, ``memory == "window"``): see :mod:`cbs_tracker.core.window`.
    The per-step estimates live in blocks that double in size with age; each step is
    weighted by its units over a short average of its small-batch norm; the window is
    the longest run of recent blocks whose estimates agree (intersection of 90%-scale
    intervals widened to ``agreement`` standard errors), capped at
    ``max_window_fraction`` of the steps unless the older data agree with it within
    ``extend_threshold`` standard errors (then the whole run is averaged flat-like).
    When the window's mean lies outside the interval of a linear trend of the ratio
    read at the current step, that trend is reported; otherwise the mean, with an
    interval that also holds the trend's. It follows a noise scale that drifts (the
    ``|G|^2`` just after initialisation is orders of magnitude above its later value)
    and keeps the flat average's precision when nothing moves.

    **Adaptive EMA** (``memory="adaptive"``, the default before the window).
    The squared error of the ratio is about ``rho / (2 H T^2)`` with ``rho`` the
    per-unit variance of ``t_s - B g_s``, estimated as above. Before each step
    the horizon is set to what reaches ``target_rel_error``,
    ``H = rho / (2 target_rel_error^2 T^2)``, bounded below by
    ``min_horizon_steps`` steps of the current size and above by
    ``max_horizon_fraction`` (``f``) times the units seen. At the upper bound a
    step's weight grows as ``u^(1/f - 1)`` with the units ``u`` seen when it ran
    (``f = 1``: a plain mean of the run; ``0.75``: weights ``~ u^(1/3)``), so old
    data keeps losing weight and the average follows a noise scale that rises
    with training; the bound is what limits precision when per-step estimates are
    very noisy (microbatches far below the noise scale). Until ``min_steps``
    steps are in, the upper bound is used.

    **Outliers.** With ``outlier_clip`` set, once ``outlier_window`` steps are in,
    each new per-step estimate is clipped to ``median +- outlier_clip * IQR`` of the
    last ``outlier_window`` estimates before it enters the averages (Adam-
    preconditioned gradients can show rare 100-1000x spikes); ordinary noise is far
    inside that band.

    Args:
        horizon: a fixed memory in units; sets ``memory = "fixed"``.
        horizon_steps: a fixed memory of this many first-step batches (the first
            accepted step's units); sets ``memory = "fixed"``. ``horizon`` wins if both are set.
        target_rel_error: adaptive memory: relative standard error of the
            noise scale the horizon aims for (default 0.05).
        min_horizon_steps: adaptive memory: lower bound of the horizon in steps of the
            current size (default 10).
        max_horizon_fraction: adaptive memory: upper bound of the horizon as a share
            of the units seen so far (default 0.75).
        min_steps: accepted steps before ``noise_scale`` is reported (default 10).
        outlier_clip: half-width of the clipping band in inter-quartile ranges
            (default 5.0); ``None`` disables clipping.
        outlier_window: per-step estimates kept for the band (default 32).
        memory: ``"window"`` (default), ``"adaptive"`` (the exponential average above) or
            ``"fixed"`` (implied by ``horizon``/``horizon_steps``).
        max_window_fraction: window memory: the longest window as a share of the steps
            before the older data are tested for agreement (default 0.35).
        agreement: window memory: standard errors within which windows must agree (default 2).
        extend_threshold: window memory: standard errors within which the older data
            rejoin the window (default 3).
        blocks_per_level: window memory: blocks of each size kept (default 4).

    Raises:
        TypeError: an argument of the wrong type (``bool`` is not a number here).
        ValueError: a value out of range (each message names the argument).
    """

    def __init__(
        self,
        *,
        horizon: float | None = None,
        horizon_steps: float | None = None,
        target_rel_error: float = 0.05,
        min_horizon_steps: float = 10.0,
        max_horizon_fraction: float = 0.75,
        min_steps: int = 10,
        outlier_clip: float | None = 5.0,
        outlier_window: int = 32,
        memory: Memory | None = None,
        max_window_fraction: float = 0.35,
        agreement: float = 2.0,
        extend_threshold: float = 3.0,
        blocks_per_level: int = 4,
    ) -> None:
        def positive(name: str, value: object, allow_none: bool, what: str) -> None:
            if value is None and allow_none:
                return
            if not _is_real(value):
                raise TypeError(f"NoiseScaleEstimator({name}={value!r}): must be {what}")
            if not (math.isfinite(value) and value > 0):  # type: ignore[arg-type]
                raise ValueError(f"NoiseScaleEstimator({name}={value!r}): must be {what}")

        positive("horizon", horizon, True, "a positive number of units or None")
        positive("horizon_steps", horizon_steps, True, "a positive number or None")
        positive("target_rel_error", target_rel_error, False, "a positive number")
        positive("min_horizon_steps", min_horizon_steps, False, "a positive number")
        positive("max_horizon_fraction", max_horizon_fraction, False, "a positive number")
        positive("outlier_clip", outlier_clip, True, "a positive number or None")
        positive("agreement", agreement, False, "a positive number")
        positive("extend_threshold", extend_threshold, False, "a positive number")
        positive("max_window_fraction", max_window_fraction, False, "a number in (0, 1]")
        if max_window_fraction > 1:
            raise ValueError(f"NoiseScaleEstimator(max_window_fraction={max_window_fraction!r}): must be a number in (0, 1]")
        if memory not in (None, "window", "adaptive", "fixed"):
            raise ValueError(f"NoiseScaleEstimator(memory={memory!r}): must be 'window', 'adaptive', 'fixed' or None")
        fixed = horizon is not None or horizon_steps is not None
        if fixed and memory not in (None, "fixed"):
            raise ValueError(f"NoiseScaleEstimator(memory={memory!r}): a horizon or horizon_steps sets memory='fixed'")
        if memory == "fixed" and not fixed:
            raise ValueError("NoiseScaleEstimator(memory='fixed'): needs horizon= or horizon_steps=")
        for name, value, low in (("min_steps", min_steps, 1), ("outlier_window", outlier_window, 4),
                                 ("blocks_per_level", blocks_per_level, 2)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"NoiseScaleEstimator({name}={value!r}): must be an integer >= {low}")
            if value < low:
                raise ValueError(f"NoiseScaleEstimator({name}={value!r}): must be an integer >= {low}")
        self.memory: Memory = "fixed" if fixed else (memory or "window")
        self.max_window_fraction = float(max_window_fraction)
        self.agreement = float(agreement)
        self.extend_threshold = float(extend_threshold)
        self.blocks_per_level = blocks_per_level
        self._configured_horizon = None if horizon is None else float(horizon)
        self.horizon_steps = None if horizon_steps is None else float(horizon_steps)
        self.target_rel_error = float(target_rel_error)
        self.min_horizon_steps = float(min_horizon_steps)
        self.max_horizon_fraction = float(max_horizon_fraction)
        self.min_steps = min_steps
        self.outlier_clip = None if outlier_clip is None else float(outlier_clip)
        self.outlier_window = outlier_window
        self._reset_state()

    def _reset_state(self) -> None:
        self._horizon: float | None = self._configured_horizon
        self._first_units: float | None = None
        self._units_seen = 0.0
        self._steps = 0
        self._keep = 1.0  # prod(1 - alpha): the weight the zero initialisation still holds
        self._moments_keep = 1.0  # the same product over the steps the second moments cover
        self._ema_grad_sq = 0.0
        self._ema_trace = 0.0
        # With a_s the unnormalised weight of step s (sum a_s = 1 - keep): sum a_s^2,
        # sum a_s^2 / n_s, sum a_s^2 x_s y_s and sum a_s^2 x_s for x, y in {g, t}.
        self._w2 = 0.0
        self._w2_per_unit = 0.0
        self._q_gg = self._q_tt = self._q_gt = 0.0
        self._l_g = self._l_t = 0.0
        self._recent_grad_sq: deque[float] = deque(maxlen=self.outlier_window)
        self._recent_trace: deque[float] = deque(maxlen=self.outlier_window)
        self._last_step: StepEstimate | None = None
        self._window: DriftWindow | None = None
        if self.memory == "window":
            self._window = DriftWindow(
                per_level=self.blocks_per_level, max_fraction=self.max_window_fraction,
                agreement=self.agreement / _Z, extend_threshold=self.extend_threshold / _Z,
                min_steps=self.min_steps, scale_steps=8.0,
            )

    # ------------------------------------------------------------------ results
    @property
    def window_steps(self) -> int | None:
        """Steps in the window the estimate now rests on (``memory="window"`` only, else ``None``)."""
        return None if self._window is None else self._window.window_steps

    def _window_estimate(self) -> tuple[float | None, tuple[float, float], bool] | None:
        if self._window is None or self._steps < self.min_steps:
            return None
        return self._window.estimate()
    @property
    def steps(self) -> int:
        """Accepted steps so far."""
        return self._steps

    @property
    def horizon(self) -> float | None:
        """The memory in units used for the last step (the fixed one when configured)."""
        return self._horizon

    @property
    def units_seen(self) -> float:
        """Units of the accepted steps so far."""
        return self._units_seen

    @property
    def grad_sq_norm(self) -> float | None:
        """Bias-corrected average of the ``|G|^2`` estimates, ``None`` before any step."""
        if self._steps == 0:
            return None
        if self._window is not None:
            means = self._window.means()
            return None if means is None else means[0]
        return self._ema_grad_sq / (1.0 - self._keep)

    @property
    def trace_cov(self) -> float | None:
        """Bias-corrected average of the ``tr(Sigma)`` estimates, ``None`` before any step."""
        if self._steps == 0:
            return None
        if self._window is not None:
            means = self._window.means()
            return None if means is None else means[1]
        return self._ema_trace / (1.0 - self._keep)

    @property
    def noise_scale(self) -> float | None:
        """``B_simple`` in the unit of the sizes given, or ``None`` when not supported yet.

        The ratio ``T / G`` of the two averages with Beale's second-order bias
        correction, ``(T / G) (1 + cov(T, G) / (T G)) / (1 + var(G) / G^2)``: a
        ratio whose denominator is noisy is biased upwards by about ``var(G) / G^2``
        (a few percent when microbatches are far below the noise scale). It is
        kept inside :attr:`noise_scale_interval`, so while ``G`` is not
        distinguishable from 0 it reads as the interval's lower end, the smallest
        value the data support. When the averages are precise it equals
        ``trace_cov / grad_sq_norm``. ``None`` until ``min_steps`` steps were
        averaged and while the averaged ``|G|^2`` is not positive; a negative
        averaged ``tr(Sigma)`` reads as 0.
        """
        estimate = self._estimate()
        return None if estimate is None else estimate[0]

    @property
    def noise_scale_interval(self) -> tuple[float, float] | None:
        """90% confidence interval of :attr:`noise_scale`, in its unit.

        Fieller's interval for ``T / G`` from the estimated variances of the two
        averages (see the class docstring). ``None`` exactly when ``noise_scale``
        is ``None``; ``(low, inf)`` while ``G`` is not distinguishable from 0, and
        ``(0.0, inf)`` while too little is known (one effective step, or a state
        restored from a version without second moments that still weighs).
        """
        estimate = self._estimate()
        return None if estimate is None else estimate[1]

    @property
    def effective_steps(self) -> float:
        """``1 / sum w_s^2`` of the normalised weights: steps an equal-weight mean would hold."""
        if self._window is not None:
            m = self._window.moments()
            return 0.0 if m is None else m.effective_steps
        if self._steps == 0 or self._w2 <= 0:
            return 0.0
        return (1.0 - self._keep) ** 2 / self._w2

    def _estimate(self) -> tuple[float, tuple[float, float]] | None:
        """``(noise_scale, interval)``, or ``None`` while not supported."""
        if self._window is not None:
            found = self._window_estimate()
            if found is None or found[0] is None:
                return None
            return found[0], found[1]
        g, t = self.grad_sq_norm, self.trace_cov
        if g is None or t is None or self._steps < self.min_steps or not g > 0:
            return None
        moments = self._moments()
        if moments is None:
            return max(t, 0.0) / g, (0.0, math.inf)
        _, _, n_eff, v_gg, v_tt, v_gt = moments
        low, high = fieller_interval(t, g, v_tt, v_gg, v_gt, _student_quantile(n_eff - 1.0))
        if not t > 0:
            return 0.0, (low, high)
        ratio = t / g * max(1.0 + v_gt / (t * g), 0.0) / (1.0 + v_gg / (g * g))
        return min(max(ratio, low), high), (low, high)

    def _moments(self) -> tuple[float, float, float, float, float, float] | None:
        """``(G, T, n_eff, var G, var T, cov)`` of the averages, or ``None`` while unknown.

        Variances of the means: ``sum w_s^2 (x_s - mean_x)(y_s - mean_y)``, times
        ``n/(n-1)`` against the shrinkage of residuals taken around fitted means.
        Unknown with one effective step or while steps without second moments (a
        version-1 state) hold more than 5% of the weight.
        """
        norm = 1.0 - self._keep
        n_eff = self.effective_steps
        if (self._moments_keep - self._keep) / norm > _MAX_UNCOVERED_WEIGHT or not n_eff > 1.0:
            return None
        g, t = self._ema_grad_sq / norm, self._ema_trace / norm
        scale = n_eff / (n_eff - 1.0) / norm**2
        v_gg = max(self._q_gg - 2 * g * self._l_g + g * g * self._w2, 0.0) * scale
        v_tt = max(self._q_tt - 2 * t * self._l_t + t * t * self._w2, 0.0) * scale
        v_gt = (self._q_gt - g * self._l_t - t * self._l_g + g * t * self._w2) * scale
        return g, t, n_eff, v_gg, v_tt, v_gt

    def result(self, accepted: bool) -> NoiseScaleEstimate:
        """The state as a :class:`NoiseScaleEstimate` (``accepted`` as given)."""
        estimate = self._estimate()
        ratio, (low, high) = estimate if estimate is not None else (None, (None, None))
        return NoiseScaleEstimate(
            grad_sq_norm=self.grad_sq_norm,
            trace_cov=self.trace_cov,
            noise_scale=ratio,
            step=self._last_step if accepted else None,
            accepted=accepted,
            steps=self._steps,
            noise_scale_low=low,
            noise_scale_high=high,
        )

    # ------------------------------------------------------------------ update
    def update(
        self,
        small_sq_norm: float,
        big_sq_norm: float,
        small_batch: float,
        big_batch: float,
        units: float | None = None,
    ) -> NoiseScaleEstimate:
        """Add one optimizer step.

        Args:
            small_sq_norm: mean over the step's ``K`` microbatches of ``|g_k|^2``.
            big_sq_norm: ``|G_big|^2`` of the step's mean gradient, same scale.
            small_batch: harmonic mean of the microbatch sizes (``B_small``).
            big_batch: ``K * small_batch`` (``B_big``).
            units: units the step consumed (sets the decay); defaults to ``big_batch``.
                With equal microbatches it equals ``big_batch``; with unequal ones
                pass the plain sum of the sizes.

        Returns:
            The smoothed state. A step with a non-finite input, or with
            ``big_batch <= small_batch`` (a single microbatch), is dropped
            without touching the state (``accepted=False``).
        """
        n = big_batch if units is None else units
        finite = math.isfinite
        if not (finite(small_sq_norm) and finite(big_sq_norm) and finite(small_batch) and finite(big_batch)
                and finite(n)):
            return self.result(accepted=False)
        if not (small_batch > 0 and big_batch > small_batch and n > 0):
            return self.result(accepted=False)
        raw = estimate_from_norms(small_sq_norm, big_sq_norm, small_batch, big_batch)
        if not (math.isfinite(raw.grad_sq_norm) and math.isfinite(raw.trace_cov)):
            return self.result(accepted=False)
        g = self._clip(raw.grad_sq_norm, self._recent_grad_sq)
        t = self._clip(raw.trace_cov, self._recent_trace)
        self._recent_grad_sq.append(raw.grad_sq_norm)
        self._recent_trace.append(raw.trace_cov)
        if self._first_units is None:
            self._first_units = float(n)
        self._units_seen += n
        if self._window is not None:
            # the clipped small norm, so that a spike does not silence the next steps' weights
            self._window.add(g, t, n, g + t / small_batch)
            self._steps += 1
            self._last_step = raw
            return self.result(accepted=True)
        self._horizon = horizon = self._next_horizon(n)
        keep = math.exp(-n / horizon)
        a = 1.0 - keep
        self._ema_grad_sq = keep * self._ema_grad_sq + a * g
        self._ema_trace = keep * self._ema_trace + a * t
        self._keep *= keep
        self._moments_keep *= keep
        k2, a2 = keep * keep, a * a
        self._w2 = k2 * self._w2 + a2
        self._w2_per_unit = k2 * self._w2_per_unit + a2 / n
        self._q_gg = k2 * self._q_gg + a2 * g * g
        self._q_tt = k2 * self._q_tt + a2 * t * t
        self._q_gt = k2 * self._q_gt + a2 * g * t
        self._l_g = k2 * self._l_g + a2 * g
        self._l_t = k2 * self._l_t + a2 * t
        self._steps += 1
        self._last_step = raw
        return self.result(accepted=True)

    def _next_horizon(self, n: float) -> float:
        """The horizon for a step of ``n`` units, from the state before the step."""
        if self._configured_horizon is not None:
            return self._configured_horizon
        if self.horizon_steps is not None:
            return self.horizon_steps * self._first_units  # type: ignore[operator]
        low = self.min_horizon_steps * n
        high = max(low, self.max_horizon_fraction * self._units_seen)
        wanted = self._target_horizon()
        return high if wanted is None else min(max(wanted, low), high)

    def _target_horizon(self) -> float | None:
        """``rho / (2 target^2 T^2)``, or ``None`` while it cannot be estimated."""
        if self._steps < self.min_steps or self._w2_per_unit <= 0:
            return None
        if (self._moments_keep - self._keep) / (1.0 - self._keep) > _MAX_UNCOVERED_WEIGHT:
            return None
        norm = 1.0 - self._keep
        g, t = self._ema_grad_sq / norm, self._ema_trace / norm
        if not (g > 0 and t > 0):
            return None
        b = t / g
        # sum a_s^2 (t_s - b g_s)^2 / sum a_s^2 / n_s: the per-unit variance of t - b g
        rho = (self._q_tt - 2 * b * self._q_gt + b * b * self._q_gg) / self._w2_per_unit
        return max(rho, 0.0) / (2.0 * self.target_rel_error**2 * t * t)

    def _clip(self, value: float, recent: deque[float]) -> float:
        if self.outlier_clip is None or len(recent) < self.outlier_window:
            return value
        ordered = sorted(recent)
        q25, median, q75 = _quantile(ordered, 0.25), _quantile(ordered, 0.5), _quantile(ordered, 0.75)
        width = self.outlier_clip * (q75 - q25)
        return min(max(value, median - width), median + width)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, object]:
        """Plain numbers (and two short lists) that rebuild the averages and the interval exactly."""
        return {
            "version": ESTIMATOR_STATE_VERSION,
            "memory": self.memory,
            "horizon": self._horizon,
            "first_units": self._first_units,
            "units_seen": self._units_seen,
            "steps": self._steps,
            "keep": self._keep,
            "moments_keep": self._moments_keep,
            "ema_grad_sq": self._ema_grad_sq,
            "ema_trace": self._ema_trace,
            "w2": self._w2,
            "w2_per_unit": self._w2_per_unit,
            "q_gg": self._q_gg,
            "q_tt": self._q_tt,
            "q_gt": self._q_gt,
            "l_g": self._l_g,
            "l_t": self._l_t,
            "recent_grad_sq": list(self._recent_grad_sq),
            "recent_trace": list(self._recent_trace),
            **({} if self._window is None else {"window": self._window.state_dict()}),
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore :meth:`state_dict` output, checking every value before anything is assigned.

        Strict on required keys, tolerant of unknown extra ones; a state of
        version 1 (before the interval) loads its averages, and the interval is
        reported again once the steps after the resume carry 95% of the weight.
        The configuration wins over the checkpoint: the constructor's memory
        settings are kept, and a checkpoint saved with another fixed horizon or
        memory mode is loaded with a warning saying so. A ``horizon_steps``
        memory is rebuilt from the checkpoint's first-step units.

        Raises:
            TypeError: ``state`` is not a mapping, or a value has the wrong type.
            KeyError: a required key is missing.
            ValueError: a value is out of range, or the version is unknown.
        """
        where = "NoiseScaleEstimator.load_state_dict"
        read = _read_state(state, where)
        memory, horizon = read["memory"], read["horizon"]
        notes = []
        if memory != self.memory:
            notes.append(f"it was saved with a {memory} memory, this estimator has a {self.memory} one")
        elif (self._configured_horizon is not None and horizon is not None
              and not math.isclose(horizon, self._configured_horizon, rel_tol=1e-12)):
            notes.append(f"it was saved with horizon={horizon:g}, this estimator has horizon={self._configured_horizon:g}")
        restart = (memory == "window") != (self.memory == "window")
        if notes:
            warnings.warn(f"{where}: {notes[0]}; the configured memory is used from now on"
                          + ("; its averages cannot be carried over and restart empty" if restart else ""),
                          RuntimeWarning, stacklevel=2)

        # Everything checked: assign.
        self._reset_state()
        if restart:
            return
        if self._window is not None and read["window"] is not None:
            self._window.load(*read["window"])
        first_units, steps = read["first_units"], read["steps"]
        if self._configured_horizon is None:
            if self.horizon_steps is not None and first_units is None and steps > 0:
                self._horizon = horizon  # version 1: its horizon was derived the same way
                first_units = None if horizon is None else horizon / self.horizon_steps
            else:
                self._horizon = horizon
        self._first_units = first_units
        self._units_seen = read["units_seen"]
        self._steps = steps
        self._keep = read["keep"]
        self._moments_keep = read["moments_keep"]
        self._ema_grad_sq, self._ema_trace = read["ema_grad_sq"], read["ema_trace"]
        moments = read["moments"]
        self._w2, self._w2_per_unit = moments["w2"], moments["w2_per_unit"]
        self._q_gg, self._q_tt, self._q_gt = moments["q_gg"], moments["q_tt"], moments["q_gt"]
        self._l_g, self._l_t = moments["l_g"], moments["l_t"]
        self._recent_grad_sq.extend(read["recent_grad_sq"])
        self._recent_trace.extend(read["recent_trace"])


# ---------------------------------------------------------------------- the estimator's state schema
# What NoiseScaleEstimator.state_dict() holds, by the version that added it. Version 1 (before the
# interval) held the averages only: its second moments restart empty, its units seen follow from
# its fixed horizon. Version 2 added the moments below, version 3 "memory" (default "adaptive") and,
# for memory="window", "window". A key added later takes a default in _read_state and leaves the
# version as it is.
_REQUIRED_V1 = ("version", "horizon", "ema_grad_sq", "ema_trace", "keep", "steps")
_REQUIRED_V2 = ("units_seen", "moments_keep", "w2", "w2_per_unit", "q_gg", "q_tt", "q_gt", "l_g", "l_t")
#: the version-2 second moments and their lower bounds (the upper is +inf)
_MOMENTS = {"w2": 0.0, "w2_per_unit": 0.0, "q_gg": 0.0, "q_tt": 0.0, "q_gt": -math.inf, "l_g": -math.inf,
            "l_t": -math.inf}


def _read_version(state: Mapping[str, object], where: str) -> int:
    """The state's version, after the keys every version requires (KeyError names the missing ones)."""
    if not isinstance(state, Mapping):
        raise TypeError(f"{where}(state={type(state).__name__}): expected a mapping from state_dict()")
    missing = [k for k in _REQUIRED_V1 if k not in state]
    version = state.get("version")
    if not missing and (not isinstance(version, int) or isinstance(version, bool)):
        raise TypeError(f"{where}: version={version!r} must be an integer")
    if not missing and not 1 <= version <= ESTIMATOR_STATE_VERSION:  # type: ignore[operator]
        newer = version > ESTIMATOR_STATE_VERSION  # type: ignore[operator]
        raise ValueError(
            f"{where}: state version {version} is "
            + (f"newer than the supported version {ESTIMATOR_STATE_VERSION}; upgrade cbs-tracker"
               if newer else f"unknown; expected 1..{ESTIMATOR_STATE_VERSION}")
        )
    if isinstance(version, int) and not isinstance(version, bool) and version >= 2:
        missing = [k for k in _REQUIRED_V1 + _REQUIRED_V2 if k not in state]
    if missing:
        raise KeyError(f"{where}: missing keys {missing}")
    return version  # type: ignore[return-value]


def _real(state: Mapping[str, object], where: str, key: str, low: float = -math.inf, high: float = math.inf) -> float:
    value = state.get(key, 0.0)
    if not _is_real(value):
        raise TypeError(f"{where}: {key}={value!r} must be a real number")
    if not (math.isfinite(value) and low <= value <= high):  # type: ignore[arg-type,operator]
        raise ValueError(f"{where}: {key}={value!r} must be finite and in [{low}, {high}]")
    return float(value)  # type: ignore[arg-type]


def _optional_positive(state: Mapping[str, object], where: str, key: str) -> float | None:
    value = state.get(key)
    if value is None:
        return None
    if not _is_real(value) or not (math.isfinite(value) and value > 0):  # type: ignore[arg-type,operator]
        error = TypeError if not _is_real(value) else ValueError
        raise error(f"{where}: {key}={value!r} must be a positive number or None")
    return float(value)  # type: ignore[arg-type]


def _read_state(state: Mapping[str, object], where: str) -> dict[str, object]:
    """Every value of an estimator state, checked (nothing assigned): the estimator's schema."""
    version = _read_version(state, where)
    steps = state["steps"]
    if not isinstance(steps, int) or isinstance(steps, bool):
        raise TypeError(f"{where}: steps={steps!r} must be an integer >= 0")
    if steps < 0:
        raise ValueError(f"{where}: steps={steps!r} must be an integer >= 0")
    horizon = _optional_positive(state, where, "horizon")
    read: dict[str, object] = {"steps": steps, "horizon": horizon,
                               "first_units": _optional_positive(state, where, "first_units")}
    keep = read["keep"] = _real(state, where, "keep", 0.0, 1.0)
    if steps > 0 and not keep < 1.0 and state.get("memory") != "window":
        raise ValueError(f"{where}: keep={keep!r} must be below 1 once steps > 0 (steps={steps})")
    read["ema_grad_sq"], read["ema_trace"] = _real(state, where, "ema_grad_sq"), _real(state, where, "ema_trace")
    if version == 1:
        read.update(units_seen=-math.log(keep) * horizon if (horizon is not None and keep > 0) else 0.0,
                    moments_keep=1.0, moments=dict.fromkeys(_MOMENTS, 0.0), memory="fixed")
    else:
        read.update(units_seen=_real(state, where, "units_seen", 0.0),
                    moments_keep=_real(state, where, "moments_keep", keep, 1.0),
                    moments={k: _real(state, where, k, low) for k, low in _MOMENTS.items()},
                    memory=state.get("memory", "adaptive"))
        if read["memory"] not in ("window", "adaptive", "fixed"):
            raise ValueError(f"{where}: memory={read['memory']!r} must be 'window', 'adaptive' or 'fixed'")
    read["window"] = None
    if read["memory"] == "window":
        saved_window = state.get("window")
        if not isinstance(saved_window, Mapping):
            raise KeyError(f"{where}: missing keys ['window'] (a state saved with memory='window')")
        read["window"] = DriftWindow.check_state(saved_window, where)
    for key in ("recent_grad_sq", "recent_trace"):
        values = state.get(key, [])
        if not isinstance(values, (list, tuple)) or not all(_is_real(v) and math.isfinite(v) for v in values):
            raise TypeError(f"{where}: {key} must be a list of finite real numbers")
        read[key] = [float(v) for v in values]
    return read


def _quantile(ordered: list[float], q: float) -> float:
    """Linear-interpolation quantile of an already sorted list."""
    pos = q * (len(ordered) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (pos - lo) * (ordered[hi] - ordered[lo])
