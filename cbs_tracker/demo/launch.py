"""Joining the process group torchrun set up, for the examples (``examples/torchrun_*.py``, ``elastic_ddp.py``)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["join_torchrun"]


def join_torchrun(backend: str | None, *, timeout_s: float = 120.0) -> tuple[int, int, torch.device]:
    """Join the process group of this torchrun round; returns ``(rank, world size, device)``.

    ``backend``: ``"gloo"``, ``"nccl"`` or ``None`` (NCCL with CUDA, else gloo). NCCL puts each
    process on the GPU ``LOCAL_RANK`` names.

    Raises:
        SystemExit: ``backend="nccl"`` without CUDA.
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise SystemExit("--backend nccl needs CUDA GPUs; use --backend gloo on CPU")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), device
