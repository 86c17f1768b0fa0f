"""Small helpers for the thread pools that read and write collections."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any


def wait_all(futures: Sequence[Future[Any]]) -> None:
    """Wait for every future in order; on the first failure cancel the ones not yet started (so
    no new request is made after an error) and re-raise it."""
    try:
        for future in futures:
            future.result()
    except BaseException:
        for future in futures:
            future.cancel()
        raise
