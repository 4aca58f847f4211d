"""Run a training script unchanged and record, at every optimizer step, the data it held and the LR it used.

    python benchmarks/clients/trace.py [--seedable-sampler] TRACE.json -- SCRIPT.py [ARGS ...]

Nothing in the script changes: global hooks watch it. A forward of a Hugging Face causal LM in
training mode (``*ForCausalLM`` / ``*LMHeadModel``, called with ``labels=``) is one microbatch: its
label tokens (``labels[..., 1:] != -100``, what the shifted loss counts) and a hash of its
``input_ids``. Torch's global optimizer pre-step hook records each step: the tokens trained before
it, its microbatches and tokens, the LR of the first parameter group. At exit the trace is written
as JSON: ``steps``, ``micro`` (one hash per microbatch, in order), ``tokens`` (all microbatches),
``unstepped`` (microbatches after the last optimizer step). ``compare.py`` reads two traces.

``--seedable-sampler`` builds every ``accelerate.Accelerator`` with
``DataLoaderConfiguration(use_seedable_sampler=True)`` (Accelerate's own option) where the script
gives none: with Accelerate's default sampler a resumed ``run_clm_no_trainer.py`` draws a new order
for the epoch it resumes in (its constant-batch run too), so which batches ran twice or never could
not be told from the data.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import runpy
import sys
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook


def main() -> None:
    argv = sys.argv[1:]
    seedable = bool(argv) and argv[0] == "--seedable-sampler"
    if seedable:
        argv = argv[1:]
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit(__doc__)
    out, script, args = Path(argv[0]), argv[2], argv[3:]
    state = {"steps": [], "micro": [], "tokens": 0, "window": [], "window_tokens": 0}

    def on_forward(model, kwargs) -> None:
        labels = kwargs.get("labels")
        if not model.training or labels is None or not torch.is_grad_enabled():
            return
        n = int((labels[..., 1:] != -100).sum())
        digest = hashlib.sha1(kwargs["input_ids"].detach().cpu().numpy().tobytes()).hexdigest()[:12]
        state["micro"].append(digest)
        state["window"].append(digest)
        state["window_tokens"] += n
        state["tokens"] += n

    def patch(cls) -> None:
        forward = cls.forward

        def traced(self, *a, **kw):
            on_forward(self, kw)
            return forward(self, *a, **kw)

        cls.forward = traced

    import transformers

    for name in dir(transformers):
        if name.endswith(("ForCausalLM", "LMHeadModel")):
            try:
                cls = getattr(transformers, name)
            except Exception:  # optional backends that are not installed
                continue
            if isinstance(cls, type) and "forward" in cls.__dict__:
                patch(cls)

    if seedable:
        import accelerate
        from accelerate.utils import DataLoaderConfiguration

        init = accelerate.Accelerator.__init__

        def seeded_init(self, *a, **kw):
            kw.setdefault("dataloader_config", DataLoaderConfiguration(use_seedable_sampler=True))
            init(self, *a, **kw)

        accelerate.Accelerator.__init__ = seeded_init

    def on_step(optimizer, _args, _kwargs) -> None:
        state["steps"].append({
            "before": state["tokens"] - state["window_tokens"],
            "micro": len(state["window"]),
            "tokens": state["window_tokens"],
            "lr": optimizer.param_groups[0]["lr"],
        })
        state["window"], state["window_tokens"] = [], 0

    register_optimizer_step_pre_hook(on_step)

    def write() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "script": Path(script).name, "args": args, "steps": state["steps"], "micro": state["micro"],
            "tokens": state["tokens"], "unstepped": len(state["window"]),
        }))

    atexit.register(write)
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
