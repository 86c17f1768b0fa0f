"""Wall-clock timing of code blocks.

CUDA kernels run asynchronously, so a host timer around GPU work measures launch time unless the
device is synchronised first. That sync stalls the pipeline, so it happens only when asked for
(`cuda_sync=True`) and only when CUDA is initialised.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Union

import torch

__all__ = ["Timer", "time_block"]

Sink = Union[Callable[[str, float], None], MutableMapping[str, float], None]


def _maybe_sync(cuda_sync: bool) -> None:
    if cuda_sync and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Timer:
    """A restartable stopwatch; also a context manager (`with Timer() as t: ...; t.elapsed`)."""

    def __init__(self, cuda_sync: bool = False, clock: Callable[[], float] = time.perf_counter):
        self.cuda_sync = cuda_sync
        self._clock = clock
        self._start: float | None = None
        self.elapsed = 0.0

    def start(self) -> Timer:
        _maybe_sync(self.cuda_sync)
        self._start = self._clock()
        return self

    def stop(self) -> float:
        """Stop and return the seconds since `start`; `elapsed` keeps the value."""
        if self._start is None:
            raise RuntimeError("Timer.stop() called before Timer.start()")
        _maybe_sync(self.cuda_sync)
        self.elapsed = self._clock() - self._start
        self._start = None
        return self.elapsed

    @property
    def running(self) -> bool:
        return self._start is not None

    def __enter__(self) -> Timer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def time_block(name: str, sink: Sink = None, *, cuda_sync: bool = False) -> Iterator[Timer]:
    """Time the `with` body and report it to `sink` when the body ends (also on an exception).

    `sink` is a callable `sink(name, seconds)`, or a mutable mapping to which the seconds are added
    (`sink[name] += seconds`, so repeated blocks accumulate), or None to only read the yielded
    Timer's `elapsed`.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"time_block name must be a non-empty string, got {name!r}")
    if sink is not None and not callable(sink) and not isinstance(sink, MutableMapping):
        raise TypeError(
            f"time_block sink must be a callable(name, seconds), a mutable mapping or None, "
            f"got {type(sink).__name__}"
        )
    timer = Timer(cuda_sync=cuda_sync)
    timer.start()
    try:
        yield timer
    finally:
        seconds = timer.stop()
        if isinstance(sink, MutableMapping):
            sink[name] = sink.get(name, 0.0) + seconds
        elif sink is not None:
            sink(name, seconds)
