"""Would the noise scale weighted by the curvature make ``kappa`` agree across models?

``B_simple = tr(Sigma) / |G|^2`` is the critical batch of McCandlish et al.'s theory only where the Hessian is a
multiple of the identity. Their critical batch itself is ``B_noise = tr(H Sigma) / (G^T H G)``: the batch at which
the loss a step gains along the noisy gradient, with the best step size, is half what the true gradient would give.
The frontier's best fixed ``kappa`` differs by model (the largest that keeps the loss: about 0.2 on the wide GPT,
0.4 on the proof and 6-layer code GPTs, 0.5 on the 3-layer code GPT, 0.7-1.2 on prose, the synthetic language and
the 1-layer GPT). If ``kappa`` were ``B_noise / B_simple``, the ratio measured here would be in that order.
Under Adam the update is ``-lr P g`` (``P = 1 / (sqrt(v) + eps)``, the optimizer's own second moments), and the
same argument gives ``B_adam = tr(P H P Sigma) / (G^T P H P G)``, measured here too.

This trains the frontier's constant run (the tracker's starting batch and microbatches, AdamW, the LR schedule in
tokens, the gradient clipped as the frontier's runs do) and at ``--marks`` (fractions of the run) freezes the
weights and draws ``--microbatches`` (``N``) fresh microbatches of the run's size: their gradients ``g_i`` give the
mean ``g`` and ``tr(Sigma_b)``; the Hessian ``H`` of ``--hessian`` other microbatches' mean loss, applied by double
backward (``torch.autograd.grad`` twice, the training gradients untouched), goes to the deviations ``d_i = g_i - g``
of the first ``--deviations`` of them and to ``g``. The estimates are unbiased: ``tr(H Sigma_b)`` is the mean of
``d_i^T H d_i`` over ``1 - 1/N``, ``G^T H G = g^T H g - tr(H Sigma_b) / N`` (and the same with ``I`` for
``B_simple``), each noise scale in tokens (the microbatch's tokens x the ratio). The mean gradient's noise is what
limits them (at ``B_simple`` ten microbatches, ``|G|^2`` from ``N`` of them has a relative error of about
``2 sqrt(10 / N)``): hence thousands of gradients and few Hessian products. A negative ``G^T H G`` (the loss curving
down along the gradient) gives no ``B_noise`` (``None``).

    python -m benchmarks.proof.curvature_scale --setting wide --seed 0 --microbatches 4096 --deviations 64 --hessian 8 --out docs/curvature_scale.json
    python -m benchmarks.proof.curvature_scale --report --out docs/curvature_scale.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

from . import gpt_proof as base
from . import gpt_proof_lr as proof_lr
from .step_ratio import save_run

#: about the largest fixed ``kappa`` that keeps the loss on the frontier, by setting (as the group and Adam
#: diagnostics read it; on tail ``kappa = 0.5``, the largest fixed one run there, and the rise to 1.2 kept it):
#: what the ratio would have to follow if it were ``kappa``
FRONTIER_KAPPA = {"wide": 0.2, "wide_lr3": 0.2, "tall": 0.3, "full": 0.4, "heldout": 0.5, "prose": 1.0, "synth": 1.0, "tail": 0.5}


def quadratic_forms(total: Any, square_sum: float, n: int, sample: Any, hvp: Any, scale: Any = None) -> dict[str, float]:
    """The unbiased ``tr(Sigma_b)``, ``|G|^2``, ``tr(H Sigma_b)`` and ``G^T H G`` from ``n`` microbatch gradients:
    ``total`` their sum, ``square_sum`` the sum of their squared norms, ``sample`` (``k x dim``) ``k`` of them,
    whose deviations from the mean the Hessian is applied to (``hvp``: ``v -> H v``). With ``scale`` (``dim``) every
    gradient is first multiplied by it (``P g``: the preconditioned forms; ``square_sum`` is then of ``P g``)."""
    from cbs_tracker.core.estimator import estimate_from_norms

    mean = total / n if scale is None else total * scale / n
    # the tracker's own estimator: the mean squared norm at one microbatch against the squared norm at n of them
    est = estimate_from_norms(square_sum / n, float(mean @ mean), 1.0, float(n))
    trace, sq = est.trace_cov, est.grad_sq_norm
    dev = (sample if scale is None else sample * scale) - mean
    # a sampled gradient is one of the n in the mean: E[d^T H d] = tr(H Sigma_b) (1 - 1/n)
    h_trace = sum(float(d @ hvp(d)) for d in dev) / len(dev) / (1 - 1 / n)
    h_sq = float(mean @ hvp(mean)) - h_trace / n
    return {"trace_cov": trace, "grad_sq_norm": sq, "h_trace_cov": h_trace, "h_grad_sq_norm": h_sq}


def noise_scales(forms: dict[str, float], tokens: float) -> tuple[float | None, float | None]:
    """``(B_simple, B_noise)`` in tokens from :func:`quadratic_forms` of microbatches of ``tokens`` tokens."""
    simple = tokens * forms["trace_cov"] / forms["grad_sq_norm"] if forms["grad_sq_norm"] > 0 else None
    noise = tokens * forms["h_trace_cov"] / forms["h_grad_sq_norm"] if forms["h_grad_sq_norm"] > 0 else None
    return simple, noise


def _flat(tensors: Any) -> Any:
    import torch

    return torch.cat([t.reshape(-1) for t in tensors])


def hessian_vector_product(model: Any, params: list[Any], batches: list[tuple[Any, Any]]) -> Any:
    """``v -> H v`` (``v`` flat, float64) for ``H`` the Hessian in ``params`` of the mean of ``model``'s losses on
    ``batches``, by double backward; the gradients' graphs are built once and kept."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):  # the fused attention kernels have no second derivative
        graphs = [torch.autograd.grad(model(x, y)[1], params, create_graph=True) for x, y in batches]
    sizes = [p.numel() for p in params]

    def hvp(v: Any) -> Any:
        out = torch.zeros_like(v)
        parts = [t.view_as(p).to(p.dtype) for t, p in zip(torch.split(v, sizes), params, strict=True)]
        for g in graphs:
            dot = sum((a * b).sum() for a, b in zip(g, parts, strict=True))
            out += _flat(torch.autograd.grad(dot, params, retain_graph=True)).double()
        return out / len(graphs)

    return hvp


