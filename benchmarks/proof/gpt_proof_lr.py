"""The proof under decaying learning rates: growth at equal tokens against a constant batch.

Same model, data, warm-up and token budget as ``gpt_proof.py``. Each run hands its
learning-rate schedule to the tracker as a ``LambdaLR`` sized in steps of the
starting batch (what a user writes), so the tracker re-times it in tokens and
multiplies it by the batch-size coupling. Runs, per seed and LR schedule
(``cosine`` or ``wsd``: warmup-stable-decay, last 20% linear, both to 10%):

* ``constant_512``: the constant 512-token batch (256-token microbatches, A = 2);
* ``tracker_default``: the library's defaults when the rule was named, ``kappa=0.5`` without
  conversion (``gpt_proof.EARLIER_DEFAULTS``; the rule keeps them), LR coupling chosen from AdamW: sqrt;
* ``tracker_convert``: the same plus ``convert_lr_decay=True`` (halvings of the
  scheduled LR become doublings while the batch stays below the measured critical batch);
* ``tracker_default_cap`` (first seed, cosine): the coupling capped at the peak LR;
* ``tracker_convert_kappa1`` (first seed): the conversion allowed up to ``B_simple`` itself;
* ``tracker_default`` and ``tracker_budget`` at a constant LR (the earlier proof's rows,
  rerun with the new defaults, except that ``tracker_budget`` passes ``cap_lr_at_peak=False``:
  the uncapped coupling that the default now avoids with a budget); ``tracker_budget_cap`` the
  budget with the coupled LR capped at its peak (the default with a budget);
* ``tracker_mbfirst`` (cosine): the default controller growing the microbatch first
  (``max_microbatch``), for the wall-clock comparison; ``tracker_mbfirst_auto`` the same
  measuring at ``measure_every="auto"`` (the tracker's own work kept near 1% of a step);
* ``tracker_kappa04`` (cosine and WSD): the default controller at ``kappa=0.4``;
* ``tracker_measured`` (cosine): the default controller with the ``kappa`` measured by branches
  (``benchmarks/proof/calibrate_proof.py``; the file ``MEASURED_KAPPA``), interpolated in log tokens;
  ``tracker_measured_cap`` the same with the coupled LR capped at its peak;
* ``constant_512_fast`` (cosine): constant 512 at its fastest layout on one process, one
  512-token microbatch per step, without the tracker (no noise scale is measurable there).

Usage::

    python -m benchmarks.proof.gpt_proof_lr --out runs/proof_lr          # about an hour on two cores
    python -m benchmarks.proof.gpt_proof_lr --quick --out runs/proof_lr_quick
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import time
from collections.abc import Generator, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from . import gpt_proof as base  # the shared setting, data and evaluation

SCHEDULES = ("constant", "tracker_default", "tracker_convert", "tracker_convert_kappa1", "tracker_budget",
             "tracker_mbfirst", "tracker_mbfirst_auto", "constant_fast", "tracker_kappa04", "tracker_measured",
             "tracker_kappaNN", "tracker_kappaNN_convert",
             "tracker_kappaNN_MM", "tracker_kappaNN_MM_convert", "seesaw", "hand_ramp", "tracker_cooled",
             "tracker_effNNN", "tracker_library_default", "tracker_kappa04_convert_peak",
             "tracker_kappaNN[_MM]_convert_untilNNN", "tracker_..._linear", "tracker_..._riseNN", "..._adam",
             "tracker_..._wd", "tracker_..._slopeNN", "tracker_..._hold", "tracker_..._gateNN",
             "tracker_..._plateauNN[_atNN][_exitNN]", "tracker_library_plateauNN[_tppNN]",
             "tracker_library_plateauNN_tppNN_long[50]")
#: a schedule trained with the coupled LR capped at the schedule's peak (``cap_lr_at_peak=True``): the
#: controller of the schedule it names
PEAK_CAPPED = {"tracker_kappa04_convert_peak": "tracker_kappa04_convert"}
#: ``tracker_kappa04_convert_until085``, ``tracker_kappa04_08_convert_until085``: the run schedule named before
#: ``_until`` converting only the halvings of the scheduled LR before 0.85 of the run (``convert_until``)
_UNTIL_RUN = re.compile(r"(tracker_\w+_convert)_until(\d)(\d\d)")
#: ``tracker_kappa03``, ``tracker_kappa07``, ...: the default controller at ``kappa = NN / 10``;
#: ``tracker_kappa04_convert``: the same with ``convert_lr_decay=True``
_KAPPA_RUN = re.compile(r"tracker_kappa(\d)(\d)(_convert)?")
#: ``tracker_kappa04_08_convert``: ``kappa`` rising linearly in tokens from 0.4 at the start to 0.8 at the
#: budget's end (a ``KappaSchedule`` of two points), with or without the conversion
_KAPPA_RAMP_RUN = re.compile(r"tracker_kappa(\d)(\d)_(\d)(\d)(_convert)?")
#: ``tracker_eff008``: growth spending an efficiency budget of 0.08 of the run's tokens (``efficiency_budget``,
#: ``total_tokens`` the setting's budget), no LR-decay conversion
_EFF_RUN = re.compile(r"tracker_eff(\d)(\d\d)")
#: ``tracker_kappa04_convert_until085_linear``: the rule it names with the LR coupled linearly to the batch
#: (``lr_scaling="linear"``: LR x 2 per doubling) in place of the square root Adam gets by default
_LINEAR_RUN = re.compile(r"(tracker_\w+)_linear")
#: ``constant_adam``, ``tracker_kappa04_convert_until085_adam``: the run schedule named before ``_adam`` with the
#: noise scale measured through Adam's preconditioner (``preconditioner="adam"``: ``tr(P Sigma P) / |P G|^2``)
_ADAM_RUN = re.compile(r"(\w+)_adam")
#: ``tracker_kappa04_convert_until085_rise13``: the rule it names with its first growth held until the noise scale
#: has risen to 1.3 x its median at a tenth of the run (:func:`rise_gated`; conversions of LR halvings unaffected)
_RISE_RUN = re.compile(r"(tracker_\w+)_rise(\d)(\d)")
#: ``tracker_kappa04_convert_until085_slope10``: the rule it names with ``kappa`` read from the run's own loss:
#: 1.0 x how fast its training loss falls per e-fold of tokens (:func:`slope_kappa`)
_SLOPE_RUN = re.compile(r"(tracker_\w+)_slope(\d)(\d)")
#: ``tracker_kappa04_convert_until085_slope10_hold``: the rule it names with no growth from the noise scale after
#: ``convert_until`` of the run (:func:`held_late`), where the last halvings of the LR are left to decay
_HOLD_RUN = re.compile(r"(tracker_\w+)_hold")
#: ``tracker_kappa04_convert_until085_gate02``: the rule it names, its growth (doublings from the noise scale and
#: conversions of LR halvings alike) held while its training loss falls by less than 0.2 nats per e-fold of tokens
#: (:func:`slope_gated`): no growth on a plateau
_GATE_RUN = re.compile(r"(tracker_\w+)_gate(\d)(\d)")
#: ``tracker_kappa04_convert_until085_plateau15``: the rule it names, with no growth before a quarter of the run
#: and none after it either if the training loss then falls by less than 0.15 nats per e-fold of tokens
#: (:func:`plateau_held`); ``..._plateau15_at19``: the verdict at 0.19 of the run in place of a quarter;
#: ``..._plateau15_exit30``: a run held at the verdict grows from the first update where the slope reaches 0.3
#: ``tracker_library_plateau15``: the library's ``BatchSizeController(hold_on_plateau=0.15,
#: plateau_tokens_per_parameter=None)`` with the run's length, given each microbatch's loss by
#: ``tracker.observe_loss`` (the prototype above, as users get it; as it was before the library had the size gate);
#: ``tracker_library_plateau15_tpp20``: ``BatchSizeController(hold_on_plateau=0.15, plateau_tokens_per_parameter=20)``,
#: the model's parameter count given by the tracker, as users get it (the first runs of it wrapped the ungated
#: controller in :func:`plateau_gated_by_size`, which decides alike: ``tests/test_plateau.py``)
_LIBRARY_PLATEAU_RUN = re.compile(r"tracker_library_plateau(\d\d)(?:_tpp(\d+))?")
_PLATEAU_RUN = re.compile(r"(tracker_\w+)_plateau(\d\d)(?:_at(\d\d))?(?:_exit(\d\d))?")
#: ``tracker_library_plateau15_tpp20_long``: the library's gated hold (``..._tpp20``) where a run long for its model
#: is read as one from the moment it becomes one: past the gate's tokens per parameter the hold is over even before
#: its verdict (a verdict there could not hold), and ``kappa`` rises as ``(tokens per parameter / gate) ** 0.25``, at
#: most 2 x (:func:`long_run`); ``..._long50``: ``** 0.5``, at most 3 x (``kappa`` 1.2, the top of the rising rule that
#: kept the loss on ``tail``)
_LONG_RUN = re.compile(r"(tracker_library_plateau\d\d_tpp(\d+))_long(50)?")
#: ``tracker_kappa04_convert_until085_wd``: the rule it names with AdamW's weight decay coupled to the batch and
#: the LR so that the decay per token (``lr x weight_decay / batch``) stays the scheduled LR's at the starting
#: batch: ``weight_decay x (B / B_start) / (lr / scheduled lr)`` (x sqrt(B / B_start) under the sqrt coupling)
_WD_RUN = re.compile(r"(tracker_\w+)_wd")
#: the kappa of ``tracker_cooled`` runs, per setting: a calibration by cooled branches
COOLED_KAPPA = {name: base.ROOT / "docs" / f"calibration_cooled_{name}_seed0.json"
                for name in ("full", "prose", "wide", "heldout")}
#: the kappa of ``tracker_measured`` runs: a calibration of the proof setting by branches
MEASURED_KAPPA = base.ROOT / "docs" / "calibration_full_seed0.json"
#: the largest microbatch of ``tracker_mbfirst`` runs, in sequences (2,048 tokens at the proof's context)
MBFIRST_MAX_SEQUENCES = 16
BASELINE_TOKENS = 512


@dataclass(frozen=True)
class Run:
    schedule: str
    seed: int
    lr_schedule: str  # "constant", "cosine" or "wsd"
    cap: bool = False

    @property
    def capped(self) -> bool:
        """The coupled LR is capped at the schedule's peak (``cap``, or a ``PEAK_CAPPED`` schedule)."""
        return self.cap or self.schedule in PEAK_CAPPED

    @property
    def name(self) -> str:
        kind = {"constant": f"constant_{BASELINE_TOKENS}", "constant_fast": f"constant_{BASELINE_TOKENS}_fast"}.get(
            self.schedule, self.schedule)
        return f"{kind}{'_cap' if self.cap else ''}_{self.lr_schedule}_seed{self.seed}"


