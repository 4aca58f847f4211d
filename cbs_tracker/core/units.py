"""Counting the units of a microbatch: samples (the batch's leading dimension) or loss-contributing tokens.

``leading_dim(batch)`` counts samples; ``label_tokens(key, ignore_index=-100)`` returns a
``batch_size_fn`` that counts ``labels != ignore_index`` on the device (no host sync).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["BatchSizeFn", "label_tokens", "leading_dim"]

BatchSizeFn = Callable[[Any], "int | float | torch.Tensor"]


def leading_dim(batch: Any) -> int:
    """Samples in a batch: the leading dimension of its first tensor (depth first).

    A tensor, or a tuple/list/dict holding tensors (``(x, y)``, ``{"input_ids": ...}``).

    Raises:
        ValueError: the batch holds no tensor with at least one dimension.
    """
    found = _first_tensor(batch)
    if found is None:
        raise ValueError(
            f"CBSCallback: found no tensor with a leading (batch) dimension in the batch "
            f"(a {type(batch).__name__}); pass CBSCallback(batch_size_fn=...) to count it"
        )
    return int(found.shape[0])


def _first_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj if obj.ndim >= 1 else None
    if isinstance(obj, Mapping):
        items: Any = obj.values()
    elif isinstance(obj, Sequence) and not isinstance(obj, (str, bytes)):
        items = obj
    else:
        return None
    for item in items:
        found = _first_tensor(item)
        if found is not None:
            return found
    return None


def label_tokens(key: int | str = -1, *, ignore_index: int = -100) -> BatchSizeFn:
    """A ``batch_size_fn`` counting loss-contributing tokens: ``(labels != ignore_index).sum()``.

    Args:
        key: where the labels are in the batch: an index into a tuple/list batch
            (default ``-1``, the last element of ``(x, y)``) or a key of a dict batch.
        ignore_index: label value that does not contribute to the loss (default -100,
            ``torch.nn.functional.cross_entropy``'s default).

    Returns:
        ``fn(batch) -> 0-d tensor`` on the labels' device (no host sync).
    """
    if not isinstance(key, (int, str)) or isinstance(key, bool):
        raise TypeError(f"label_tokens(key={key!r}): expected an int index or a str key")

    def count(batch: Any) -> torch.Tensor:
        labels = batch[key]
        if not isinstance(labels, torch.Tensor):
            raise TypeError(
                f"label_tokens(key={key!r}): batch[{key!r}] is a {type(labels).__name__}, not a tensor of labels"
            )
        return (labels != ignore_index).sum()

    return count
