"""The plateau option's size gate on a toy long for its model, where the growth it frees costs the loss.

A bigram language model (an embedding of 8 and a linear head over 32 tokens, 544 parameters) on a Markov chain of
its own seed (transitions drawn from a Dirichlet(0.3)), in 64-token sequences, four a microbatch, two microbatches a
step, AdamW at 1e-2 under cosine over 1,500 steps of the starting batch (768k tokens, 1,412 per parameter), the
plain loop of the README with ``tracker.observe_loss``. Three controllers, paired by seed on the same tokens:
``BatchSizeController(hold_on_plateau=0.15, plateau_tokens_per_parameter=None)`` (the hold without its size gate),
``BatchSizeController()`` (the default: the hold with its gate; the verdict comes 353 tokens per parameter in) and
``BatchSizeController(hold_on_plateau=None)`` (the ``kappa`` rule alone, the earlier default). Prints, per seed,
each one's held-out loss (fresh chains of the seed's language) and optimizer steps, then the gated and the ``kappa``
runs' differences from the ungated one: mean, standard error and the 90% t-interval's upper end. ``--constant``: in place of the rules, constant batches of 2, 4 and 8
times the starting one on the same tokens (the LR x sqrt of the factor, as the tracker couples it), each one's loss
against the starting batch's, and the starting batch's median noise scale over the last three quarters of its run:
what the model affords against what ``B_simple`` says.

    python benchmarks/gate_toy.py                     # six seeds, about a minute
    python benchmarks/gate_toy.py --lr-coupling keep  # the LR left as scheduled when the batch grows
    python benchmarks/gate_toy.py --constant          # the batch the toy affords, against its noise scale
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
import torch.nn.functional as F
from torch import nn

from cbs_tracker import BatchSizeController, CBSTracker

V, D, T, MICRO = 32, 8, 64, 4  # vocabulary, width, context, sequences per microbatch
RULES = {
    "ungated": {"hold_on_plateau": 0.15, "plateau_tokens_per_parameter": None},
    "gated": {},  # the default: hold_on_plateau=0.15 with plateau_tokens_per_parameter=20
    "kappa": {"hold_on_plateau": None},
}
#: the controllers a run can have: the rules, and one that only measures (the constant batches)
CONTROLLERS = {**RULES, "observed": {"observe_only": True, "hold_on_plateau": None}}
#: the t quantile of a one-sided 95% (a two-sided 90% interval's upper end) by degrees of freedom
T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895}


class Bigram(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.emb(x)).reshape(-1, V), y.reshape(-1))


def language(seed: int) -> torch.Tensor:
    """The seed's transition matrix (drawn first, so every rule of a seed trains on the same language)."""
    torch.manual_seed(seed)
    return torch.distributions.Dirichlet(torch.full((V,), 0.3)).sample((V,))


def chains(trans: torch.Tensor, n: int, length: int, gen: torch.Generator | None = None) -> torch.Tensor:
    out = torch.empty(n, length + 1, dtype=torch.long)
    out[:, 0] = torch.randint(V, (n,), generator=gen)
    for t in range(length):
        out[:, t + 1] = torch.multinomial(trans[out[:, t]], 1, generator=gen).squeeze(1)
    return out