def lr_at(setting: base.Setting, lr_schedule: str, tokens: float) -> float:
    """The learning rate of a step ending at ``tokens``: ``gpt_proof.lr_at`` plus ``wsd``."""
    if lr_schedule != "wsd" or tokens < setting.warmup_tokens:
        return base.lr_at(setting, lr_schedule, tokens)
    start = 0.8 * setting.budget_tokens
    if tokens <= start:
        return setting.lr
    frac = min(1.0, (tokens - start) / (setting.budget_tokens - start))
    return setting.lr * (1.0 - (1.0 - setting.min_lr_ratio) * frac)


def plan(setting: base.Setting) -> list[Run]:
    runs: list[Run] = []
    for seed in setting.seeds:
        for lr_schedule in ("cosine", "wsd"):
            runs += [Run("constant", seed, lr_schedule), Run("tracker_default", seed, lr_schedule),
                     Run("tracker_convert", seed, lr_schedule)]
        if seed == setting.seeds[0]:
            runs.append(Run("tracker_default", seed, "cosine", cap=True))
            runs += [Run("tracker_convert_kappa1", seed, s) for s in ("cosine", "wsd")]
    for seed in setting.seeds:
        runs += [Run("tracker_default", seed, "constant"), Run("tracker_budget", seed, "constant")]
    # the budget's plan with the coupled LR capped at its peak (the library's default with a budget)
    runs += [Run("tracker_budget", seed, "constant", cap=True) for seed in setting.seeds]
    runs += [Run("tracker_mbfirst", seed, "cosine") for seed in setting.seeds]  # microbatch first, wall-clock
    runs += [Run("tracker_mbfirst_auto", seed, "cosine") for seed in setting.seeds]  # ... measuring at "auto"
    runs += [Run("constant_fast", seed, "cosine") for seed in setting.seeds]  # constant 512, one microbatch
    # the default controller at kappa = 0.4 instead of 0.5 (a retuning experiment)
    runs += [Run("tracker_kappa04", seed, s) for seed in setting.seeds for s in ("cosine", "wsd")]
    # the default controller with kappa measured by branches from the constant 512 run of seed 0
    runs += [Run("tracker_measured", seed, "cosine") for seed in setting.seeds]
    # ... with the coupled LR capped at its peak (is it the batch or the LR above the peak that costs?)
    runs += [Run("tracker_measured", seed, "cosine", cap=True) for seed in setting.seeds]
    return runs


def measured_kappa(path: Path = MEASURED_KAPPA) -> list[tuple[float, float]]:
    """``(tokens, kappa)`` of a calibration file written by ``benchmarks/proof/calibrate_proof.py``."""
    points = json.loads(path.read_text())["points"]
    return [(p["tokens"], p["kappa"]) for p in points if p["kappa"] is not None]


def calibration_tokens(run: Run, setting: base.Setting) -> float:
    """The tokens the branches behind a measured kappa trained on (0 for a rule without branches)."""
    path = {"tracker_measured": MEASURED_KAPPA, "tracker_cooled": COOLED_KAPPA.get(setting.name)}.get(run.schedule)
    if path is None:
        return 0.0
    return float(sum(p["total_branch_tokens"] for p in json.loads(Path(path).read_text())["points"]))


