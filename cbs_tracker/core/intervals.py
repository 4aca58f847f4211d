"""Confidence intervals for a ratio of two estimated means (pure math, scalars or arrays).

Fieller's interval for ``num / den`` and the Student quantile it is taken at; both
accept NumPy arrays, so the window memory can price every candidate window at once.
"""

from __future__ import annotations

import math

import numpy as np

INTERVAL_CONFIDENCE = 0.90
Z = 1.6448536269514722  # standard normal quantile at (1 + INTERVAL_CONFIDENCE) / 2


# the Cornish-Fisher coefficients of the expansion below
_G1 = (Z**3 + Z) / 4
_G2 = (5 * Z**5 + 16 * Z**3 + 3 * Z) / 96
_G3 = (3 * Z**7 + 19 * Z**5 + 17 * Z**3 - 15 * Z) / 384


def student_quantile(dof):  # noqa: ANN001, ANN201  (a float or an array, the same back)
    """Student-t quantile at ``(1 + INTERVAL_CONFIDENCE) / 2`` (Cornish-Fisher, A&S 26.7.5).

    Args:
        dof: degrees of freedom (a number or an array); below 1 they count as 1. A number
            is computed in Python floats (the same value NumPy's scalars give, without their cost).
    """
    nu = np.maximum(dof, 1.0) if isinstance(dof, np.ndarray) else max(float(dof), 1.0)
    return Z + _G1 / nu + _G2 / nu**2 + _G3 / nu**3


def fieller_intervals(num, den, var_num, var_den, cov, quantile):  # noqa: ANN001, ANN201
    """Fieller's confidence interval for ``num / den``, clipped to ``[0, inf]``, elementwise.

    The set of ``r`` with ``(num - r den)^2 <= q^2 (var_num - 2 r cov + r^2 var_den)``
    (Fieller 1954). When ``den`` is significant (``den^2 > q^2 var_den``) it is a
    bounded interval; otherwise its positive part is ``[low, inf)``, with ``low > 0``
    only where ``num`` itself is significantly positive.

    Args:
        num, den: the estimates (numbers or arrays of one shape).
        var_num, var_den, cov: their variances and covariance.
        quantile: ``q``, e.g. 1.645 for a 90% two-sided interval.

    Returns:
        ``(low, high)`` arrays with ``0 <= low <= high <= inf``.
    """
    q2 = quantile * quantile
    a = den * den - q2 * var_den
    b = num * den - q2 * cov
    c = num * num - q2 * var_num
    root = np.sqrt(np.maximum(b * b - a * c, 0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        lower = np.maximum((b - root) / a, 0.0)
        upper = np.maximum((b + root) / a, 0.0)
    bounded = a > 0
    # a <= 0: with c <= 0 (or a == 0) every ratio near 0 is allowed, so no lower bound;
    # a < 0 < c: the set lies outside the two roots, one below 0 and one above
    no_lower = ~bounded & ((c <= 0) | (a == 0))
    low = np.where(bounded, lower, np.where(no_lower, 0.0, lower))
    high = np.where(bounded, upper, np.inf)
    return low, high


def fieller_interval(
    num: float, den: float, var_num: float, var_den: float, cov: float, quantile: float
) -> tuple[float, float]:
    """:func:`fieller_intervals` for one ratio, as two floats, in Python floats (the same numbers,
    operation for operation, as the array form gives an array of one; a step prices a few dozen)."""
    q2 = quantile * quantile
    a = den * den - q2 * var_den
    b = num * den - q2 * cov
    c = num * num - q2 * var_num
    root = math.sqrt(max(b * b - a * c, 0.0))
    if a > 0:
        return max((b - root) / a, 0.0), max((b + root) / a, 0.0)
    if c <= 0 or a == 0:
        return 0.0, math.inf
    return max((b - root) / a, 0.0), math.inf  # a < 0 < c (or a not a number: NaN, as the array form)
