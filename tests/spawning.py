"""``spawn``: ``torch.multiprocessing.spawn`` whose workers leave without the interpreter's teardown.

A gloo worker that returned cleanly (its files written, its process group destroyed)
can still abort at interpreter exit ("terminate called without an active exception",
SIGABRT) about one run in ten on these machines; the test then fails on nothing the
worker did. Here a worker that returned exits at once with status 0; one that raised
goes through ``spawn``'s own error path, so its traceback still reaches the test.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def _run_then_exit(rank: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable[..., Any], args: tuple[Any, ...] = (), nprocs: int = 1, join: bool = True) -> Any:
    """``torch.multiprocessing.spawn(fn, args, nprocs, join)``, each worker ended by ``os._exit(0)``."""
    return mp.spawn(_run_then_exit, args=(fn, tuple(args)), nprocs=nprocs, join=join)
