"""``hold_on_plateau``: the loss's slope against numpy's least squares, the decisions against the frontier's
prototype (``benchmarks/proof/gpt_proof_lr.plateau_held``, separate code) step for step, resume, a verdict that
waits for a readable slope, and what the option says when it cannot read."""

from __future__ import annotations

import logging
import math
import random
import warnings

import numpy as np
import pytest

from cbs_tracker.policy.controller import BatchSizeController
from cbs_tracker.policy.plateau import LossSlope
from tests.scripts import load_script

MICRO, STEPS, WARMUP = 512.0, 1200, 20 * 512.0
TOTAL = STEPS * MICRO


@pytest.fixture(scope="module")
def proof_lr():
    return load_script("benchmarks/frontier.py", "frontier_for_plateau").proof_lr


def steep(t):
    return 3 - 0.3 * math.log(t)


def flat(t):
    return 3 - 0.1 * math.log(t)


def bent(t, knee=600 * MICRO):  # a plateau to half the run, then a fast fall
    return 3 - 0.1 * math.log(min(t, knee)) - 0.6 * math.log(max(t, knee) / knee)


def lr_at(tokens, halve_at=900 * MICRO):
    """A linear warm-up over WARMUP tokens, then constant, halved at ``halve_at``."""
    return 1e-3 * min(1.0, tokens / WARMUP) * (0.5 if tokens >= halve_at else 1.0)


def feed(ctrl, loss_at, *, noise=10 * MICRO, steps=STEPS, start=1, acc=1, jitter=0.0, rng=None):
    """The controller over a run: each step's loss (``observe_loss``) before its update, a noise scale the
    default grows on, the LR of :func:`lr_at` for the coming step. Returns the steps where the batch changed,
    the conversions, and the accumulation and tokens where it stopped."""
    tokens, changed, decision = (start - 1) * MICRO * acc, [], None
    for step in range(start, steps + 1):
        tokens += MICRO * acc
        loss = loss_at(tokens) + (rng.gauss(0, jitter) if rng else 0.0)
        if getattr(ctrl, "observe_loss", None) is not None:
            ctrl.observe_loss(tokens, loss)
        decision = ctrl.update(step=step, tokens_seen=tokens, global_batch=MICRO * acc, accumulation_steps=acc,
                               noise_scale=noise, noise_scale_low=noise, noise_scale_high=noise,
                               scheduled_lr=lr_at(tokens))
        if decision.changed:
            changed.append(step)
        acc = decision.accumulation_steps
    return changed, decision.lr_conversions


def test_the_slope_is_the_least_squares_fit_over_the_second_half_from_twice_the_lrs_warm_up():
    rng = random.Random(0)
    slope = LossSlope()
    seen = []
    for step in range(1, 400):
        t = 100.0 * step
        slope.observe_lr(t - 100.0, 1e-3 * min(1.0, (t - 100.0) / 3000.0))  # the update before this loss
        y = flat(t) + rng.gauss(0, 0.05)
        slope.add(t, y)
        seen.append((t, y))
        xs = [(a, b) for a, b in seen if a >= max(t / 2, 2 * 3000.0)]
        value = slope.slope(t)
        if t < 2.5 * 3000.0 or len(xs) < 8:
            assert value is None
            continue
        reference = -np.polyfit(np.log([a for a, _ in xs]), [b for _, b in xs], 1)[0]
        assert value == pytest.approx(reference, rel=1e-6, abs=1e-9)
    assert slope.warmup == 3000.0
    assert 0.05 < value < 0.15  # the planted 0.1, read through the noise