def rise_gated(controller: Any, *, rise: float, total_tokens: float, at: float = 0.1) -> Any:
    """``controller`` (a ``BatchSizeController``), changed in place so that its growth waits until the noise scale
    has risen: ``kappa`` is held at 0 (no growth from the noise scale; the conversions of LR halvings go on) until
    the median of the last ``window`` noise scales reaches ``rise`` x that median at ``at`` of the run. A
    prototype for the frontier, not the library's: the critical batch grows as the loss falls, so a noise scale
    that has not risen since early in the run is read as a level the run cannot use yet."""

    class RiseGated(type(controller)):  # type: ignore[misc]
        def update(self, **kwargs: Any) -> Any:
            value = kwargs.get("noise_scale")
            if value is not None and 0 < value < float("inf"):
                self.rise_recent = (self.rise_recent + [float(value)])[-self.window:]
            if self.rise_recent and self.rise_opened_at is None:
                level = sorted(self.rise_recent)[len(self.rise_recent) // 2]
                if self.rise_reference is None and kwargs["tokens_seen"] >= at * total_tokens:
                    self.rise_reference = level
                if self.rise_reference is not None and level >= rise * self.rise_reference:
                    self.rise_opened_at = float(kwargs["tokens_seen"])
            return super().update(**kwargs)

        def _kappa_at(self, tokens: float) -> float:
            return super()._kappa_at(tokens) if self.rise_opened_at is not None else 0.0

    controller.rise, controller.rise_recent, controller.rise_reference, controller.rise_opened_at = rise, [], None, None
    controller.__class__ = RiseGated
    return controller


def couple_weight_decay(optimizer: Any, decays: list[float], batch_ratio: float, lr_ratio: float) -> None:
    """Set each param group's weight decay to ``decays[i] x batch_ratio / lr_ratio``: AdamW's decay per token
    (``lr x weight_decay / batch``) kept at the scheduled LR's at the starting batch (the EMA timescale in tokens
    that "Power Lines" finds should stay fixed as the batch grows)."""
    for group, decay in zip(optimizer.param_groups, decays, strict=True):
        group["weight_decay"] = decay * batch_ratio / lr_ratio


def held_late(controller: Any) -> Any:
    """``controller`` (a ``BatchSizeController`` with ``convert_until`` and ``total_tokens``), changed in place so
    that its ``kappa`` is 0 from ``convert_until`` of the run on: no doubling from the noise scale in the part of
    the run whose LR halvings it leaves to decay (under WSD, the final decay, where the noise scale rises as the
    LR anneals). A prototype for the frontier, not the library's."""
    end = controller.convert_until * controller.total_tokens

    class HeldLate(type(controller)):  # type: ignore[misc]
        def _kappa_at(self, tokens: float) -> float:
            return 0.0 if tokens >= end else super()._kappa_at(tokens)

    controller.__class__ = HeldLate
    return controller


def slope_kappa(controller: Any, *, scale: float, warmup_tokens: float, cap: float = 1.2) -> Any:
    """``controller`` (a ``BatchSizeController``), changed in place so that its ``kappa`` is ``scale`` x the slope
    of the run's training loss against the log of its tokens, ``-dL / d ln T``, fitted by least squares to the
    steps' mean losses over the second half of the tokens seen so far (from twice the warm-up on), capped at
    ``cap``; 0 (no growth from the noise scale; conversions of LR halvings go on) before 2.5 x the warm-up. The
    training loop gives it each step's loss (``observe_loss``) before the step's update. A prototype for the
    frontier, not the library's: a model whose loss still falls slowly (a plateau) reads a small ``kappa``."""
    import math
    from collections import deque

    class SlopeKappa(type(controller)):  # type: ignore[misc]
        def observe_loss(self, tokens: float, loss: float) -> None:
            x, pts, sums = math.log(tokens), self.slope_points, self.slope_sums
            pts.append((tokens, x, loss))
            for k, v in enumerate((1.0, x, loss, x * x, x * loss)):
                sums[k] += v
            start = max(tokens / 2, 2 * warmup_tokens)
            while pts and pts[0][0] < start:
                _, x0, y0 = pts.popleft()
                for k, v in enumerate((1.0, x0, y0, x0 * x0, x0 * y0)):
                    sums[k] -= v
            n, sx, sy, sxx, sxy = sums
            spread = sxx - sx * sx / n if n else 0.0
            if tokens < 2.5 * warmup_tokens or n < 8 or spread <= 0:
                self.slope_value = None
            else:
                self.slope_value = -(sxy - sx * sy / n) / spread

        def _kappa_at(self, tokens: float) -> float:
            return 0.0 if self.slope_value is None else min(cap, max(0.0, scale * self.slope_value))

    controller.slope_points, controller.slope_sums, controller.slope_value = deque(), [0.0] * 5, None
    controller.__class__ = SlopeKappa
    return controller


def _growth_switched(controller: Any, *, warmup_tokens: float, grows: Any) -> Any:
    """``controller`` (a ``BatchSizeController``), changed in place so that it keeps the slope of
    :func:`slope_kappa` (``slope_value``) and grows only where ``grows(controller, tokens)`` says so: elsewhere
    ``kappa`` and ``conversion_kappa`` are 0 (a halving of the scheduled LR then decays as scheduled); there, the
    rule it had."""
    base_kappa_at, conversion_kappa = type(controller)._kappa_at, controller.conversion_kappa
    slope_kappa(controller, scale=1.0, warmup_tokens=warmup_tokens, cap=math.inf)

    class GrowthSwitched(type(controller)):  # type: ignore[misc]
        def _kappa_at(self, tokens: float) -> float:
            on = grows(self, tokens)
            self.conversion_kappa = conversion_kappa if on else 0.0
            return base_kappa_at(self, tokens) if on else 0.0

    controller.__class__ = GrowthSwitched
    return controller


def slope_gated(controller: Any, *, gate: float, warmup_tokens: float) -> Any:
    """``controller`` (a ``BatchSizeController``), changed in place so that it grows only while the run's training
    loss falls by at least ``gate`` nats per e-fold of tokens (the slope of :func:`slope_kappa`, read from 2.5 x the
    warm-up on): below it, ``kappa`` is 0 and so is ``conversion_kappa`` (a halving of the scheduled LR then decays
    as scheduled); above it, the rule it had. Not latched: the gate opens and closes with the slope. A prototype
    for the frontier, not the library's: a run on a loss plateau is read as one that needs its steps."""
    return _growth_switched(controller, warmup_tokens=warmup_tokens,
                            grows=lambda ctrl, tokens: ctrl.slope_value is not None and ctrl.slope_value >= gate)


def plateau_held(controller: Any, *, below: float, warmup_tokens: float, total_tokens: float,
                 at: float = 0.25, exit: float | None = None) -> Any:
    """``controller`` (a ``BatchSizeController``), changed in place so that it does not grow (``kappa`` and
    ``conversion_kappa`` 0) before ``at`` of the run, and then decides once, from the slope of
    :func:`slope_kappa` at its first update past ``at``: below ``below`` nats per e-fold of tokens (a loss still
    on its plateau) it holds; otherwise it is the rule it was for the rest of the run. A run held there never
    grows, unless ``exit`` is given: then it is the rule it was from the first update where the slope reaches
    ``exit`` (the loss has left its plateau; ``plateau_exit`` keeps the tokens). A prototype for the frontier, not
    the library's: on the GPTs whose loss sat on a plateau for the first quarter of the run every doubling cost
    loss, and a growth gated by the slope alone leaked onto the plateau."""
    if 2.5 * warmup_tokens > at * total_tokens:
        raise ValueError(f"plateau_held(at={at!r}): the slope is read from 2.5 x the warm-up, {2.5 * warmup_tokens:g} "
                         f"tokens, past {at!r} of the run ({at * total_tokens:g} tokens): no slope to decide from")
    if exit is not None and not exit >= below:
        raise ValueError(f"plateau_held(exit={exit!r}): must be at least below={below!r}, the slope the verdict "
                         "holds under (or None: a held run never grows)")

    def grows(ctrl: Any, tokens: float) -> bool:
        if tokens >= at * total_tokens and ctrl.plateau_held is None:  # the verdict, once
            ctrl.plateau_slope = ctrl.slope_value
            ctrl.plateau_held = ctrl.slope_value is None or ctrl.slope_value < below
        elif (ctrl.plateau_held and exit is not None and ctrl.slope_value is not None
              and ctrl.slope_value >= exit):  # off the plateau: latched
            ctrl.plateau_held, ctrl.plateau_exit = False, tokens
        return ctrl.plateau_held is False

    controller.plateau_held, controller.plateau_slope, controller.plateau_exit = None, None, None
    controller.plateau_exit_above = exit
    return _growth_switched(controller, warmup_tokens=warmup_tokens, grows=grows)


def plateau_gated_by_size(controller: Any, *, parameters: int, tokens_per_parameter: float) -> Any:
    """``controller`` (a ``BatchSizeController`` with ``hold_on_plateau``), changed in place so that a verdict that
    holds holds only if the run has seen fewer than ``tokens_per_parameter`` tokens per parameter of the model
    (``parameters``) by then; past that, the growth rule is in force as on a verdict that does not hold. The prototype
    the library's ``plateau_tokens_per_parameter`` was made from, kept as the reference its test compares it with
    (``controller`` must not have that gate itself): a loss that falls slowly early in a model's training sits on a
    plateau it will leave (growth there cost the loss), one that falls slowly after many tokens per parameter is a
    run long for its model (growth there kept it), and the nats threshold alone cannot tell the two apart."""
    from cbs_tracker.policy.plateau import PlateauHold

    if not controller.plateau.active:
        raise ValueError("plateau_gated_by_size: the controller has no hold_on_plateau to gate")
    if controller.plateau.tokens_per_parameter is not None:
        raise ValueError("plateau_gated_by_size: the controller is gated already (plateau_tokens_per_parameter="
                         f"{controller.plateau.tokens_per_parameter:g}); build it with plateau_tokens_per_parameter=None")
    if not parameters > 0 or not tokens_per_parameter > 0:
        raise ValueError(f"plateau_gated_by_size(parameters={parameters!r}, tokens_per_parameter="
                         f"{tokens_per_parameter!r}): both must be > 0")

    class SizeGated(PlateauHold):
        def _verdict(self, tokens: float, total: float) -> str | None:
            said = super()._verdict(tokens, total)
            if self.held and tokens >= tokens_per_parameter * parameters:
                self.held, self.gated = False, tokens / parameters
                self.slope.clear()
                said = f"{said}; but {tokens / parameters:.3g} tokens per parameter >= {tokens_per_parameter:g}: " \
                       "the growth rule is in force"
            return said

    controller.plateau.__class__ = SizeGated
    controller.plateau.gated = None  # the tokens per parameter at a verdict the gate overturned
    return controller


def long_run(controller: Any, *, tokens_per_parameter: float, exponent: float = 0.25, most: float = 2.0) -> Any:
    """``controller`` (a ``BatchSizeController`` with ``hold_on_plateau`` and its size gate), changed in place so that
    a run long for its model is read as one as soon as it is: from ``tokens_per_parameter`` tokens per parameter of the
    model on (the count the tracker gives), growth is no longer held before the verdict (a verdict there could only
    let it grow: the gate overturns a holding one), and the noise-scale doublings' ``kappa`` is multiplied by
    ``(tokens per parameter / tokens_per_parameter) ** exponent``, at most ``most``. A prototype for the frontier:
    on the GPTs trained for 190-380 tokens per parameter every rule run kept the loss, ``kappa`` rising to 1.2 too,
    while below 20 tokens per parameter ``kappa`` 0.5 lost it on several. Inert where the count is unknown, in
    samples, or below ``tokens_per_parameter``."""
    hold = controller.plateau
    if not hold.active or hold.tokens_per_parameter is None:
        raise ValueError("long_run: the controller needs hold_on_plateau with its size gate")

    def past(tokens: float) -> float | None:
        """tokens per parameter over the gate's, where it is read"""
        if hold.parameters is None or hold.in_samples:
            return None
        return tokens / (tokens_per_parameter * hold.parameters)

    class LongRunHold(type(hold)):  # type: ignore[misc]
        def holds(self, tokens: float, total: float | None) -> bool:
            ratio = past(tokens)
            if self.held is None and ratio is not None and ratio >= 1:
                return False
            return super().holds(tokens, total)

    hold.__class__ = LongRunHold
    kappa_at = controller._kappa_at

    def long_kappa_at(tokens: float) -> float:
        ratio = past(tokens)
        factor = 1.0 if ratio is None else min(most, max(1.0, ratio) ** exponent)
        return kappa_at(tokens) * factor

    controller._kappa_at = long_kappa_at
    return controller


def make_controller(run: Run, setting: base.Setting) -> Any:
    """The controller of a run (``None`` for a constant batch). Every rule converts the halvings of the scheduled LR
    as it did when it was named (all of them, unless its name says ``_until``), whatever the library's default;
    only ``tracker_library_default`` takes the library's defaults as they are."""
    if _LIBRARY_PLATEAU_RUN.fullmatch(run.schedule) is not None:  # before _PLATEAU_RUN's prototypes
        return _controller_of(run, setting)
    long_match = _LONG_RUN.fullmatch(run.schedule)
    if long_match is not None:
        steep = long_match.group(3) is not None
        return long_run(_controller_of(replace(run, schedule=long_match.group(1)), setting),
                        tokens_per_parameter=float(long_match.group(2)), exponent=0.5 if steep else 0.25,
                        most=3.0 if steep else 2.0)
    same_controller = _ADAM_RUN.fullmatch(run.schedule) or _WD_RUN.fullmatch(run.schedule)
    if same_controller is not None:  # only the measurement (_adam) or the weight decay (_wd) differs
        return make_controller(replace(run, schedule=same_controller.group(1)), setting)
    rise_run = _RISE_RUN.fullmatch(run.schedule)
    if rise_run is not None:
        return rise_gated(make_controller(replace(run, schedule=rise_run.group(1)), setting),
                          rise=int(rise_run.group(2)) + int(rise_run.group(3)) / 10, total_tokens=setting.budget_tokens)
    hold_run = _HOLD_RUN.fullmatch(run.schedule)
    if hold_run is not None:
        return held_late(make_controller(replace(run, schedule=hold_run.group(1)), setting))
    slope_run = _SLOPE_RUN.fullmatch(run.schedule)
    if slope_run is not None:
        return slope_kappa(make_controller(replace(run, schedule=slope_run.group(1)), setting),
                           scale=int(slope_run.group(2)) + int(slope_run.group(3)) / 10,
                           warmup_tokens=setting.warmup_tokens)
    plateau_run = _PLATEAU_RUN.fullmatch(run.schedule)
    if plateau_run is not None:
        return plateau_held(make_controller(replace(run, schedule=plateau_run.group(1)), setting),
                            below=int(plateau_run.group(2)) / 100, warmup_tokens=setting.warmup_tokens,
                            total_tokens=setting.budget_tokens,
                            at=0.25 if plateau_run.group(3) is None else int(plateau_run.group(3)) / 100,
                            exit=None if plateau_run.group(4) is None else int(plateau_run.group(4)) / 100)
    gate_run = _GATE_RUN.fullmatch(run.schedule)
    if gate_run is not None:
        return slope_gated(make_controller(replace(run, schedule=gate_run.group(1)), setting),
                           gate=int(gate_run.group(2)) + int(gate_run.group(3)) / 10,
                           warmup_tokens=setting.warmup_tokens)
    linear_run = _LINEAR_RUN.fullmatch(run.schedule)
    if linear_run is not None:
        controller = make_controller(replace(run, schedule=linear_run.group(1)), setting)
        controller.lr_scaling = "linear"  # an explicit controller setting wins over the tracker's "auto"
        return controller
    controller = _controller_of(run, setting)
    if (controller is not None and hasattr(controller, "convert_until") and run.schedule != "tracker_library_default"
            and _UNTIL_RUN.fullmatch(run.schedule) is None):
        controller.convert_until = 1.0
    return controller


def _controller_of(run: Run, setting: base.Setting) -> Any:
    from cbs_tracker.policy.controller import BatchSizeController as Library

    def BatchSizeController(**settings: Any) -> Any:  # noqa: N802 - the library's class, as the rules were named
        """The library's controller without a hold on a loss plateau unless the rule names one: every rule but the
        ``library:hold_on_plateau`` ones was named before the hold was the library's default."""
        return Library(**{"hold_on_plateau": None, **settings})

    if run.schedule in ("constant", "constant_fast"):
        return None
    if run.schedule in PEAK_CAPPED:
        return _controller_of(replace(run, schedule=PEAK_CAPPED[run.schedule]), setting)
    # the rules keep the defaults they were named under (base.EARLIER_DEFAULTS: kappa 0.5, no
    # conversion), whatever the library's, so their stored results keep their meaning
    earlier = base.EARLIER_DEFAULTS
    if run.schedule in ("tracker_default", "tracker_mbfirst", "tracker_mbfirst_auto"):
        return BatchSizeController(**earlier)
    if run.schedule == "tracker_convert":
        return BatchSizeController(kappa=earlier["kappa"], kappa_rise=1.0, convert_lr_decay=True)
    if run.schedule == "tracker_convert_kappa1":
        # conversions allowed up to B_simple itself (kappa = 0.5 bounded them at half of it then)
        return BatchSizeController(convert_lr_decay=True, kappa=1.0, kappa_rise=1.0)
    if run.schedule == "tracker_budget":
        return BatchSizeController(**earlier, budget_tokens=setting.budget_tokens)
    if run.schedule == "tracker_library_default":
        # the library's default as a user gets it, with the run's length (an adapter gives it)
        return Library(total_tokens=setting.budget_tokens)
    library_plateau = _LIBRARY_PLATEAU_RUN.fullmatch(run.schedule)
    if library_plateau is not None:  # the library's default with its hold_on_plateau, the loss from the tracker
        gate = library_plateau.group(2)  # the size gate's tokens per parameter (the tracker gives the model's count)
        return BatchSizeController(total_tokens=setting.budget_tokens,
                                   hold_on_plateau=int(library_plateau.group(1)) / 100,
                                   plateau_tokens_per_parameter=None if gate is None else float(gate))
    until_run = _UNTIL_RUN.fullmatch(run.schedule)
    if until_run is not None:
        # late halvings of the scheduled LR left to decay (convert_until of the run's length, which it is given)
        controller = _controller_of(replace(run, schedule=until_run.group(1)), setting)
        controller.convert_until = int(until_run.group(2)) + int(until_run.group(3)) / 100
        if controller.total_tokens is None:
            controller.total_tokens = setting.budget_tokens
        return controller
    if run.schedule == "tracker_kappa04":
        return BatchSizeController(kappa=0.4, kappa_rise=1.0, convert_lr_decay=False)
    if run.schedule == "tracker_measured":
        return BatchSizeController(kappa=measured_kappa(), convert_lr_decay=False)
    if run.schedule == "tracker_cooled":
        return BatchSizeController(kappa=measured_kappa(COOLED_KAPPA[setting.name]), convert_lr_decay=False)
    eff_run = _EFF_RUN.fullmatch(run.schedule)
    if eff_run is not None:
        budget = int(eff_run.group(1)) + int(eff_run.group(2)) / 100
        return BatchSizeController(efficiency_budget=budget, total_tokens=setting.budget_tokens,
                                   kappa_rise=1.0, convert_lr_decay=False)
    ramp_run = _KAPPA_RAMP_RUN.fullmatch(run.schedule)
    if ramp_run is not None:
        from cbs_tracker.policy.kappa import KappaSchedule

        first, last = (int(ramp_run.group(i)) + int(ramp_run.group(i + 1)) / 10 for i in (1, 3))
        return BatchSizeController(kappa=KappaSchedule([(0, first), (setting.budget_tokens, last)]),
                                   convert_lr_decay=ramp_run.group(5) is not None)
    kappa_run = _KAPPA_RUN.fullmatch(run.schedule)
    if kappa_run is not None:
        kappa = int(kappa_run.group(1)) + int(kappa_run.group(2)) / 10
        return BatchSizeController(kappa=kappa, kappa_rise=1.0, convert_lr_decay=kappa_run.group(3) is not None)
    if run.schedule in ("seesaw", "hand_ramp"):
        from cbs_tracker.policy.batch_schedule import BatchSchedule

        marks = seesaw_marks(setting, run.lr_schedule) if run.schedule == "seesaw" else base.ramp_marks(setting)
        return BatchSchedule(marks, microbatch=setting.tracker_micro_sequences * setting.seq_len)
    raise ValueError(f"unknown schedule {run.schedule!r}; expected one of {SCHEDULES}")


def seesaw_marks(setting: base.Setting, lr_schedule: str) -> list[tuple[float, int]]:
    """LR decay turned into growth alone (Seesaw, Meterez et al. 2025): the batch doubles from the
    starting batch wherever the scheduled LR has halved since its peak (at ``peak * 2**-k``), and
    nowhere else. The LR schedule still runs and the tracker's ``sqrt`` coupling multiplies each
    doubling's LR by sqrt(2), so each halving becomes LR x 1/sqrt(2) with the batch x 2, Seesaw's
    rule for Adam. ``(tokens, global batch)`` marks, found by bisection on the schedule."""
    marks, batch, level = [(0.0, setting.tracker_start_tokens)], setting.tracker_start_tokens, setting.lr / 2
    low, end = setting.warmup_tokens, float(setting.budget_tokens)
    while lr_at(setting, lr_schedule, end) <= level * (1 + 1e-12):
        lo, hi = low, end  # lr_at is non-increasing after the warm-up: the first point at or below ``level``
        for _ in range(100):
            mid = 0.5 * (lo + hi)
            lo, hi = (lo, mid) if lr_at(setting, lr_schedule, mid) <= level else (mid, hi)
        batch *= 2
        marks.append((hi, batch))
        low, level = hi, level / 2
    return marks


class RunClock:
    """The seconds a run spent on its own work: it counts only while the run's code runs, so
    runs interleaved in one process (``--runs a+b``) each count their own steps."""

    def __init__(self) -> None:
        self.own, self.since = 0.0, time.perf_counter()

    def pause(self) -> None:
        self.own += time.perf_counter() - self.since

    def resume(self) -> None:
        self.since = time.perf_counter()

    def restart(self) -> None:
        self.own, self.since = 0.0, time.perf_counter()

    def now(self) -> float:
        return self.own + time.perf_counter() - self.since


def train(run: Run, setting: base.Setting, out: Path) -> dict[str, Any]:
    """One run alone: trains, writes ``runs/<name>.json`` and returns its result."""
    return train_interleaved([run], setting, out)[run.name]


def train_interleaved(runs: list[Run], setting: base.Setting, out: Path) -> dict[str, dict[str, Any]]:
    """Several runs in one process, one optimizer step at a time, always advancing the run that has
    seen the fewest tokens, so the machine's noise hits them alike; each times only its own steps.

    Each run keeps its own data stream and random-number state, so it trains exactly as it does
    alone, except a ``measure_every="auto"`` run, whose measuring rate follows its own timings.
    Switching runs at every step leaves each step's caches cold; that costs a run with many small
    steps more than one with few large ones (measured in ``docs/results.md``). CPU runs only: the
    clock does not synchronise an accelerator.
    """
    names = [run.name for run in runs]
    if len(set(names)) != len(names):
        raise ValueError(f"train_interleaved: runs={names} names a run twice")
    steppers = {run.name: train_steps(run, setting, out, others=[r.name for r in runs if r != run]) for run in runs}
    tokens = dict.fromkeys(steppers, 0.0)
    results: dict[str, dict[str, Any]] = {}
    while steppers:
        name = min(steppers, key=lambda n: tokens[n])
        try:
            tokens[name] = next(steppers[name])
        except StopIteration as stop:
            results[name] = stop.value
            del steppers[name]
    return results


def train_steps(run: Run, setting: base.Setting, out: Path, others: list[str]) -> Iterator[float]:
    """A run as a generator: yields the tokens seen after each optimizer step, returns the result
    (written to ``runs/<name>.json``). Its clock stops while it is suspended."""
    import torch

    clock = RunClock()
    body = _train_body(run, setting, out, clock, others)
    rng = None  # this run's random-number state while another run steps
    while True:
        if rng is not None:
            torch.set_rng_state(rng)
        try:
            tokens = next(body)
        except StopIteration as stop:
            return stop.value
        rng = torch.get_rng_state()
        clock.pause()
        yield tokens
        clock.resume()


def start_of_run(setting: base.Setting, seed: int, lr_schedule: str, start: int) -> tuple[Any, Any, Any]:
    """The model (seeded by ``seed``), AdamW at the setting's LR and the LR schedule every run of ``setting`` starts
    from; the schedule a ``LambdaLR`` sized in optimizer steps of ``start`` tokens, as a user writes it."""
    import torch

    from cbs_tracker.demo.gpt import GPT, GPTConfig, make_adamw

    torch.manual_seed(seed)
    model = GPT(GPTConfig(context_length=setting.seq_len, n_layer=setting.n_layer, d_model=setting.d_model,
                          n_head=setting.n_head))
    optimizer = make_adamw(model, setting.lr, setting.weight_decay)
    for group in optimizer.param_groups:
        group["lr"] = setting.lr
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda e: lr_at(setting, lr_schedule, (e + 1) * start) / setting.lr
    )
    return model, optimizer, scheduler


