"""A byte-count progress bar: tqdm on a terminal, nothing in logs and CI."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def progress_bar(
    total: int, desc: str, *, enabled: bool | None = None
) -> Iterator[Callable[[int], None]]:
    """Yield ``advance(n_bytes)``; safe to call from several threads.

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
        if bar is not None and n > 0:
            with lock:
                bar.update(n)

    try:
        yield advance
    finally:
        if bar is not None:
            bar.close()
