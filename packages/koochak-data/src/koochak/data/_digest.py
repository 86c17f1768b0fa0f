"""SHA256 helpers shared by shards, archive, pull and verify: one way to hash a stream."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from typing import Any

# How a SHA256 appears in every format we read: 64 lower-case hex digits.
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
CHUNK = 1 << 20


def sha256_stream(
    read: Callable[[int], bytes],
    *,
    chunk: int = CHUNK,
    progress: Callable[[int], None] | None = None,
) -> tuple[str, int]:
    """Hash everything ``read(chunk)`` returns until it returns nothing: (hex digest, bytes)."""
    digest = hashlib.sha256()
    total = 0
    while data := read(chunk):
        digest.update(data)
        total += len(data)
        if progress is not None:
            progress(len(data))
    return digest.hexdigest(), total


def sha256_object(
    store: Any, key: str, *, chunk: int = CHUNK, progress: Callable[[int], None] | None = None
) -> tuple[str, int]:
    """SHA256 and length of the whole object ``key`` of ``store``, read once in ``chunk``s."""
    with store.open(key) as handle:
        return sha256_stream(handle.read, chunk=chunk, progress=progress)
