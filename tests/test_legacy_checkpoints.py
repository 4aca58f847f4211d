"""Checkpoints saved by the code of 2026-12-05 (committed in tests/data/) load and resume exactly.

The files were written by ``python -m tests.legacy_checkpoints`` before the state schemas
(``core/session.py`` and ``core/estimator.py`` reading through ``policy/_state.py``'s
``StateReader``); a change to the state format must keep reading them.
"""

from __future__ import annotations

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


def test_a_lightning_checkpoint_of_2026_12_05_resumes_the_same_schedule_and_noise_scale():
    saved = torch.load(legacy.LIGHTNING_FILE, weights_only=False)
    state = saved["callbacks"]["CBSCallback"]
    assert state["accumulation_steps"] > state["starting_accumulation"]  # after growth

    full_cb, full_rec, module, ds = legacy.lightning_parts()
    legacy.lightning_trainer([full_cb, full_rec]).fit(module, legacy.lightning_loader(ds))
    cb, rec, module, ds = legacy.lightning_parts()
    trainer = legacy.lightning_trainer([cb, rec])
    trainer.fit(module, legacy.lightning_loader(ds), ckpt_path=str(legacy.LIGHTNING_FILE))

    after = [r for r in full_rec.rows if r["epoch"] >= 1]
    assert len(rec.rows) == len(after) > 0
    assert rec.rows[0]["lightning_accumulation"] == state["accumulation_steps"]
    for a, b in zip(after, rec.rows):
        assert (b["microbatches"], b["lightning_accumulation"]) == (a["microbatches"], a["lightning_accumulation"])
        assert b["record"] == a["record"]
    assert cb.applied_changes == [c for c in full_cb.applied_changes if c[0] > state["step"]]
    assert cb.state_dict() == full_cb.state_dict()
