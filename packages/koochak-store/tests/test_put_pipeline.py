"""How put moves bytes: reused read buffers, SHA256 overlapped, disk writeback started early."""

from __future__ import annotations

import hashlib
import io
import os
import sys

import pytest
from koochak.storage import _payload, _syscalls
from koochak.storage._payload import _stream_chunks
from koochak.storage.store import LocalStore
from koochak.storage.testing import FaultyStore

DATA = bytes(range(256)) * 12_000  # ~3 MB


@pytest.fixture
def small_chunks(monkeypatch):
    """Many chunks from little data, each hashed on the helper thread as in a large put."""
    monkeypatch.setattr(_payload, "_READ_CHUNK", 64 << 10)
    monkeypatch.setattr(_payload, "_CHUNK", 64 << 10)
    monkeypatch.setattr(_payload, "_OVERLAP_MIN", 1)


class _ShortReads(io.RawIOBase):
    """A raw stream whose reads return at most 10,000 bytes, like a pipe or a socket."""

    def __init__(self, data: bytes) -> None:
        self._data = memoryview(data)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = min(len(buffer), 10_000, len(self._data) - self._pos)
        buffer[:n] = self._data[self._pos : self._pos + n]
        self._pos += n
        return n


class _ReadOnly:
    """A stream with read() only (no readinto)."""

    def __init__(self, data: bytes) -> None:
        self._inner = io.BytesIO(data)

    def read(self, n: int = -1) -> bytes:
        return self._inner.read(n)


class _RawReadOverride(io.RawIOBase):
    """Overrides read() alone, so its readinto is the io.RawIOBase stub that raises."""

    def __init__(self, data: bytes) -> None:
        self._inner = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        return self._inner.read(n)


class _BufferedReadOverride(io.BufferedIOBase):
    """Overrides read() alone; io.BufferedIOBase.readinto then works through read()."""

    def __init__(self, data: bytes) -> None:
        self._inner = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def read(self, n: int | None = -1) -> bytes:
        return self._inner.read(n)


@pytest.mark.parametrize("publish", ["link", "exclusive"])
@pytest.mark.parametrize(
    "make",
    [
        io.BytesIO,
        _ReadOnly,
        _ShortReads,
        lambda d: io.BufferedReader(_ShortReads(d)),
        _RawReadOverride,
        _BufferedReadOverride,
    ],
    ids=["BytesIO", "read-only", "raw-short-reads", "buffered", "raw-read-only", "buffered-read"],
)
def test_streams_hash_and_store_every_byte_across_many_reused_buffers(
    tmp_path, small_chunks, publish, make
):
    store = LocalStore(tmp_path, publish=publish)
    info = store.put("obj", make(DATA), expected_size=len(DATA))
    assert info.sha256 == hashlib.sha256(DATA).hexdigest()
    assert store.get("obj") == DATA


def test_stream_chunks_alternate_two_buffers_after_the_first_read(small_chunks):
    # The producer refills buffer k while chunk k - 1 (the other buffer) is hashed and written;
    # a chunk's buffer is reused only two chunks later, after its hash was waited for.
    stream = io.BytesIO(DATA)
    chunks = _stream_chunks(stream, stream.read)
    first, stable = next(chunks)
    assert stable and isinstance(first.obj, bytes)
    owners = []
    for chunk, stable in chunks:
        assert stable
        owners.append(id(chunk.obj))
    assert len(owners) > 4
    assert owners[0] != owners[1] and owners[0::2] == [owners[0]] * len(owners[0::2])
    assert owners[1::2] == [owners[1]] * len(owners[1::2])


def test_a_small_stream_never_allocates_the_read_buffers(monkeypatch):
    made = []
    real = bytearray

    def spy(*args):
        made.append(args)
        return real(*args)

    monkeypatch.setattr(_payload, "bytearray", spy, raising=False)
    stream = io.BytesIO(b"tiny")
    assert [bytes(c) for c, _ in _stream_chunks(stream, stream.read)] == [b"tiny"]
    assert made == []


def test_a_stream_that_returns_none_or_text_is_refused(tmp_path):
    class NonBlocking(io.RawIOBase):
        def readable(self) -> bool:
            return True

        def readinto(self, buffer):
            return None

    store = LocalStore(tmp_path)
    with pytest.raises(TypeError, match="blocking"):
        store.put("a", NonBlocking())
    with pytest.raises(TypeError, match="text mode"):
        store.put("b", io.StringIO("text"))
    assert store.list() == []


def test_put_starts_writeback_of_each_large_chunk_then_fsyncs(tmp_path, small_chunks):
    store = FaultyStore(tmp_path)
    store.put("obj", DATA)
    chunks = -(-len(DATA) // (64 << 10))
    assert store.calls["writeback"] == chunks
    assert store.calls["fsync"] >= 2  # the file, then its directory: durability is fsync's job
    assert store.get("obj") == DATA


def test_without_fsync_no_writeback_is_started(tmp_path, small_chunks):
    store = FaultyStore(tmp_path, fsync=False)
    store.put("obj", DATA)
    assert store.calls["writeback"] == 0


def test_small_puts_make_no_writeback_call(tmp_path):
    store = FaultyStore(tmp_path)
    store.put("obj", b"x" * 1000)
    assert store.calls["writeback"] == 0


def test_writeback_unavailable_is_tried_once_and_the_put_still_succeeds(
    tmp_path, small_chunks, monkeypatch
):
    monkeypatch.setattr(_syscalls, "_sync_file_range", lambda: None)
    store = FaultyStore(tmp_path)
    info = store.put("obj", DATA)
    assert store.calls["writeback"] == 1  # refused once, then not asked again in this put
    assert info.sha256 == hashlib.sha256(DATA).hexdigest()
    assert store.get("obj") == DATA


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux-only")
def test_sync_file_range_is_found_and_accepts_a_written_range_on_linux(tmp_path):
    # Guards the ctypes signature: a wrong one would fail silently and lose the speed-up.
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"x" * 8192)
        assert _syscalls._Syscalls().start_writeback(fd, 0, 8192) is True
    finally:
        os.close(fd)


def test_large_chunks_are_hashed_on_the_helper_thread_while_the_caller_writes(
    tmp_path, small_chunks, monkeypatch
):
    # The overlap itself: SHA256 of a chunk runs on the helper thread, never on the writing one.
    import threading

    real = hashlib.sha256
    threads: list[str] = []

    class Recording:
        def __init__(self) -> None:
            self._sha = real()

        def update(self, data) -> None:
            threads.append(threading.current_thread().name)
            self._sha.update(data)

        def hexdigest(self) -> str:
            return self._sha.hexdigest()

    monkeypatch.setattr(_payload.hashlib, "sha256", Recording)
    info = LocalStore(tmp_path).put("obj", io.BytesIO(DATA))
    assert info.sha256 == real(DATA).hexdigest()
    assert len(threads) > 4
    assert all(name.startswith("koochak-sha256") for name in threads)
