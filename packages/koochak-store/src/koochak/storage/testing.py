"""Testing helpers for Store implementations: a conformance suite and a fault-injecting store.

Any Store backend proves it keeps the contract by subclassing the suite and providing a fixture
that makes a fresh, empty store::

    import pytest
    from koochak.storage.testing import StoreConformance

    class TestMyStore(StoreConformance):
        @pytest.fixture
        def store(self, tmp_path):
            return MyStore(tmp_path)

``FaultyStore`` is a LocalStore whose filesystem calls fail on demand (an errno on the Nth open,
read, write, fsync, link, close or stat; short writes and reads; corrupted reads), with a fake
clock so tests of settle deadlines never sleep. ``ThrottledStore`` slows any Store to a given
bandwidth (a slow durable tier or an object-storage link, without a network). Importing this
module needs pytest.
"""

from __future__ import annotations

import errno as _errno
import hashlib
import io
import os
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import pytest
from koochak.storage._syscalls import _Syscalls
from koochak.storage.store import (
    TEMP_PREFIX,
    LocalStore,
    ObjectInfo,
    Store,
    StoreCapabilities,
    capabilities_of,
    exists,
    list_shallow,
)

__all__ = [
    "StoreConformance",
    "Fault",
    "FaultyStore",
    "FakeClock",
    "FAULT_OPS",
    "ThrottledStore",
    "visible_files",
]

FAULT_OPS = (
    "open", "read", "write", "fsync", "syncfs", "close", "stat", "link", "rename", "lock",
    "unlink", "list",
)  # fmt: skip


@dataclass(frozen=True)
class Fault:
    """Make calls ``nth`` .. ``nth + times - 1`` (1-based) of one filesystem operation misbehave.

    op:     one of FAULT_OPS ("read" is a positional read, "stat" covers stat and fstat,
            "list" is a directory scan)
    mode:   "error" raises OSError(errno); "short" transfers only half the bytes (write/read);
            "corrupt" flips the first byte returned (read)
    """

    op: str
    nth: int = 1
    errno: int = _errno.EIO
    times: int = 1
    mode: str = "error"

    def __post_init__(self) -> None:
        if self.op not in FAULT_OPS:
            raise ValueError(f"Fault.op={self.op!r}; expected one of {FAULT_OPS}")
        if self.mode not in ("error", "short", "corrupt"):
            raise ValueError(f"Fault.mode={self.mode!r}; expected 'error', 'short' or 'corrupt'")
        if self.mode == "short" and self.op not in ("write", "read"):
            raise ValueError("Fault mode 'short' applies to op 'write' or 'read' only")
        if self.mode == "corrupt" and self.op != "read":
            raise ValueError("Fault mode 'corrupt' applies to op 'read' only")
        if self.nth < 1 or self.times < 1:
            raise ValueError(f"Fault nth={self.nth}, times={self.times}; both must be >= 1")

    def hits(self, call: int) -> bool:
        return self.nth <= call < self.nth + self.times


