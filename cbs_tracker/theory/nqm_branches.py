"""Do short branches predict the batch that is best for the rest of a run? The NQM answers exactly.

On the noisy quadratic model (:class:`~cbs_tracker.theory.nqm.ExactNQM`, SGD in expectation) the
final loss of any schedule of step sizes and batches is a closed form, so at a branch point of a
run at batch ``B0`` the batch that minimises the loss **at the end of the budget** (the rest of
the run at ``k * B0``, its step size times the coupling of ``k`` and the run's LR schedule, final
decay included) can be computed, and set beside what short branches from the same state say:

* an **uncooled** branch trains ``branch_share`` of the remaining budget at ``k * B0`` with the
  run's own LR and is read at its end; a larger batch lowers the gradient noise at once, the way
  an LR decay does, so these favour the largest batch (the short-horizon bias);
* a **cooled** branch anneals its LR over its last ``cooldown`` fraction
  (:func:`~cbs_tracker.calibrate.branches.branch_lr_factors`, the same factors
  :func:`~cbs_tracker.calibrate.measure_critical_batch` applies) and compares models with that
  noise removed, as the run's own final decay will.

Each side's pick is the critical batch of :func:`~cbs_tracker.policy.critical.critical_batch_interval`
(the exact losses, so ``epsilon`` is a relative tolerance); ``python -m
cbs_tracker.theory.nqm_branches`` prints the table.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from cbs_tracker.calibrate.branches import branch_lr_factors
from cbs_tracker.policy.critical import BranchLosses, critical_batch_interval
from cbs_tracker.policy.lr import coupling_factor
from cbs_tracker.theory.nqm import ExactNQM, NQMConfig

__all__ = ["BranchStudyPoint", "branch_study", "cosine_multiplier", "main"]

MULTIPLES = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)


def cosine_multiplier(budget: float, floor: float = 0.1) -> Callable[[float], float]:
    """The LR multiplier of a cosine from 1 to ``floor`` over ``budget`` samples (no warm-up)."""
    def at(tokens: float) -> float:
        p = min(max(tokens / budget, 0.0), 1.0)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * p))
    return at


@dataclass(frozen=True)
class BranchStudyPoint:
    """One branch point: the exact best batch for the rest of the run beside the branches' picks.

    Attributes:
        tokens: samples seen at the branch point.
        noise_scale: the exact ``B_simple = tr(Sigma) / |G|^2`` there.
        final_losses: the loss at the end of the budget for the rest of the run at each ``k * B0``.
        best_batch: the batch of the lowest of ``final_losses``.
        uncooled: each batch's loss after an uncooled branch; ``uncooled_pick`` its critical batch.
        cooled: the same with the branch's LR annealed; ``cooled_pick`` its critical batch.
    """

    tokens: float
    noise_scale: float
    final_losses: dict[float, float]
    best_batch: float
    uncooled: dict[float, float]
    uncooled_pick: float
    cooled: dict[float, float]
    cooled_pick: float


def _advance(model: ExactNQM, v: np.ndarray, lrs: Sequence[float], batch: float) -> np.ndarray:
    """Second moments after SGD steps of sizes ``lrs`` at ``batch`` (runs of equal steps in closed form)."""
    h, sigma2 = model.curvatures, model.noise_variance
    lrs = np.asarray(lrs, dtype=np.float64)
    i, n = 0, lrs.size
    while i < n:
        j = i + 1
        while j < n and lrs[j] == lrs[i]:
            j += 1
        a = (1.0 - lrs[i] * h) ** 2
        a_n = a ** (j - i)
        v = v * a_n + lrs[i] ** 2 * sigma2 / batch * (1.0 - a_n) / (1.0 - a)
        i = j
    return v


def _pick(losses: dict[float, float], epsilon: float) -> float:
    branches = [BranchLosses(b, 1.0, 1.0, (loss,)) for b, loss in sorted(losses.items())]
    return critical_batch_interval(branches, epsilon=epsilon).low


def branch_study(config: NQMConfig | None = None, *, budget: float = 4e5, batch: float = 8.0,
                 fractions: Sequence[float] = (0.1, 0.2, 0.3), multiples: Sequence[float] = MULTIPLES,
                 branch_share: float = 0.1, cooldown: float = 0.5, cooldown_shape: str = "sqrt",
                 coupling: str = "sqrt", lr_multiplier: Callable[[float], float] | None = None,
                 epsilon: float = 1e-3, grid: float = 800.0) -> list[BranchStudyPoint]:
    """Branch at each ``fraction`` of ``budget`` of a run at ``batch`` and compare with the exact end.

    Args:
        config: the NQM (default: ``NQMConfig(lr=0.25, dims=300, noise_floor=0.25)``, so that the
            largest coupled step size stays stable).
        budget: samples of the whole run.
        batch: the run's batch ``B0`` up to the branch point.
        fractions: branch points as fractions of ``budget``.
        multiples: the batches ``k * B0`` compared.
        branch_share: each branch's length as a share of the remaining budget.
        cooldown, cooldown_shape: the cooled branches' anneal (as in ``measure_critical_batch``).
        coupling: the step size of ``k * B0`` is the run's times this coupling of ``k``.
        lr_multiplier: the run's LR schedule against samples (default: cosine to 10%).
        epsilon: the critical-batch tolerance, relative to the loss at the branch point.
        grid: the run up to the branch point changes its step size every ``grid`` samples.
    """
    model = ExactNQM(config or NQMConfig(lr=0.25, dims=300, noise_floor=0.25))
    sched = lr_multiplier or cosine_multiplier(budget)
    h, sigma2 = model.curvatures, model.noise_variance
    points = []
    for fraction in fractions:
        t0 = fraction * budget
        n0 = int(t0 // batch)
        lrs = [model.lr * sched(round((i + 1) * batch / grid) * grid) for i in range(n0)]
        v = _advance(model, model.initial_second_moment.copy(), lrs, batch)
        start_loss = 0.5 * float(h @ v)
        rest = budget - t0

        def run(k: float, samples: float, cool: float, start: np.ndarray = v, at: float = t0) -> float:
            steps = int(samples // (k * batch))
            factors = branch_lr_factors(steps, step_units=k * batch, tokens=at, lr_mult=coupling_factor(coupling, k),
                                        lr_schedule=sched, cooldown=cool, cooldown_shape=cooldown_shape)
            return 0.5 * float(h @ _advance(model, start, [model.lr * f for f in factors], k * batch))

        final = {k * batch: run(k, rest, 0.0) for k in multiples}
        uncooled = {k * batch: run(k, branch_share * rest, 0.0) for k in multiples}
        cooled = {k * batch: run(k, branch_share * rest, cooldown) for k in multiples}
        eps = epsilon * start_loss
        points.append(BranchStudyPoint(
            tokens=t0, noise_scale=float(np.sum(sigma2)) / float((h * h) @ v), final_losses=final,
            best_batch=min(final, key=final.__getitem__), uncooled=uncooled, uncooled_pick=_pick(uncooled, eps),
            cooled=cooled, cooled_pick=_pick(cooled, eps)))
    return points


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--noise-floor", type=float, nargs="+", default=[0.25, 0.1])
    p.add_argument("--branch-share", type=float, nargs="+", default=[0.02, 0.05, 0.1, 0.2])
    p.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.45])
    args = p.parse_args(argv)
    print("| noise floor | branch point | B_simple | best batch for the rest (exact) | branch share | "
          "uncooled branches | cooled branches |")
    print("|---|---|---|---|---|---|---|")
    for floor in args.noise_floor:
        for share in args.branch_share:
            for pt in branch_study(NQMConfig(lr=0.25, dims=300, noise_floor=floor), fractions=args.fractions,
                                   branch_share=share):
                print(f"| {floor:g} | {pt.tokens:,.0f} | {pt.noise_scale:,.0f} | {pt.best_batch:g} | {share:.0%} | "
                      f"{pt.uncooled_pick:g} | {pt.cooled_pick:g} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
