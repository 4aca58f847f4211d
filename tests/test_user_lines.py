"""What a user's loop is told, and where: a missing training loss said in the run's first updates (not a quarter
in), a warning from deep in a decision attributed to the user's own line, and ``labels=`` that are not token labels
refused (their elements would be counted as tokens, and the hold would read a loss that is not per token)."""

from __future__ import annotations

import warnings

import pytest
import torch

from cbs_tracker import BatchSizeController, CBSTracker
from cbs_tracker.core.units import label_tokens
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


@pytest.mark.filterwarnings("ignore:.*single microbatch")
@pytest.mark.parametrize("labels", [torch.randn(4), torch.randn(4, dtype=torch.float64), [1, 2, 3]])
def test_labels_that_are_not_integer_tokens_are_refused(labels):
    model = torch.nn.Linear(4, 1)
    tracker = CBSTracker(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=1)
    with pytest.raises(TypeError, match=r"microbatch\(labels=<a .*>\): expected a tensor of integer token labels"):
        with tracker.microbatch(labels=labels):
            pass
    with tracker.microbatch(labels=torch.tensor([1, 2, -100, 3])):  # token labels still count
        model(torch.randn(4, 4)).sum().backward()
    tracker.step()
    count = label_tokens()
    assert int(count((None, torch.tensor([[1, -100], [2, 3]])))) == 3
    if isinstance(labels, torch.Tensor):
        with pytest.raises(TypeError, match=r"label_tokens\(key=-1\): batch\[-1\] is a tensor of torch.float"):
            count((None, labels))