def measure_at(model: Any, optimizer: Any, stream: Any, micro: int, micro_tokens: float, microbatches: int,
               deviations: int, hessian: int, per_step: int) -> dict[str, Any]:
    """Both noise scales, plain and through Adam's preconditioner, at the model's current weights (``micro``
    sequences, ``micro_tokens`` tokens, a microbatch; ``per_step`` microbatches a step): ``microbatches``
    gradients for the mean and the trace, the Hessian of ``hessian`` other microbatches applied to the first
    ``deviations`` of them."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    group = optimizer.param_groups[0]
    beta2, eps = group["betas"][1], group["eps"]
    v = torch.cat([optimizer.state[p]["exp_avg_sq"].reshape(-1) for p in params]).double()
    step = float(optimizer.state[params[0]]["step"])  # one optimizer: every parameter has taken the same steps
    total, squares, sample = None, None, []
    for i in range(microbatches):
        x, y = stream.next_batch(micro)
        g = _flat(torch.autograd.grad(model(x, y)[1], params)).double()
        total = g.clone() if total is None else total.add_(g)
        squares = g * g if squares is None else squares.add_(g * g)
        if i < deviations:
            sample.append(g)
    rows = torch.stack(sample)
    mean = total / microbatches
    spread = (squares - microbatches * mean * mean) / (microbatches - 1)  # each coordinate's variance
    # P as the optimizer holds it (the library's preconditioned measure), and as the next step would use it: its
    # second moments updated with a step's expected squared gradient (a step: ``per_step`` microbatches)
    scales = {"adam": 1.0 / ((v / (1 - beta2 ** step)).sqrt() + eps),
              "adam_next": 1.0 / (((beta2 * v + (1 - beta2) * (mean * mean + spread / per_step))
                                   / (1 - beta2 ** (step + 1))).sqrt() + eps)}
    hvp = hessian_vector_product(model, params, [stream.next_batch(micro) for _ in range(hessian)])
    forms = {"plain": quadratic_forms(total, float(squares.sum()), microbatches, rows, hvp)}
    for name, scale in scales.items():
        forms[name] = quadratic_forms(total, float((scale * scale * squares).sum()), microbatches, rows, hvp, scale)
    out: dict[str, Any] = {"forms": forms}
    for name, key in (("plain", ""), ("adam", "adam_"), ("adam_next", "adam_next_")):
        out[f"b_{key}simple"], out[f"b_{key}noise"] = noise_scales(forms[name], micro_tokens)
    return out


def measure(setting: base.Setting, seed: int, marks: list[float], microbatches: int, deviations: int,
            hessian: int) -> dict[str, Any]:
    """Train the constant run to each mark and measure there (:func:`measure_at`)."""
    import torch

    from cbs_tracker.demo.corpus import SequenceStream

    torch.set_num_threads(1)
    start, micro = setting.tracker_start_tokens, setting.tracker_micro_sequences
    b = micro * setting.seq_len
    per_window = start // b
    model, optimizer, scheduler = proof_lr.start_of_run(setting, seed, "cosine", start)
    stream = SequenceStream(base.load_setting_corpus(setting).train, seq_len=setting.seq_len, seed=seed)
    probe = SequenceStream(base.load_setting_corpus(setting).train, seq_len=setting.seq_len, seed=10_000 + seed)
    tokens, points = 0.0, []
    for mark in marks:
        while tokens < mark * setting.budget_tokens:
            optimizer.zero_grad(set_to_none=True)
            for _ in range(per_window):
                x, y = stream.next_batch(micro)
                (model(x, y)[1] / per_window).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), setting.clip)
            optimizer.step()
            scheduler.step()
            tokens += start
        optimizer.zero_grad(set_to_none=True)
        point = measure_at(model, optimizer, probe, micro, b, microbatches, deviations, hessian, per_window)
        point.update(mark=mark, tokens=tokens)
        points.append(point)
        ratios = {key: _ratio(point, key) for key in RATIOS}
        print(f"{setting.name} seed {seed} at {mark:.2f} ({tokens:,.0f} tokens): B_simple {_fmt(point['b_simple'])}; "
              + ", ".join(f"{label} x{_fmt(ratios[key], '.2f')}" for key, label in RATIOS.items()), flush=True)
    return {"seed": seed, "microbatch_tokens": b, "start_tokens": start, "points": points}


#: the ratios to ``B_simple`` reported, by the key of their noise scale
RATIOS = {"b_noise": "B_noise", "b_adam_noise": "B_adam (stored v)", "b_adam_next_noise": "B_adam (next step's v)"}


def _ratio(point: dict[str, Any], key: str) -> float | None:
    """``point[key] / B_simple`` where both are positive (a negative form has no noise scale), else ``None``."""
    top, bottom = point.get(key), point.get("b_simple")
    return top / bottom if top is not None and bottom is not None and top > 0 and bottom > 0 else None


def _fmt(value: float | None, spec: str = ",.0f") -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, spec)


def report(runs: list[dict[str, Any]]) -> str:
    """A markdown row per setting: the frontier's ``kappa`` and, over its seeds and marks, the median and range of
    each ratio of :data:`RATIOS`, each from the points where both of its noise scales are positive."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault(r["setting"], []).append(r)
    lines = ["| setting | frontier's kappa | seeds x marks | "
             + " | ".join(f"{label} / B_simple: median (range)" for label in RATIOS.values()) + " |",
             "|---|---|---|" + "---|" * len(RATIOS)]
    for name in sorted(by, key=lambda n: FRONTIER_KAPPA.get(n, math.inf)):
        cells = []
        for key in RATIOS:
            ratios = [v for r in by[name] for p in r["points"] if (v := _ratio(p, key)) is not None]
            cells.append(f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})" if ratios else "-")
        kappa = FRONTIER_KAPPA.get(name)
        points = sum(len(r["points"]) for r in by[name])
        lines.append(f"| {name} | {'-' if kappa is None else kappa} | {points} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setting", choices=sorted(base.SETTINGS), default="wide")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--marks", default="0.1,0.25,0.5", help="fractions of the run (default 0.1,0.25,0.5)")
    p.add_argument("--microbatches", type=int, default=2048,
                   help="gradients drawn at each mark for the mean and the trace (default 2048)")
    p.add_argument("--deviations", type=int, default=32,
                   help="of them, those the Hessian is applied to (default 32)")
    p.add_argument("--hessian", type=int, default=4, help="microbatches whose mean loss's Hessian is used (default 4)")
    p.add_argument("--out", type=Path, required=True, help="a JSON file; runs of other settings in it are kept")
    p.add_argument("--report", action="store_true", help="run nothing; print the table of --out's runs")
    args = p.parse_args(argv)
    if args.report:
        print(report(json.loads(args.out.read_text())["runs"]), end="")
        return 0
    marks = [float(m) for m in args.marks.split(",")]
    if (not all(0 < m <= 1 for m in marks) or marks != sorted(marks) or args.microbatches < 2
            or not 1 <= args.deviations <= args.microbatches or args.hessian < 1):
        p.error(f"--marks must rise in (0, 1], --microbatches >= 2, --deviations in [1, --microbatches] and "
                f"--hessian >= 1; got {args.marks!r}, {args.microbatches}, {args.deviations}, {args.hessian}")
    setting = base.SETTINGS[args.setting]
    run = measure(setting, args.seed, marks, args.microbatches, args.deviations, args.hessian)
    result = {"setting": setting.name, "setting_key": setting.key(), "seed": args.seed, "lr_schedule": "cosine",
              "library_commit": base._library_commit(), "frontier_kappa": FRONTIER_KAPPA.get(setting.name),
              "microbatches": args.microbatches, "deviations": args.deviations, "hessian": args.hessian, **run}
    save_run(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
