"""A drift-aware average of per-step noise-scale estimates: the window that describes the weights now.

Per-step ``|G|^2`` and ``tr(Sigma)`` estimates are kept as mergeable sums in blocks
whose sizes double with age (an exponential histogram: a bounded number of blocks
however long the run). Each step is weighted by its units over a short moving
average of the small-batch squared norm, so the ``|G|^2`` of an early phase, orders
of magnitude above its later value, cannot dominate the sums. The window is the
longest run of newest blocks whose estimates agree (intersection of confidence
intervals, Katkovnik's ICI rule) within a cap on its share of the run; the
older data rejoin it when they agree with it. Within the window the noise scale
is the ratio of the averages, or, when that lags a detectable trend, a linear
trend of the ratio read at the current position.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from operator import add as _plus

from cbs_tracker.core.intervals import fieller_interval, student_quantile

# The fields of a block, in order: sums over its steps with weight w = units / scale.
# W = sum w, W2 = sum w^2, SG = sum w g, ST = sum w t, QGG/QTT/QGT = sum w^2 g g / t t / g t,
# LG/LT = sum w^2 g / t, STEPS = steps, GX/TX = sum w g x / w t x, GXX = sum w g x^2,
# W2X/W2XX = sum w^2 x / w^2 x^2 (x: the step's position in units); LEVEL last.
_FIELDS = 15
(W, W2, SG, ST, QGG, QTT, QGT, LG, LT, STEPS, GX, TX, GXX, W2X, W2XX) = range(_FIELDS)
LEVEL = _FIELDS
_STALE = object()  # estimate() not computed since the last step
# The trend is read only where the window's |G|^2 has at most this relative standard error.
TREND_MAX_REL_SE = 0.2


def _block(w: float, g: float, t: float, x: float) -> list[float]:
    ww = w * w
    return [w, ww, w * g, w * t, ww * g * g, ww * t * t, ww * g * t, ww * g, ww * t, 1.0,
            w * g * x, w * t * x, w * g * x * x, ww * x, ww * x * x, 0.0]


def _add(into: list[float], block: Sequence[float]) -> None:
    for i in range(_FIELDS):
        into[i] += block[i]


@dataclass(frozen=True)
class WindowMoments:
    """Weighted means of a window and the variances of those means.

    Attributes:
        grad_sq_norm: weighted mean of the per-step ``|G|^2`` estimates.
        trace_cov: weighted mean of the per-step ``tr(Sigma)`` estimates.
        effective_steps: ``(sum w)^2 / sum w^2``.
        var_grad_sq: variance of ``grad_sq_norm`` (from the spread of the steps).
        var_trace: variance of ``trace_cov``.
        cov: their covariance.
    """

    grad_sq_norm: float
    trace_cov: float
    effective_steps: float
    var_grad_sq: float
    var_trace: float
    cov: float


def level_moments(acc: Sequence[float]) -> WindowMoments | None:
    """Means and their variances, ``sum w^2 (x - mean)(y - mean) / W^2 * n/(n-1)``; ``None`` below two steps."""
    w = acc[W]
    if not w > 0 or not acc[W2] > 0:
        return None
    n_eff = w * w / acc[W2]
    if not n_eff > 1.0:
        return None
    g, t = acc[SG] / w, acc[ST] / w
    scale = n_eff / (n_eff - 1.0) / (w * w)
    v_gg = max(acc[QGG] - 2 * g * acc[LG] + g * g * acc[W2], 0.0) * scale
    v_tt = max(acc[QTT] - 2 * t * acc[LT] + t * t * acc[W2], 0.0) * scale
    v_gt = (acc[QGT] - g * acc[LT] - t * acc[LG] + g * t * acc[W2]) * scale
    return WindowMoments(g, t, n_eff, v_gg, v_tt, v_gt)


def trend_fit(acc: Sequence[float], x0: float) -> tuple[float, float, float] | None:
    """The noise scale at ``x0`` from a linear trend of the ratio over the window.

    Solves ``sum w (t - (b0 + b1 (x - x0)) g) (1, x - x0) = 0`` for ``b0, b1`` (the
    ratio estimator with a trend), and gives ``b0`` with its standard error from a
    sandwich with the window's per-weight variance of ``t - B g``.

    Returns:
        ``(b0, standard error, degrees of freedom)``, or ``None`` with fewer than four
        steps or no spread in position.
    """
    if acc[STEPS] < 4 or not acc[SG] > 0:
        return None
    a = acc[SG]
    b = acc[GX] - x0 * acc[SG]
    d = acc[GXX] - 2 * x0 * acc[GX] + x0 * x0 * acc[SG]
    det = a * d - b * b
    if not det > 1e-12 * a * d:
        return None
    y0, y1 = acc[ST], acc[TX] - x0 * acc[ST]
    b0 = (d * y0 - b * y1) / det
    level = acc[ST] / acc[SG]
    n_eff = acc[W] ** 2 / acc[W2]
    rho = max(acc[QTT] - 2 * level * acc[QGT] + level * level * acc[QGG], 0.0) / acc[W2]
    rho *= n_eff / max(n_eff - 2.0, 1.0)
    s00 = acc[W2]
    s01 = acc[W2X] - x0 * acc[W2]
    s11 = acc[W2XX] - 2 * x0 * acc[W2X] + x0 * x0 * acc[W2]
    var = rho * (d * d * s00 - 2 * d * b * s01 + b * b * s11) / (det * det)
    return b0, math.sqrt(max(var, 0.0)), max(n_eff - 2.0, 1.0)


def _candidate_interval(acc: Sequence[float], position: float, scale: float) -> tuple[float, float] | None:
    """The interval of one candidate window (its sums ``acc``), or ``None`` where there is none.

    The trend's Wald interval where :meth:`DriftWindow._trend` would use it, else
    Fieller's interval of the means (:func:`level_moments`), both widened to ``scale``
    times the 90% quantile. Python floats, one candidate at a time: a step prices a
    few dozen candidates, and the same few lines run for each.
    """
    w, w2, sg, st, qgg, qtt, qgt, lg, lt, steps, gx, tx, gxx, w2x, w2xx = acc
    if not (w > 0 and w2 > 0):
        return None
    n_eff = w * w / w2
    if not n_eff > 1.0:
        return None
    g, t = sg / w, st / w
    norm = n_eff / (n_eff - 1.0) / (w * w)
    v_gg = max(qgg - 2 * g * lg + g * g * w2, 0.0) * norm
    v_tt = max(qtt - 2 * t * lt + t * t * w2, 0.0) * norm
    v_gt = (qgt - g * lt - t * lg + g * t * w2) * norm
    bound = TREND_MAX_REL_SE * g
    if g > 0 and v_gg <= bound * bound and steps >= 4 and sg > 0:
        # the trend, where the window's |G|^2 is known to TREND_MAX_REL_SE (trend_fit, read at ``position``)
        x0 = position
        b = gx - x0 * sg
        d = gxx - 2 * x0 * gx + x0 * x0 * sg
        det = sg * d - b * b
        if det > 1e-12 * sg * d:
            b0 = (d * st - b * (tx - x0 * st)) / det
            level = st / sg
            rho = max(qtt - 2 * level * qgt + level * level * qgg, 0.0) / w2
            rho = rho * n_eff / max(n_eff - 2.0, 1.0)
            s01 = w2x - x0 * w2
            s11 = w2xx - 2 * x0 * w2x + x0 * x0 * w2
            se = math.sqrt(max(rho * (d * d * w2 - 2 * d * b * s01 + b * b * s11) / (det * det), 0.0))
            half = scale * student_quantile(max(n_eff - 2.0, 1.0)) * se
            return b0 - half, b0 + half
    return fieller_interval(t, g, v_tt, v_gg, v_gt, scale * student_quantile(n_eff - 1.0))


class DriftWindow:
    """Blocks of per-step sums and the window chosen over them (see the module docstring).

    Args:
        per_level: blocks kept per size before the two oldest merge (resolution of the window).
        max_fraction: the longest window, as a share of the steps seen, before the
            older data are tested for agreement.
        agreement: half-width, in standard errors at 90% confidence, of the
            intervals whose intersection chooses the window.
        extend_threshold: the older data rejoin the window when their mean
            ``t - B g`` is within this many standard errors (90% quantile scale) of 0.
        min_steps: the shortest window.
        scale_steps: memory in steps of the small-norm average each step's weight is divided by.
    """

    def __init__(self, *, per_level: int, max_fraction: float, agreement: float,
                 extend_threshold: float, min_steps: int, scale_steps: float) -> None:
        self.per_level = per_level
        self.max_fraction = max_fraction
        self.agreement = agreement
        self.extend_threshold = extend_threshold
        self.min_steps = min_steps
        self.scale_steps = scale_steps
        self.blocks: list[list[float]] = []
        self.scale: float | None = None
        self.position = 0.0
        self.steps = 0
        self.window: list[float] | None = None
        self.extended = False
        self._cached: object = _STALE  # estimate() of the current window

    # ------------------------------------------------------------------ update
    def add(self, grad_sq: float, trace: float, units: float, small_sq_norm: float) -> None:
        """Add one step's estimates; ``small_sq_norm`` (> 0) feeds the weight's scale."""
        if self.scale is None or not self.scale > 0:
            self.scale = small_sq_norm if small_sq_norm > 0 else 1.0
        weight = units / self.scale
        if small_sq_norm > 0:
            keep = math.exp(-1.0 / self.scale_steps)
            self.scale = keep * self.scale + (1.0 - keep) * small_sq_norm
        self.blocks.append(_block(weight, grad_sq, trace, self.position + units / 2))
        self.position += units
        self.steps += 1
        self._compact()
        self._choose()
        self._cached = _STALE

    def _compact(self) -> None:
        blocks, level = self.blocks, 0.0
        while True:
            same = [i for i, b in enumerate(blocks) if b[LEVEL] == level]
            if len(same) <= self.per_level:
                return
            i, j = same[0], same[1]  # the two oldest of this size are neighbours
            merged = [x + y for x, y in zip(blocks[i][:_FIELDS], blocks[j][:_FIELDS])]
            blocks[i] = merged + [level + 1]
            del blocks[j]
            level += 1

    def _trend(self, acc: Sequence[float]) -> tuple[float, float, float] | None:
        """:func:`trend_fit` where it can be trusted: ``|G|^2`` of the window known to 20%.

        The trend's equations carry the noisy ``|G|^2`` estimates on both sides; with
        ``|G|^2`` barely resolved the fit extrapolates wildly and its standard error,
        which treats them as known, does not show it.
        """
        m = level_moments(acc)
        if m is None or not m.grad_sq_norm > 0 or m.var_grad_sq > (TREND_MAX_REL_SE * m.grad_sq_norm) ** 2:
            return None
        return trend_fit(acc, self.position)

    def _bounded(self, acc: Sequence[float]) -> bool:
        m = level_moments(acc)
        if m is None or not m.grad_sq_norm > 0:
            return False
        q = student_quantile(m.effective_steps - 1.0)
        return m.grad_sq_norm**2 > q * q * m.var_grad_sq

    def _choose(self) -> None:
        """Choose the window: candidates of the newest blocks, newest first, priced one at a time until
        one disagrees with those before it or the cap is reached.

        ``tests/test_estimator.py`` holds it to a plain loop built from :func:`level_moments` and
        :func:`trend_fit`, and to the vectorised form (every candidate priced at once in NumPy) that
        it replaced: a step prices a few dozen candidates, which a NumPy call per formula made cost
        several times more than the arithmetic.
        """
        blocks, min_steps, scale, position = self.blocks, self.min_steps, self.agreement, self.position
        cap = self.max_fraction * self.steps
        acc = [0.0] * _FIELDS
        run_low, run_high = -math.inf, math.inf
        chosen: list[float] | None = None
        capped = False
        i = len(blocks) - 1
        while i >= 0:
            block = blocks[i]
            before = acc[STEPS]
            if not (before < min_steps or before + block[STEPS] <= cap):
                capped = True  # the older blocks are tested for agreement by _settle
                break
            acc = list(map(_plus, acc, block))  # (the block's LEVEL is left out: acc has _FIELDS)
            i -= 1
            if acc[STEPS] < min_steps:
                continue
            interval = _candidate_interval(acc, position, scale)
            if interval is None or interval[0] != interval[0]:  # no interval (or NaN: not a valid candidate)
                continue
            low, high = interval
            if low > run_high or high < run_low:
                break  # disagrees with the newer candidates: the window is the last one that agreed
            run_low, run_high = max(run_low, low), min(run_high, high)
            chosen = acc

        def total() -> list[float]:  # every block, summed in the same order (newest first)
            out = acc
            for j in range(i, -1, -1):
                out = list(map(_plus, out, blocks[j]))
            return out

        self._settle(chosen, capped, total)

    def _settle(self, chosen: list[float] | None, capped: bool, total: Callable[[], list[float]]) -> None:
        """Keep the chosen window, or the whole run (``total()``: every block's sums) when it cannot say
        anything or the older data agree."""
        if chosen is not None and not self._bounded(chosen):
            # |G|^2 of the window the data agree on is not distinguishable from 0: a cut
            # that leaves nothing to say is not taken, the whole run is all there is
            chosen, capped = total(), False
        self.window, self.extended = chosen, False
        if not capped or chosen is None or not chosen[SG] > 0:
            return
        whole = total()
        older = [x - y for x, y in zip(whole, chosen)]
        ratio = chosen[ST] / chosen[SG]
        rho = max(chosen[QTT] - 2 * ratio * chosen[QGT] + ratio * ratio * chosen[QGG], 0.0) / chosen[W2]
        gap = (older[ST] - ratio * older[SG]) / older[W]
        var = rho * (older[W2] / older[W] ** 2 + chosen[W2] / chosen[W] ** 2)
        q = self.extend_threshold * student_quantile(chosen[STEPS] - 1.0)
        if gap * gap <= q * q * var:
            self.window, self.extended = whole, True

    # ------------------------------------------------------------------ results
    @property
    def window_steps(self) -> int:
        """Steps in the chosen window (0 before one is chosen)."""
        return 0 if self.window is None else int(round(self.window[STEPS]))

    def means(self) -> tuple[float, float] | None:
        """``(|G|^2, tr(Sigma))`` weighted means of the window (of every step before one is chosen)."""
        acc = self.window
        if acc is None:
            acc = [0.0] * _FIELDS
            for block in self.blocks:
                _add(acc, block)
        if not acc[W] > 0:
            return None
        return acc[SG] / acc[W], acc[ST] / acc[W]

    def moments(self) -> WindowMoments | None:
        """The chosen window's means and their variances."""
        return None if self.window is None else level_moments(self.window)

    def estimate(self) -> tuple[float | None, tuple[float, float], bool] | None:
        """See :meth:`_estimate`; computed once per step."""
        if self._cached is _STALE:
            self._cached = self._estimate()
        return self._cached  # type: ignore[return-value]

    def _estimate(self) -> tuple[float | None, tuple[float, float], bool] | None:
        """``(ratio of the means or None, 90% interval, trend used)``, or ``None`` without a window.

        The ratio of the window's means with Beale's correction, its Fieller interval
        widened to hold the trend's interval; the trend's value and interval instead
        when the ratio of the means lies outside the trend's interval (it lags) and
        the window was not joined by the older data (no drift found).
        """
        m = self.moments()
        if m is None:
            means = self.means()
            if means is None:
                return None
            g, t = means
            return (max(t, 0.0) / g if g > 0 else None), (0.0, math.inf), False
        q = student_quantile(m.effective_steps - 1.0)
        low, high = fieller_interval(m.trace_cov, m.grad_sq_norm, m.var_trace, m.var_grad_sq, m.cov, q)
        ratio = None
        if m.grad_sq_norm > 0:
            ratio = 0.0
            if m.trace_cov > 0:
                g, t = m.grad_sq_norm, m.trace_cov
                ratio = t / g * max(1.0 + m.cov / (t * g), 0.0) / (1.0 + m.var_grad_sq / (g * g))
                ratio = min(max(ratio, low), high)
        if self.extended:
            return ratio, (low, high), False
        fit = self._trend(self.window)  # type: ignore[arg-type]
        if fit is None:
            return ratio, (low, high), False
        b0, se, dof = fit
        qt = student_quantile(dof)
        t_low, t_high = max(b0 - qt * se, 0.0), max(b0 + qt * se, 0.0)
        if ratio is None or not t_low <= ratio <= t_high:
            return max(b0, 0.0), (t_low, t_high), True
        return ratio, (min(low, t_low), max(high, t_high)), False

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, object]:
        return {
            "blocks": [list(b) for b in self.blocks],
            "scale": self.scale,
            "position": self.position,
            "steps": self.steps,
        }

    @staticmethod
    def check_state(state: Mapping[str, object], where: str) -> tuple[list[list[float]], float | None, float, int]:
        """Validate a :meth:`state_dict`; raise ``TypeError``/``ValueError`` naming the key."""
        blocks = state.get("blocks")
        if not isinstance(blocks, (list, tuple)) or not all(
            isinstance(b, (list, tuple)) and len(b) == _FIELDS + 1
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in b)
            for b in blocks
        ):
            raise TypeError(f"{where}: window.blocks must be a list of lists of {_FIELDS + 1} finite numbers")
        scale = state.get("scale")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not (math.isfinite(scale) and scale > 0)):
            raise ValueError(f"{where}: window.scale={scale!r} must be a positive number or None")
        position = state.get("position", 0.0)
        steps = state.get("steps", 0)
        if isinstance(position, bool) or not isinstance(position, (int, float)) or not (math.isfinite(position) and position >= 0):
            raise ValueError(f"{where}: window.position={position!r} must be a finite number >= 0")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"{where}: window.steps={steps!r} must be an integer >= 0")
        return [[float(v) for v in b] for b in blocks], None if scale is None else float(scale), float(position), steps

    def load(self, blocks: list[list[float]], scale: float | None, position: float, steps: int) -> None:
        """Assign a checked state and choose the window again."""
        self.blocks, self.scale, self.position, self.steps = blocks, scale, position, steps
        self.window, self.extended, self._cached = None, False, _STALE
        if blocks:
            self._choose()