def _train_body(run: Run, setting: base.Setting, out: Path, clock: RunClock,
                others: list[str]) -> Generator[float, None, dict[str, Any]]:
    import torch

    base._library_commit()  # read now: the code this run imports, not a commit made while it trains
    from cbs_tracker.integrations.plain import CBSTracker

    from cbs_tracker.demo.corpus import SequenceStream, evaluate

    torch.set_num_threads(1)
    adam_run = _ADAM_RUN.fullmatch(run.schedule)
    controller = make_controller(run, setting)
    named = run  # the name the result is kept under
    if adam_run is not None:
        run = replace(run, schedule=adam_run.group(1))  # trained as the run it names; only the measure differs
    corpus = base.load_setting_corpus(setting)
    micro_seqs = setting.tracker_micro_sequences
    micro_tokens = micro_seqs * setting.seq_len
    fast = run.schedule == "constant_fast"
    start = BASELINE_TOKENS if run.schedule in ("constant", "constant_fast") else setting.tracker_start_tokens
    if run.schedule in ("constant", "constant_fast") and setting.constant_tokens is not None:
        start = setting.constant_tokens  # the setting's own constant batch (the run keeps its name)
    if run.schedule == "hand_ramp":
        start = setting.ramp[0][0]  # the ramp's first batch from the first step
    if fast:
        micro_seqs = BASELINE_TOKENS // setting.seq_len  # the whole step as one microbatch
        micro_tokens = micro_seqs * setting.seq_len
    model, optimizer, scheduler = start_of_run(setting, run.seed, run.lr_schedule, start)
    stream = SequenceStream(corpus.train, seq_len=setting.seq_len, seed=run.seed)
    tracker = None if fast else CBSTracker(
        model, optimizer, accumulation_steps=start // micro_tokens, controller=controller,
        preconditioner="adam" if adam_run is not None else None,
        lr_scheduler=scheduler, cap_lr_at_peak=run.capped,
        max_microbatch=MBFIRST_MAX_SEQUENCES if run.schedule.startswith("tracker_mbfirst") else None,
        measure_every="auto" if run.schedule == "tracker_mbfirst_auto" else 1)
    wd_coupled = _WD_RUN.fullmatch(run.schedule) is not None
    decays = [g["weight_decay"] for g in optimizer.param_groups]
    evals: dict[str, list[float]] = {"step": [], "tokens": [], "val_loss": []}
    trace: dict[str, list[Any]] = {"tokens": [], "global_batch": [], "noise_scale": [], "lr": [], "scheduled_lr": [],
                                   "grad_sq_norm": [], "trace_cov": [], "train_loss": []}

    evals["train_s"] = []
    eval_s = 0.0

    def record_eval(step: int, tokens: float) -> None:
        nonlocal eval_s
        t = clock.now()
        evals["train_s"].append(round(t - eval_s, 2))  # training time so far, evaluations left out
        evals["step"].append(step)
        evals["tokens"].append(tokens)
        evals["val_loss"].append(round(evaluate(model, corpus.val, seq_len=setting.seq_len,
                                                num_sequences=setting.eval_sequences), 5))
        eval_s += clock.now() - t

    clock.restart()
    record_eval(0, 0.0)
    tokens, step, next_eval, next_trace = 0.0, 0, setting.eval_every_tokens, 0.0
    record = None
    batches = iter(lambda: stream.next_batch(micro_seqs), None)  # an endless loader
    if fast:
        yield from fast_loop(model, optimizer, scheduler, batches, setting, micro_tokens, record_eval, evals)
        tokens = evals["tokens"][-1]
        step = evals["step"][-1]
    windows = None if tracker is None else tracker.windows(batches)
    loss_sum = loss_tokens = window_loss = 0.0
    window_micro = 0
    while tracker is not None and windows is not None and (
        tokens + tracker.accumulation_steps * tracker.microbatch_batches * micro_tokens <= setting.budget_tokens
    ):
        window = next(windows)
        for x, y in window:
            with tracker.microbatch(labels=y):
                _, loss = model(x, y)
                (loss / tracker.accumulation_steps).backward()
            tracker.observe_loss(loss)  # the library's hold_on_plateau reads it (a no-op for the other rules)
            value = loss.item()  # one host read of the microbatch's loss, for the trace and the window's mean
            loss_sum, loss_tokens = loss_sum + value * micro_tokens, loss_tokens + micro_tokens
            window_loss, window_micro = window_loss + value, window_micro + 1
        if hasattr(controller, "slope_points"):  # a prototype's: the window's mean loss, before the step's update
            controller.observe_loss(tokens + window_micro * micro_tokens, window_loss / window_micro)
        window_loss, window_micro = 0.0, 0
        record = tracker.step()
        if wd_coupled:
            couple_weight_decay(optimizer, decays, record.global_batch / start, record.lr / record.scheduled_lr)
        torch.nn.utils.clip_grad_norm_(model.parameters(), setting.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step, tokens = record.step, record.tokens_seen
        yield tokens
        if tokens >= next_trace:
            for key in ("global_batch", "noise_scale", "lr", "scheduled_lr", "grad_sq_norm", "trace_cov"):
                trace[key].append(getattr(record, key))
            trace["tokens"].append(tokens)
            if wd_coupled:
                trace.setdefault("weight_decay", []).append(optimizer.param_groups[0]["weight_decay"])
            if hasattr(controller, "slope_points"):
                trace.setdefault("kappa", []).append(controller._kappa_at(tokens))
            trace["train_loss"].append(round(loss_sum / loss_tokens, 4))  # mean over the tokens since the last point
            loss_sum = loss_tokens = 0.0
            next_trace = tokens + setting.trace_every_tokens
        if tokens >= next_eval:
            record_eval(step, tokens)
            next_eval += setting.eval_every_tokens
            print(f"{run.name}: step {step}, {tokens:.0f} tokens, batch {record.global_batch:.0f}, "
                  f"val loss {evals['val_loss'][-1]:.4f}, lr {record.lr:.2e}", flush=True)
    if evals["step"][-1] != step:
        record_eval(step, tokens)
    result = {
        "name": named.name, "schedule": named.schedule, "seed": run.seed, "lr_schedule": run.lr_schedule,
        "cap_lr_at_peak": run.capped, "lr_coupling_mode": None if tracker is None else tracker.session.coupling_mode,
        "final_val_loss": evals["val_loss"][-1], "steps": step, "tokens": tokens,
        "final_batch_tokens": micro_tokens if fast else None if record is None else record.global_batch,
        "lr_conversions": None if record is None else record.lr_conversions,
        "train_time_s": round(clock.now(), 1), "train_only_s": round(clock.now() - eval_s, 1),
        "interleaved_with": others,
        "branch_tokens": calibration_tokens(run, setting),
        "evals": evals, "trace": trace,
        "setting": setting.name, "setting_key": setting.key(), "library_commit": base._library_commit(),
    }
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / "runs" / f"{named.name}.json").write_text(json.dumps(result))
    return result


