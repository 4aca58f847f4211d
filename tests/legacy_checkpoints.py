"""The runs behind the committed checkpoints in ``tests/data/`` (written by the code of 2026-12-05, ``f4661fb``).

``python -m tests.legacy_checkpoints`` writes them again; the committed files stay as they are
so that a later change to the state format is tested against a state saved before it
(tests/test_legacy_checkpoints.py).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
PLAIN_FILE = DATA / "plain_loop_2026-12-05.pt"
LIGHTNING_FILE = DATA / "lightning_2026-12-05.ckpt"
PLAIN_STEPS, PLAIN_SAVE_AT = 300, 221  # saved after the first doubling (step 194), before the second (248)
LIGHTNING_EPOCHS = 3


def lightning_parts(**controller_settings):
    """A fresh callback, recorder, module and dataset (the configuration of the committed run: its controller had
    no hold on a loss plateau, ``hold_on_plateau=None``, the default then; ``controller_settings`` override)."""
    controller_settings = {"hold_on_plateau": None, **controller_settings}
    from cbs_tracker import BatchSizeController, CBSCallback
    from tests.estimators import NoIntervalEstimator
    from tests.lightning_workers import Recorder, Regression, regression_data

    cb = CBSCallback(
        controller=BatchSizeController(kappa=2.0, warmup_steps=5, warmup_tokens=0, patience=3, window=4,
                                       cooldown_tokens=0, **controller_settings),
        estimator=NoIntervalEstimator(horizon_steps=5, min_steps=3),
    )
    return cb, Recorder(cb), Regression(lr=0.05), regression_data(512)


def lightning_trainer(callbacks, **kw):
    import lightning.pytorch as pl

    kw = {"enable_checkpointing": False, **kw}
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, max_epochs=LIGHTNING_EPOCHS, accumulate_grad_batches=2,
                      callbacks=callbacks, **kw)


def lightning_loader(ds):
    import torch

    return torch.utils.data.DataLoader(ds, batch_size=4, shuffle=False)


def write_plain(path: Path) -> None:
    from tests import plain_workers

    plain_workers.train(PLAIN_SAVE_AT, ckpt_out=str(path), save_at=PLAIN_SAVE_AT)


def write_lightning(path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    cb, rec, module, ds = lightning_parts()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = ModelCheckpoint(dirpath=tmp, filename="{epoch}", every_n_epochs=1, save_top_k=-1,
                               save_on_train_epoch_end=True)
        trainer = lightning_trainer([cb, rec, ckpt], enable_checkpointing=True)
        trainer.fit(module, lightning_loader(ds))
        shutil.copy(Path(tmp) / "epoch=0.ckpt", path)


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    DATA.mkdir(exist_ok=True)
    which = sys.argv[1:] or ["plain", "lightning"]
    if "plain" in which:
        write_plain(PLAIN_FILE)
    if "lightning" in which:
        write_lightning(LIGHTNING_FILE)
