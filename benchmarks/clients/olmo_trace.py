"""Run ``examples/olmo_core_gpt.py`` unchanged; on rank 0 record every optimizer step's LR, global batch and tokens.

    python -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/clients/olmo_trace.py OUT.json -- [ARGS]

A global optimizer pre-step hook reads the trainer's ``global_step``, ``global_train_tokens_seen``
(the step's batch included, the clock OLMo-core's token scheduler reads), the loader's
``global_batch_size`` and the first param group's ``lr``; rank 0 writes them as a JSON list.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

import olmo_core.train.trainer as olmo_trainer
from torch.optim.optimizer import register_optimizer_step_pre_hook


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        raise SystemExit(__doc__)
    out, args = sys.argv[1], sys.argv[3:]
    rows: list[dict] = []
    box: dict = {}
    fit = olmo_trainer.Trainer.fit

    def fit_(self, *a, **k):
        box["trainer"] = self
        return fit(self, *a, **k)

    def hook(opt, a, k) -> None:
        t = box.get("trainer")
        if t is None:
            return
        g = opt.param_groups[0]
        rows.append({"step": int(t.global_step), "tokens_seen": int(t.global_train_tokens_seen),
                     "global_batch": int(t.data_loader.global_batch_size), "max_tokens": t.max_tokens,
                     "lr": float(g["lr"]), "initial_lr": float(g.get("initial_lr") or 0)})

    olmo_trainer.Trainer.fit = fit_
    register_optimizer_step_pre_hook(hook)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = os.path.join(root, "examples", "olmo_core_gpt.py")  # run as a user runs it, as __main__
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        if int(os.environ.get("RANK", 0)) == 0:
            with open(out, "w") as f:
                json.dump(rows, f)


if __name__ == "__main__":
    main()
