"""``BatchSizeController(convert_until=...)``: halvings of the scheduled LR late in the run are not converted.

The truth these tests hold the controller to is the schedule itself: where a cosine (to 10%) or a
warmup-stable-decay schedule (the last 20% linear to 10%) halves its LR is known in closed form, so
which halvings fall before ``convert_until`` of the run, and hence how many doublings the run makes,
is known before it runs. The same run with ``convert_until=1`` (every halving converts) is the second
truth: the option must only remove the late conversions, never move the early ones.
"""

from __future__ import annotations

import math
import warnings

import pytest

from cbs_tracker.policy.controller import BatchSizeController

MICRO = 512
TOTAL = 4000 * MICRO  # the run's length in units (4,000 starting batches)
B_SIMPLE = 64.0 * MICRO  # far above every batch the conversions reach: only convert_until refuses


def cosine(fraction: float, floor: float = 0.1) -> float:
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(fraction, 1.0)))


def wsd(fraction: float, floor: float = 0.1, decay: float = 0.2) -> float:
    start = 1.0 - decay
    return 1.0 if fraction <= start else 1.0 - (1.0 - floor) * min(1.0, (fraction - start) / decay)


def halving_fractions(lr_at) -> list[float]:
    """Where ``lr_at`` (of the run's fraction) first falls to 1/2, 1/4, 1/8 ... of its peak (bisection)."""
    out, level = [], 0.5
    while lr_at(1.0) <= level:
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if lr_at(mid) <= level else (mid, hi)
        out.append(hi)
        level /= 2
    return out


def run(ctrl: BatchSizeController, lr_at, *, tokens: float = 0.0, step: int = 1, acc: int = 1,
        until: float = TOTAL):
    """A caller that trains ``TOTAL`` units with the LR of its fraction, applying each decision at once."""
    decisions = []
    while tokens < until:
        batch = MICRO * acc
        tokens += batch
        d = ctrl.update(step=step, tokens_seen=tokens, global_batch=batch, accumulation_steps=acc,
                        noise_scale=B_SIMPLE, scheduled_lr=lr_at(tokens / TOTAL))
        decisions.append((tokens, d))
        acc, step = d.accumulation_steps, step + 1
    return decisions, (tokens, step, acc)


def conversions(decisions) -> list[float]:
    """The run's fraction at each conversion (margin=100 keeps the measured rule from growing)."""
    return [t / TOTAL for t, d in decisions if d.changed and d.reason.startswith("convert:")]


def controller(**kw) -> BatchSizeController:
    return BatchSizeController(kappa=0.4, margin=100.0, **kw)


@pytest.mark.parametrize("schedule,until,expected", [
    (cosine, 0.85, 2), (cosine, 1.0, 3), (wsd, 0.85, 0), (wsd, 1.0, 3), (wsd, 0.95, 1),
])
def test_only_the_halvings_before_convert_until_convert(schedule, until, expected):
    halvings = halving_fractions(schedule)
    assert sum(h <= until for h in halvings) == expected  # the closed form says it before the run
    decisions, _ = run(controller(convert_until=until, total_tokens=TOTAL), schedule)
    made = conversions(decisions)
    assert len(made) == expected
    # each conversion at or after the halving it replaces and before the next one (a conversion waits for the
    # window to refill after the previous change: 32 measurements at the new batch)
    for at, halving, after in zip(made, halvings, halvings[1:] + [1.0]):
        assert halving <= at < after, (made, halvings)
    # against every halving converting: the early ones are the same, only the late ones are gone
    everything, _ = run(controller(convert_until=1.0, total_tokens=TOTAL), schedule)
    assert conversions(everything)[:expected] == made


def test_a_late_halving_is_said_and_the_lr_decays_as_scheduled(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="cbs_tracker.policy.controller"):
        decisions, (_, _, acc) = run(controller(convert_until=0.85, total_tokens=TOTAL), wsd)
    assert acc == 1 and all(d.lr_factor == 1.0 for _, d in decisions)
    said = [r.getMessage() for r in caplog.records if "not converted" in r.getMessage()]
    assert len(said) == 3 and all("past convert_until=0.85 of the run" in m for m in said), said
    first = halving_fractions(wsd)[0]
    assert f"{first * TOTAL:.4g} of {TOTAL:.4g} units" in said[0]


def test_the_run_length_an_adapter_gives_counts_and_without_one_every_halving_converts():
    adapter = controller(convert_until=0.85)
    adapter.set_run_length(TOTAL)
    decisions, _ = run(adapter, wsd)
    assert conversions(decisions) == []
    blind = controller(convert_until=0.85)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decisions, _ = run(blind, wsd)
    assert len(conversions(decisions)) == 3
    said = [str(w.message) for w in caught if "convert_until" in str(w.message)]
    assert len(said) == 1 and "every halving of the scheduled LR converts" in said[0]
    assert "Pass total_tokens=" in said[0]


def test_no_warning_when_the_option_is_off_the_length_known_or_the_lr_never_halves():
    constant = lambda fraction: 1.0  # noqa: E731
    for ctrl, schedule in ((controller(convert_until=1.0), wsd), (controller(convert_until=0.85, total_tokens=TOTAL), wsd),
                           (controller(convert_until=0.85, convert_lr_decay=False), wsd),
                           (controller(convert_until=0.85), constant)):  # no length, but nothing to convert
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run(ctrl, schedule)
        assert not [w for w in caught if "convert_until" in str(w.message)]


@pytest.mark.parametrize("schedule", [cosine, wsd])
def test_a_resume_decides_as_the_uninterrupted_run(schedule):
    straight, _ = run(controller(convert_until=0.85, total_tokens=TOTAL), schedule)
    first = controller(convert_until=0.85, total_tokens=TOTAL)
    head, (tokens, step, acc) = run(first, schedule, until=0.8 * TOTAL)
    resumed = controller(convert_until=0.85, total_tokens=TOTAL)
    resumed.load_state_dict(first.state_dict())
    tail, _ = run(resumed, schedule, tokens=tokens, step=step, acc=acc)
    assert [(t, d.accumulation_steps, d.reason) for t, d in head + tail] == \
        [(t, d.accumulation_steps, d.reason) for t, d in straight]


@pytest.mark.parametrize("value,exc,match", [
    (0.0, ValueError, "must be finite and > 0"), (1.5, ValueError, r"must be in \(0, 1\]"),
    ("0.8", TypeError, "expected a number"), (True, TypeError, "expected a number"),
    (float("nan"), ValueError, "must be finite"),
])
def test_convert_until_is_checked(value, exc, match):
    with pytest.raises(exc, match=r"BatchSizeController\(convert_until=.*" + match):
        BatchSizeController(convert_until=value)  # type: ignore[arg-type]
