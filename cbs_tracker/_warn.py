"""Warnings that point at the user's code: the first frame outside this package and the frameworks it runs in.

A warning raised deep in a decision (a controller's verdict reached through the session, the loop and a context
manager) would otherwise name a line of ``cbs_tracker``; the user's line that led to it (``tracker.step()``,
``trainer.fit(...)``) is the one to show.
"""

from __future__ import annotations

import sys
import warnings

__all__ = ["warn_user"]

#: modules whose frames a warning skips: this package, its adapters and the frameworks that call them
_SKIPPED = ("cbs_tracker", "contextlib", "torch", "lightning", "lightning_fabric", "pytorch_lightning", "transformers",
            "accelerate", "olmo_core")


def _skipped(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in _SKIPPED)


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the first frame outside :data:`_SKIPPED` (the outermost
    frame where every one is inside)."""
    level, frame = 2, sys._getframe(1)
    while frame.f_back is not None and _skipped(frame.f_globals.get("__name__", "")):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