@pytest.mark.parametrize("loss_at", [steep, flat, bent], ids=["steep", "flat", "bent"])
@pytest.mark.parametrize("exit", [None, 0.3], ids=["no-exit", "exit0.3"])
def test_the_library_decides_as_the_frontiers_prototype_step_for_step(proof_lr, loss_at, exit):
    """Same losses (with noise), noise scale and LR: the same doublings at the same steps and the same
    conversions as ``plateau_held`` on the default controller; and on the steep loss the first growth comes
    after a quarter of the run, where the rule without the option grows earlier."""
    library = BatchSizeController(total_tokens=TOTAL, hold_on_plateau=0.15, plateau_exit=exit,
                                  plateau_tokens_per_parameter=None)
    prototype = proof_lr.plateau_held(BatchSizeController(total_tokens=TOTAL, hold_on_plateau=None), below=0.15, warmup_tokens=WARMUP,
                                      total_tokens=TOTAL, exit=exit)
    ours = feed(library, loss_at, rng=random.Random(1), jitter=0.02)
    theirs = feed(prototype, loss_at, rng=random.Random(1), jitter=0.02)
    assert ours == theirs
    assert library.plateau.held == prototype.plateau_held
    assert library.plateau.verdict_slope == pytest.approx(prototype.plateau_slope, rel=1e-9)
    if loss_at is steep:
        without, _ = feed(BatchSizeController(total_tokens=TOTAL, hold_on_plateau=None), loss_at)
        assert without[0] * MICRO < 0.25 * TOTAL < ours[0][0] * MICRO
    if loss_at is flat:
        assert ours == ([], 0) and library.plateau.held is True
    if loss_at is bent:
        assert bool(ours[0]) == (exit is not None)


def ungated(**kwargs):
    return BatchSizeController(total_tokens=TOTAL, hold_on_plateau=0.15, plateau_tokens_per_parameter=None, **kwargs)


@pytest.mark.parametrize("loss_at", [steep, flat, bent], ids=["steep", "flat", "bent"])
@pytest.mark.parametrize("parameters", [5_000, 10_000], ids=["30-per-param", "15-per-param"])
@pytest.mark.parametrize("given", ["argument", "adapter"])
def test_the_size_gate_decides_as_the_frontiers_prototype_and_lets_a_run_past_20_per_parameter_grow(
        proof_lr, loss_at, parameters, given, caplog):
    """``plateau_tokens_per_parameter`` (default 20) against ``plateau_gated_by_size`` (the frontier's first runs of
    ``library:hold_on_plateau=0.15+tpp20``, separate code wrapped around the ungated option): the same doublings at
    the same steps, with the count given as ``model_parameters=`` or by an adapter (``set_model_parameters``). The
    verdict comes at a quarter of the run, 153,600 tokens: 30.7 tokens per parameter of a 5,000-parameter model,
    15.4 of a 10,000-parameter one. On the flat loss, whose verdict holds, past 20 the run decides as the option
    does on the steep loss, whose verdict lets the rule grow (past the verdict only the noise scale decides); below
    it, it holds as the option does."""
    if given == "argument":
        library = BatchSizeController(total_tokens=TOTAL, hold_on_plateau=0.15, model_parameters=parameters)
    else:
        library = BatchSizeController(total_tokens=TOTAL, hold_on_plateau=0.15)
        library.set_model_parameters(parameters)
    prototype = proof_lr.plateau_gated_by_size(ungated(), parameters=parameters, tokens_per_parameter=20)
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="cbs_tracker"):
        warnings.simplefilter("error")  # a known count: nothing to warn of
        ours = feed(library, loss_at, rng=random.Random(2), jitter=0.02)
    assert ours == feed(prototype, loss_at, rng=random.Random(2), jitter=0.02)
    assert (library.plateau.held, library.plateau.gated) == (prototype.plateau.held, prototype.plateau.gated)
    if loss_at is flat:
        grows = parameters == 5_000
        assert library.plateau.held is not grows
        said = (" (a plateau by its slope), not held: the run has seen 30.7 tokens per parameter, at least "
                "plateau_tokens_per_parameter=20, a run long for its model" if grows else
                "below 0.15, growth held (15.4 tokens per parameter, below plateau_tokens_per_parameter=20)")
        assert said in caplog.text
        if grows:
            assert feed(library_like := BatchSizeController(total_tokens=TOTAL, hold_on_plateau=0.15,
                                                             model_parameters=parameters), flat) == \
                feed(ungated(), steep)
            assert library_like.plateau.gated == pytest.approx(0.25 * TOTAL / parameters, rel=0.01)
            assert ours[0] and ours[0][0] * MICRO >= 0.25 * TOTAL
        else:
            assert ours == ([], 0) and library.plateau.gated is None
    with pytest.raises(ValueError, match=r"parameters=0, tokens_per_parameter=20\): both must be > 0"):
        proof_lr.plateau_gated_by_size(ungated(), parameters=0, tokens_per_parameter=20)
    with pytest.raises(ValueError, match="has no hold_on_plateau to gate"):
        proof_lr.plateau_gated_by_size(BatchSizeController(hold_on_plateau=None), parameters=10, tokens_per_parameter=20)
    with pytest.raises(ValueError, match=r"gated already \(plateau_tokens_per_parameter=20\)"):
        proof_lr.plateau_gated_by_size(BatchSizeController(hold_on_plateau=0.15), parameters=10,
                                       tokens_per_parameter=20)


