"""A byte-count progress bar: tqdm on a terminal, nothing in logs and CI."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def progress_bar(
    total: int,
    desc: str,
    *,
    enabled: bool | None = None,
    also: Callable[[int], None] | None = None,
) -> Iterator[Callable[[int], None]]:
    """Yield ``advance(n_bytes)``, which moves the bar and calls ``also(n_bytes)`` (a caller's
    own progress callback); safe to call from several threads, calls are serialised.

    ``enabled=None`` shows a bar only when stderr is a terminal. Without tqdm installed there is
    simply no bar: progress is a convenience, never a reason to fail the work.
    """
    if enabled is None:
        enabled = sys.stderr.isatty()
    bar = None
    if enabled:
        try:
            from tqdm import tqdm
        except ImportError:
            bar = None
        else:
            bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024)
    lock = threading.Lock()

    def advance(n: int) -> None:
        if n <= 0 or (bar is None and also is None):
            return
        with lock:
            if bar is not None:
                bar.update(n)
            if also is not None:
                also(n)

    try:
        yield advance
    finally:
        if bar is not None:
            bar.close()
