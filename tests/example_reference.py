"""Slow single-process references for the example scripts: same data, same weights, per-microbatch gradients.

Each reference materialises every microbatch gradient ``g_k`` of a window in
float64 and feeds the estimator the README's definitions directly:
``|G_small|^2 = mean_k |g_k|^2``, ``|G_big|^2 = |mean_k g_k|^2``,
``B_small`` = harmonic mean of the label-token counts, ``B_big = K B_small``.
The optimizer then takes the step on ``mean_k g_k``, which is what DDP or FSDP2
averaging ``sum_k g_k / A`` over ``D`` ranks gives. Nothing of the tracker's
hooks, reductions or scale bookkeeping is used, so a run of an example that
agrees with its reference measured what these formulas say.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from cbs_tracker import NoiseScaleEstimator
from cbs_tracker.demo.corpus import SequenceStream, evaluate, load_corpus
from cbs_tracker.demo.gpt import GPT, GPTConfig, make_adamw


def microbatch_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``g_k``: gradient of the microbatch's mean token loss, flattened, float64 (tied weights once)."""
    model.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    return torch.cat([p.grad.detach().double().reshape(-1) for p in model.parameters()])


def window_statistics(grads: list[torch.Tensor], sizes: list[float]) -> dict[str, Any]:
    """The two norms and batch sizes of one window, from its microbatch gradients."""
    g = torch.stack(grads)
    k = len(sizes)
    small_batch = k / sum(1.0 / s for s in sizes)
    mean = g.mean(0)
    return {
        "small": float(g.pow(2).sum(1).mean()), "big": float(mean.pow(2).sum()),
        "small_batch": small_batch, "big_batch": k * small_batch, "units": float(sum(sizes)), "mean": mean,
    }


def set_flat_grad(model: nn.Module, flat: torch.Tensor) -> None:
    """Write a flat float64 gradient into ``.grad`` in the parameters' own dtype."""
    i = 0
    for p in model.parameters():
        n = p.numel()
        p.grad = flat[i : i + n].reshape(p.shape).to(p.dtype).clone()
        i += n


def torchrun_reference(
    *, steps: int, micro_sequences: int, seq_len: int, accumulation: int, world: int, max_bytes: int,
    lr: float = 2e-3, seed: int = 0, bf16: bool = False,
) -> dict[str, float]:
    """What ``examples/torchrun_{ddp,fsdp}.py`` must measure, in one process.

    ``bf16=True`` mirrors ``MixedPrecisionPolicy(param_dtype=bfloat16,
    reduce_dtype=float32)``: each window's gradients come from a bf16 copy of the
    float32 weights (what FSDP2 all-gathers), are averaged in float32 precision,
    and the float32 weights take the step; validation runs the bf16 copy too.
    The accumulation stays fixed (the caller keeps the controller in warm-up).
    """
    torch.manual_seed(seed)
    corpus = load_corpus(max_bytes)
    model = GPT(GPTConfig(context_length=seq_len))
    optimizer = make_adamw(model, lr=lr, weight_decay=0.1)
    estimator = NoiseScaleEstimator()
    stream = SequenceStream(corpus.train, seq_len=seq_len, seed=seed)
    for _ in range(steps):
        compute = copy.deepcopy(model).to(torch.bfloat16) if bf16 else model
        grads, sizes = [], []
        for _ in range(accumulation):
            x, y = stream.next_batch(micro_sequences * world)  # every rank's slice of this microbatch
            for r in range(world):
                rows = slice(r * micro_sequences, (r + 1) * micro_sequences)
                grads.append(microbatch_gradient(compute, x[rows], y[rows]))
                sizes.append(float(y[rows].numel()))  # every label is a real byte
        stats = window_statistics(grads, sizes)
        estimator.update(stats["small"], stats["big"], stats["small_batch"], stats["big_batch"], stats["units"])
        set_flat_grad(model, stats["mean"])
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    scored = copy.deepcopy(model).to(torch.bfloat16) if bf16 else model
    val = evaluate(scored, corpus.val, seq_len=seq_len, num_sequences=64)
    return {
        "noise_scale": estimator.noise_scale, "grad_sq_norm": estimator.grad_sq_norm,
        "trace_cov": estimator.trace_cov, "val": val,
    }
