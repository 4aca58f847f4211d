"""The gradient noise scale from small- and big-batch squared gradient norms (pure math).

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", App. A:
a batch of ``B`` examples with per-example gradient mean ``G`` and covariance
``Sigma`` gives ``E|G_B|^2 = |G|^2 + tr(Sigma)/B``. Two batch sizes
``B_small < B_big`` give unbiased estimates::

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)
    B_simple  = tr(Sigma) / |G|^2

Each optimizer step gives ``K = A * D`` small batches (microbatches) and one
big batch (their mean). With microbatch sizes ``b_k`` and the usual "mean loss
per microbatch, divided by A" weighting, ``E|g_k|^2 = |G|^2 + tr(Sigma)/b_k`` and
``E|mean_k g_k|^2 = |G|^2 + tr(Sigma) / (K * b_h)`` with ``b_h`` the harmonic mean
of the ``b_k``; so ``B_small = b_h`` and ``B_big = K * b_h`` (see
:func:`estimate_from_norms`).

The two estimates are smoothed **separately** by moving averages whose decay is
defined per unit (token or sample), not per step, and only then divided
(never average ratios). Nothing here imports ``torch``.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

ESTIMATOR_STATE_VERSION = 1


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

    McCandlish et al. 2018, App. A, eqs. A.1–A.2.

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
    """

    grad_sq_norm: float | None
    trace_cov: float | None
    noise_scale: float | None
    step: StepEstimate | None
    accepted: bool
    steps: int


