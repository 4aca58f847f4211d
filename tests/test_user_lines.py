"""What a user's loop is told, and where: a missing training loss said in the run's first updates (not a quarter
in), a warning from deep in a decision attributed to the user's own line, and ``labels=`` that are not token labels
refused (their elements would be counted as tokens, and the hold would read a loss that is not per token)."""

from __future__ import annotations

import warnings

import pytest
import torch

from cbs_tracker import BatchSizeController, CBSTracker
from cbs_tracker.policy.controller import NO_LOSS_UPDATES

STEPS = 80


def _loop(observe: bool, steps: int = STEPS):
    """A plain loop in tokens (sizes given) with the default controller and the run's length; returns the warnings,
    the controller and the step each warning came at."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctrl = BatchSizeController(total_tokens=steps * 2 * 16.0)
    tracker = CBSTracker(model, opt, accumulation_steps=2, controller=ctrl)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        at = []
        for step in range(1, steps + 1):
            for _ in range(tracker.accumulation_steps):
                with tracker.microbatch(size=16):
                    loss = model(torch.randn(16, 4)).pow(2).mean()
                    (loss / tracker.accumulation_steps).backward()
                if observe:
                    tracker.observe_loss(loss)
            tracker.step()  # the user's line a decision's warning names
            at += [step] * (len(caught) - len(at))
            opt.step()
            opt.zero_grad()
    return caught, ctrl, at


def test_a_run_that_gives_no_loss_is_told_in_its_first_updates_at_the_users_line():
    caught, ctrl, at = _loop(observe=False)
    early = [i for i, w in enumerate(caught) if f"in its first {NO_LOSS_UPDATES} updates" in str(w.message)]
    assert len(early) == 1, [str(w.message) for w in caught]
    assert "tracker.observe_loss(loss)" in str(caught[early[0]].message)
    assert caught[early[0]].filename == __file__  # not session.py or controller.py
    assert at[early[0]] <= NO_LOSS_UPDATES + 1 < 0.25 * STEPS  # long before the verdict, a quarter in
    assert ctrl.plateau.unread  # which then read nothing, as said
    given, ctrl, _ = _loop(observe=True)
    assert not [w for w in given if "no training loss" in str(w.message)]
    assert ctrl.plateau.slope.seen > 0


def test_the_verdict_that_read_nothing_is_not_warned_twice():
    total = 200 * 512.0
    ctrl = BatchSizeController(total_tokens=total)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 201):
            ctrl.update(step=step, tokens_seen=step * 512.0, global_batch=512.0, accumulation_steps=1,
                        noise_scale=4096.0, noise_scale_low=4096.0, noise_scale_high=4096.0, scheduled_lr=1e-3)
    said = [str(w.message) for w in caught if "no training loss" in str(w.message)]
    assert ctrl.plateau.unread and len(said) == 1 and f"first {NO_LOSS_UPDATES} updates" in said[0]
    assert caught[0].filename == __file__


def _labelled(labels, **controller):
    """Two steps of a plain loop counting tokens from ``labels=``; returns the warnings about the labels' kind."""
    model = torch.nn.Linear(4, 1)
    ctrl = BatchSizeController(total_tokens=1000.0, **controller)
    tracker = CBSTracker(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2, controller=ctrl)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            for _ in range(2):
                with tracker.microbatch(labels=labels):
                    model(torch.randn(4, 4)).sum().backward()
            tracker.step()
    return [w for w in caught if "not token ids" in str(w.message)]


def test_float_labels_under_the_default_hold_are_counted_and_said_once():
    """A per-position regression with padding (float targets, ``ignore_index`` where padded) counts its positions as
    tokens, as before; the default hold, whose threshold is a language model's loss per token, says so once, naming
    the way to say which; an explicit hold, or token ids, say nothing."""
    targets = torch.tensor([0.5, -100.0, 1.5, 2.5])
    said = _labelled(targets)
    assert len(said) == 1 and "hold_on_plateau=None" in str(said[0].message) and said[0].filename == __file__
    assert "torch.float32" in str(said[0].message)
    assert _labelled(targets, hold_on_plateau=None) == [] and _labelled(targets, hold_on_plateau=0.3) == []
    assert _labelled(torch.tensor([1, 2, -100, 3])) == []
    model = torch.nn.Linear(4, 1)
    tracker = CBSTracker(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    with pytest.raises(TypeError, match=r"microbatch\(labels=list\): expected a tensor of labels"):
        with tracker.microbatch(labels=[1, 2, 3]):
            pass
