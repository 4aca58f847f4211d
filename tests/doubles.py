"""Test doubles shared by the adapters' tests (no framework imported here)."""

from __future__ import annotations

import dataclasses
import math
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


def assert_same(a: Any, b: Any, where: str = "", *, exact_types: bool = False) -> None:
    """Equal exactly, through dicts, lists, tuples and dataclasses: tensors bit for bit, NaN equal to NaN
    (``exact_types``: numbers of the same type too, 1 is not 1.0)."""
    import torch

    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        assert dataclasses.is_dataclass(b), where
        a, b = dataclasses.asdict(a), dataclasses.asdict(b)
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}", exact_types=exact_types)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]", exact_types=exact_types)
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), f"{where}: {a!r} != {b!r}"
    else:
        assert a == b and (not exact_types or type(a) is type(b)), f"{where}: {a!r} != {b!r}"
