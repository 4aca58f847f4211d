"""Calibration: the critical batch measured by short branches from a run's own state.

A training workflow over the model (branches, held-out evaluations, tables), not part of
the per-step measurement: :func:`measure_critical_batch` takes one point,
:class:`CalibrateAt` takes points at token marks during a run, and a :class:`Calibration`
turns points into a ``kappa`` schedule for the controller. The command line is
``cbs-tracker calibrate`` (:mod:`cbs_tracker.commands.calibrate`).
"""

from cbs_tracker.calibrate.branches import (
    CalibrateAt,
    Calibration,
    CalibrationPoint,
    FrozenNoiseScale,
    calibration_scalars,
    frozen_noise_scale,
    measure_critical_batch,
)

__all__ = ["CalibrateAt", "Calibration", "CalibrationPoint", "FrozenNoiseScale", "calibration_scalars",
           "frozen_noise_scale", "measure_critical_batch"]
