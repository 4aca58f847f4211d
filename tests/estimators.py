"""Estimators for tests of adapter mechanics."""

from __future__ import annotations

from cbs_tracker import NoiseScaleEstimator


class NoIntervalEstimator(NoiseScaleEstimator):
    """The library's estimator without its confidence interval.

    The controller then decides on its median rule alone, so a test of the adapters'
    mechanics (windows, resume, logging, ranks agreeing) sees decisions within a few
    dozen steps; decisions on evidence are tested in tests/test_controller.py.
    """

    @property
    def noise_scale_interval(self) -> None:  # type: ignore[override]
        return None