def test_without_the_models_size_a_holding_verdict_holds_and_says_what_to_pass():
    """No count (a controller driven by hand, or units that are samples): the verdict holds as the ungated option's
    does and warns once, naming ``model_parameters=`` and ``plateau_tokens_per_parameter=None``; with the gate off
    it says nothing. A verdict that lets the rule grow needs no count and says nothing either."""
    ctrl = BatchSizeController(total_tokens=TOTAL, hold_on_plateau=0.15)
    with pytest.warns(UserWarning, match=r"growth held; plateau_tokens_per_parameter=20 could not tell a plateau "
                                         r"from a run long for its model.*pass model_parameters=.*"
                                         r"plateau_tokens_per_parameter=None") as said:
        assert feed(ctrl, flat) == feed(ungated(), flat) == ([], 0)
    assert len([w for w in said if "could not tell" in str(w.message)]) == 1
    assert ctrl.plateau.held is True and ctrl.model_parameters is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        feed(ungated(), flat)
        feed(BatchSizeController(total_tokens=TOTAL, hold_on_plateau=0.15), steep)


def test_in_samples_the_gate_is_not_read_and_a_holding_verdict_says_so_without_a_warning(caplog):
    """Units that are samples (an adapter says so, with the count it made): a holding verdict holds, whatever the
    count (here one that would be 30.7 per parameter in tokens), says at INFO that the gate is not read, and warns
    of nothing; a count the user gave is said, once, not to be used."""
    for given in (False, True):
        ctrl = BatchSizeController(total_tokens=TOTAL, hold_on_plateau=0.15, model_parameters=5_000 if given else None)
        with warnings.catch_warnings(record=True) as said, caplog.at_level(logging.INFO, logger="cbs_tracker"):
            warnings.simplefilter("always")
            ctrl.set_model_parameters(5_000, unit="samples")
            assert feed(ctrl, flat) == ([], 0)
        assert [str(w.message) for w in said] == ([
            "BatchSizeController(model_parameters=5000): the run's units are samples, so plateau_tokens_per_parameter "
            "is not read and the count is not used (count tokens, or give plateau_tokens_per_parameter=None)"]
            if given else [])
        assert ctrl.plateau.held is True and ctrl.plateau.gated is None
        assert "below 0.15, growth held (the units are samples: plateau_tokens_per_parameter=20 is not read)" \
            in caplog.text