def train(seed: int, rule: str, steps: int, lr_coupling: str = "auto", factor: int = 1,
          noise: list[float] | None = None) -> tuple[float, int, BatchSizeController]:
    """One run (``rule`` one of :data:`CONTROLLERS`): its held-out loss, its optimizer steps and its controller.
    ``factor``: a batch of that many starting batches from the first step, on the same tokens (``steps / factor``
    steps, the LR x sqrt(factor)); ``noise`` collects the measured noise scale after each step."""
    trans = language(seed)
    seqs = chains(trans, 1024, 1024).unfold(1, T + 1, T).reshape(-1, T + 1)
    model = Bigram()
    steps //= factor
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2 * math.sqrt(factor))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    controller = BatchSizeController(**CONTROLLERS[rule])
    tracker = CBSTracker(model, optimizer, accumulation_steps=2 * factor, controller=controller,
                         lr_scheduler=scheduler, lr_coupling=lr_coupling)
    order = torch.Generator().manual_seed(seed + 1)
    batches = (seqs[i] for _ in iter(int, 1) for i in torch.randperm(len(seqs), generator=order).split(MICRO)
               if len(i) == MICRO)
    taken = 0
    while not tracker.done(steps):
        for _ in range(tracker.accumulation_steps):
            s = next(batches)
            x, y = s[:, :-1], s[:, 1:]
            with tracker.microbatch(labels=y):
                loss = model(x, y)
                (loss / tracker.accumulation_steps).backward()
            tracker.observe_loss(loss)
        tracker.step()
        tracker.clip_grad_norm_(1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        taken += 1
        if noise is not None and tracker.noise_scale is not None:
            noise.append(tracker.noise_scale)
    held = chains(trans, 256, 1024, torch.Generator().manual_seed(99))
    with torch.no_grad():
        return float(model(held[:, :-1], held[:, 1:])), taken, controller


def paired(deltas: list[float]) -> tuple[float, float, float]:
    """Mean, standard error and the 90% t-interval's upper end of paired differences."""
    mean = statistics.fmean(deltas)
    se = statistics.stdev(deltas) / math.sqrt(len(deltas)) if len(deltas) > 1 else math.nan
    return mean, se, mean + T95.get(len(deltas) - 1, 1.645) * se


def constant_ladder(seeds: list[int], steps: int, factors: tuple[int, ...] = (2, 4, 8)) -> None:
    """Per seed, the starting batch's loss and median noise scale, and each larger constant batch's loss against it."""
    print("| seed | starting batch (512 tokens): held-out loss | its median noise scale (tokens) | "
          + " | ".join(f"{f} x: loss against it" for f in factors) + " |")
    print("|---|---|---|" + "---|" * len(factors))
    deltas: dict[int, list[float]] = {f: [] for f in factors}
    for seed in seeds:
        noise: list[float] = []
        base = train(seed, "observed", steps, noise=noise)[0]
        for f in factors:
            deltas[f].append(train(seed, "observed", steps, factor=f)[0] - base)
        cells = " | ".join(f"{deltas[f][-1]:+.4f}" for f in factors)
        print(f"| {seed} | {base:.4f} | {statistics.median(noise[len(noise) // 4:]):.0f} | {cells} |")
    for f in factors:
        mean, se, upper = paired(deltas[f])
        print(f"{f} x the starting batch: {mean:+.4f} nats (standard error {se:.4f}, 90% upper end {upper:+.4f})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2,3,4,5")
    p.add_argument("--steps", type=int, default=1500, help="steps of the starting batch (default 1500)")
    p.add_argument("--lr-coupling", default="auto", choices=("auto", "keep", "sqrt", "linear"),
                   help="the tracker's LR coupling (default auto: x sqrt(B/B0) for AdamW)")
    p.add_argument("--constant", action="store_true", help="constant batches of 2-8 starting batches instead")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.constant:
        constant_ladder(seeds, args.steps)
        return 0
    rows = {rule: [train(seed, rule, args.steps, args.lr_coupling) for seed in seeds] for rule in RULES}
    print("| seed | " + " | ".join(f"{r}: held-out loss, steps" for r in RULES) + " | gated: tokens per parameter "
          "at the verdict |")
    print("|---|" + "---|" * (len(RULES) + 1))
    for k, seed in enumerate(seeds):
        gated = rows["gated"][k][2].plateau.gated
        print(f"| {seed} | " + " | ".join(f"{rows[r][k][0]:.4f}, {rows[r][k][1]}" for r in RULES)
              + f" | {'not gated' if gated is None else f'{gated:.0f}'} |")
    for rule in ("gated", "kappa"):
        mean, se, upper = paired([a[0] - b[0] for a, b in zip(rows[rule], rows["ungated"])])
        print(f"{rule} - ungated: {mean:+.4f} nats (standard error {se:.4f}, 90% upper end {upper:+.4f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
