"""Checked reading of a saved policy state: every value is validated before any is assigned.

Each policy part parses its keys with a :class:`StateReader` into a plain dict and
assigns only after every part has parsed, so a failed load leaves the controller as it was.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Integral, Real
from typing import Any

__all__ = ["StateReader"]

_REQUIRED = object()


class StateReader:
    """Typed, range-checked access to a state mapping.

    Args:
        state: the mapping being loaded (never modified).
        owner: the call named in error messages, e.g. ``"BatchSizeController.load_state_dict"``.

    Errors name the key, the value and what is allowed: ``TypeError`` for a wrong type,
    ``ValueError`` for a value out of range, ``KeyError`` for a missing required key.
    """

    def __init__(self, state: Mapping[str, Any], owner: str) -> None:
        self.state = state
        self.owner = owner

    def _get(self, key: str, default: Any) -> Any:
        if key in self.state:
            return self.state[key]
        if default is _REQUIRED:
            raise KeyError(f"{self.owner}: missing required key {key!r}")
        return default

    def _fail(self, exc: type[Exception], key: str, value: Any, allowed: str) -> Exception:
        return exc(f"{self.owner}: state[{key!r}]={value!r}: expected {allowed}")

    def integer(self, key: str, *, minimum: int | None = None, maximum: int | None = None,
                default: Any = _REQUIRED) -> int:
        """An int in ``[minimum, maximum]`` (a float with an integral value is refused)."""
        value = self._get(key, default)
        allowed = "an int" + ("" if minimum is None else f" >= {minimum}") + (
            "" if maximum is None else f" and <= {maximum}")
        if isinstance(value, bool) or not isinstance(value, Integral):
            raise self._fail(TypeError, key, value, allowed)
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            raise self._fail(ValueError, key, value, allowed)
        return int(value)

    def number(self, key: str, *, minimum: float | None = None, positive: bool = False,
               default: Any = _REQUIRED) -> float:
        """A finite real number, ``>= minimum`` (or ``> 0`` with ``positive``)."""
        value = self._get(key, default)
        bound = " > 0" if positive else ("" if minimum is None else f" >= {minimum:g}")
        allowed = f"a finite number{bound}"
        if isinstance(value, bool) or not isinstance(value, Real):
            raise self._fail(TypeError, key, value, allowed)
        out = float(value)
        if not math.isfinite(out) or (positive and out <= 0) or (minimum is not None and out < minimum):
            raise self._fail(ValueError, key, value, allowed)
        return out

    def flag(self, key: str, *, default: Any = _REQUIRED) -> bool:
        """A flag saved as 0 or 1 (``True``/``False`` accepted)."""
        value = self._get(key, default)
        if isinstance(value, bool):
            return value
        if not isinstance(value, Integral):
            raise self._fail(TypeError, key, value, "0 or 1")
        if value not in (0, 1):
            raise self._fail(ValueError, key, value, "0 or 1")
        return bool(value)

    def positive_list(self, key: str, *, default: Any = _REQUIRED) -> list[float]:
        """A list of finite numbers ``> 0``."""
        value = self._get(key, default)
        if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
            raise self._fail(TypeError, key, value, "a list of finite numbers > 0")
        out = []
        for item in value:
            if isinstance(item, bool) or not isinstance(item, Real):
                raise self._fail(TypeError, key, value, "a list of finite numbers > 0")
            if not math.isfinite(float(item)) or item <= 0:
                raise self._fail(ValueError, key, value, "a list of finite numbers > 0")
            out.append(float(item))
        return out
