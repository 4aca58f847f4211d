"""Would the noise scale of one group of parameters make ``kappa`` agree across models?

``B_simple = tr(Sigma) / |G|^2`` sums over every parameter. Both sums split over groups of parameters (token and
position embeddings, attention, MLP, LayerNorms), and each group has its own noise scale ``B_g = tr(Sigma_g) /
|G_g|^2``. If noise that moves the loss little (flat directions) sat in one group, that group would inflate
``B_simple`` on some models more than on others, and a group's noise scale would stand to ``B_simple`` in the ratio
of the largest ``kappa`` each model keeps the loss with (the frontier's: about 0.2 on the wide GPT, 0.3 on the
6-layer code GPT, 0.4 on the proof GPT, 0.5 on the 3-layer code GPT, 1 on prose and the synthetic language).

This trains a setting's run at the tracker's starting batch and microbatches with a constant batch (AdamW, the
LR schedule in tokens, the gradient clipped as the frontier's runs do), takes each step's per-microbatch
gradients group by group before clipping, estimates ``|G_g|^2`` and ``tr(Sigma_g)`` per step with the library's
:func:`~cbs_tracker.core.estimator.estimate_from_norms`, and sums them over ``--stretches`` equal stretches of the
first ``--until`` of the run (a ratio of sums: the tracker's own noise scale agrees with it on these runs).

    python -m benchmarks.proof.group_scale --setting wide --seeds 0,1 --out docs/group_scale.json   # 0.5-3 min a seed
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from . import gpt_proof as base
from . import gpt_proof_lr as proof_lr
from .step_ratio import save_run

GROUPS = ("embedding", "attention", "mlp", "layernorm")


def group_of(name: str) -> str:
    """The group of a parameter of ``cbs_tracker.demo.gpt``'s model, by its name."""
    if name.startswith(("wte.", "wpe.")):
        return "embedding"
    if ".ln_" in name or name.startswith("ln_f."):
        return "layernorm"
    if ".attn." in name:
        return "attention"
    if ".mlp." in name:
        return "mlp"
    raise ValueError(f"group_of: no group for parameter {name!r}")


def measure(setting: base.Setting, seed: int, until: float, stretches: int) -> dict[str, Any]:
    """Per stretch and group (and ``"all"``): the summed ``|G|^2`` and ``tr(Sigma)`` estimates and their ratio;
    ``steps``: each step's tokens at its end and its ``|G|^2`` and ``tr(Sigma)`` over all groups (not saved)."""
    import torch

    from cbs_tracker.core.estimator import estimate_from_norms
    from cbs_tracker.demo.corpus import SequenceStream

    torch.set_num_threads(1)
    start, micro = setting.tracker_start_tokens, setting.tracker_micro_sequences
    b = micro * setting.seq_len
    steps_per_window = start // b
    if steps_per_window < 2:
        raise ValueError(f"{setting.name}: the starting batch {start} holds one microbatch of {b} tokens")
    model, optimizer, scheduler = proof_lr.start_of_run(setting, seed, "cosine", start)
    stream = SequenceStream(base.load_setting_corpus(setting).train, seq_len=setting.seq_len, seed=seed)
    named = [(group_of(n), p) for n, p in model.named_parameters()]
    ends = [until * setting.budget_tokens * (k + 1) / stretches for k in range(stretches)]
    sums = [{g: [0.0, 0.0] for g in (*GROUPS, "all")} for _ in ends]
    tokens, steps = 0.0, []
    while tokens < ends[-1]:
        total = [torch.zeros_like(p) for _, p in named]
        small = dict.fromkeys(GROUPS, 0.0)
        for _ in range(steps_per_window):
            x, y = stream.next_batch(micro)
            optimizer.zero_grad(set_to_none=True)
            model(x, y)[1].backward()
            for (g, p), t in zip(named, total, strict=True):
                small[g] += float(p.grad.pow(2).sum()) / steps_per_window
                t.add_(p.grad, alpha=1 / steps_per_window)
        big = dict.fromkeys(GROUPS, 0.0)
        for (g, p), t in zip(named, total, strict=True):
            big[g] += float(t.pow(2).sum())
            p.grad = t
        row = sums[next(k for k, e in enumerate(ends) if tokens < e)]
        for g in (*GROUPS, "all"):
            s, q = (sum(small.values()), sum(big.values())) if g == "all" else (small[g], big[g])
            est = estimate_from_norms(s, q, b, start)
            row[g][0] += est.grad_sq_norm
            row[g][1] += est.trace_cov
        steps.append((tokens + start, est.grad_sq_norm, est.trace_cov))  # the last group is "all"
        torch.nn.utils.clip_grad_norm_(model.parameters(), setting.clip)
        optimizer.step()
        scheduler.step()
        tokens += start
    return {"seed": seed, "steps": steps, "start_tokens": start, "microbatch_tokens": b, "ends": ends,
            "grad_sq_norm": [{g: v[0] for g, v in row.items()} for row in sums],
            "trace_cov": [{g: v[1] for g, v in row.items()} for row in sums],
            "noise_scale": [{g: (v[1] / v[0] if v[0] > 0 else None) for g, v in row.items()} for row in sums]}


def ratios(runs: list[dict[str, Any]], budget: float, lo: float = 0.1, hi: float = 0.5) -> dict[str, float]:
    """Per group, the median over seeds and the stretches ending in ``(lo, hi]`` of the run of ``B_g / B_simple``."""
    out = {}
    for g in GROUPS:
        values = [row[g] / row["all"] for r in runs for row, end in zip(r["noise_scale"], r["ends"])
                  if lo * budget < end <= hi * budget and row[g] and row["all"]]
        out[g] = round(statistics.median(values), 3) if values else None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setting", choices=sorted(base.SETTINGS), default="wide")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--until", type=float, default=0.5, help="the share of the run measured (default 0.5)")
    p.add_argument("--stretches", type=int, default=10, help="equal stretches of it (default 10)")
    p.add_argument("--out", type=Path, required=True, help="a JSON file; runs of other settings in it are kept")
    args = p.parse_args(argv)
    if not 0 < args.until <= 1 or args.stretches < 1:
        p.error(f"--until must be in (0, 1] and --stretches >= 1, got {args.until} and {args.stretches}")
    setting = base.SETTINGS[args.setting]
    runs = [measure(setting, int(s), args.until, args.stretches) for s in args.seeds.split(",")]
    for r in runs:
        del r["steps"]
    result = {"setting": setting.name, "setting_key": setting.key(), "seed": args.seeds, "lr_schedule": "cosine",
              "library_commit": base._library_commit(),
              "runs": runs, "ratio_to_b_simple": ratios(runs, setting.budget_tokens)}
    print(setting.name, "B_group / B_simple over 10-50% of the run:", result["ratio_to_b_simple"])
    save_run(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
