"""What ``put`` receives and how it is hashed: payload chunking and the overlapped SHA256 (the
checks of ``expected_size`` / ``expected_sha256`` are the contract's: ``protocol.check_put_expectations``).

Nothing here touches the filesystem; LocalStore writes what these helpers hand it. The sizes are
module attributes on purpose (LocalStore reads them through this module), so tests can shrink
them to get many chunks from little data.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

# Large enough that per-call overhead vanishes against the disk, small enough to pipeline hashing.
_CHUNK = 8 << 20
# Reads from a stream: larger than LocalStore.open's 8 MiB buffer, so a BufferedReader reads
# straight into put's buffer instead of through its own.
_READ_CHUNK = 16 << 20
# Below this a chunk is hashed inline; handing it to a thread would cost more than it saves.
_OVERLAP_MIN = 1 << 20


class _Hasher:
    """SHA256 of a stream of chunks, overlapped with reading and writing them.

    hashlib releases the GIL for large buffers, so a helper thread hashes chunk *n* while the
    caller writes it and fetches chunk *n + 1*. At most one chunk is in flight, so the digest is
    always taken in order; ``wait()`` before reusing a buffer that may be mutated.
    """

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None

    def start(self, chunk: memoryview) -> None:
        self.wait()
        if len(chunk) < _OVERLAP_MIN:
            self._sha.update(chunk)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="koochak-sha256")
        self._pending = self._pool.submit(self._sha.update, chunk)

    def wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def hexdigest(self) -> str:
        self.wait()
        return self._sha.hexdigest()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


def _views(data: bytes | bytearray | memoryview) -> Iterator[memoryview]:
    """Split one buffer into ``_CHUNK``-sized views, without copying."""
    view = memoryview(data).cast("B")
    for offset in range(0, len(view), _CHUNK):
        yield view[offset : offset + _CHUNK]


def _chunks(data: object) -> Iterator[tuple[memoryview, bool]]:
    """Yield the payload of ``put`` as ``(chunk, stable)`` memoryviews, without copying buffers.

    ``stable`` means the chunk's bytes stay unchanged while the *next* chunk is produced, so its
    hash may still be running then. That holds for immutable bytes, for a buffer handed to put
    whole (its owner is blocked in put), and for this function's own two alternating read
    buffers; it does not hold for blocks from a caller's iterable, which may refill one buffer.
    """
    if isinstance(data, str):
        raise TypeError(
            "put() data must be bytes, a binary stream or an iterable of bytes, not str"
        )
    if isinstance(data, (bytes, bytearray, memoryview)):
        for view in _views(data):
            yield view, True
        return
    read = getattr(data, "read", None)
    if callable(read):
        yield from _stream_chunks(data, read)
        return
    try:
        iterator = iter(data)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(
            f"put() data must be bytes, a binary stream or an iterable of bytes, "
            f"got {type(data).__name__}"
        ) from None
    for block in iterator:
        if not isinstance(block, (bytes, bytearray, memoryview)):
            raise TypeError(f"put() iterable yielded {type(block).__name__}; expected bytes")
        stable = isinstance(block, bytes)
        for view in _views(block):
            yield view, stable


def _stream_chunks(
    stream: object, read: Callable[[int], object]
) -> Iterator[tuple[memoryview, bool]]:
    """Chunks of a binary stream: read into two reused buffers where the stream allows it.

    ``readinto`` fills the same two buffers in turn (one being written and hashed while the
    other fills) instead of allocating a new bytes object per chunk. The first read uses
    ``read``, so a small stream never pays for the buffers; a stream whose ``readinto`` is only
    the unimplemented stub (an ``io.RawIOBase`` subclass overriding ``read`` alone) stays on
    ``read``.
    """
    block = _checked_block(read(_READ_CHUNK))
    if not block:
        return
    yield memoryview(block).cast("B"), isinstance(block, bytes)
    readinto = getattr(stream, "readinto", None)
    buffers = None
    if len(block) == _READ_CHUNK and callable(readinto):
        buffers = [memoryview(bytearray(_READ_CHUNK)), memoryview(bytearray(_READ_CHUNK))]
        try:
            got = readinto(buffers[0])
        except (NotImplementedError, io.UnsupportedOperation):
            buffers = None  # the stub raises before reading anything: nothing is lost
    if buffers is None:
        while block := _checked_block(read(_READ_CHUNK)):
            yield memoryview(block).cast("B"), isinstance(block, bytes)
        return
    turn = 0
    while True:
        if got is None:
            raise TypeError("put() stream returned None; pass a blocking binary stream")
        if not got:
            return
        yield buffers[turn][:got], True
        turn ^= 1
        got = readinto(buffers[turn])


def _checked_block(block: object) -> bytes:
    if block is None:  # non-blocking stream with nothing ready: not supported
        raise TypeError("put() stream returned None; pass a blocking binary stream")
    if isinstance(block, str):
        raise TypeError("put() stream is in text mode; open it with 'rb'")
    if not isinstance(block, (bytes, bytearray, memoryview)):
        raise TypeError(f"put() stream read returned {type(block).__name__}; expected bytes")
    return block  # type: ignore[return-value]