class FakeClock:
    """A monotonic clock that only moves when someone sleeps on it."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class _FaultySyscalls(_Syscalls):
    def __init__(self, faults: Iterable[Fault]) -> None:
        self.faults = tuple(faults)
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()

    def _fault(self, op: str) -> Fault | None:
        with self._lock:
            self.calls[op] += 1
            call = self.calls[op]
        for fault in self.faults:
            if fault.op == op and fault.hits(call):
                if fault.mode == "error":
                    raise OSError(
                        fault.errno, f"injected {os.strerror(fault.errno)} on {op} #{call}"
                    )
                return fault
        return None

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        self._fault("open")
        return super().open(path, flags, mode)

    def write(self, fd: int, data: memoryview) -> int:
        fault = self._fault("write")
        if fault is not None and len(data) > 1:
            data = data[: len(data) // 2]
        return super().write(fd, data)

    def fsync(self, fd: int) -> None:
        self._fault("fsync")
        super().fsync(fd)

    def syncfs(self, fd: int) -> bool:
        self._fault("syncfs")
        return super().syncfs(fd)

    def start_writeback(self, fd: int, offset: int, length: int) -> bool:
        # Counted, never failed: it is only a hint and the real call reports no errors.
        with self._lock:
            self.calls["writeback"] += 1
        return super().start_writeback(fd, offset, length)

    def close(self, fd: int) -> None:
        try:
            self._fault("close")
        finally:
            super().close(fd)  # the descriptor is gone either way, as with a real failing close

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        fault = self._fault("read")
        if fault is not None and fault.mode == "short" and size > 1:
            size //= 2
        data = super().pread(fd, size, offset)
        if fault is not None and fault.mode == "corrupt" and data:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        return data

    def fstat(self, fd: int) -> os.stat_result:
        self._fault("stat")
        return super().fstat(fd)

    def stat(self, path: str, *, follow_symlinks: bool = False) -> os.stat_result:
        self._fault("stat")
        return super().stat(path, follow_symlinks=follow_symlinks)

    def link(self, src: str, dst: str) -> None:
        self._fault("link")
        super().link(src, dst)

    def rename(self, src: str, dst: str) -> None:
        self._fault("rename")
        super().rename(src, dst)

    def lock(self, fd: int) -> bool:
        self._fault("lock")
        return super().lock(fd)

    def unlink(self, path: str) -> None:
        self._fault("unlink")
        super().unlink(path)

    def scandir(self, path: str) -> list[os.DirEntry[str]]:
        self._fault("list")
        return super().scandir(path)

    def walk(self, path: str) -> Iterator[tuple[str, list[str], list[str]]]:
        # Each directory is one "list"; a failing one is skipped with everything below it,
        # as os.walk skips a directory it cannot list.
        for dirpath, dirnames, filenames in super().walk(path):
            try:
                self._fault("list")
            except OSError:
                dirnames.clear()
                continue
            yield dirpath, dirnames, filenames


class _Delegating:
    """A Store that hands every call to ``inner``; the test stores below override what they
    change."""

    inner: Store

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        return self.inner.get(key, start, end)

    def open(self, key: str) -> BinaryIO:
        return self.inner.open(key)

    def put(self, key: str, data: Any, **expected: Any) -> ObjectInfo:
        return self.inner.put(key, data, **expected)

    def stat(self, key: str) -> ObjectInfo:
        return self.inner.stat(key)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def local_path(self, key: str) -> str | None:
        return self.inner.local_path(key)


class FaultyStore(_Delegating):
    """A LocalStore at ``root`` whose filesystem calls fail as ``faults`` say.

    ``calls`` counts every operation so tests can aim a fault (e.g. "the 3rd write"). The
    ``clock`` (default: a FakeClock) drives settle deadlines; its ``sleep`` never blocks.
    Other keyword arguments go to LocalStore (publish, fsync, verify_readback, ...).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        faults: Iterable[Fault] = (),
        *,
        clock: FakeClock | None = None,
        **settings: Any,
    ) -> None:
        self.inner = LocalStore(root, **settings)
        self.clock = clock if clock is not None else FakeClock()
        self._syscalls = _FaultySyscalls(faults)
        self.inner._sys = self._syscalls
        self.inner._clock = self.clock
        self.inner._sleep = self.clock.sleep
        self.location = f"faulty:{self.inner.location}"
        self.profile = self.inner.profile

    def capabilities(self) -> StoreCapabilities:
        """The LocalStore's profile only: no root or publish mode, so that nothing reaches its
        files by path around the fault seam (a ``latest`` symlink, a probe), no read settling
        (named reads would sleep for real, not on the fake clock), no ``put_many`` (not
        forwarded)."""
        return StoreCapabilities(profile=self.inner.profile)

    @property
    def calls(self) -> Counter[str]:
        return self._syscalls.calls

    @property
    def faults(self) -> tuple[Fault, ...]:
        return self._syscalls.faults

    def set_faults(self, faults: Iterable[Fault]) -> None:
        """Replace the faults and reset the call counters."""
        self._syscalls.faults = tuple(faults)
        self._syscalls.calls.clear()


