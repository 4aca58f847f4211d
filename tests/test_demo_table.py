"""The demo's table shows the noise scale's 90% interval."""

from __future__ import annotations

import math

from cbs_tracker.commands.demo import format_interval


def test_interval_column():
    assert format_interval(None, None) == "-"
    assert format_interval(1210.4, 1530.0) == "1,210-1,530"
    # unbounded above while |G|^2 is not distinguishable from 0: one token, a lower bound
    assert format_interval(900.0, math.inf) == ">=900"
