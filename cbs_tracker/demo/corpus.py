"""The embedded demo data: byte-level text of the running Python's standard library.

:func:`load_corpus` returns the standard library's ``.py`` files as bytes (vocabulary
256, no download; the last 1% is the validation split); :class:`SequenceStream` draws
training windows so that sequence ``i`` depends only on ``(seed, i)``, whatever the
microbatch and rank split, and :func:`evaluate` gives the validation loss.
``docs/history-2026.md`` (Demo data, in the design page's reasoning) says which files are included and why.
"""

from __future__ import annotations

import logging
import math
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "VOCAB_SIZE",
    "Corpus",
    "SequenceStream",
    "corpus_files",
    "evaluate",
    "load_corpus",
    "load_docstrings",
    "sample_batch",
    "stdlib_root",
    "validation_starts",
    "windows",
]

logger = logging.getLogger(__name__)

VOCAB_SIZE = 256
"""Byte-level vocabulary: every byte value is a token."""

_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})

# Concatenated bytes per (root, max_bytes): reading the whole standard library is slow,
# and the demo, its tests and the experiment load the corpus many times per process.
_CACHE: dict[tuple[str, int | None], tuple[np.ndarray, int]] = {}


def _check_int(name: str, value: Any, *, minimum: int, context: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{context}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{context}: {name}={value!r} is not allowed; it must be >= {minimum}")
    return int(value)


def _check_data(data: Any, context: str) -> np.ndarray:
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 1:
        got = (
            f"numpy array of dtype {data.dtype} and shape {data.shape}"
            if isinstance(data, np.ndarray)
            else type(data).__name__
        )
        raise TypeError(f"{context}: data must be a 1-D numpy uint8 array, got {got}")
    return data


def stdlib_root() -> Path:
    """The directory of the running Python's standard library (``sysconfig`` ``stdlib``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """The ``.py`` files of the corpus, in corpus order.

    Args:
        root: directory to collect from; the running Python's standard library
            when ``None``.

    Returns:
        Absolute paths of every ``*.py`` file under ``root`` (symbolic links to
        directories are not followed), without anything inside a
        ``site-packages``, ``dist-packages`` or ``__pycache__`` directory,
        sorted by their path relative to ``root`` written with ``/``.
    """
    base = stdlib_root() if root is None else Path(root)
    if not base.is_dir():
        raise ValueError(f"corpus_files: root={str(base)!r} is not a directory")
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                rel = PurePath(os.path.relpath(path, base)).as_posix()
                found.append((rel, path))
    found.sort(key=lambda item: item[0])
    return [path for _, path in found]


def _read_concatenated(root: Path, max_bytes: int | None) -> tuple[np.ndarray, int]:
    key = (str(root.resolve()), max_bytes)
    cached = _CACHE.get(key)
    if cached is not None:
        return cached
    chunks: list[bytes] = []
    total = 0
    num_files = 0
    for path in corpus_files(root):
        chunk = path.read_bytes()
        chunks.append(chunk)
        total += len(chunk)
        num_files += 1
        if max_bytes is not None and total >= max_bytes:
            break
    blob = b"".join(chunks)
    if max_bytes is not None:
        blob = blob[:max_bytes]
    data = np.frombuffer(blob, dtype=np.uint8)  # read-only view of immutable bytes
    _CACHE[key] = (data, num_files)
    logger.info("corpus: %d bytes from %d files under %s", data.size, num_files, root)
    return data, num_files


@dataclass(frozen=True, eq=False)
class Corpus:
    """Byte-level corpus split into training and validation bytes.

    Attributes:
        train: the first ``num_bytes - len(val)`` bytes, read-only 1-D ``np.uint8``.
        val: the last ``floor(val_fraction * num_bytes)`` bytes, read-only 1-D ``np.uint8``.
        num_files: ``.py`` files read (the last one may be cut by ``max_bytes``).
        root: the directory the files come from.
        vocab_size: 256 (one token per byte value).
    """

    train: np.ndarray
    val: np.ndarray
    num_files: int
    root: str
    vocab_size: int = VOCAB_SIZE

    @property
    def num_bytes(self) -> int:
        """Bytes in both splits together (= tokens, one per byte)."""
        return int(self.train.size + self.val.size)


def load_corpus(
    max_bytes: int | None = None,
    *,
    root: str | os.PathLike[str] | None = None,
    val_fraction: float = 0.01,
) -> Corpus:
    """Load the standard-library corpus (cached per process).

    The bytes of :func:`corpus_files` are concatenated in order; the last
    ``floor(val_fraction * n)`` of the ``n`` bytes are the validation split, the
    rest the training split. Deterministic for a given Python installation.

    Args:
        max_bytes: keep only the first ``max_bytes`` bytes of the concatenation
            (reading stops as soon as enough files are read), then split. For
            quick runs and tests. ``None`` keeps everything.
        root: directory to read instead of the standard library (tests).
        val_fraction: share of the bytes held out at the end, in ``(0, 1)``.

    Returns:
        A :class:`Corpus` whose arrays are read-only views of the cached bytes.

    Raises:
        TypeError: ``max_bytes`` is not an int, or ``val_fraction`` not a number.
        ValueError: ``max_bytes < 1024``, ``val_fraction`` outside ``(0, 1)``,
            ``root`` not a directory, or no ``.py`` files found.
    """
    if max_bytes is not None:
        max_bytes = _check_int("max_bytes", max_bytes, minimum=1024, context="load_corpus")
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)):
        raise TypeError(
            f"load_corpus: val_fraction must be a float, got {type(val_fraction).__name__} "
            f"{val_fraction!r}"
        )
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(
            f"load_corpus: val_fraction={val_fraction!r} is not allowed; it must be in (0, 1)"
        )
    base = stdlib_root() if root is None else Path(root)
    if not base.is_dir():
        raise ValueError(f"load_corpus: root={str(base)!r} is not a directory")
    data, num_files = _read_concatenated(base, max_bytes)
    if data.size == 0:
        raise ValueError(f"load_corpus: no .py bytes found under root={str(base)!r}")
    num_val = int(math.floor(val_fraction * data.size))
    split = data.size - num_val
    return Corpus(train=data[:split], val=data[split:], num_files=num_files, root=str(base))


def load_docstrings(val_fraction: float = 0.01) -> Corpus:
    """A second corpus, English prose: the docstrings of the standard library's ``.py`` files.

    Module, class and function docstrings (cleaned by ``ast.get_docstring``), in the order of
    :func:`corpus_files` and, within a file, of ``ast.walk``, joined by blank lines: about 2.3 MB
    on CPython 3.11 (files that do not parse are skipped). Parsing the library takes 15-40 s, so
    the bytes are kept in a file under the system's temporary folder, named by a hash of the
    library's path and the Python version, and read from there by later processes. The last
    ``val_fraction`` of the bytes is the validation split.
    """
    import ast
    import hashlib
    import sys
    import tempfile

    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0.0 < val_fraction < 1.0:
        raise ValueError(f"load_docstrings: val_fraction={val_fraction!r} is not allowed; it must be in (0, 1)")
    root = stdlib_root()
    tag = hashlib.sha256(f"{root}|{sys.version}".encode()).hexdigest()[:12]
    cache = Path(tempfile.gettempdir()) / f"cbs_tracker_docstrings_{tag}.bin"
    if cache.exists():
        blob = cache.read_bytes()
    else:
        docs = []
        for path in corpus_files(root):
            try:
                tree = ast.parse(path.read_bytes())
            except (SyntaxError, ValueError):  # a few test files are not valid Python on purpose
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node, clean=True)
                    if doc:
                        docs.append(doc)
        blob = "\n\n".join(docs).encode("utf-8", errors="replace")
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(blob)
        os.replace(tmp, cache)  # atomic: parallel processes never read half a file
    data = np.frombuffer(blob, dtype=np.uint8)
    split = data.size - int(math.floor(val_fraction * data.size))
    return Corpus(train=data[:split], val=data[split:], num_files=0, root=str(root))


def windows(
    data: np.ndarray, starts: np.ndarray, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets for windows starting at ``starts``.

    Args:
        data: 1-D ``np.uint8`` bytes.
        starts: 1-D integer offsets, each in ``[0, len(data) - seq_len - 1]``.
        seq_len: tokens per sequence.

    Returns:
        ``(x, y)``, int64 CPU tensors of shape ``(len(starts), seq_len)`` with
        ``x[i, t] = data[starts[i] + t]`` and ``y[i, t] = data[starts[i] + t + 1]``.
    """
    _check_data(data, "windows")
    seq_len = _check_int("seq_len", seq_len, minimum=1, context="windows")
    starts = np.asarray(starts, dtype=np.int64)
    if starts.size and (starts.min() < 0 or starts.max() > data.size - seq_len - 1):
        raise ValueError(
            f"windows: starts must lie in [0, {data.size - seq_len - 1}] for seq_len={seq_len} "
            f"and {data.size} bytes, got [{starts.min()}, {starts.max()}]"
        )
    index = starts[:, None] + np.arange(seq_len + 1, dtype=np.int64)[None, :]
    block = torch.from_numpy(data[index].astype(np.int64))
    return block[:, :-1], block[:, 1:]


def _num_starts(data: np.ndarray, seq_len: int, context: str) -> int:
    n = data.size - seq_len  # valid starts are 0 .. n - 1
    if n < 1:
        raise ValueError(
            f"{context}: seq_len={seq_len} needs at least {seq_len + 1} bytes, data has {data.size}"
        )
    return n


def sample_batch(
    data: np.ndarray,
    batch_sequences: int,
    seq_len: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniformly random windows drawn with a torch generator (simple, stateless use).

    For experiments that must not depend on how a batch is split into
    microbatches or ranks, use :class:`SequenceStream` instead.

    Args:
        data: 1-D ``np.uint8`` bytes.
        batch_sequences: sequences to draw.
        seq_len: tokens per sequence.
        generator: source of randomness (the global torch RNG when ``None``).

    Returns:
        ``(x, y)`` as in :func:`windows`, shape ``(batch_sequences, seq_len)``.
    """
    _check_data(data, "sample_batch")
    batch_sequences = _check_int(
        "batch_sequences", batch_sequences, minimum=1, context="sample_batch"
    )
    seq_len = _check_int("seq_len", seq_len, minimum=1, context="sample_batch")
    n = _num_starts(data, seq_len, "sample_batch")
    starts = torch.randint(0, n, (batch_sequences,), generator=generator).numpy()
    return windows(data, starts, seq_len)


class SequenceStream:
    """An endless, reproducible stream of training windows.

    Sequence ``i`` starts at offset ``starts(i, 1)[0]``, drawn uniformly from
    ``[0, len(data) - seq_len - 1]`` by ``np.random.default_rng([seed, i //
    block_size])`` at position ``i % block_size`` of its block. Because it
    depends on ``(seed, i)`` only, the stream's order does not depend on how
    the consumer groups the sequences: one call for 8 sequences returns the
    concatenation of two calls for 4, and :meth:`next_batch` with
    ``world_size=D`` hands rank ``r`` the ``r``-th contiguous slice of the same
    global batch.

    Args:
        data: 1-D ``np.uint8`` training bytes.
        seq_len: tokens per sequence.
        seed: stream seed (non-negative int).
        block_size: sequences drawn per RNG block (part of the stream's
            definition: changing it changes the order).
    """

    def __init__(
        self, data: np.ndarray, *, seq_len: int, seed: int = 0, block_size: int = 4096
    ) -> None:
        self.data = _check_data(data, "SequenceStream")
        self.seq_len = _check_int("seq_len", seq_len, minimum=1, context="SequenceStream")
        self.seed = _check_int("seed", seed, minimum=0, context="SequenceStream")
        self.block_size = _check_int("block_size", block_size, minimum=1, context="SequenceStream")
        self._num_starts = _num_starts(data, self.seq_len, "SequenceStream")
        self.position = 0
        self._block_index = -1
        self._block = np.empty(0, dtype=np.int64)

    def _block_starts(self, block_index: int) -> np.ndarray:
        if block_index != self._block_index:
            rng = np.random.default_rng([self.seed, block_index])
            self._block = rng.integers(0, self._num_starts, size=self.block_size, dtype=np.int64)
            self._block_index = block_index
        return self._block

    def starts(self, first: int, count: int) -> np.ndarray:
        """Start offsets of sequences ``first .. first + count - 1`` (pure in ``(seed, i)``)."""
        first = _check_int("first", first, minimum=0, context="SequenceStream.starts")
        count = _check_int("count", count, minimum=0, context="SequenceStream.starts")
        out = np.empty(count, dtype=np.int64)
        done = 0
        while done < count:
            i = first + done
            block_index, offset = divmod(i, self.block_size)
            take = min(count - done, self.block_size - offset)
            out[done : done + take] = self._block_starts(block_index)[offset : offset + take]
            done += take
        return out

    def next_batch(
        self, num_sequences: int, *, rank: int = 0, world_size: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The next sequences of the stream for one rank; advances the stream.

        The stream advances by ``num_sequences * world_size`` on every rank;
        rank ``r`` gets sequences ``position + r * num_sequences`` onwards, so
        concatenating the ranks' batches in rank order gives the batch a single
        process would draw with ``num_sequences * world_size``.

        Args:
            num_sequences: sequences for this rank.
            rank: this rank's index in the data-parallel group.
            world_size: data-parallel ranks.

        Returns:
            ``(x, y)`` as in :func:`windows`, shape ``(num_sequences, seq_len)``.
        """
        num_sequences = _check_int(
            "num_sequences", num_sequences, minimum=1, context="SequenceStream.next_batch"
        )
        world_size = _check_int(
            "world_size", world_size, minimum=1, context="SequenceStream.next_batch"
        )
        rank = _check_int("rank", rank, minimum=0, context="SequenceStream.next_batch")
        if rank >= world_size:
            raise ValueError(
                f"SequenceStream.next_batch: rank={rank} is not allowed; it must be < world_size={world_size}"
            )
        first = self.position + rank * num_sequences
        self.position += num_sequences * world_size
        return windows(self.data, self.starts(first, num_sequences), self.seq_len)

    def state_dict(self) -> dict[str, int]:
        """The least state that resumes the stream (the data must be the same)."""
        return {
            "version": 1,
            "position": self.position,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "block_size": self.block_size,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from :meth:`state_dict`; the seed, length and block size must match."""
        for key in ("version", "position", "seed", "seq_len", "block_size"):
            if key not in state:
                raise KeyError(f"SequenceStream.load_state_dict: missing key {key!r}")
        for key in ("seed", "seq_len", "block_size"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"SequenceStream.load_state_dict: {key}={state[key]!r} in the state differs "
                    f"from this stream's {key}={getattr(self, key)!r}"
                )
        self.position = _check_int(
            "position", state["position"], minimum=0, context="SequenceStream.load_state_dict"
        )


def validation_starts(val: np.ndarray, seq_len: int, num_sequences: int) -> np.ndarray:
    """Fixed validation windows: ``num_sequences`` starts evenly spaced over ``val``.

    ``starts[j] = floor(j * (len(val) - seq_len - 1) / max(num_sequences - 1, 1))``;
    no randomness, so every run and every process scores the same bytes.
    """
    _check_data(val, "validation_starts")
    seq_len = _check_int("seq_len", seq_len, minimum=1, context="validation_starts")
    num_sequences = _check_int(
        "num_sequences", num_sequences, minimum=1, context="validation_starts"
    )
    last = _num_starts(val, seq_len, "validation_starts") - 1
    return (np.arange(num_sequences, dtype=np.int64) * last) // max(num_sequences - 1, 1)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    val: np.ndarray,
    *,
    seq_len: int,
    num_sequences: int = 256,
    batch: int = 64,
) -> float:
    """Mean validation loss in nats per byte over the fixed :func:`validation_starts` windows.

    ``loss = (1 / (N T)) sum_{i, t} -log p(y[i, t] | x[i, :t+1])`` over all
    ``N = num_sequences`` windows of ``T = seq_len`` bytes. The model is run in
    eval mode (restored afterwards) on the device of its first parameter;
    ``model(x)`` must return logits of shape ``(B, T, 256)`` or a tuple whose
    first item they are.

    Args:
        model: the language model.
        val: 1-D ``np.uint8`` validation bytes.
        seq_len: tokens per window (at most the model's context).
        num_sequences: windows to score.
        batch: windows per forward pass.

    Returns:
        The mean loss as a Python float.
    """
    batch = _check_int("batch", batch, minimum=1, context="evaluate")
    starts = validation_starts(val, seq_len, num_sequences)
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    was_training = model.training
    model.eval()
    try:
        total = 0.0
        for lo in range(0, starts.size, batch):
            x, y = windows(val, starts[lo : lo + batch], seq_len)
            out = model(x.to(device))
            logits = out[0] if isinstance(out, tuple) else out
            loss = F.cross_entropy(
                logits.float().reshape(-1, logits.size(-1)),
                y.to(device).reshape(-1),
                reduction="sum",
            )
            total += float(loss)
    finally:
        model.train(was_training)
    return total / (starts.size * seq_len)