class ThrottledStore(_Delegating):
    """Any Store, with its reads and/or writes slowed to ``bytes_per_second``.

    Reads and writes each share one link of that bandwidth (full duplex): concurrent transfers
    split it rather than multiply it, as on a real network link or a single disk. Bytes wait
    (``sleep``, by default ``time.sleep``) for their slot on the link and cost no CPU while
    waiting. Metadata calls (stat, list, delete) are not slowed. ``profile`` is the inner
    store's, so ``copy_objects`` plans as it would for that store. A test's slow durable tier,
    a benchmark's 100 MB/s object store.
    """

    _CHUNK = 1 << 20

    def __init__(
        self,
        inner: Store,
        bytes_per_second: float,
        *,
        reads: bool = True,
        writes: bool = True,
        sleep: Any = time.sleep,
    ) -> None:
        if not bytes_per_second > 0:
            raise ValueError(
                f"ThrottledStore: bytes_per_second must be > 0, got {bytes_per_second!r}"
            )
        from koochak.storage.profile import profile_of

        self.inner = inner
        self.location = inner.location
        self.profile = profile_of(inner)
        self.bytes_per_second = float(bytes_per_second)
        self._reads, self._writes = reads, writes
        self._sleep = sleep
        self._lock = threading.Lock()
        self._free_at = {"read": 0.0, "write": 0.0}  # monotonic time each link is free again

    def capabilities(self) -> StoreCapabilities:
        """The inner store's profile only: no root or publish mode (nothing may reach its files
        by path, unthrottled), no batch put or self-checks (not forwarded)."""
        return StoreCapabilities(profile=self.profile)

    def _transfer(self, link: str, nbytes: int) -> None:
        """Wait until ``nbytes`` have crossed ``link`` at the configured bandwidth."""
        if nbytes <= 0:
            return
        with self._lock:
            now = time.monotonic()
            done = max(now, self._free_at[link]) + nbytes / self.bytes_per_second
            self._free_at[link] = done
        delay = done - time.monotonic()
        if delay > 0:
            self._sleep(delay)

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        data = self.inner.get(key, start, end)
        if self._reads:
            self._transfer("read", len(data))
        return data

    def open(self, key: str) -> BinaryIO:
        return io.BytesIO(self.get(key))

    def local_path(self, key: str) -> str | None:
        """None: every byte must cross the link. A reader that used the inner store's path
        (to map a checkpoint, say) would skip the throttle, and one that opened the object to
        find out it is no plain file would already have paid a whole read for it."""
        return None

    def put(self, key: str, data: Any, **expected: Any) -> ObjectInfo:
        if not self._writes:
            return self.inner.put(key, data, **expected)
        if isinstance(data, str):
            return self.inner.put(key, data, **expected)  # the inner store refuses text
        return self.inner.put(key, self._slowed(data), **expected)

    def _slowed(self, data: Any) -> Iterator[Any]:
        if isinstance(data, (bytes, bytearray, memoryview)):
            view = memoryview(data).cast("B")
            for offset in range(0, view.nbytes, self._CHUNK):
                chunk = view[offset : offset + self._CHUNK]
                self._transfer("write", chunk.nbytes)
                yield chunk
            return
        if hasattr(data, "read"):
            while chunk := data.read(self._CHUNK):
                self._transfer("write", len(chunk))
                yield chunk
            return
        for chunk in data:
            self._transfer("write", memoryview(chunk).nbytes)
            yield chunk


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _pattern(size: int, seed: int = 0) -> bytes:
    """Deterministic, non-repeating-looking bytes, so shifted or truncated data never matches."""
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.sha256(f"{seed}:{counter}".encode()).digest()
        counter += 1
    return bytes(out[:size])


def visible_files(root: str | os.PathLike[str]) -> list[str]:
    """Every regular file under ``root`` except publication temp files, as relative paths."""
    found = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            if not name.startswith(TEMP_PREFIX):
                found.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(found)


