"""Test doubles shared by the adapters' tests (no framework imported here)."""

from __future__ import annotations

import types
from typing import Any


class PlanController:
    """Deterministic stand-in for a controller: ``plan[step]`` is the new accumulation decided at ``step``."""

    observe_only = False
    kappa = 2.0  # its critical_batch is 2 x the noise scale

    def __init__(self, plan: dict[int, int]) -> None:
        self.plan = dict(plan)
        self.calls: list[dict[str, Any]] = []

    def update(self, *, step, tokens_seen, global_batch, accumulation_steps, noise_scale, **_):
        self.calls.append(dict(step=step, tokens_seen=tokens_seen, global_batch=global_batch,
                               accumulation_steps=accumulation_steps, noise_scale=noise_scale))
        new = self.plan.get(step)
        return types.SimpleNamespace(
            accumulation_steps=accumulation_steps if new is None else new, changed=new is not None,
            critical_batch=None if noise_scale is None else 2.0 * noise_scale, lr_factor=1.0, reason="plan",
        )

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