class NoiseScaleEstimator:
    """Moving averages of the ``|G|^2`` and ``tr(Sigma)`` estimates, decayed per unit.

    After a step of ``n`` units (tokens or samples) each average moves by
    ``alpha = 1 - exp(-n / horizon)``: the average forgets at the same rate per
    token whatever the batch, so a doubling does not change how much history it
    holds. Startup bias is removed by dividing by ``1 - prod(1 - alpha)`` (as in
    Adam). The result is in the unit of the sizes passed to :meth:`update`.

    Per-step estimates can be far off on rare steps (Adam-preconditioned
    gradients showed 100–1000x spikes on a small GPT). With ``outlier_clip`` set,
    once ``outlier_window`` steps are in, each new per-step estimate is clipped to
    ``median +- outlier_clip * IQR`` of the last ``outlier_window`` estimates
    before it enters the average; ordinary noise is far inside that band, so the
    average stays unbiased for it.

    Args:
        horizon: memory of the averages in units; ``None`` (default) sets it to
            ``horizon_steps`` times the first step's global batch.
        horizon_steps: default horizon in starting-batch steps (default 100).
        min_steps: accepted steps before ``noise_scale`` is reported (default 10).
        outlier_clip: half-width of the clipping band in inter-quartile ranges
            (default 5.0); ``None`` disables clipping.
        outlier_window: per-step estimates kept for the band (default 32).

    Raises:
        ValueError: for a non-positive horizon, ``horizon_steps``, ``outlier_clip``,
            or ``min_steps < 1``, ``outlier_window < 4``.
    """

    def __init__(
        self,
        *,
        horizon: float | None = None,
        horizon_steps: float = 100.0,
        min_steps: int = 10,
        outlier_clip: float | None = 5.0,
        outlier_window: int = 32,
    ) -> None:
        if horizon is not None and not (isinstance(horizon, (int, float)) and horizon > 0):
            raise ValueError(f"NoiseScaleEstimator(horizon={horizon!r}): must be a positive number of units or None")
        if not (isinstance(horizon_steps, (int, float)) and horizon_steps > 0):
            raise ValueError(f"NoiseScaleEstimator(horizon_steps={horizon_steps!r}): must be a positive number")
        if not (isinstance(min_steps, int) and min_steps >= 1):
            raise ValueError(f"NoiseScaleEstimator(min_steps={min_steps!r}): must be an integer >= 1")
        if outlier_clip is not None and not (isinstance(outlier_clip, (int, float)) and outlier_clip > 0):
            raise ValueError(f"NoiseScaleEstimator(outlier_clip={outlier_clip!r}): must be a positive number or None")
        if not (isinstance(outlier_window, int) and outlier_window >= 4):
            raise ValueError(f"NoiseScaleEstimator(outlier_window={outlier_window!r}): must be an integer >= 4")
        self.horizon = None if horizon is None else float(horizon)
        self.horizon_steps = float(horizon_steps)
        self.min_steps = min_steps
        self.outlier_clip = None if outlier_clip is None else float(outlier_clip)
        self.outlier_window = outlier_window
        self._reset_state()

    def _reset_state(self) -> None:
        self._ema_grad_sq = 0.0
        self._ema_trace = 0.0
        self._keep = 1.0  # prod(1 - alpha): the weight the zero initialisation still holds
        self._steps = 0
        self._recent_grad_sq: deque[float] = deque(maxlen=self.outlier_window)
        self._recent_trace: deque[float] = deque(maxlen=self.outlier_window)
        self._last_step: StepEstimate | None = None

    # ------------------------------------------------------------------ results
    @property
    def steps(self) -> int:
        """Accepted steps so far."""
        return self._steps

    @property
    def grad_sq_norm(self) -> float | None:
        """Bias-corrected average of the ``|G|^2`` estimates, ``None`` before any step."""
        if self._steps == 0:
            return None
        return self._ema_grad_sq / (1.0 - self._keep)

    @property
    def trace_cov(self) -> float | None:
        """Bias-corrected average of the ``tr(Sigma)`` estimates, ``None`` before any step."""
        if self._steps == 0:
            return None
        return self._ema_trace / (1.0 - self._keep)

    @property
    def noise_scale(self) -> float | None:
        """``B_simple`` in the unit of the sizes given, or ``None`` when not supported yet.

        ``None`` until ``min_steps`` steps were averaged and while the averaged
        ``|G|^2`` is not positive; a negative averaged ``tr(Sigma)`` reads as 0.
        """
        g, t = self.grad_sq_norm, self.trace_cov
        if g is None or t is None or self._steps < self.min_steps or not g > 0:
            return None
        return max(t, 0.0) / g

    def result(self, accepted: bool) -> NoiseScaleEstimate:
        return NoiseScaleEstimate(
            grad_sq_norm=self.grad_sq_norm,
            trace_cov=self.trace_cov,
            noise_scale=self.noise_scale,
            step=self._last_step if accepted else None,
            accepted=accepted,
            steps=self._steps,
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
        values = (small_sq_norm, big_sq_norm, small_batch, big_batch)
        n = big_batch if units is None else units
        if not all(math.isfinite(v) for v in (*values, n)):
            return self.result(accepted=False)
        if not (small_batch > 0 and big_batch > small_batch and n > 0):
            return self.result(accepted=False)
        raw = estimate_from_norms(small_sq_norm, big_sq_norm, small_batch, big_batch)
        if not (math.isfinite(raw.grad_sq_norm) and math.isfinite(raw.trace_cov)):
            return self.result(accepted=False)
        if self.horizon is None:
            self.horizon = self.horizon_steps * n
        grad_sq = self._clip(raw.grad_sq_norm, self._recent_grad_sq)
        trace = self._clip(raw.trace_cov, self._recent_trace)
        self._recent_grad_sq.append(raw.grad_sq_norm)
        self._recent_trace.append(raw.trace_cov)
        keep = math.exp(-n / self.horizon)
        self._ema_grad_sq = keep * self._ema_grad_sq + (1.0 - keep) * grad_sq
        self._ema_trace = keep * self._ema_trace + (1.0 - keep) * trace
        self._keep *= keep
        self._steps += 1
        self._last_step = raw
        return self.result(accepted=True)

    def _clip(self, value: float, recent: deque[float]) -> float:
        if self.outlier_clip is None or len(recent) < self.outlier_window:
            return value
        ordered = sorted(recent)
        median = _quantile(ordered, 0.5)
        spread = _quantile(ordered, 0.75) - _quantile(ordered, 0.25)
        width = self.outlier_clip * spread
        return min(max(value, median - width), median + width)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, object]:
        """Plain numbers (and two short lists) that rebuild the averages exactly."""
        return {
            "version": ESTIMATOR_STATE_VERSION,
            "horizon": self.horizon,
            "ema_grad_sq": self._ema_grad_sq,
            "ema_trace": self._ema_trace,
            "keep": self._keep,
            "steps": self._steps,
            "recent_grad_sq": list(self._recent_grad_sq),
            "recent_trace": list(self._recent_trace),
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict` output; strict on required keys, tolerant of extra ones.

        Raises:
            KeyError: if a required key is missing.
            ValueError: if the version is newer than this code understands.
        """
        required = ("version", "horizon", "ema_grad_sq", "ema_trace", "keep", "steps")
        missing = [k for k in required if k not in state]
        if missing:
            raise KeyError(f"NoiseScaleEstimator.load_state_dict: missing keys {missing}")
        if int(state["version"]) > ESTIMATOR_STATE_VERSION:  # type: ignore[arg-type]
            raise ValueError(
                f"NoiseScaleEstimator.load_state_dict: state version {state['version']} is newer than "
                f"the supported version {ESTIMATOR_STATE_VERSION}; upgrade cbs-tracker"
            )
        self._reset_state()
        horizon = state["horizon"]
        self.horizon = None if horizon is None else float(horizon)  # type: ignore[arg-type]
        self._ema_grad_sq = float(state["ema_grad_sq"])  # type: ignore[arg-type]
        self._ema_trace = float(state["ema_trace"])  # type: ignore[arg-type]
        self._keep = float(state["keep"])  # type: ignore[arg-type]
        self._steps = int(state["steps"])  # type: ignore[arg-type]
        self._recent_grad_sq.extend(float(v) for v in state.get("recent_grad_sq", []))  # type: ignore[union-attr]
        self._recent_trace.extend(float(v) for v in state.get("recent_trace", []))  # type: ignore[union-attr]


def _quantile(ordered: list[float], q: float) -> float:
    """Linear-interpolation quantile of an already sorted list."""
    pos = q * (len(ordered) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (pos - lo) * (ordered[hi] - ordered[lo])