class StoreConformance:
    """The Store contract as tests. Subclass it and provide a ``store`` fixture (fresh, empty)."""

    @pytest.fixture
    def store(self) -> Store:
        raise NotImplementedError("subclasses of StoreConformance provide a 'store' fixture")

    # -- put -------------------------------------------------------------------------------

    def test_store_satisfies_the_protocol(self, store: Store) -> None:
        assert isinstance(store, Store)
        assert isinstance(store.location, str) and store.location

    def test_put_then_get_returns_the_same_bytes(self, store: Store) -> None:
        data = _pattern(1000)
        store.put("a/b/c.bin", data)
        assert store.get("a/b/c.bin") == data

    def test_put_returns_size_and_sha256_of_what_was_written(self, store: Store) -> None:
        data = _pattern(4321, seed=1)
        info = store.put("x.bin", data)
        assert (info.key, info.size, info.sha256) == ("x.bin", len(data), _sha(data))

    def test_put_is_create_only(self, store: Store) -> None:
        store.put("k", b"first")
        with pytest.raises(FileExistsError):
            store.put("k", b"second, longer")
        assert store.get("k") == b"first"
        assert [info.key for info in store.list()] == ["k"]

    def test_put_accepts_bytes_bytearray_memoryview_streams_and_iterables(
        self, store: Store
    ) -> None:
        data = _pattern(3000, seed=2)
        store.put("bytes", data)
        store.put("bytearray", bytearray(data))
        store.put("memoryview", memoryview(data))
        store.put("stream", io.BytesIO(data))
        store.put("iterable", (data[i : i + 700] for i in range(0, len(data), 700)))
        for key in ("bytes", "bytearray", "memoryview", "stream", "iterable"):
            assert store.get(key) == data, key

    def test_put_from_a_producer_that_reuses_its_buffer(self, store: Store) -> None:
        # Readers often refill one buffer; each chunk must be consumed before the next is asked for.
        parts = [_pattern(3 << 20, seed=seed) for seed in (10, 11, 12)]

        def refilled() -> Iterator[bytearray]:
            buffer = bytearray(3 << 20)
            for part in parts:
                buffer[:] = part
                yield buffer

        info = store.put("reused", refilled())
        assert info.sha256 == _sha(b"".join(parts))
        assert store.get("reused") == b"".join(parts)

    def test_put_refuses_text(self, store: Store) -> None:
        with pytest.raises(TypeError):
            store.put("text", "not bytes")  # type: ignore[arg-type]
        assert store.list() == []

    def test_put_of_an_empty_object(self, store: Store) -> None:
        info = store.put("empty", b"")
        assert info.size == 0 and info.sha256 == _sha(b"")
        assert store.get("empty") == b""
        assert store.stat("empty").size == 0

    def test_put_of_a_multi_chunk_object_round_trips(self, store: Store) -> None:
        data = _pattern(9 << 20, seed=3)  # larger than one 8 MiB write chunk
        info = store.put("big", io.BytesIO(data))
        assert info.sha256 == _sha(data)
        assert store.get("big") == data

    def test_put_with_wrong_expected_size_leaves_nothing(self, store: Store) -> None:
        with pytest.raises(ValueError, match="expected_size"):
            store.put("k", b"12345", expected_size=4)
        with pytest.raises(ValueError, match="expected_size"):
            store.put("k", b"12345", expected_size=6)
        assert store.list() == []
        with pytest.raises(FileNotFoundError):
            store.stat("k")

    def test_put_with_wrong_expected_sha256_leaves_nothing(self, store: Store) -> None:
        with pytest.raises(ValueError, match="expected_sha256"):
            store.put("k", b"abc", expected_sha256=_sha(b"abd"))
        assert store.list() == []
        info = store.put("k", b"abc", expected_size=3, expected_sha256=_sha(b"abc").upper())
        assert info.sha256 == _sha(b"abc")

    @pytest.mark.parametrize(
        ("expectation", "named"),
        [
            ({"expected_size": -1}, "expected_size"),
            ({"expected_size": True}, "expected_size"),
            ({"expected_size": "3"}, "expected_size"),
            ({"expected_sha256": "abc"}, "expected_sha256"),
            ({"expected_sha256": "g" * 64}, "expected_sha256"),
        ],
    )
    def test_put_refuses_malformed_expectations_before_writing(
        self, store: Store, expectation: dict, named: str
    ) -> None:
        with pytest.raises(ValueError, match=named):
            store.put("k", b"abc", **expectation)
        assert store.list() == []

    def test_put_whose_source_fails_leaves_nothing(self, store: Store) -> None:
        def source() -> Iterator[bytes]:
            yield b"x" * 1000
            raise RuntimeError("source broke")

        with pytest.raises(RuntimeError, match="source broke"):
            store.put("k", source())
        assert store.list() == []
        store.put("k", b"retry works")
        assert store.get("k") == b"retry works"

    def test_concurrent_puts_of_one_key_publish_exactly_one(self, store: Store) -> None:
        payloads = [_pattern(50_000, seed=i) for i in range(6)]
        winners: list[bytes] = []
        losers: list[BaseException] = []
        barrier = threading.Barrier(len(payloads))

        def put(data: bytes) -> None:
            barrier.wait()
            try:
                store.put("race", data)
                winners.append(data)
            except FileExistsError as exc:
                losers.append(exc)

        threads = [threading.Thread(target=put, args=(p,)) for p in payloads]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(winners) == 1 and len(losers) == len(payloads) - 1
        assert store.get("race") == winners[0]
        assert [info.key for info in store.list()] == ["race"]

    # -- reads -----------------------------------------------------------------------------

    def test_get_range_is_half_open_and_clamped_like_a_slice(self, store: Store) -> None:
        data = _pattern(100, seed=4)
        store.put("r", data)
        for start, end in [(0, 10), (10, 20), (95, 200), (None, 5), (50, None), (200, 300),
                           (30, 10), (-10, None), (None, -90)]:  # fmt: skip
            assert store.get("r", start, end) == data[start:end], (start, end)

    def test_get_missing_key_raises_file_not_found(self, store: Store) -> None:
        with pytest.raises(FileNotFoundError):
            store.get("missing")
        with pytest.raises(FileNotFoundError):
            store.open("missing")
        with pytest.raises(FileNotFoundError):
            store.stat("missing")

    def test_open_returns_a_readable_binary_stream(self, store: Store) -> None:
        data = _pattern(5000, seed=5)
        store.put("o", data)
        with store.open("o") as stream:
            assert stream.read(10) == data[:10]
            assert stream.read() == data[10:]

    def test_stat_reports_size_and_mtime(self, store: Store) -> None:
        store.put("s", b"12345")
        info = store.stat("s")
        assert (info.key, info.size) == ("s", 5)
        assert isinstance(info.mtime_ns, int) and info.mtime_ns > 0

    def test_a_directory_of_objects_is_not_an_object(self, store: Store) -> None:
        store.put("dir/x", b"1")
        with pytest.raises(FileNotFoundError):
            store.get("dir")
        with pytest.raises(FileNotFoundError):
            store.stat("dir")

    # -- list / delete ---------------------------------------------------------------------

    def test_list_is_recursive_sorted_and_matches_a_string_prefix(self, store: Store) -> None:
        for key in ["b/2", "a/bc/1", "a/b/1", "a/b/0", "a/c", "ab", "z"]:
            store.put(key, key.encode())
        assert [i.key for i in store.list()] == [
            "a/b/0",
            "a/b/1",
            "a/bc/1",
            "a/c",
            "ab",
            "b/2",
            "z",
        ]
        assert [i.key for i in store.list("a/b")] == ["a/b/0", "a/b/1", "a/bc/1"]
        assert [i.key for i in store.list("a/b/")] == ["a/b/0", "a/b/1"]
        assert [i.key for i in store.list("a")] == ["a/b/0", "a/b/1", "a/bc/1", "a/c", "ab"]
        assert [i.key for i in store.list("nothing/")] == []
        sizes = {i.key: i.size for i in store.list()}
        assert sizes["a/bc/1"] == len(b"a/bc/1")

    def test_list_shallow_leaves_out_every_key_with_the_delimiter_after_the_prefix(
        self, store: Store
    ) -> None:
        keys = [
            "s1.pt",
            "s1.pt.ready.json",
            "s1.pt.part-00000-00000",
            "s1.pt.part-00001-index",
            "s2.pt",
            "s2.pt.part-00000-00000",
            "s2.pt.x/part-y",
            "t.pt.part-0",
            "d/s3.pt",
        ]
        for key in keys:
            store.put(key, key.encode())
        shallow = list_shallow(store, "s", ".part-")
        assert [i.key for i in shallow] == ["s1.pt", "s1.pt.ready.json", "s2.pt", "s2.pt.x/part-y"]
        assert shallow == [i for i in store.list("s") if ".part-" not in i.key]  # sizes too
        assert [i.key for i in list_shallow(store, "s1.pt.part-", ".part-")] == [
            "s1.pt.part-00000-00000",
            "s1.pt.part-00001-index",
        ]  # after the prefix only
        assert [i.key for i in list_shallow(store, "", "/")] == [
            k for k in sorted(keys) if "/" not in k]  # fmt: skip

    def test_exists_is_one_stat(self, store: Store) -> None:
        store.put("e/here", b"x")
        assert exists(store, "e/here")
        assert not exists(store, "e/gone")
        assert not exists(store, "e/her")  # a prefix of a key is not a key

    def test_list_of_an_empty_store_is_empty(self, store: Store) -> None:
        assert store.list() == []

    def test_delete_removes_and_a_missing_key_raises(self, store: Store) -> None:
        store.put("d/x", b"1")
        store.delete("d/x")
        assert store.list() == []
        with pytest.raises(FileNotFoundError):
            store.get("d/x")
        with pytest.raises(FileNotFoundError):
            store.delete("d/x")
        store.put("d/x", b"again")  # a deleted key can be created anew
        assert store.get("d/x") == b"again"

    # -- keys ------------------------------------------------------------------------------

    @pytest.mark.parametrize(
        "key", ["", "/abs", "a/../b", "..", "a//b", "a/", "./a", "a/./b", "a?b", "a#b"]
    )
    def test_invalid_keys_are_rejected_by_every_operation(self, store: Store, key: str) -> None:
        for call in (
            lambda: store.put(key, b"1"),
            lambda: store.get(key),
            lambda: store.open(key),
            lambda: store.stat(key),
            lambda: store.delete(key),
        ):
            with pytest.raises(ValueError):
                call()
        assert store.list() == []

    # -- declared abilities (capabilities_of) -------------------------------------------------

    def test_declared_capabilities_are_a_store_capabilities(self, store: Store) -> None:
        declared = capabilities_of(store)
        assert isinstance(declared, StoreCapabilities)
        if declared.profile is not None:
            from koochak.storage.profile import StoreProfile

            assert isinstance(declared.profile, StoreProfile)

    def test_a_declared_root_holds_the_objects(self, store: Store) -> None:
        root = capabilities_of(store).root
        if root is None:
            assert capabilities_of(store).publish is None, "a filesystem publish mode needs a root"
            return
        store.put("rooted/obj", b"where it says")
        assert store.local_path("rooted/obj") == os.path.join(root, "rooted", "obj")
        with open(os.path.join(root, "rooted", "obj"), "rb") as handle:
            assert handle.read() == b"where it says"

    def test_a_declared_batch_put_is_create_only_and_verified(self, store: Store) -> None:
        if not capabilities_of(store).put_many:
            return
        a, b = _pattern(100, seed=20), _pattern(200, seed=21)
        batch = store.put_many  # type: ignore[attr-defined]
        infos = batch([("m/a", a, 100, _sha(a)), ("m/b", b, None, None)])
        assert [(i.key, i.size, i.sha256) for i in infos] == [
            ("m/a", 100, _sha(a)),
            ("m/b", 200, _sha(b)),
        ]
        assert store.get("m/a") == a and store.get("m/b") == b
        with pytest.raises(FileExistsError):
            batch([("m/a", b"again", None, None)])
        with pytest.raises(ValueError):
            batch([("m/c", b"abc", 4, None)])
        assert store.get("m/a") == a
        assert [i.key for i in store.list("m/")] == ["m/a", "m/b"]

    def test_declared_self_checks_answer_in_rows(self, store: Store) -> None:
        if not capabilities_of(store).probe_checks:
            return
        rows = store.probe_checks("probe-checks/")  # type: ignore[attr-defined]
        assert rows, "a store that declares probe_checks reports at least one"
        for row in rows:
            assert set(row) == {"name", "supported", "detail", "seconds"}, row
            assert isinstance(row["name"], str) and row["supported"] in (True, False, None)

    def test_declared_read_settling_reaches_the_named_reads(self, store: Store) -> None:
        from koochak.storage.named import read_settle_seconds

        assert read_settle_seconds(store) == capabilities_of(store).read_settle_seconds >= 0

    # -- built on the contract: a lease works on every store ---------------------------------

    def test_a_lease_admits_one_holder_and_is_released(self, store: Store) -> None:
        from koochak.storage.lease import LeaseHeld, acquire_lease, read_lease

        held = acquire_lease(store, purpose="conformance")
        with pytest.raises(LeaseHeld, match="conformance"):
            acquire_lease(store)
        held.renew()
        assert read_lease(store) == held.record
        held.release()
        assert store.list() == []
        acquire_lease(store).release()
        assert store.list() == []

    def test_local_path_is_absolute_or_none(self, store: Store) -> None:
        store.put("p/q", b"1")
        path = store.local_path("p/q")
        if path is not None:
            assert os.path.isabs(path)
            with open(path, "rb") as f:
                assert f.read() == b"1"