def test_the_users_count_wins_over_the_adapters_and_bad_counts_are_refused():
    ctrl = BatchSizeController(hold_on_plateau=0.15, model_parameters=10_000)
    ctrl.set_model_parameters(5_000)  # an adapter's count (a pipeline stage's, say): the user's wins
    assert ctrl.model_parameters == 10_000
    adapter = BatchSizeController(hold_on_plateau=0.15)
    adapter.set_model_parameters(5_000)
    adapter.set_model_parameters(6_000)  # the adapter's latest count
    assert adapter.model_parameters == 6_000
    for kwargs, error, match in [
            ({"plateau_tokens_per_parameter": 0}, ValueError,
             r"plateau_tokens_per_parameter=0\): must be finite and > 0, or None to turn the size gate off"),
            ({"plateau_tokens_per_parameter": "20"}, TypeError, r"plateau_tokens_per_parameter='20'\): expected a number"),
            ({"model_parameters": 0}, ValueError, r"model_parameters=0\): must be >= 1"),
            ({"model_parameters": 1.5e6}, TypeError, r"model_parameters=1500000.0\): expected an int")]:
        with pytest.raises(error, match=match):
            BatchSizeController(hold_on_plateau=0.15, **kwargs)
    with pytest.raises(ValueError, match=r"set_model_parameters\(count=0\): must be >= 1"):
        adapter.set_model_parameters(0)
    with pytest.raises(TypeError, match=r"set_model_parameters\(count=True\): expected an int"):
        adapter.set_model_parameters(True)
    with pytest.raises(ValueError, match=r"set_model_parameters\(unit='bytes'\): must be 'tokens' or 'samples'"):
        adapter.set_model_parameters(10, unit="bytes")
    assert BatchSizeController(hold_on_plateau=0.15, model_parameters=np.int64(7)).model_parameters == 7


def test_a_run_resumed_after_a_verdict_the_gate_overturned_keeps_growing_as_the_uninterrupted_one():
    """Saved after the verdict (the flat loss at 30.7 tokens per parameter, step 300) and before the first doubling:
    the resumed controller keeps the gate's verdict (``plateau_gated`` in the state) and changes the batch at the
    same steps."""
    def make():
        return BatchSizeController(total_tokens=TOTAL, hold_on_plateau=0.15, model_parameters=5_000)

    whole = feed(make(), flat)
    first = make()
    head = feed(first, flat, steps=305)
    assert first.plateau.gated == pytest.approx(30.7, abs=0.1)
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    assert (resumed.plateau.held, resumed.plateau.gated) == (False, first.plateau.gated)
    tail = feed(resumed, flat, start=306)
    assert head[0] == [] and tail[0] == whole[0] and whole[0][0] > 306
    for bad in ({"plateau_gated": -1.0}, {"plateau_gated": 30.7, "plateau_held": True}):
        with pytest.raises(ValueError, match=r"state\['plateau_gated'\]=.*does not hold"):
            make().load_state_dict({**first.state_dict(), **bad})


def test_a_resumed_controller_decides_as_the_uninterrupted_one():
    """Saved before the verdict (its loss points in the state) and after it, loaded into a fresh controller:
    the rest of the run changes the batch at the same steps."""
    def make():
        return ungated(plateau_exit=0.3)

    whole = feed(make(), bent)
    for cut in (250, 700):
        first = make()
        head = feed(first, bent, steps=cut)
        acc = first.accumulation_steps
        state = first.state_dict()
        assert (len(state["loss_points"]) > 8) == (cut == 250 or first.plateau.held is True)
        resumed = make()
        resumed.load_state_dict(state)
        assert resumed.plateau.held == first.plateau.held
        tail = feed(resumed, bent, start=cut + 1, acc=acc)
        assert head[0] + tail[0] == whole[0]


def test_a_verdict_due_before_the_slope_can_be_read_waits_for_it_held_and_says_so():
    """A warm-up of 12% of the run: at a quarter the slope (read from 2.5 x the warm-up, 30%) cannot be read
    yet; the verdict waits, growth held, with one warning, and comes at the first update where it can."""
    warmup = 0.12 * TOTAL

    def lr_late(tokens):
        return 1e-3 * min(1.0, tokens / warmup)

    ctrl = BatchSizeController(total_tokens=TOTAL, hold_on_plateau=0.15)
    tokens, grown = 0.0, []
    with pytest.warns(UserWarning, match=r"hold_on_plateau=0.15: at .* the loss's slope cannot be read yet") as said:
        for step in range(1, STEPS + 1):
            tokens += MICRO
            ctrl.observe_loss(tokens, steep(tokens))
            d = ctrl.update(step=step, tokens_seen=tokens, global_batch=MICRO, accumulation_steps=1,
                            noise_scale=10 * MICRO, noise_scale_low=10 * MICRO, noise_scale_high=10 * MICRO,
                            scheduled_lr=lr_late(tokens))
            if d.changed:
                grown.append(tokens)
                break
    assert len([w for w in said if "cannot be read yet" in str(w.message)]) == 1
    assert ctrl.plateau.slope.warmup == pytest.approx(warmup, abs=MICRO)
    assert ctrl.plateau.verdict_tokens == pytest.approx(2.5 * ctrl.plateau.slope.warmup, abs=MICRO)
    assert ctrl.plateau.verdict_slope == pytest.approx(0.3) and ctrl.plateau.held is False
    assert grown and grown[0] > ctrl.plateau.verdict_tokens


