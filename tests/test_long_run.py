"""``long_run_kappa``: ``kappa`` rising with the run's tokens per parameter past ``plateau_tokens_per_parameter``, and
the hold ending there. Against the formula, inert where the count is not read, and a resume that decides as the
uninterrupted run (the factor is configuration and tokens, nothing saved)."""

from __future__ import annotations

import math

import pytest

from cbs_tracker.policy.controller import LONG_RUN_MOST, BatchSizeController

MICRO, STEPS, PARAMETERS = 1024.0, 2000, 10_240  # 20 tokens per parameter at a tenth of the run
TOTAL = STEPS * MICRO


def feed(ctrl, steps=range(1, STEPS + 1), acc=1, tokens=0.0):
    """A steep loss and a large noise scale: the controller grows wherever its rule lets it. Returns each step's
    ``(tokens, kappa, accumulation)``, from a run that starts at ``steps[0]`` with ``acc`` and ``tokens`` seen."""
    out = []
    for step in steps:
        tokens += MICRO * acc
        if tokens > TOTAL:
            break
        ctrl.observe_loss(tokens, 3 - 0.3 * math.log(tokens))
        d = ctrl.update(step=step, tokens_seen=tokens, global_batch=MICRO * acc, accumulation_steps=acc,
                        noise_scale=64 * MICRO, noise_scale_low=64 * MICRO, noise_scale_high=64 * MICRO,
                        scheduled_lr=1e-3 * min(1.0, tokens / (20 * MICRO)))
        acc = d.accumulation_steps
        out.append((tokens, ctrl.kappa, acc))
    return out


def test_kappa_rises_as_the_formula_past_the_gate_and_growth_starts_before_the_verdict():
    ctrl = BatchSizeController(total_tokens=TOTAL, long_run_kappa=0.5, model_parameters=PARAMETERS)
    run = feed(ctrl)
    for tokens, kappa, _ in run:
        want = 0.4 * min(LONG_RUN_MOST, max(1.0, tokens / (20 * PARAMETERS)) ** 0.5)
        assert kappa == pytest.approx(want, rel=1e-12)
    assert max(k for _, k, _ in run) == pytest.approx(0.4 * LONG_RUN_MOST)  # reached: 200 per parameter at the end
    first = next(t for t, _, a in run if a > 1)
    assert 0.1 * TOTAL <= first < 0.25 * TOTAL  # past the gate, before the verdict a quarter in
    default = feed(BatchSizeController(total_tokens=TOTAL, model_parameters=PARAMETERS))
    assert next(t for t, _, a in default if a > 1) >= 0.25 * TOTAL


@pytest.mark.parametrize("how", ["samples", "unknown", "large"])
def test_it_is_inert_where_the_tokens_per_parameter_are_not_read_or_not_reached(how):
    kwargs = {"model_parameters": 10 * PARAMETERS} if how == "large" else {}  # 2 tokens per parameter at the end
    ctrl = BatchSizeController(total_tokens=TOTAL, long_run_kappa=0.5, hold_on_plateau=0.15, **kwargs)
    plain = BatchSizeController(total_tokens=TOTAL, hold_on_plateau=0.15, **kwargs)
    if how == "samples":
        for c in (ctrl, plain):
            c.set_model_parameters(PARAMETERS, unit="samples")
    assert feed(ctrl) == feed(plain)
    assert {k for _, k, _ in feed(BatchSizeController(total_tokens=TOTAL, long_run_kappa=0.5,
                                                      hold_on_plateau=None, **kwargs))} == {0.4}


def test_a_resume_past_the_gate_decides_as_the_uninterrupted_run():
    def make():
        c = BatchSizeController(total_tokens=TOTAL, long_run_kappa=0.5)
        c.set_model_parameters(PARAMETERS)  # as an adapter gives it at every start (configuration, not saved)
        return c

    whole = feed(make())
    first = make()
    head = feed(first, steps=range(1, 301))
    again = make()
    again.load_state_dict(first.state_dict())
    tail = feed(again, steps=range(301, STEPS + 1), acc=head[-1][2], tokens=head[-1][0])
    assert head + tail == whole[:len(head) + len(tail)] and len(head) + len(tail) == len(whole)


def test_bad_values_are_refused_naming_the_argument():
    with pytest.raises(ValueError, match=r"long_run_kappa=0.5, plateau_tokens_per_parameter=None\): long_run_kappa "
                                         r"reads the run's tokens per parameter"):
        BatchSizeController(long_run_kappa=0.5, plateau_tokens_per_parameter=None)
    for bad, error in ((0.0, ValueError), (-1.0, ValueError), (math.inf, ValueError), ("0.5", TypeError),
                       (True, TypeError)):
        with pytest.raises(error, match=r"long_run_kappa="):
            BatchSizeController(long_run_kappa=bad)
