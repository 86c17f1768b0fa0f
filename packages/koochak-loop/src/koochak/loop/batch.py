"""Batch helpers: move nested batches to a device, repeat an iterable, take a prefix."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from itertools import islice
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def to_device(batch: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
    """Return ``batch`` with every tensor moved to ``device``.

    Walks dicts, lists, tuples and named tuples; anything else (strings, numbers) is returned
    unchanged. Tensors already on ``device`` are returned as they are (``Tensor.to`` is a no-op).
    """
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        moved = {k: to_device(v, device, non_blocking) for k, v in batch.items()}
        if type(batch) is dict:
            return moved
        try:
            return type(batch)(moved)
        except TypeError:  # mappings whose constructor takes other arguments (defaultdict, ...)
            return moved
    if isinstance(batch, tuple):
        moved = [to_device(v, device, non_blocking) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else tuple(moved)
    if isinstance(batch, list):
        return [to_device(v, device, non_blocking) for v in batch]
    return batch


def cycle(iterable: Iterable[T]) -> Iterator[T]:
    """Iterate ``iterable`` again and again (re-calling ``iter``, so a DataLoader reshuffles).

    Unlike ``itertools.cycle`` nothing is cached. An iterable that yields nothing raises
    ValueError instead of spinning forever.
    """
    while True:
        empty = True
        for item in iterable:
            empty = False
            yield item
        if empty:
            raise ValueError("cycle(): the iterable yielded no items")


def take(iterable: Iterable[T], n: int) -> Iterator[T]:
    """The first ``n`` items of ``iterable`` (fewer if it ends first)."""
    if n < 0:
        raise ValueError(f"take(): n must be >= 0, got {n}")
    return islice(iterable, n)
