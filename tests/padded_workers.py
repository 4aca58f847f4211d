"""A token-level regression with padded rows, whose noise scale in tokens is known analytically.

Every valid token is an i.i.d. example ``y = x . w* + sigma * eps`` with ``x ~ N(0, I_d)``;
each row holds a random number of valid tokens and the rest are labelled ``-100``. At
frozen weights ``w = w* + delta`` the per-token gradient of ``0.5 (w . x - y)^2`` has mean
``G = delta`` and covariance trace ``(d + 1)|delta|^2 + d sigma^2``, so
``B_simple = ((d + 1)|delta|^2 + d sigma^2) / |delta|^2`` tokens.

Kept in a module of its own so that ``torch.multiprocessing.spawn`` children can import
the worker by name.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
from torch import nn

IGNORE = -100.0


def truth(delta: torch.Tensor, sigma: float) -> float:
    """The analytic ``B_simple`` in tokens at weights ``w* + delta``."""
    d, dd = delta.numel(), float(delta.double().pow(2).sum())
    return ((d + 1) * dd + d * sigma**2) / dd


class PaddedTokens(torch.utils.data.Dataset):
    """``{"x": (T, d), "labels": (T,)}`` rows; row ``i`` has ``valid[i]`` leading valid tokens."""

    def __init__(self, rows: int, *, length: int, valid: tuple[int, int], w_star: torch.Tensor,
                 sigma: float, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        d = w_star.numel()
        self.x = torch.randn(rows, length, d, generator=g)
        y = self.x @ w_star + sigma * torch.randn(rows, length, generator=g)
        self.valid = torch.randint(valid[0], valid[1] + 1, (rows,), generator=g)
        pad = torch.arange(length)[None, :] >= self.valid[:, None]
        self.labels = y.masked_fill(pad, IGNORE)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.labels[i]}

    def rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[start:stop], self.labels[start:stop]


class TokenRegression(nn.Module):
    """``Linear(d, 1)`` per token at frozen weights; the loss counts the tokens whose label is not -100.

    ``forward`` follows the Hugging Face convention: with ``num_items_in_batch`` the summed
    token loss divided by it, otherwise the mean over the microbatch's valid tokens.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.net = nn.Linear(weight.numel(), 1, bias=False)
        with torch.no_grad():
            self.net.weight.copy_(weight[None])

    def token_sum(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        mask = labels != IGNORE
        err = self.net(x).squeeze(-1) - labels
        return 0.5 * err.pow(2).masked_fill(~mask, 0.0).sum()

    def forward(self, x: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Any = None,
                **kwargs: Any) -> dict[str, torch.Tensor]:
        total = self.token_sum(x, labels)
        if num_items_in_batch is None:
            return {"loss": total / (labels != IGNORE).sum()}
        return {"loss": total / num_items_in_batch}


def reference_grad(weight: torch.Tensor, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean gradient over every valid token of ``x``/``labels`` (closed form, float64)."""
    mask = labels != IGNORE
    xs, ys = x[mask].double(), labels[mask].double()
    return ((xs @ weight.double() - ys)[:, None] * xs).mean(0)


def setting(seed: int = 0, d: int = 8, sigma: float = 0.5, scale: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w*, delta)`` of a run."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(d, generator=g), scale * torch.randn(d, generator=g)


def plain_run(data: PaddedTokens, weight: torch.Tensor, *, normalization: str, accumulation: int,
              rows_per_micro: int, steps: int, first_row: int = 0, row_stride: int | None = None,
              estimator: Any = None, measured_as: str | None = None) -> dict[str, Any]:
    """A frozen plain-loop run (optionally one DDP rank); returns the records and every window's gradient check.

    The loop fetches each window first, so a unit-normalised loss knows the window's
    tokens before its first backward, as the Hugging Face ``Trainer`` does.
    ``measured_as`` tells the tracker another normalisation than the loss uses (the
    mistake a test must be able to see).
    """
    import torch.distributed as dist

    from cbs_tracker import CBSTracker

    model = TokenRegression(weight)
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    wrapped: nn.Module = nn.parallel.DistributedDataParallel(model) if ranks > 1 else model
    tracker = CBSTracker(wrapped, accumulation_steps=accumulation, unit="tokens", controller=None,
                         estimator=estimator, loss_normalization=measured_as or normalization)
    per_step = accumulation * rows_per_micro
    stride = per_step if row_stride is None else row_stride
    records, worst = [], 0.0
    for s in range(steps):
        start = first_row + s * stride
        window = [data.rows(start + k * rows_per_micro, start + (k + 1) * rows_per_micro) for k in range(accumulation)]
        counts = [(labels != IGNORE).sum() for _, labels in window]
        local = sum(float(c) for c in counts)
        divisor = local
        if normalization == "group":
            total = torch.tensor([local], dtype=torch.float64)
            if ranks > 1:
                dist.all_reduce(total)
            divisor = float(total) / ranks
        for k, (x, labels) in enumerate(window):
            with tracker.microbatch(size=counts[k]):
                if normalization == "mean":
                    loss = wrapped(x, labels)["loss"] / accumulation
                else:
                    loss = wrapped(x, labels, num_items_in_batch=divisor)["loss"]
                loss.backward()
        records.append(tracker.step())
        got = model.net.weight.grad.detach().double().flatten()
        if normalization == "mean":
            # the loop's choice: the mean over the window's (all ranks') microbatches of their own means
            parts = [reference_grad(weight, x, labels) for x, labels in window]
            want = torch.stack(parts).mean(0)
            if ranks > 1:
                dist.all_reduce(want)
                want /= ranks
        else:
            xs = torch.cat([x for x, _ in window])
            ls = torch.cat([labels for _, labels in window])
            want = reference_grad(weight, xs, ls) * (local / divisor)
            if ranks > 1:
                dist.all_reduce(want)
                want /= ranks
        worst = max(worst, float((got - want).norm() / want.norm()))
        model.zero_grad(set_to_none=True)
    return {"records": records, "worst_grad_error": worst, "noise_scale": tracker.noise_scale,
            "interval": tracker.noise_scale_interval}


def ddp_worker(rank: int, world: int, port: int, out_dir: str, kwargs: dict[str, Any]) -> None:
    """One rank of a 2-process gloo run of :func:`plain_run`; ranks see rows of different lengths."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from cbs_tracker import NoiseScaleEstimator

        w_star, delta = setting()
        # rank 0 holds short rows, rank 1 long ones: the ranks' token counts differ every step
        valid = kwargs["valid"][rank]
        data = PaddedTokens(kwargs["rows"], length=64, valid=valid, w_star=w_star, sigma=0.5, seed=10 + rank)
        out = {}
        for normalization in kwargs["normalizations"]:
            run = plain_run(data, w_star + delta, normalization=normalization, accumulation=kwargs["accumulation"],
                            rows_per_micro=kwargs["rows_per_micro"], steps=kwargs["steps"],
                            estimator=NoiseScaleEstimator(horizon_steps=1e9, min_steps=10))
            out[normalization] = {
                "noise_scale": run["noise_scale"], "worst_grad_error": run["worst_grad_error"],
                "records": [dataclasses.asdict(r) for r in run["records"]],
            }
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # both ranks done before the group goes away (gloo aborts otherwise)
    finally:
        dist.destroy_process_group()
