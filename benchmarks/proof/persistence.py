"""Does the gradient the noise scale calls signal persist from one step to the next?

The tracker's ``|G|^2`` comes from the microbatches of one step: with two of them, ``g1 . g2`` is an unbiased
estimate of ``|G(w_t)|^2``. A gradient that flips from step to step (the weights bouncing across a sharp
valley) counts there as signal although it moves the run nowhere. Across steps, ``g_t . g_{t+1}`` (independent
data) estimates ``G(w_t) . G(w_{t+1})``. Their ratio over a stretch of steps,

    persistence = mean(g_t . g_{t+1}) / mean(g1_t . g2_t),

is near 1 where the gradient moves slowly and near 0 (or below) where it oscillates. This trains the frontier's
constant run (as ``gpt_proof_lr.py``: AdamW, the setting's LR schedule and starting batch, the gradients taken
before clipping) and prints the ratio over each of ``--marks`` stretches of the first ``--until`` of the run.

    python -m benchmarks.proof.persistence --setting wide --seed 0 --out docs/persistence.json
"""

from __future__ import annotations

from typing import Any

from . import gpt_proof as base
from . import gpt_proof_lr as proof_lr
from .step_ratio import run_arguments, save_run


def persistence(within: list[float], across: list[float]) -> float:
    """``mean(across) / mean(within)``: the step-to-step product over the same-step product of two microbatches."""
    return (sum(across) / len(across)) / (sum(within) / len(within))


def measure(setting: base.Setting, seed: int, lr_schedule: str, marks: int, until: float,
            log: Any = print) -> dict[str, Any]:
    import torch

    from cbs_tracker.demo.corpus import SequenceStream

    torch.set_num_threads(1)
    corpus = base.load_setting_corpus(setting)
    start = setting.constant_tokens or proof_lr.BASELINE_TOKENS
    micro_seqs = setting.tracker_micro_sequences
    accumulation = start // (micro_seqs * setting.seq_len)
    if accumulation != 2:
        raise ValueError(f"--setting {setting.name}: {accumulation} microbatches a step; this measures two")
    model, optimizer, scheduler = proof_lr.start_of_run(setting, seed, lr_schedule, start)
    stream = SequenceStream(corpus.train, seq_len=setting.seq_len, seed=seed)
    params = [p for p in model.parameters() if p.requires_grad]
    steps = int(setting.budget_tokens // start * until)
    per_mark = steps // marks  # the steps after the last full stretch are trained but not reported
    if per_mark < 2:
        raise ValueError(f"marks={marks}: {steps} steps leave fewer than two a stretch")
    previous = None
    within: list[float] = []
    across: list[float] = []
    points: list[dict[str, Any]] = []
    for step in range(steps):
        halves = []
        for _ in range(accumulation):
            x, y = stream.next_batch(micro_seqs)
            _, loss = model(x, y)
            loss.backward()  # summed: each half is its microbatch's own gradient
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            halves.append(flat - sum(halves) if halves else flat.clone())
        with torch.no_grad():
            for p in params:
                p.grad /= accumulation  # the window's mean, as the frontier trains
        mean = (halves[0] + halves[1]) / 2
        within.append(float(halves[0] @ halves[1]))
        if previous is not None:
            across.append(float(previous @ mean))
        previous = mean
        torch.nn.utils.clip_grad_norm_(model.parameters(), setting.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % per_mark == 0:
            ratio = persistence(within, across)
            points.append({"step": step + 1, "tokens": (step + 1) * start, "persistence": ratio,
                           "within": sum(within) / len(within), "across": sum(across) / len(across)})
            log(f"{setting.name} seed {seed}: to step {step + 1} ({(step + 1) * start:,} tokens), "
                f"persistence {ratio:.3f}")
            within, across = [], []
    return {"setting": setting.name, "setting_key": setting.key(), "seed": seed, "lr_schedule": lr_schedule,
            "start_batch": start, "library_commit": base._library_commit(), "points": points}


def main(argv: list[str] | None = None) -> int:
    p = run_arguments(__doc__, "stretches the ratio is taken over")
    args = p.parse_args(argv)
    if args.marks < 1 or not 0 < args.until <= 1:
        p.error("--marks must be >= 1 and --until in (0, 1]")
    result = measure(base.SETTINGS[args.setting], args.seed, args.schedule, args.marks, args.until)
    save_run(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
