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
import math
from typing import Any

import torch
from torch import nn
from torch.utils.data import DistributedSampler

from cbs_tracker import NoiseScaleEstimator
from cbs_tracker.demo.corpus import SequenceStream, evaluate, load_corpus, windows
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


def float32_sq_norm(model: nn.Module, flat: torch.Tensor) -> float:
    """``|flat|^2`` as float32 arithmetic gives it: per-parameter float32 norms (torch's
    ``linalg.vector_norm``), squared and summed in float32. Used only to size tolerances."""
    parts, i = [], 0
    for p in model.parameters():
        n = p.numel()
        parts.append(torch.linalg.vector_norm(flat[i : i + n], dtype=torch.float32))
        i += n
    v = torch.stack(parts)
    return float(torch.dot(v, v))


def lightning_reference(
    *, sequences_per_epoch: int, epochs: int, world: int, changes: dict[tuple[int, int], int],
    max_bytes: int = 2_000_000, seq_len: int = 128, micro_sequences: int = 2, accumulation: int = 2,
    lr: float = 2e-3, seed: int = 0,
) -> dict[str, Any]:
    """What ``examples/lightning_gpt.py`` must measure, in one process, without Lightning.

    Data. The example's dataset is the first ``sequences_per_epoch`` windows of
    ``SequenceStream(seed)``, the same every epoch. On one process the loader reads
    them in order. With ``world`` ranks Lightning replaces the sampler by
    ``DistributedSampler(shuffle=True, seed=seed)`` (it treats every training loader
    as shuffled) and calls ``set_epoch(epoch)``: a permutation per epoch, padded
    with its head to a multiple of ``world``, rank ``r`` taking ``r, r + world, ...``.
    Each rank cuts its list into microbatches of ``micro_sequences`` (the last may be
    shorter).

    Windows. A window of ``A`` runs from where the last one ended (the callback keeps
    Lightning's zeroing and stepping on its bounds); the epoch's last batch ends one
    (then a short window, ``K < A``), every loss divided by ``A``. ``changes`` replays the accumulation the example ran:
    ``{(epoch, batch): A}`` holds from that batch on and multiplies the learning rate
    as the callback's ``"auto"`` coupling does for AdamW (``sqrt(A / A0)`` in all,
    applied as the ratio to the previous factor). No LR scheduler is used.

    Training. Each rank's step gradient is summed in float32 in the order the
    backward passes add into ``.grad`` (``g_k / A``, ``A`` a power of two, is exactly
    what the backward of ``loss / A`` gives); two ranks are averaged as DDP does
    (``x / 2 + y / 2``); then ``clip_grad_norm_(1.0)`` over the optimizer's
    parameters and AdamW's step, as Lightning does. So the weights are the example's,
    step for step. The measurement uses only float64 copies of the ``g_k`` (module
    docstring) and ``NoiseScaleEstimator`` on them.

    Returns:
        ``{"steps": [...], "val": validation loss}``; a step's dict holds ``step``,
        ``k`` (microbatches, all ranks), ``accumulation`` (per rank, as run),
        ``window_accumulation`` (``A`` of the window), ``units``, ``tokens_seen``,
        ``lr`` (the one the step used), ``small``/``big`` (the two squared norms),
        ``small_batch``/``big_batch``, ``float32_error`` (the larger relative error
        of :func:`float32_sq_norm` on the ``g_k`` and on the float32 step gradient
        against the float64 norms), the estimator's ``grad_sq_norm``, ``trace_cov``
        and ``noise_scale`` after the step (``None`` while it has none), and when
        the step was measured (``K >= 2``) its own ``step_grad_sq_norm`` and
        ``step_trace_cov``.
    """
    assert world in (1, 2), "with more ranks the DDP average depends on the all-reduce's order"
    torch.manual_seed(seed)  # pl.seed_everything(seed), then the module builds the GPT
    corpus = load_corpus(max_bytes)
    model = GPT(GPTConfig(context_length=seq_len))
    model.train()
    optimizer = make_adamw(model, lr=lr, weight_decay=0.1)
    clip_params = [p for group in optimizer.param_groups for p in group["params"]]  # Lightning clips these
    estimator = NoiseScaleEstimator()
    starts = SequenceStream(corpus.train, seq_len=seq_len, seed=seed).starts(0, sequences_per_epoch)

    def rank_batches(epoch: int, rank: int) -> list[list[int]]:
        order = list(range(sequences_per_epoch))
        if world > 1:
            sampler = DistributedSampler(order, num_replicas=world, rank=rank, shuffle=True, seed=seed)
            sampler.set_epoch(epoch)
            order = list(sampler)
        return [order[i : i + micro_sequences] for i in range(0, len(order), micro_sequences)]

    steps: list[dict[str, Any]] = []
    a, coupling, seen = accumulation, 1.0, 0.0
    for epoch in range(epochs):
        batches = [rank_batches(epoch, r) for r in range(world)]
        num_batches, first = len(batches[0]), 0
        for b in range(num_batches):
            if (epoch, b) in changes:
                assert b == first, f"the change at epoch {epoch} batch {b} falls inside a window"
                a = changes[(epoch, b)]
                ratio, coupling = math.sqrt(a / accumulation) / coupling, math.sqrt(a / accumulation)
                for group in optimizer.param_groups:
                    group["lr"] = group["lr"] * ratio
            if not (b + 1 - first == a or b == num_batches - 1):
                continue
            flats, sizes, small32, per_rank = [], [], [], []
            for r in range(world):
                acc = None
                for i in range(first, b + 1):
                    x, y = windows(corpus.train, starts[batches[r][i]], seq_len)
                    model.zero_grad(set_to_none=True)
                    _, loss = model(x.contiguous(), y.contiguous())  # the loader's collated batch
                    loss.backward()
                    g = torch.cat([p.grad.detach().reshape(-1) for p in model.parameters()])
                    flats.append(g.double())
                    sizes.append(float(y.numel()))  # every label is a real byte
                    small32.append(float32_sq_norm(model, g))
                    acc = g / a if acc is None else acc + g / a
                per_rank.append(acc)
            first = b + 1
            synced = per_rank[0] if world == 1 else per_rank[0] / 2 + per_rank[1] / 2
            stats = window_statistics(flats, sizes)
            k = len(sizes)
            big32 = float32_sq_norm(model, synced) * (world * a / k) ** 2  # synced = sum_k g_k / (A D)
            seen += stats["units"]
            row: dict[str, Any] = {
                "step": len(steps) + 1, "k": k, "accumulation": k // world, "window_accumulation": a,
                "units": stats["units"],
                "tokens_seen": seen, "lr": float(optimizer.param_groups[0]["lr"]),
                "small": stats["small"], "big": stats["big"],
                "small_batch": stats["small_batch"], "big_batch": stats["big_batch"],
                "float32_error": max(abs(sum(small32) / k / stats["small"] - 1), abs(big32 / stats["big"] - 1)),
            }
            if k >= 2:  # one microbatch has no second batch size: not measured
                est = estimator.update(
                    stats["small"], stats["big"], stats["small_batch"], stats["big_batch"], stats["units"]
                )
                row.update(step_grad_sq_norm=est.step.grad_sq_norm, step_trace_cov=est.step.trace_cov)
            row.update(
                grad_sq_norm=estimator.grad_sq_norm, trace_cov=estimator.trace_cov, noise_scale=estimator.noise_scale
            )
            steps.append(row)
            set_flat_grad(model, synced)
            torch.nn.utils.clip_grad_norm_(clip_params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    val = evaluate(model, corpus.val, seq_len=seq_len, num_sequences=64)
    return {"steps": steps, "val": val}
