"""The library's own controller and estimator on the noisy quadratic model.

Runs :class:`~cbs_tracker.policy.controller.BatchSizeController` on the NQM of
:mod:`cbs_tracker.theory.nqm` with the same settings at every budget, fed the exact
noise scale or the library's :class:`~cbs_tracker.core.estimator.NoiseScaleEstimator`
on sampled gradients, budget-unaware and budget-aware. Importing this module
registers those rows with :func:`cbs_tracker.theory.nqm.register_row`, so
``cbs-tracker nqm`` prints them; ``docs/history-2026.md`` (The controller on the NQM) explains the variants.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from cbs_tracker.core.estimator import NoiseScaleEstimator
from cbs_tracker.policy.controller import BatchSizeController, Decision
from cbs_tracker.theory.nqm import (
    DEFAULT_B_MAX,
    DEFAULT_B_MIN,
    DEFAULT_BUDGET,
    ExactNQM,
    NQMConfig,
    OnlineObservation,
    OnlineRun,
    RowContext,
    ScheduleResult,
    Spectrum,
    register_row,
    run_online,
)

__all__ = [
    "ChiSquareMonteCarlo",
    "ControllerRun",
    "nqm_controller",
    "run_controller",
]

NoiseSource = Literal["exact", "estimated"]


def nqm_controller(
    *, b_min: float = DEFAULT_B_MIN, b_max: float = DEFAULT_B_MAX, budget: float | None = None, **overrides: Any
) -> BatchSizeController:
    """The controller as the NQM comparison runs it: library defaults plus the problem's bounds.

    ``max_batch = b_max`` and ``max_accumulation_steps = b_max / b_min`` (the default
    ``B_max = 8192`` is 1024 starting batches, beyond the default cap of 256);
    ``budget_tokens = budget`` for the budget-aware rows. Nothing else is set: every
    other option keeps its library default, at every budget.

    Args:
        b_min: the starting (smallest) batch, in samples.
        b_max: the largest batch.
        budget: samples of the run (budget-aware mode) or ``None``.
        **overrides: further :class:`BatchSizeController` arguments (for experiments).
    """
    acc_cap = max(1, int(math.floor(b_max / b_min + 1e-9)))
    # the quadratic model has no loss curve for the default's hold on a loss plateau to read
    kwargs: dict[str, Any] = {"max_batch": float(b_max), "max_accumulation_steps": acc_cap, "hold_on_plateau": None}
    if budget is not None:
        kwargs["budget_tokens"] = float(budget)
    kwargs.update(overrides)
    return BatchSizeController(**kwargs)


class ChiSquareMonteCarlo:
    """One sampled NQM run whose steps cost O(dims) whatever the number of microbatches.

    A step with ``K`` microbatches of ``m`` samples at iterate ``theta`` has
    microbatch gradients ``g_k = h theta + xi_k``, ``xi_k ~ N(0, diag(sigma^2)/m)``.
    Their mean is ``g = h theta + xi_bar`` with ``xi_bar ~ N(0, sigma^2/(K m))``, and
    ``sum_k |g_k - g|^2 = sum_i (sigma_i^2/m) chi^2_(K-1)``, independent of ``xi_bar``
    (Cochran's theorem). So ``|G_small|^2 = mean_k |g_k|^2 = |g|^2 + sum_k |g_k - g|^2 / K``
    and ``|G_big|^2 = |g|^2`` come out with their exact joint law, together with the
    update ``theta <- theta - eta g``.

    Args:
        config: the spectrum (default: :class:`~cbs_tracker.theory.nqm.NQMConfig`).
        seed: seed of the generator (initial point and all noise).
    """

    def __init__(self, config: NQMConfig | None = None, *, seed: int = 0) -> None:
        self.config = config or NQMConfig()
        self._spec = Spectrum(self.config)
        self._rng = np.random.default_rng(int(seed))
        self._sigma = np.sqrt(self._spec.sigma2)
        self.theta = np.sqrt(self._spec.v0) * self._rng.standard_normal(self.config.dims)
        self.steps = 0
        self.tokens_seen = 0.0

    @property
    def trace_cov(self) -> float:
        """``tr(Sigma) = sum sigma_i^2`` (per example)."""
        return self._spec.trace_cov

    def step(self, num_micro: int, micro_batch: float) -> tuple[float, float]:
        """One SGD step on ``num_micro`` microbatches of ``micro_batch`` samples.

        Returns:
            ``(small_sq_norm, big_sq_norm)``: the mean squared norm of the microbatch
            gradients and the squared norm of their mean, both at the iterate before
            the update.
        """
        k = int(num_micro)
        if k < 1:
            raise ValueError(f"ChiSquareMonteCarlo.step(num_micro={num_micro!r}): must be >= 1")
        m = float(micro_batch)
        if not (m > 0 and math.isfinite(m)):
            raise ValueError(f"ChiSquareMonteCarlo.step(micro_batch={micro_batch!r}): must be > 0")
        sp = self._spec
        g = sp.h * self.theta + self._sigma * (self._rng.standard_normal(sp.h.size) / math.sqrt(k * m))
        big = float(np.dot(g, g))
        spread = float(np.dot(sp.sigma2, self._rng.chisquare(k - 1, sp.h.size))) / m if k > 1 else 0.0
        self.theta = self.theta - sp.lr * g
        self.steps += 1
        self.tokens_seen += k * m
        return big + spread / k, big

    def loss(self) -> float:
        """``1/2 sum h_i theta_i^2`` at the current iterate."""
        return float(0.5 * np.dot(self._spec.h, self.theta**2))

    def grad_sq_norm(self) -> float:
        """True ``|G|^2 = sum h_i^2 theta_i^2`` at the current iterate."""
        return float(np.dot(self._spec.h**2, self.theta**2))


@dataclass(frozen=True)
class ControllerRun:
    """One controller run on the NQM.

    Attributes:
        run: the batches and the exact expected final loss (:class:`cbs_tracker.theory.nqm.OnlineRun`).
        noise_source: ``"exact"`` or ``"estimated"``.
        budget_aware: whether ``budget_tokens`` was set.
        fed_noise_scales: per step, the noise scale given to the controller (``nan``: none yet).
        changes: ``(step, tokens_seen, new_batch, reason)`` of every change.
        feedback_trap: whether the controller declared the feedback trap.
        seed: the Monte-Carlo seed (estimated runs).
    """

    run: OnlineRun
    noise_source: NoiseSource
    budget_aware: bool
    fed_noise_scales: np.ndarray = field(repr=False)
    changes: tuple[tuple[int, float, float, str], ...]
    feedback_trap: bool
    seed: int = 0

    @property
    def final_loss(self) -> float:
        """Exact expected loss of the chosen batch sequence."""
        return self.run.expected_final_loss


def _policy(ctrl: BatchSizeController, unit: float, fed: list[float], changes: list, trap: list[bool]
            ) -> Callable[[OnlineObservation, float | None], float]:
    def decide(obs: OnlineObservation, noise_scale: float | None) -> float:
        acc = max(1, int(round(obs.batch / unit)))
        d: Decision = ctrl.update(step=obs.step, tokens_seen=float(obs.tokens_seen), global_batch=float(obs.batch),
                                  accumulation_steps=acc, noise_scale=noise_scale)
        fed.append(math.nan if noise_scale is None else float(noise_scale))
        if d.changed:
            changes.append((obs.step, float(obs.tokens_seen), float(d.accumulation_steps * unit), d.reason))
        trap[0] = d.feedback_trap
        return float(d.accumulation_steps * unit)

    return decide


def run_controller(
    *,
    budget: float = DEFAULT_BUDGET,
    b_min: float = DEFAULT_B_MIN,
    b_max: float = DEFAULT_B_MAX,
    budget_aware: bool = False,
    noise: NoiseSource = "exact",
    seed: int = 0,
    config: NQMConfig | None = None,
    controller: BatchSizeController | None = None,
    estimator: NoiseScaleEstimator | None = None,
) -> ControllerRun:
    """Spend ``budget`` samples on the NQM with the batch chosen online by the controller.

    The run starts at ``b_min`` (one accumulation step of ``b_min`` samples). After
    each step the controller gets ``step``, ``tokens_seen``, the step's batch, its
    accumulation (batch / ``b_min``) and the noise scale, and its decision sets the
    next batch.

    Args:
        budget: samples to spend.
        b_min: starting batch.
        b_max: largest batch.
        budget_aware: pass ``budget_tokens=budget`` to the controller.
        noise: ``"exact"``: the expected dynamics and the exact ``B_simple``
            (:func:`cbs_tracker.theory.nqm.run_online`); ``"estimated"``: one sampled run
            (:class:`ChiSquareMonteCarlo`, ``seed``) with microbatches of
            ``b_min / 4`` samples, the per-step norms fed to ``estimator`` (default
            :class:`NoiseScaleEstimator` with its defaults) and its smoothed
            noise scale to the controller.
        seed: Monte-Carlo seed.
        config: the NQM spectrum (default: :class:`~cbs_tracker.theory.nqm.NQMConfig`).
        controller: a controller to use instead of :func:`nqm_controller`'s.
        estimator: an estimator to use instead of the default one.

    Returns:
        The :class:`ControllerRun`; ``run.expected_final_loss`` is the exact expected
        loss of the batch sequence chosen.
    """
    if noise not in ("exact", "estimated"):
        raise ValueError(f"run_controller(noise={noise!r}): expected 'exact' or 'estimated'")
    ctrl = controller or nqm_controller(b_min=b_min, b_max=b_max, budget=budget if budget_aware else None)
    fed: list[float] = []
    changes: list[tuple[int, float, float, str]] = []
    trap = [False]
    decide = _policy(ctrl, float(b_min), fed, changes, trap)
    with warnings.catch_warnings():
        # the trap warning is reported in ControllerRun.feedback_trap
        warnings.filterwarnings("ignore", message=".*follows the batch.*", category=RuntimeWarning)
        if noise == "exact":
            run = run_online(lambda obs: decide(obs, obs.noise_scale), budget=budget, initial_batch=b_min,
                             model="exact", config=config)
        else:
            run = _run_sampled(decide, budget=budget, b_min=b_min, seed=seed, config=config,
                               estimator=estimator or NoiseScaleEstimator())
    return ControllerRun(
        run=run, noise_source=noise, budget_aware=ctrl.budget_tokens is not None,
        fed_noise_scales=np.asarray(fed), changes=tuple(changes), feedback_trap=trap[0], seed=seed,
    )


def _run_sampled(decide: Callable[[OnlineObservation, float | None], float], *, budget: float, b_min: float,
                 seed: int, config: NQMConfig | None, estimator: NoiseScaleEstimator) -> OnlineRun:
    mc = ChiSquareMonteCarlo(config, seed=seed)
    micro = b_min / 4.0
    batch = float(b_min)
    batches: list[float] = []
    losses: list[float] = []
    scales: list[float] = []
    tokens = 0.0
    while tokens < budget * (1 - 1e-12):
        k = max(1, int(round(batch / micro)))
        m = micro
        rest = budget - tokens
        if k * m >= rest * (1 - 1e-12):  # the last step takes what is left
            k = max(1, int(round(rest / micro)))
            m = rest / k
        small, big = mc.step(k, m)
        tokens = mc.tokens_seen
        estimate = estimator.update(small, big, m, k * m, k * m)
        loss = mc.loss()
        grad_sq = mc.grad_sq_norm()
        batches.append(k * m)
        losses.append(loss)
        scales.append(mc.trace_cov / grad_sq)
        obs = OnlineObservation(
            step=mc.steps, tokens_seen=tokens, budget=budget, batch=k * m, loss=loss,
            grad_sq_norm=grad_sq, trace_cov=mc.trace_cov, noise_scale=mc.trace_cov / grad_sq,
            big_sq_norm=big, micro_batch=m,
        )
        batch = decide(obs, estimate.noise_scale)
    arr = np.asarray(batches)
    return OnlineRun(
        model="monte_carlo", final_loss=float(losses[-1]), expected_final_loss=ExactNQM(config).final_loss(arr),
        steps=arr.size, batches=arr, losses=np.asarray(losses), noise_scales=np.asarray(scales),
    )


# --------------------------------------------------------------------------- rows

_ROWS: tuple[tuple[str, bool, NoiseSource, str], ...] = (
    ("online", False, "exact", "controller (defaults), exact noise scale"),
    ("online_estimated", False, "estimated", "controller (defaults), estimator on sampled gradients"),
    ("budget_aware", True, "exact", "controller + budget, exact noise scale"),
    ("budget_aware_estimated", True, "estimated", "controller + budget, estimator on sampled gradients"),
)


def _row(name: str, budget_aware: bool, noise: NoiseSource, label: str) -> Callable[[RowContext], ScheduleResult]:
    def produce(ctx: RowContext) -> ScheduleResult:
        res = run_controller(budget=ctx.budget, b_min=ctx.b_min, b_max=ctx.b_max, budget_aware=budget_aware,
                             noise=noise, config=ctx.model.config)
        top = float(res.run.batches.max())
        steps_at_start = max(1, int(math.floor(ctx.budget / ctx.b_min + 1e-9)))
        start_constant = ctx.model.constant_loss(ctx.b_min, steps_at_start)
        note = (
            f"x{start_constant / res.final_loss:.2f} vs constant B={ctx.b_min:g} (its start), "
            f"ends at B={res.run.batches[-2] if res.run.steps > 1 else top:.4g}, {len(res.changes)} changes"
        )
        if res.feedback_trap:
            note += ", feedback trap detected"
        if noise == "estimated":
            note += f", Monte-Carlo seed {res.seed}"
        return res.run.as_row(name, label, note)

    return produce


for _name, _aware, _noise, _label in _ROWS:
    register_row(_name, _row(_name, _aware, _noise, _label))
