"""Checkpoints saved by the code of 2026-12-05 (committed in tests/data/) load and resume exactly.

The files were written by ``python -m tests.legacy_checkpoints`` before the state schemas
(``core/session.py`` and ``core/estimator.py`` reading through ``policy/_state.py``'s
``StateReader``); a change to the state format must keep reading them.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests import legacy_checkpoints as legacy
from tests import plain_workers

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
    pytest.mark.filterwarnings("ignore:.*litlogger.*"),
    pytest.mark.filterwarnings("ignore:.*isinstance.*treespec.*"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


def test_a_plain_loop_checkpoint_of_2026_12_05_resumes_the_same_schedule_and_noise_scale():
    saved = torch.load(legacy.PLAIN_FILE, weights_only=False)
    assert saved["step"] == legacy.PLAIN_SAVE_AT
    assert saved["tracker"]["accumulation_steps"] > saved["tracker"]["starting_accumulation"]  # after growth
    expected = plain_workers.train(legacy.PLAIN_STEPS)[legacy.PLAIN_SAVE_AT:]
    resumed = plain_workers.train(legacy.PLAIN_STEPS, ckpt_in=str(legacy.PLAIN_FILE))
    assert [r["step"] for r in resumed] == [r["step"] for r in expected]
    # bitwise: the same weights, optimizer, data and tracker state give the same arithmetic
    assert resumed == expected


@pytest.mark.parametrize("resumed_with", ["its settings", "the hold, today's default"])
def test_a_lightning_checkpoint_of_2026_12_05_resumes_the_same_schedule_and_noise_scale(resumed_with):
    saved = torch.load(legacy.LIGHTNING_FILE, weights_only=False)
    state = saved["callbacks"]["CBSCallback"]
    assert state["accumulation_steps"] > state["starting_accumulation"]  # after growth

    full_cb, full_rec, module, ds = legacy.lightning_parts()
    legacy.lightning_trainer([full_cb, full_rec]).fit(module, legacy.lightning_loader(ds))
    # the run began without a hold on a loss plateau; resumed by a controller with today's default hold, it goes
    # on without it (a verdict read mid-run would hold growth the run had already taken), and says so
    hold = {} if resumed_with == "its settings" else {"hold_on_plateau": 0.15}
    cb, rec, module, ds = legacy.lightning_parts(**hold)
    trainer = legacy.lightning_trainer([cb, rec])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, legacy.lightning_loader(ds), ckpt_path=str(legacy.LIGHTNING_FILE))
    said = [str(w.message) for w in caught if "saved without the hold" in str(w.message)]
    assert len(said) == (1 if hold else 0), said

    after = [r for r in full_rec.rows if r["epoch"] >= 1]
    assert len(rec.rows) == len(after) > 0
    assert rec.rows[0]["lightning_accumulation"] == state["accumulation_steps"]
    for a, b in zip(after, rec.rows):
        assert (b["microbatches"], b["lightning_accumulation"]) == (a["microbatches"], a["lightning_accumulation"])
        assert b["record"] == a["record"]
    assert cb.applied_changes == [c for c in full_cb.applied_changes if c[0] > state["step"]]
    mine, theirs = cb.state_dict(), full_cb.state_dict()
    hold_keys = {k for k in mine["controller"] if k.startswith(("plateau_", "loss_", "losses_"))}
    assert bool(hold_keys) == bool(hold) and (not hold or mine["controller"]["plateau_held"] is False)
    mine["controller"] = {k: v for k, v in mine["controller"].items() if k not in hold_keys}
    assert mine == theirs
