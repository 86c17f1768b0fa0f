"""Batch helpers: move nested batches to a device, repeat an iterable, take a prefix, and an
endless resumable shuffle (`shuffled_batches`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from itertools import count, islice
from typing import Any, TypeVar

import torch

T = TypeVar("T")
_TENSOR = torch.Tensor


def to_device(batch: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
    """Return ``batch`` with every tensor moved to ``device``.

    Walks dicts, lists, tuples and named tuples; anything else (strings, numbers) is returned
    unchanged. Tensors already on ``device`` are returned as they are (``Tensor.to`` is a no-op).
    """
    if type(batch) is tuple and len(batch) == 2:  # (inputs, targets), the commonest batch of all
        first, second = batch
        if isinstance(first, _TENSOR) and isinstance(second, _TENSOR):
            if non_blocking:
                return first.to(device, non_blocking=True), second.to(device, non_blocking=True)
            return first.to(device), second.to(device)  # per batch: no keyword to pass
    kind = type(batch)
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if kind is tuple or kind is list:  # the common case first: cheaper than the Mapping check
        moved = [
            v.to(device, non_blocking=non_blocking)
            if type(v) is torch.Tensor
            else to_device(v, device, non_blocking)
            for v in batch
        ]
        return tuple(moved) if kind is tuple else moved
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


def shuffled_batches(
    num_items: int, batch_size: int, *, seed: int, start: int = 0
) -> Iterator[torch.Tensor]:
    """Endless index batches over ``num_items`` items, reproducible batch by batch.

    Pass ``p`` is a permutation drawn from ``(seed, p)`` alone, cut into ``num_items //
    batch_size`` full batches (the ragged tail is dropped). Batch ``b`` is therefore the same in
    every run, and a resumed run passes ``start=checkpoint["next_step"] * grad_accum`` to see
    exactly the batches an uninterrupted run would have seen next. Nothing is drawn from the
    global RNG, so the checkpoint's RNG state stays untouched.
    """
    if batch_size < 1 or num_items < batch_size:
        raise ValueError(
            f"shuffled_batches(): need 1 <= batch_size <= num_items, got batch_size={batch_size} "
            f"for {num_items} items"
        )
    if start < 0:
        raise ValueError(f"shuffled_batches(): start must be >= 0, got {start}")
    per_pass = num_items // batch_size
    first_pass, offset = divmod(start, per_pass)
    for p in count(first_pass):
        # A large odd multiplier keeps (seed, pass) pairs from colliding for small seeds.
        order = torch.randperm(
            num_items, generator=torch.Generator().manual_seed(seed * 1_000_003 + p)
        )
        for i in range(offset, per_pass):
            yield order[i * batch_size : (i + 1) * batch_size]
        offset = 0