@pytest.mark.filterwarnings("ignore:.*convert_until=0.85. has no run length")
def test_without_a_loss_or_a_run_length_it_says_so_and_the_rule_decides_as_without_the_option():
    plain = feed(BatchSizeController(total_tokens=TOTAL, hold_on_plateau=None), steep)

    class NoLoss(BatchSizeController):
        observe_loss = None  # feed() skips it: no loss reaches the controller

    ctrl = NoLoss(total_tokens=TOTAL, hold_on_plateau=0.15)
    with pytest.warns(UserWarning, match=r"hold_on_plateau=0.15\): no training loss reached the controller in its first"):
        unread = feed(ctrl, steep)
    assert ctrl.plateau.unread and ctrl.plateau.held is False
    held_first = [s for s in plain[0] if s * MICRO < 0.25 * TOTAL]
    assert held_first and unread[0][0] * MICRO >= 0.25 * TOTAL  # held until the verdict, then the rule's own
    with pytest.warns(UserWarning, match=r"hold_on_plateau=0.15\) has no run length.*nothing is held"):
        assert feed(BatchSizeController(hold_on_plateau=0.15), flat) == feed(BatchSizeController(hold_on_plateau=None), flat)


def test_the_options_are_checked_and_a_loss_that_is_not_finite_is_skipped():
    for kwargs, match in [({"hold_on_plateau": 0.0}, r"hold_on_plateau=0.0\): must be finite and > 0"),
                          ({"hold_on_plateau": 0.15, "plateau_at": 1.0}, r"plateau_at=1.0\): must be in \(0, 1\)"),
                          ({"hold_on_plateau": None, "plateau_exit": 0.3}, r"plateau_exit=0.3, hold_on_plateau=None\): plateau_exit needs"),
                          ({"hold_on_plateau": 0.15, "plateau_exit": 0.1}, r"must be at least it")]:
        with pytest.raises(ValueError, match=match):
            BatchSizeController(**kwargs)
    ctrl = BatchSizeController(total_tokens=TOTAL, hold_on_plateau=0.15)
    with pytest.raises(ValueError, match=r"observe_loss\(tokens=0.0\): must be finite and > 0"):
        ctrl.observe_loss(0.0, 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ctrl.observe_loss(10.0, math.nan)
        ctrl.observe_loss(20.0, math.inf)
    assert ctrl.plateau.slope.seen == 0
    ctrl.observe_loss(30.0, 2.0)
    assert ctrl.plateau.slope.seen == 1


def test_the_default_hold_reads_tokens_and_is_off_where_an_adapter_says_the_units_are_samples():
    """``hold_on_plateau="auto"`` (the default) is 0.15 where the units are tokens (its threshold was read off
    language models' loss per token, in nats) and off in samples, where it decides as ``hold_on_plateau=None``; a
    threshold asked for is kept in samples; an unknown word is refused."""
    alone = feed(BatchSizeController(total_tokens=TOTAL, hold_on_plateau=None), flat)
    assert alone[0]  # the kappa rule alone grows on this noise scale, plateau or not
    for unit, active in (("tokens", True), ("samples", False)):
        default = BatchSizeController(total_tokens=TOTAL)
        default.set_model_parameters(1_000_000, unit=unit)
        assert default.plateau.active is active and default.plateau.below == (0.15 if active else None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            decided = feed(default, flat)
        assert (decided == alone) is not active  # in tokens the flat loss holds it for good
        assert ("plateau_held" in default.state_dict()) is active
    asked = BatchSizeController(total_tokens=TOTAL, hold_on_plateau=0.15)
    asked.set_model_parameters(1_000_000, unit="samples")
    assert asked.plateau.active and feed(asked, flat) == ([], 0)
    with pytest.raises(ValueError, match=r"hold_on_plateau='on'\): expected a number > 0 .*'auto'"):
        BatchSizeController(hold_on_plateau="on")
    assert BatchSizeController(hold_on_plateau="auto", plateau_exit=0.3).plateau.exit == 0.3
    with pytest.raises(ValueError, match="must be at least it"):
        BatchSizeController(plateau_exit=0.1)


def test_a_verdict_that_cannot_be_read_by_half_the_run_gives_way_to_the_rule_and_says_so():
    """A warm-up of 30% of the run (``OneCycleLR``'s default ``pct_start``): the slope could be read only from 75%; the
    verdict waits, held, until half the run (twice ``plateau_at``) and then lets the rule grow, with a warning."""
    warmup = 0.3 * TOTAL
    ctrl = BatchSizeController(total_tokens=TOTAL, hold_on_plateau=0.15)
    tokens, grown = 0.0, []
    with pytest.warns(UserWarning) as said:
        for step in range(1, STEPS + 1):
            tokens += MICRO
            ctrl.observe_loss(tokens, steep(tokens))
            d = ctrl.update(step=step, tokens_seen=tokens, global_batch=MICRO, accumulation_steps=1,
                            noise_scale=10 * MICRO, noise_scale_low=10 * MICRO, noise_scale_high=10 * MICRO,
                            scheduled_lr=1e-3 * min(1.0, tokens / warmup))
            if d.changed:
                grown.append(tokens)
                break
    messages = [str(w.message) for w in said]
    assert sum("until 0.5 of the run" in m for m in messages) == 1  # the wait, said once, with its end
    assert sum("could still not be read" in m and "the growth rule is in force" in m for m in messages) == 1
    assert ctrl.plateau.held is False and ctrl.plateau.verdict_slope is None
    assert ctrl.plateau.verdict_tokens == pytest.approx(0.5 * TOTAL, abs=MICRO)
    assert grown and 0.5 * TOTAL < grown[0] < 0.75 * TOTAL  # the rule's own growth, before the slope could be read


def test_the_default_says_when_its_verdict_holds_for_good_and_a_controller_that_only_observes_holds_nothing():
    """The hold, when the user did not ask for it (``"auto"``), warns at a verdict that stops growth for the rest of
    the run (where an asked-for threshold says so at INFO); ``observe_only`` changes nothing, so it has no hold and
    reads no loss."""
    default = BatchSizeController(total_tokens=TOTAL)
    with pytest.warns(UserWarning, match=r"below 0.15, growth held.*the default holds growth for the rest of the run "
                                         r"\(hold_on_plateau=None grows"):
        assert feed(default, flat) == ([], 0)
    asked = BatchSizeController(total_tokens=TOTAL, hold_on_plateau=0.15, plateau_tokens_per_parameter=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert feed(asked, flat) == ([], 0)
    for observer in (BatchSizeController(observe_only=True),
                     BatchSizeController(observe_only=True, hold_on_plateau=0.15, total_tokens=TOTAL)):
        assert not observer.plateau.active and not observer.plateau.collecting and observer.state_dict().get(
            "plateau_held", "absent") == "absent"


def test_a_held_state_loaded_without_the_hold_reports_no_verdict():
    """A state whose hold held, loaded by a controller built with ``hold_on_plateau=None``: the configuration wins
    (no hold), and the controller does not claim the saved verdict it does not follow."""
    held = BatchSizeController(total_tokens=TOTAL, hold_on_plateau=0.15, plateau_tokens_per_parameter=None)
    feed(held, flat)
    assert held.plateau.held is True and held.plateau.verdict_slope is not None
    off = BatchSizeController(total_tokens=TOTAL, hold_on_plateau=None)
    off.load_state_dict(held.state_dict())
    assert (off.plateau.held, off.plateau.verdict_slope, off.plateau.verdict_tokens) == (None, None, None)
    assert "plateau_held" not in off.state_dict() and not off.plateau.collecting