def fast_loop(model: Any, optimizer: Any, scheduler: Any, batches: Any, setting: base.Setting, micro_tokens: int,
              record_eval: Any, evals: dict[str, Any]) -> Iterator[float]:
    """Constant batch, one microbatch per step, no tracker: the same clipping, schedule and evaluations."""
    import torch

    tokens, step, next_eval = 0.0, 0, setting.eval_every_tokens
    while tokens + micro_tokens <= setting.budget_tokens:
        x, y = next(batches)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), setting.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step, tokens = step + 1, tokens + micro_tokens
        yield tokens
        if tokens >= next_eval:
            record_eval(step, tokens)
            next_eval += setting.eval_every_tokens
    if evals["step"][-1] != step:
        record_eval(step, tokens)


def run_all(setting: base.Setting, out: Path, jobs: int, only: set[str] | None,
            names: list[str] | None = None) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    for path in sorted((out / "runs").glob("*.json")):
        r = json.loads(path.read_text())
        if r.get("setting_key") == setting.key():
            results[r["name"]] = r
    # each entry is one process: a run alone, or runs joined by "+" interleaved step by step
    todo = [[r] for r in plan(setting) if r.name not in results and (only is None or r.schedule in only)]
    if names:
        by_name = {r.name: r for r in plan(setting)}
        unknown = [n for group in names for n in group.split("+") if n not in by_name]
        if unknown:
            raise SystemExit(f"--runs: unknown run names {unknown}; choose from {sorted(by_name)}")
        named = [n for group in names for n in group.split("+")]
        twice = sorted({n for n in named if named.count(n) > 1})
        if twice:
            raise SystemExit(f"--runs: {twice} named more than once")
        todo = [[by_name[n] for n in group.split("+")] for group in names
                if any(n not in results for n in group.split("+"))]
    running: dict[str, tuple[list[Run], subprocess.Popen[bytes]]] = {}
    (out / "logs").mkdir(parents=True, exist_ok=True)
    while todo or running:
        while todo and len(running) < jobs:
            group = todo.pop(0)
            label = "+".join(r.name for r in group)
            cmd, env = base.worker_command("gpt_proof_lr", "--worker", json.dumps([asdict(r) for r in group]),
                                           "--setting", setting.name, "--out", str(out))
            log = open(out / "logs" / f"{label}.log", "wb")  # noqa: SIM115
            running[label] = (group, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
            print(f"[{time.strftime('%H:%M:%S')}] start {label}", flush=True)
        time.sleep(0.5)
        for label, (group, proc) in list(running.items()):
            if proc.poll() is None:
                continue
            del running[label]
            for run in group:
                path = out / "runs" / f"{run.name}.json"
                if proc.returncode != 0 or not path.exists():
                    print(f"[{time.strftime('%H:%M:%S')}] FAILED {run.name}", flush=True)
                    continue
                results[run.name] = json.loads(path.read_text())
                print(f"[{time.strftime('%H:%M:%S')}] done  {run.name}: {results[run.name]['final_val_loss']:.4f}, "
                      f"{results[run.name]['steps']} steps", flush=True)
    return results


def summarise(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run beside the constant 512 of the same LR schedule and seed (constant LR: no baseline)."""
    rows = []
    for r in sorted(results.values(), key=lambda r: (r["lr_schedule"], r["seed"], r["name"])):
        ref = results.get(Run("constant", r["seed"], r["lr_schedule"]).name)
        row = {k: r[k] for k in ("name", "schedule", "seed", "lr_schedule", "cap_lr_at_peak", "lr_coupling_mode",
                                 "final_val_loss", "steps", "tokens", "final_batch_tokens", "lr_conversions")}
        if ref is not None and ref is not r:
            row["delta_loss_vs_constant_512"] = round(r["final_val_loss"] - ref["final_val_loss"], 4)
            row["fewer_steps_vs_constant_512"] = round(1.0 - r["steps"] / ref["steps"], 3)
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| run | LR schedule | seed | final val loss | vs constant 512 | steps | fewer steps | final batch |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        delta = r.get("delta_loss_vs_constant_512")
        fewer = r.get("fewer_steps_vs_constant_512")
        lines.append(
            f"| {r['name'].rsplit('_seed', 1)[0]} | {r['lr_schedule']} | {r['seed']} | {r['final_val_loss']:.4f} | "
            f"{'' if delta is None else f'{delta:+.4f}'} | {r['steps']} | {'' if fewer is None else f'{fewer:.0%}'} | "
            f"{r['final_batch_tokens']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def draw(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    colors = {"constant": "black", "tracker_default": "tab:blue", "tracker_convert": "tab:red",
              "tracker_convert_kappa1": "tab:orange", "tracker_budget": "tab:green", "tracker_mbfirst": "tab:purple",
              "tracker_mbfirst_auto": "tab:pink",
              "constant_fast": "gray", "tracker_kappa04": "tab:brown",
              "tracker_measured": "tab:olive"}
    for col, lr_schedule in enumerate(("cosine", "wsd")):
        for r in results.values():
            if r["lr_schedule"] != lr_schedule or r["seed"] != 0 or "evals" not in r:
                continue  # a baseline row taken from an earlier results file has no curves
            ls = ":" if r["cap_lr_at_peak"] else "-"
            e, t = r["evals"], r["trace"]
            axes[0, col].plot(e["tokens"][1:], e["val_loss"][1:], ls, color=colors[r["schedule"]], label=r["name"])
            axes[1, col].plot(t["tokens"], t["lr"], ls, color=colors[r["schedule"]], label=f"{r['name']} LR")
        axes[0, col].set_title(f"val loss vs tokens ({lr_schedule}, seed 0)")
        axes[0, col].set_ylim(top=2.0)
        axes[1, col].set_title("applied learning rate vs tokens")
        for ax in axes[:, col]:
            ax.set_xlabel("tokens")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def draw_wallclock(results: dict[str, dict[str, Any]], path: Path) -> bool:
    """Validation loss against training seconds (evaluations left out) for the runs that timed them."""
    timed = [r for r in results.values() if "train_s" in r.get("evals", {})]
    if not timed:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = sorted({r["seed"] for r in timed})
    fig, axes = plt.subplots(1, len(seeds), figsize=(6 * len(seeds), 4.5), squeeze=False)
    for ax, seed in zip(axes[0], seeds):
        for r in timed:
            if r["seed"] == seed:
                e = r["evals"]
                ax.plot(e["train_s"][1:], e["val_loss"][1:], label=f"{r['name'].rsplit('_seed', 1)[0]} ({r['steps']} steps)")
        ax.set_title(f"val loss vs training time (seed {seed}, {timed[0]['lr_schedule']})")
        ax.set_xlabel("seconds of training (evaluations left out)")
        ax.set_ylabel("val loss (nats/byte)")
        ax.set_ylim(top=2.0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def wallclock(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per seed of the cosine schedule: training time (evaluations left out) and loss of each timed run.

    ``reach_s``: the training seconds at the first evaluation at or below constant 512's final
    validation loss (``None`` if never). Ratios are against constant 512 (2 x 256-token
    microbatches, the proof's layout) and constant 512 at one 512-token microbatch.
    """
    rows = []
    for seed in sorted({r["seed"] for r in results.values()}):
        ref = results.get(Run("constant", seed, "cosine").name)
        if ref is None or "train_only_s" not in ref:
            continue
        row: dict[str, Any] = {"seed": seed}
        for key, schedule in (("constant", "constant"), ("constant_fast", "constant_fast"),
                              ("accumulation_only", "tracker_default"), ("microbatch_first", "tracker_mbfirst"),
                              ("microbatch_first_auto", "tracker_mbfirst_auto"), ("kappa04", "tracker_kappa04")):
            r = results.get(Run(schedule, seed, "cosine").name)
            if r is None or "train_only_s" not in r:
                continue
            e = r["evals"]
            reach = next((t for t, v in zip(e["train_s"], e["val_loss"]) if v <= ref["final_val_loss"]), None)
            row[key] = {"final_val_loss": r["final_val_loss"], "steps": r["steps"], "train_s": r["train_only_s"],
                        "reach_s": reach, "vs_constant": round(r["train_only_s"] / ref["train_only_s"], 3)}
            if key != "constant" and r.get("trace", {}).get("global_batch"):
                row[key]["phases"] = phase_ratios(r, ref)
        rows.append(row)
    return rows


def phase_ratios(run: dict[str, Any], ref: dict[str, Any]) -> list[dict[str, Any]]:
    """Per global batch the run trained at: its tokens and its training time over ``ref``'s for the same tokens.

    A batch change is placed at the last trace sample before it (the trace samples a step every
    ``trace_every_tokens``, so an edge may sit up to that many tokens early); the last phase ends
    at the run's final tokens. Both runs' training clocks are read at their evaluations and
    interpolated linearly in tokens at those edges (evaluations come every ``eval_every_tokens``,
    so a phase shorter than a few evaluations is read coarsely).
    """
    import numpy as np

    tokens, batches = run["trace"]["tokens"], run["trace"]["global_batch"]
    edges, levels, done = [0.0], [batches[0]], 0.0
    for end, batch in zip(tokens, batches):
        if batch != levels[-1]:
            edges.append(done)
            levels.append(batch)
        done = end
    edges.append(max(done, float(run.get("tokens", done))))

    def clock(r: dict[str, Any], at: float) -> float:
        return float(np.interp(at, r["evals"]["tokens"], r["evals"]["train_s"]))

    phases = []
    for batch, start, end in zip(levels, edges, edges[1:]):
        ref_s = clock(ref, end) - clock(ref, start)
        phases.append({"global_batch": int(batch), "from_tokens": start, "to_tokens": end,
                       "vs_constant": round((clock(run, end) - clock(run, start)) / ref_s, 3) if ref_s > 0 else None})
    return phases


def phase_table(rows: list[dict[str, Any]], key: str = "microbatch_first") -> str:
    """``key``'s :func:`phase_ratios` as a markdown table: one row per seed and global batch."""
    lines = ["| seed | global batch (tokens) | tokens trained at it | time vs constant 512 for those tokens |",
             "|---|---|---|---|"]
    for row in rows:
        for ph in row.get(key, {}).get("phases", []):
            ratio = "" if ph["vs_constant"] is None else f"{ph['vs_constant']:.2f}"
            lines.append(f"| {row['seed']} | {ph['global_batch']:,} | {ph['from_tokens'] / 1e6:.2f}–"
                         f"{ph['to_tokens'] / 1e6:.2f}M | {ratio} |")
    return "\n".join(lines) + "\n"


WALLCLOCK_RUNS = (("constant", "constant 512 (2 × 256)"), ("constant_fast", "constant 512 (1 × 512)"),
                  ("accumulation_only", "tracker, accumulation only"), ("microbatch_first", "tracker, microbatch first"),
                  ("microbatch_first_auto", "tracker, microbatch first, measuring at auto"),
                  ("kappa04", "tracker, accumulation only, κ = 0.4"))


def wallclock_table(rows: list[dict[str, Any]], label: str = "run") -> str:
    """The wall-clock comparison as a markdown table (one row per seed and run; ``label`` heads the run column)."""
    lines = [f"| seed | {label} | final val loss | vs constant 512 | optimizer steps | training seconds | time vs constant "
             "512 | reaches constant 512's final loss at |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ref = row["constant"]
        for key, name in WALLCLOCK_RUNS:
            r = row.get(key)
            if r is None:
                continue
            delta = "" if key == "constant" else f"{r['final_val_loss'] - ref['final_val_loss']:+.4f}"
            reach = "never" if r["reach_s"] is None else f"{r['reach_s']:,.0f} s"
            lines.append(f"| {row['seed']} | {name} | {r['final_val_loss']:.4f} | {delta} | {r['steps']:,} | "
                         f"{r['train_s']:,.0f} | {r['vs_constant']:.2f} | {reach} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/proof_lr")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--only", default=None, help=f"comma-separated schedules ({', '.join(SCHEDULES)})")
    p.add_argument("--runs", default=None,
                   help="comma-separated run names to run now, in this order; names joined by '+' run in one "
                        "process, interleaved step by step, so the machine's noise hits them alike (wall-clock)")
    p.add_argument("--report-only", action="store_true", help="run nothing; rebuild the table, JSON and PNG")
    p.add_argument("--baselines", default=None,
                   help="take the constant_512 rows from this earlier results.json (a constant batch does not "
                        "depend on the estimator or the controller) instead of running them")
    p.add_argument("--seeds", default=None,
                   help="comma-separated seeds the plan covers (default: the setting's, 0,1); more seeds make more "
                        "runs nameable in --runs and reported, without changing how any run trains")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--setting", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.worker is not None:
        group = [Run(**spec) for spec in json.loads(args.worker)]
        for name, r in train_interleaved(group, base.SETTINGS[args.setting], out).items():
            print(f"{name}: {r['final_val_loss']:.4f} after {r['steps']} steps, {r['train_only_s']:.0f} s of training")
        return 0
    setting = base.QUICK if args.quick else base.FULL
    if args.seeds is not None:
        try:
            seeds = tuple(int(x) for x in args.seeds.split(",") if x.strip())
        except ValueError:
            seeds = ()
        if not seeds or any(x < 0 for x in seeds) or len(set(seeds)) != len(seeds):
            p.error(f"--seeds={args.seeds!r}: expected distinct integers >= 0 separated by commas, e.g. 0,1,2,3")
        setting = replace(setting, seeds=seeds)
    only = None if args.only is None else {x.strip() for x in args.only.split(",") if x.strip()}
    out.mkdir(parents=True, exist_ok=True)
    names = None if args.runs is None or args.report_only else [x.strip() for x in args.runs.split(",") if x.strip()]
    results = run_all(setting, out, max(1, args.jobs), {"-"} if args.report_only else only, names)
    if args.baselines:
        earlier = json.loads(Path(args.baselines).read_text())
        if earlier.get("setting_key") != setting.key():
            raise SystemExit(f"--baselines {args.baselines}: measured with another setting ({earlier.get('setting')!r})")
        for row in earlier["runs"]:
            if row["schedule"] == "constant" and row["name"] not in results:
                results[row["name"]] = {k: v for k, v in row.items() if not k.endswith("_vs_constant_512")}
    rows = summarise(results)
    (out / "results.json").write_text(json.dumps({"setting": setting.name, "setting_key": setting.key(),
                                                   "runs": rows}, indent=1))
    (out / "table.md").write_text(table(rows))
    draw(results, out / "proof_lr.png")
    if draw_wallclock(results, out / "wallclock.png"):
        timed = wallclock(results)
        (out / "wallclock.json").write_text(json.dumps(timed, indent=1))
        (out / "wallclock.md").write_text(wallclock_table(timed) + "\n" + phase_table(timed))
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
