"""Reads of objects that a verified manifest names: missing means "not visible here yet".

A ready manifest, a shard index or a collection's file table names objects that were complete
before it was written. Through an object-storage mount another client may see the manifest
before the objects (listings and lookups are cached per client for a while), so when such an
object is missing that is the store still settling, not an absent object: these reads retry a
FileNotFoundError until the store's declared ``read_settle_seconds`` pass
(``capabilities_of(store)``; 0 for a store that declares none), and then raise a FileNotFoundError that says a manifest names the
object. They never turn it into "absent": a caller that skips absent objects (resume picking the
newest valid checkpoint) must not skip one that is only late.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from typing import BinaryIO, TypeVar

from koochak.storage.protocol import ObjectInfo, Store, capabilities_of

__all__ = ["get_named", "open_named", "stat_named", "read_settle_seconds"]

_T = TypeVar("_T")
_log = logging.getLogger(__name__)


def read_settle_seconds(store: Store) -> float:
    """How long ``store`` asks readers to wait for an object to appear (0 if it does not say)."""
    return float(capabilities_of(store).read_settle_seconds)


def get_named(
    store: Store, key: str, start: int | None = None, end: int | None = None, *, named_by: str
) -> bytes:
    """``store.get(key, start, end)`` for an object ``named_by`` (a manifest) says exists."""
    return _named(store, key, named_by, lambda: store.get(key, start, end))


def open_named(store: Store, key: str, *, named_by: str) -> BinaryIO:
    """``store.open(key)`` for an object ``named_by`` says exists."""
    return _named(store, key, named_by, lambda: store.open(key))


def stat_named(store: Store, key: str, *, named_by: str) -> ObjectInfo:
    """``store.stat(key)`` for an object ``named_by`` says exists."""
    return _named(store, key, named_by, lambda: store.stat(key))


def _named(store: Store, key: str, named_by: str, call: Callable[[], _T]) -> _T:
    wait = read_settle_seconds(store)
    deadline = time.monotonic() + wait
    delay = 0.05
    while True:
        try:
            return call()
        except FileNotFoundError:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if delay == 0.05:
                _log.info("%s/%s, named by %s, is not visible yet; waiting up to %.0f s",
                          store.location, key, named_by, left)  # fmt: skip
            time.sleep(min(delay, left))
            delay = min(delay * 2, 2.0)
    raise FileNotFoundError(
        errno.ENOENT,
        f"missing although {named_by} names it (waited read_settle_seconds={wait:g}); another "
        "client may not have finished, or it was removed by hand: restore it, or remove "
        f"{named_by} if that publication is gone",
        f"{store.location}/{key}",
    )
