"""How long the constant run's steps are against the loss-optimal step along their own direction.

On the frontier's settings the constant batch trains as in ``gpt_proof_lr.py`` (AdamW, the setting's LR
schedule, its starting batch); at ``--marks`` evenly spaced points it measures, over ``--steps``
consecutive optimizer steps, the update ``d = w_next - w`` against the gradient of one fixed probe batch
(``--probe`` sequences of the training split, drawn with a seed no training stream uses) before and after the update:

    a0 = -g(w) . d        (the descent the step was aimed at)
    a1 = -g(w + d) . d    (what is left of it after the step)
    step / best step = 1 - sum(a1) / sum(a0)

On a quadratic along ``d`` the ratio is the step over the step that minimises the loss along ``d``:
0 for a step far too short, 1 for the best, 2 where the step overshoots to the same loss. A run whose
ratio stays near 0 is limited by its LR, not by its gradient noise: growing its batch at the LR coupling
Adam gets (LR x sqrt(2) per doubling) takes away descent the noise scale cannot see. The probe's
gradients are taken with ``torch.autograd.grad`` and never touch the training gradients; the training
run itself is the constant run of the frontier, step for step.

    python -m benchmarks.proof.step_ratio --setting wide --seed 0 --out docs/step_ratio.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from . import gpt_proof as base
from . import gpt_proof_lr as proof_lr


def _directional(model: Any, params: list[Any], probe: tuple[Any, Any], d: list[Any]) -> tuple[float, float]:
    """The probe batch's loss and ``-grad . d`` at the model's current weights."""
    import torch

    _, loss = model(*probe)
    grads = torch.autograd.grad(loss, params)
    return float(loss.detach()), -sum(float((g * x).sum()) for g, x in zip(grads, d))


def descent_before_and_after(model: Any, params: list[Any], probe: tuple[Any, Any],
                             before: list[Any]) -> tuple[float, float, float]:
    """``a0 = -g(before) . d`` and ``a1 = -g(after) . d`` of the probe batch for the update ``d = after - before``
    (``after``: the parameters as they are now, left so), and the probe loss after it."""
    import torch

    d = [p.detach() - b for p, b in zip(params, before)]
    with torch.no_grad():
        after = [p.detach().clone() for p in params]
        for p, b in zip(params, before):
            p.copy_(b)
    _, a0 = _directional(model, params, probe, d)
    with torch.no_grad():
        for p, a in zip(params, after):
            p.copy_(a)
    loss1, a1 = _directional(model, params, probe, d)
    return a0, a1, loss1


def measure(setting: base.Setting, seed: int, lr_schedule: str, marks: int, steps: int,
            probe_sequences: int, until: float, log: Any = print) -> dict[str, Any]:
    import torch

    from cbs_tracker.demo.corpus import SequenceStream

    torch.set_num_threads(1)
    corpus = base.load_setting_corpus(setting)
    start = setting.constant_tokens or proof_lr.BASELINE_TOKENS
    micro_seqs = setting.tracker_micro_sequences
    micro_tokens = micro_seqs * setting.seq_len
    accumulation = start // micro_tokens
    model, optimizer, scheduler = proof_lr.start_of_run(setting, seed, lr_schedule, start)
    stream = SequenceStream(corpus.train, seq_len=setting.seq_len, seed=seed)
    probe = SequenceStream(corpus.train, seq_len=setting.seq_len, seed=1_000_003 + seed).next_batch(probe_sequences)
    params = [p for p in model.parameters() if p.requires_grad]
    total_steps = setting.budget_tokens // start
    spacing = int(total_steps * until) // marks
    if not 1 <= steps <= spacing:
        raise ValueError(f"steps={steps}: must be in [1, {spacing}] (the steps between two of the {marks} marks)")
    at = {round(total_steps * until * (i + 1) / marks) - steps for i in range(marks)}
    points: list[dict[str, Any]] = []
    a0s: list[float] = []
    a1s: list[float] = []
    for step in range(int(total_steps * until)):
        for _ in range(accumulation):
            x, y = stream.next_batch(micro_seqs)
            _, loss = model(x, y)
            (loss / accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), setting.clip)
        measuring = any(m <= step < m + steps for m in at)
        before = [p.detach().clone() for p in params] if measuring else None
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if before is None:
            continue
        a0, a1, loss1 = descent_before_and_after(model, params, probe, before)
        a0s.append(a0)
        a1s.append(a1)
        if len(a0s) == steps:
            ratio = 1 - sum(a1s) / sum(a0s) if sum(a0s) > 0 else math.nan
            points.append({"step": step + 1, "tokens": (step + 1) * start, "lr": lr, "ratio": ratio,
                           "a0": a0s[:], "a1": a1s[:], "probe_loss": loss1})
            log(f"{setting.name} seed {seed}: step {step + 1} ({(step + 1) * start:,} tokens), lr {lr:.2e}, probe loss "
                f"{loss1:.4f}, step / best step {ratio:.3f}")
            a0s.clear()
            a1s.clear()
    return {"setting": setting.name, "setting_key": setting.key(), "seed": seed, "lr_schedule": lr_schedule,
            "start_batch": start, "marks": marks, "steps_per_mark": steps, "probe_sequences": probe_sequences,
            "library_commit": base._library_commit(), "points": points}


def save_run(path: Path, result: dict[str, Any]) -> None:
    """Add ``result`` to the JSON file at ``path`` (``{"runs": [...]}``), replacing a run of the same setting, seed
    and LR schedule."""
    saved = json.loads(path.read_text()) if path.exists() else {"runs": []}
    key = (result["setting_key"], result["seed"], result["lr_schedule"])
    saved["runs"] = [r for r in saved["runs"] if (r["setting_key"], r["seed"], r["lr_schedule"]) != key] + [result]
    path.write_text(json.dumps(saved, indent=1))


def run_arguments(doc: str | None, marks_help: str) -> argparse.ArgumentParser:
    """The arguments both diagnostics take: which constant run, how many points over how much of it, the file."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setting", choices=sorted(base.SETTINGS), default="wide")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schedule", choices=("cosine", "wsd"), default="cosine")
    p.add_argument("--marks", type=int, default=10, help=f"{marks_help} (default 10)")
    p.add_argument("--until", type=float, default=0.5, help="the share of the run trained (default 0.5)")
    p.add_argument("--out", type=Path, required=True, help="a JSON file; runs of other settings in it are kept")
    return p


def main(argv: list[str] | None = None) -> int:
    p = run_arguments(__doc__, "measuring points, evenly spaced")
    p.add_argument("--steps", type=int, default=8, help="consecutive steps summed at each point (default 8)")
    p.add_argument("--probe", type=int, default=64, help="probe batch, in sequences (default 64)")
    args = p.parse_args(argv)
    if args.marks < 1 or args.steps < 1 or args.probe < 1 or not 0 < args.until <= 1:
        p.error("--marks, --steps and --probe must be >= 1 and --until in (0, 1]")
    result = measure(base.SETTINGS[args.setting], args.seed, args.schedule, args.marks, args.steps, args.probe,
                     args.until)
    save_run(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
