"""CUDA prefetch: copy the next batch to the GPU on a side stream while this one computes.

On a CUDA device each batch is pinned (page-locked) and copied with ``non_blocking=True`` on a
dedicated stream one step ahead; before a batch is handed out the compute stream waits for its
copy, and every tensor is marked as used by the compute stream so the caching allocator does not
recycle its memory early. On any other device this is a plain ``to_device`` pass-through, which
is what the CPU unit tests exercise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from koochak.loop.batch import to_device


def _pin(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch if batch.is_pinned() else batch.pin_memory()
    if isinstance(batch, dict):
        return {k: _pin(v) for k, v in batch.items()}
    if isinstance(batch, tuple):
        pinned = [_pin(v) for v in batch]
        return type(batch)(*pinned) if hasattr(batch, "_fields") else tuple(pinned)
    if isinstance(batch, list):
        return [_pin(v) for v in batch]
    return batch


def _record_stream(batch: Any, stream: torch.cuda.Stream) -> None:
    if isinstance(batch, torch.Tensor):
        batch.record_stream(stream)
    elif isinstance(batch, dict):
        for v in batch.values():
            _record_stream(v, stream)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            _record_stream(v, stream)


def cuda_prefetch(
    iterable: Iterable[Any],
    device: torch.device | str,
    prepare_batch_fn: Callable[[Any], Any] | None = None,
) -> Iterator[Any]:
    """Yield the batches of ``iterable`` on ``device``, one copy in flight ahead on CUDA.

    ``prepare_batch_fn`` (optional) runs on each batch once it is on the device (on CUDA: on the
    side stream, so GPU-side preprocessing overlaps the previous step too).
    """
    device = torch.device(device)
    if device.type != "cuda":
        for batch in iterable:
            batch = to_device(batch, device)
            yield prepare_batch_fn(batch) if prepare_batch_fn is not None else batch
        return

    stream = torch.cuda.Stream(device=device)

    def load(batch: Any) -> Any:
        with torch.cuda.stream(stream):
            moved = to_device(_pin(batch), device, non_blocking=True)
            return prepare_batch_fn(moved) if prepare_batch_fn is not None else moved

    iterator = iter(iterable)
    try:
        pending = load(next(iterator))
    except StopIteration:
        return
    while True:
        current_stream = torch.cuda.current_stream(device)
        current_stream.wait_stream(stream)
        ready = pending
        _record_stream(ready, current_stream)
        try:
            pending = load(next(iterator))
        except StopIteration:
            yield ready
            return
        yield ready
