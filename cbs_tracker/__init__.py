"""cbs-tracker: measure the gradient noise scale online and grow the batch when the run can use it.

The package re-exports its public names; each lives in a module of its own.
Names whose module needs an optional dependency (Lightning, TensorBoard, OLMo-core) are
imported on first use, so ``import cbs_tracker`` needs only torch and numpy.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it (imported lazily on first attribute access)
_EXPORTS: dict[str, str] = {
    "NoiseScaleEstimator": "cbs_tracker.core.estimator",
    "NoiseScaleEstimate": "cbs_tracker.core.estimator",
    "estimate_from_norms": "cbs_tracker.core.estimator",
    "GradStatsCollector": "cbs_tracker.core.collector",
    "StepStats": "cbs_tracker.core.collector",
    "CBSTracker": "cbs_tracker.integrations.plain",
    "BatchSizeController": "cbs_tracker.policy.controller",
    "Decision": "cbs_tracker.policy.controller",
    "apply_lr_factor": "cbs_tracker.policy.lr",
    "StepRecord": "cbs_tracker.core.record",
    "FSDPTracker": "cbs_tracker.integrations.fsdp",
    "plan_doubling": "cbs_tracker.theory.schedule",
    "TensorBoardLogger": "cbs_tracker.integrations.tensorboard",
    "CBSCallback": "cbs_tracker.integrations.lightning",
    "CBSDataLoader": "cbs_tracker.integrations.lightning",
    "CBSTrainer": "cbs_tracker.integrations.transformers",
    "CBSOlmoCallback": "cbs_tracker.integrations.olmo_core",
    "label_tokens": "cbs_tracker.core.units",
    "measure_critical_batch": "cbs_tracker.calibrate",
    "Calibration": "cbs_tracker.calibrate",
    "CalibrationPoint": "cbs_tracker.calibrate",
    "KappaSchedule": "cbs_tracker.policy.kappa",
    "BatchSchedule": "cbs_tracker.policy.batch_schedule",
    "leading_dim": "cbs_tracker.core.units",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cbs_tracker' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
