"""No growth decision on noise: a frozen regression with a known noise scale, started at 1/32 of it."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "decisions_on_noise", Path(__file__).resolve().parents[1] / "benchmarks" / "decisions_on_noise.py"
)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_the_batch_never_grows_beyond_the_critical_batch_on_noise():
    # B_simple = 257 never changes; kappa * B_simple / (1 + margin) = 116.8 allows 64 from a start of 8.
    finals, beyond = [], 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the feedback guard's trap warning
        for seed in range(20):
            b = bench.run(seed, truth=257.0, steps=3000, micro=4.0, a0=2, evidence=True)
            beyond += max(b) > 64
            finals.append(b[-1])
    assert beyond == 0, finals
    # 18 of 20 reach the allowed batch; the other two stop at 16, where the feedback guard
    # declares a trap on the first doubling (the README's caveats say so)
    assert sum(f == 64 for f in finals) >= 18, finals
