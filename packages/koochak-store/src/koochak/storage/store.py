"""Write-once object stores: the Store protocol, LocalStore and open_store.

A Store holds immutable objects under relative POSIX keys. The contract is deliberately narrow —
get, open, put (create-only), stat, list, delete, local_path — because object storage and its
FUSE mounts cannot rename, append, overwrite or symlink atomically. Everything durable that
Koochak writes goes through it.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import io
import logging
import os
import pathlib
import re
import stat as _stat
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO, Protocol, TypeVar, runtime_checkable
from urllib.parse import unquote

from koochak.storage.keys import PUBLISH_MODES, TEMP_PREFIX, _validate_prefix, validate_key

if TYPE_CHECKING:
    from koochak.storage.profile import StoreProfile

__all__ = [
    "ObjectInfo",
    "Store",
    "LocalStore",
    "PUBLISH_MODES",
    "SETTLING_ERRNOS",
    "TEMP_PREFIX",
    "validate_key",
    "open_store",
    "register_store",
]

_T = TypeVar("_T")
_log = logging.getLogger(__name__)

# Errors some object-storage mounts return for minutes after another node closed a file (ETIME,
# EIO) or while their client is cut off from the service. Only these are waited out, only on reads.
SETTLING_ERRNOS = frozenset(
    {errno.ETIME, errno.EIO, errno.ECONNABORTED, errno.ECONNRESET, errno.ENOTCONN}
)

# Large enough that per-call overhead vanishes against the disk, small enough to pipeline hashing.
_CHUNK = 8 << 20
# Reads from a stream: larger than LocalStore.open's 8 MiB buffer, so a BufferedReader reads
# straight into put's buffer instead of through its own.
_READ_CHUNK = 16 << 20
# Below this a chunk is hashed inline; handing it to a thread would cost more than it saves.
_OVERLAP_MIN = 1 << 20
# How a put creates its file (a temp name, or the key itself): never an existing one.
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC


@dataclass(frozen=True)
class ObjectInfo:
    """What a store knows about one object. ``sha256`` is set by ``put`` only."""

    key: str
    size: int
    mtime_ns: int
    sha256: str | None = None


@runtime_checkable
class Store(Protocol):
    """A flat namespace of write-once objects under relative POSIX keys.

    Contract (every implementation, checked by ``koochak.storage.testing.StoreConformance``):

    * ``get(key, start, end)`` returns the bytes of ``[start, end)`` with slice semantics
      (clamped at EOF); a missing key raises ``FileNotFoundError``.
    * ``open(key)`` returns a readable binary stream.
    * ``put(key, data)`` is create-only: an existing key raises ``FileExistsError`` and the
      existing object is untouched. It returns only once the object is durable and reads back
      with the written size; nothing partial is ever visible under ``key``. A mismatch with
      ``expected_size`` / ``expected_sha256`` raises ``ValueError`` and leaves nothing behind.
    * ``stat(key)`` and ``list(prefix)`` describe objects; ``list`` matches a plain string prefix
      recursively, sorted by key, and never shows publication temp files.
    * ``delete(key)`` removes one object; a missing key raises ``FileNotFoundError``.
    * ``local_path(key)`` is an absolute filesystem path when there is one, else ``None``.

    There is no rename, append, overwrite or symlink: object storage cannot provide them.
    """

    location: str

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes: ...

    def open(self, key: str) -> BinaryIO: ...

    def put(
        self,
        key: str,
        data: bytes | bytearray | memoryview | BinaryIO | Iterable[bytes],
        *,
        expected_size: int | None = None,
        expected_sha256: str | None = None,
    ) -> ObjectInfo: ...

    def stat(self, key: str) -> ObjectInfo: ...

    def list(self, prefix: str = "") -> list[ObjectInfo]: ...

    def delete(self, key: str) -> None: ...

    def local_path(self, key: str) -> str | None: ...


class _Syscalls:
    """The filesystem calls LocalStore makes, in one place so tests can inject faults."""

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        return os.open(path, flags, mode)

    def write(self, fd: int, data: memoryview) -> int:
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def start_writeback(self, fd: int, offset: int, length: int) -> bool:
        """Start (not wait for) writeback of a written range; False where that is unsupported.

        Only a head start for the fsync that follows, which alone makes the bytes durable and
        reports any write error, so a refusal here (no such call, a filesystem that does not
        support it) is no fault of the put.
        """
        function = _sync_file_range()
        if function is None:
            return False
        return function(fd, offset, length, _SYNC_FILE_RANGE_WRITE) == 0

    def close(self, fd: int) -> None:
        os.close(fd)

    def syncfs(self, fd: int) -> bool:
        """Flush the whole filesystem holding ``fd`` (Linux ``syncfs``); False where missing."""
        function = _libc_syncfs()
        if function is None:
            return False
        if function(fd) != 0:
            error = _ctypes_errno()
            raise OSError(error, f"syncfs failed: {os.strerror(error)}")
        return True

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        return os.pread(fd, size, offset)

    def fstat(self, fd: int) -> os.stat_result:
        return os.fstat(fd)

    def stat(self, path: str) -> os.stat_result:
        return os.lstat(path)  # like _open_object: a symlink is not an object

    def link(self, src: str, dst: str) -> None:
        os.link(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def scandir(self, path: str) -> list[os.DirEntry[str]]:
        with os.scandir(path) as it:
            return list(it)


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


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux only; not in Python's os module), or None."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function  # ctypes releases the GIL for the call, so hashing keeps running


_SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>: start writeback of dirty pages, do not wait for it


@functools.cache
def _libc_syncfs() -> Callable[[int], int] | None:
    """libc's ``syncfs`` (Linux only; not in Python's os module), or None."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        function = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def _ctypes_errno() -> int:
    import ctypes

    return ctypes.get_errno()


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


_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def _check_expected(key: str, expected_size: int | None, expected_sha256: str | None) -> str | None:
    if expected_size is not None and (
        isinstance(expected_size, bool) or not isinstance(expected_size, int) or expected_size < 0
    ):
        raise ValueError(
            f"put({key!r}): expected_size must be a non-negative int, got {expected_size!r}"
        )
    if expected_sha256 is None:
        return None
    digest = str(expected_sha256).lower()
    if not _SHA256_HEX.fullmatch(digest):
        raise ValueError(
            f"put({key!r}): expected_sha256 must be 64 hex digits, got {expected_sha256!r}"
        )
    return digest


class LocalStore:
    """A Store on a local or mounted filesystem, rooted at ``root``.

    ``publish="link"`` (POSIX filesystems) writes a hidden temp file in the target directory,
    fsyncs it, then hard-links it to the key (``os.link`` never replaces) and removes the temp
    name. ``publish="exclusive"`` (object-storage FUSE mounts without hard links) creates the key
    itself with ``O_CREAT|O_EXCL`` and relies on the mount publishing the object on close; a put
    that fails removes what it created.

    ``fsync=False`` skips fsync for mounts that reject it; ``verify_readback=True`` re-reads and
    re-hashes every object after writing it; ``settle_seconds`` waits for a just-closed object to
    appear with its full size; ``read_settle_seconds`` retries reads (get, open, stat, list) that
    fail with one of ``SETTLING_ERRNOS`` until that deadline. Writes are never retried.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        publish: str = "link",
        fsync: bool = True,
        verify_readback: bool = False,
        settle_seconds: float = 0.0,
        read_settle_seconds: float = 0.0,
        profile: StoreProfile | None = None,
    ) -> None:
        if publish not in PUBLISH_MODES:
            raise ValueError(f"LocalStore publish={publish!r}; expected one of {PUBLISH_MODES}")
        for name, value in (
            ("settle_seconds", settle_seconds),
            ("read_settle_seconds", read_settle_seconds),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"LocalStore {name}={value!r}; expected a number >= 0")
        if profile is not None:
            from koochak.storage.profile import StoreProfile

            if not isinstance(profile, StoreProfile):
                raise TypeError(
                    f"LocalStore profile must be a StoreProfile, got {type(profile).__name__}"
                )
        self.root = pathlib.Path(os.path.abspath(os.path.expanduser(os.fspath(root))))
        self.location = str(self.root)
        self.publish = publish
        self.fsync = bool(fsync)
        self.verify_readback = bool(verify_readback)
        self.settle_seconds = float(settle_seconds)
        self.read_settle_seconds = float(read_settle_seconds)
        self.profile = profile
        # Seams for tests: fault injection and a fake clock, so no test sleeps for real.
        self._sys = _Syscalls()
        self._clock: Callable[[], float] = time.monotonic
        self._sleep: Callable[[float], None] = time.sleep

    def __repr__(self) -> str:
        return f"LocalStore({self.location!r}, publish={self.publish!r})"

    def child(self, prefix: str) -> LocalStore:
        """A LocalStore with the same settings, rooted at ``root/prefix``."""
        validate_key(prefix)
        other = LocalStore(
            self.root / prefix,
            publish=self.publish,
            fsync=self.fsync,
            verify_readback=self.verify_readback,
            settle_seconds=self.settle_seconds,
            read_settle_seconds=self.read_settle_seconds,
            profile=self.profile,
        )
        other._sys, other._clock, other._sleep = self._sys, self._clock, self._sleep
        return other

    def local_path(self, key: str) -> str:
        return str(self.root / validate_key(key))

    # -- reads -----------------------------------------------------------------------------

    def _settled(self, what: str, call: Callable[[], _T]) -> _T:
        """Run a read, waiting out the settling errnos until ``read_settle_seconds`` pass."""
        deadline = self._clock() + self.read_settle_seconds
        delay = 0.05
        while True:
            try:
                return call()
            except OSError as exc:
                remaining = deadline - self._clock()
                if exc.errno not in SETTLING_ERRNOS or remaining <= 0:
                    raise
                if delay == 0.05:  # once per read: say why this read is slow
                    _log.info("%s in %s: %s; retrying for up to %.0f s", what, self.location,
                              exc, remaining)  # fmt: skip
                self._sleep(min(delay, remaining))
                delay = min(delay * 2, 2.0)

    def _open_object(self, key: str) -> tuple[int, os.stat_result]:
        """A descriptor on the regular file at ``key``, checked before anything is read.

        O_NONBLOCK: opening a FIFO (or device) planted under the root must not block; O_NOFOLLOW:
        a symlink is not an object (a ``latest`` pointer is for people, not for reads). Either
        is FileNotFoundError, as for a directory, so callers see "missing", never a hang.
        """
        path = self.local_path(key)
        try:
            fd = self._sys.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise FileNotFoundError(errno.ENOENT, "not an object (a symlink)", path) from None
            raise
        try:
            st = self._sys.fstat(fd)
            if not _stat.S_ISREG(st.st_mode):
                raise FileNotFoundError(
                    errno.ENOENT, "not an object (a directory, FIFO or device)", path
                )
            os.set_blocking(fd, True)  # a regular file: reads may wait for the disk again
        except BaseException:
            self._sys.close(fd)
            raise
        return fd, st

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        validate_key(key)
        for name, value in (("start", start), ("end", end)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"get({key!r}): {name} must be an int or None, got {value!r}")
        return self._settled(f"get {key}", lambda: self._get(key, start, end))

    def _get(self, key: str, start: int | None, end: int | None) -> bytes:
        fd, st = self._open_object(key)
        try:
            begin, stop, _ = slice(start, end).indices(st.st_size)
            want = max(0, stop - begin)
            # os.pread allocates the result once and reads straight into it: no extra copy.
            first = self._sys.pread(fd, want, begin)
            if len(first) == want or not first:
                return first
            parts, got = [first], len(first)
            while got < want:
                more = self._sys.pread(fd, want - got, begin + got)
                if not more:
                    break  # the file shrank under us; return what exists, like a slice would
                parts.append(more)
                got += len(more)
            return b"".join(parts)
        finally:
            self._sys.close(fd)

    def open(self, key: str) -> BinaryIO:
        validate_key(key)

        def _open() -> BinaryIO:
            fd, _ = self._open_object(key)
            return os.fdopen(fd, "rb", buffering=_CHUNK)

        return self._settled(f"open {key}", _open)

    def stat(self, key: str) -> ObjectInfo:
        validate_key(key)
        path = self.local_path(key)
        st = self._settled(f"stat {key}", lambda: self._sys.stat(path))
        if not _stat.S_ISREG(st.st_mode):
            raise FileNotFoundError(
                errno.ENOENT, "not an object (a directory, symlink, FIFO or device)", path
            )
        return ObjectInfo(key=key, size=st.st_size, mtime_ns=st.st_mtime_ns)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        _validate_prefix(prefix)
        # Walk only the deepest directory the prefix pins down, then filter by string prefix.
        base = prefix.rpartition("/")[0]
        found: list[ObjectInfo] = []
        pending = [base]
        while pending:
            rel_dir = pending.pop()
            abs_dir = str(self.root / rel_dir) if rel_dir else str(self.root)
            try:
                entries = self._settled(f"list {rel_dir}", lambda d=abs_dir: self._sys.scandir(d))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for entry in entries:
                if entry.name.startswith(TEMP_PREFIX):
                    continue
                key = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
                if entry.is_dir(follow_symlinks=False):
                    if key.startswith(prefix) or prefix.startswith(key + "/"):
                        pending.append(key)
                elif entry.is_file(follow_symlinks=False) and key.startswith(prefix):
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # deleted while we listed
                    found.append(ObjectInfo(key=key, size=st.st_size, mtime_ns=st.st_mtime_ns))
        found.sort(key=lambda info: info.key)
        return found

    def remove_stale_temps(self, older_than_seconds: float = 3600.0) -> list[str]:
        """Delete publication temp files not modified for ``older_than_seconds``; return their paths.

        A writer killed mid-put (link mode) leaves its hidden temp file behind: invisible, but it
        holds disk space. A live writer keeps touching its temp file, so an age threshold well
        above the longest pause between two writes is safe to run at any time.
        """
        if isinstance(older_than_seconds, bool) or not isinstance(older_than_seconds, (int, float)):
            raise ValueError(f"older_than_seconds={older_than_seconds!r}; expected a number")
        cutoff = time.time() - older_than_seconds
        removed = []
        for dirpath, _, names in os.walk(self.root):
            for name in names:
                if not name.startswith(TEMP_PREFIX):
                    continue
                path = os.path.join(dirpath, name)
                try:
                    if os.lstat(path).st_mtime < cutoff:
                        os.unlink(path)
                        removed.append(path)
                except FileNotFoundError:
                    continue  # its writer finished or another sweeper got it
        return sorted(removed)

    # -- writes ----------------------------------------------------------------------------

    def delete(self, key: str) -> None:
        path = self.local_path(key)
        st = os.lstat(path)  # FileNotFoundError names the path
        if _stat.S_ISDIR(st.st_mode):
            raise FileNotFoundError(errno.ENOENT, "not an object (a directory)", path)
        self._sys.unlink(path)

    def put(
        self,
        key: str,
        data: bytes | bytearray | memoryview | BinaryIO | Iterable[bytes],
        *,
        expected_size: int | None = None,
        expected_sha256: str | None = None,
    ) -> ObjectInfo:
        validate_key(key)
        want_sha = _check_expected(key, expected_size, expected_sha256)
        final = self.local_path(key)
        # Cheap early refusal so a conflicting 1 GiB put fails before writing; the link or
        # O_EXCL below is what actually guarantees create-only.
        if os.path.lexists(final):
            raise FileExistsError(errno.EEXIST, "object already exists", final)
        parent = os.path.dirname(final)
        self._makedirs(parent)
        if self.publish == "link":
            return self._put_link(key, final, parent, data, expected_size, want_sha)
        return self._put_exclusive(key, final, parent, data, expected_size, want_sha)

    def put_many(
        self, objects: Iterable[tuple[str, bytes | bytearray | memoryview, int | None, str | None]]
    ) -> list[ObjectInfo]:
        """Publish ``(key, data, expected_size, expected_sha256)`` objects for one flush or two.

        Each object is checked and published as by ``put`` (create-only, hashed while written,
        a mismatch raises ValueError), but durability is paid once per batch instead of twice
        per object: every object is written under its hidden temp name, then one filesystem
        flush (``syncfs``) makes all the data durable, then each temp name is hard-linked to
        its key, then a second flush makes the names durable. A crash at any point leaves each
        key either absent or complete. A failure while writing (an existing key, a size or
        SHA256 mismatch, an I/O error) publishes nothing of the batch; a key that someone else
        publishes between our write and our link raises FileExistsError naming it, with the
        objects before it published and none after it. ``publish="exclusive"`` stores, which
        cannot link, put each object in turn. A ``syncfs`` flushes everything dirty on the
        filesystem, other writers' data included: worth it for many small objects, not for a
        few large ones.
        """
        batch = list(objects)
        if self.publish != "link":
            return [
                self.put(key, data, expected_size=size, expected_sha256=sha)
                for key, data, size, sha in batch
            ]
        # (key, final path, parent directory, temp path, size, SHA256) of each written object
        written: list[tuple[str, str, str, str, int, str]] = []
        published: list[ObjectInfo] = []
        try:
            for key, data, expected_size, expected_sha256 in batch:
                validate_key(key)
                want_sha = _check_expected(key, expected_size, expected_sha256)
                final = self.local_path(key)
                if os.path.lexists(final):
                    raise FileExistsError(errno.EEXIST, "object already exists", final)
                parent = os.path.dirname(final)
                self._makedirs(parent)
                name = os.path.basename(final)
                temp = os.path.join(parent, f"{TEMP_PREFIX}{uuid.uuid4().hex}-{name[:120]}")
                fd = self._sys.open(temp, _CREATE_FLAGS, 0o644)
                written.append((key, final, parent, temp, 0, ""))
                size, digest = self._fill_and_close(
                    fd, key, data, expected_size, want_sha, fsync=False
                )
                if self.verify_readback:
                    self._verify_bytes(key, temp, size, digest)
                written[-1] = (key, final, parent, temp, size, digest)
            if written and self.fsync:  # the data, before any name points at it
                self._sync_filesystems(
                    dict.fromkeys(w[2] for w in written), [w[3] for w in written]
                )
            parents: dict[str, None] = {}
            for key, final, parent, temp, size, digest in written:
                self._sys.link(temp, final)  # never replaces: a concurrent writer fails this
                try:
                    st = self._wait_visible(key, final, size)
                except BaseException:
                    self._remove_failed(final)
                    raise
                parents[parent] = None
                published.append(
                    ObjectInfo(key=key, size=size, mtime_ns=st.st_mtime_ns, sha256=digest)
                )
        finally:
            for *_, temp, _, _ in written:
                try:
                    self._sys.unlink(temp)
                except OSError:
                    pass  # hidden and never listed; the outcome stands
            if published and self.fsync:
                # The names: one flush for the batch (or each directory where syncfs is missing).
                self._sync_filesystems(parents, [])
        return published

    def _sync_filesystems(self, directories: Iterable[str], files: Sequence[str]) -> None:
        """Make everything written under ``directories`` durable with one ``syncfs`` per
        filesystem they are on; where syncfs is missing, fsync each of ``files`` (or, with
        none given, each directory) instead."""
        anchors: dict[int, str] = {}
        for path in directories:
            anchors.setdefault(os.stat(path).st_dev, path)  # a mount below root is its own fs
        synced = True
        for path in anchors.values():
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                synced = self._sys.syncfs(fd) and synced
            finally:
                os.close(fd)
        if synced:
            return
        for path in files:
            fd = self._sys.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                self._sys.fsync(fd)
            finally:
                self._sys.close(fd)
        if not files:
            for path in directories:
                self._fsync_dir(path)

    def _put_link(self, key, final, parent, data, expected_size, want_sha) -> ObjectInfo:
        name = os.path.basename(final)
        temp = os.path.join(parent, f"{TEMP_PREFIX}{uuid.uuid4().hex}-{name[:120]}")
        fd = self._sys.open(temp, _CREATE_FLAGS, 0o644)
        try:
            size, digest = self._fill_and_close(fd, key, data, expected_size, want_sha)
            if self.verify_readback:
                self._verify_bytes(key, temp, size, digest)
            # os.link never replaces: a concurrent writer of the same key makes this fail.
            self._sys.link(temp, final)
        finally:
            try:
                self._sys.unlink(temp)
            except OSError:
                pass  # a leftover temp name is hidden and never listed; the put's outcome stands
        try:
            if self.fsync:
                self._fsync_dir(parent)
            st = self._wait_visible(key, final, size)
        except BaseException:
            # The link happened but the object is not known durable and readable: a put that
            # raises must leave nothing behind, and this object is ours alone to remove.
            self._remove_failed(final)
            raise
        return ObjectInfo(key=key, size=size, mtime_ns=st.st_mtime_ns, sha256=digest)

    def _put_exclusive(self, key, final, parent, data, expected_size, want_sha) -> ObjectInfo:
        # Opened outside the try: if O_EXCL fails, the existing file is someone else's.
        fd = self._sys.open(final, _CREATE_FLAGS, 0o644)
        committed = False
        try:
            # The mount publishes on close, so a failed close is a failed put.
            size, digest = self._fill_and_close(fd, key, data, expected_size, want_sha)
            if self.fsync:
                self._fsync_dir(parent)
            st = self._wait_visible(key, final, size)
            if self.verify_readback:
                self._verify_bytes(key, final, size, digest)
            committed = True
        finally:
            if not committed:
                self._remove_failed(final)
        return ObjectInfo(key=key, size=size, mtime_ns=st.st_mtime_ns, sha256=digest)

    def _fill_and_close(
        self, fd, key, data, expected_size, want_sha, fsync: bool | None = None
    ) -> tuple[int, str]:
        """Write and check ``data`` into a new file, fsync (``fsync``, default the store's
        setting) and close it; return (size, SHA256).

        The descriptor is closed even when writing fails, and a failed close fails the put.
        """
        try:
            size, digest = self._write_checked(key, fd, data, expected_size, want_sha)
            if self.fsync if fsync is None else fsync:
                self._sys.fsync(fd)
        finally:
            self._sys.close(fd)
        return size, digest

    def _remove_failed(self, path: str) -> None:
        """Remove the object of a put that is failing; the put's own error is what propagates."""
        try:
            self._sys.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            _log.warning("failed put left %s behind and it could not be removed: %s", path, exc)

    def _write_checked(self, key, fd, data, expected_size, want_sha) -> tuple[int, str]:
        hasher = _Hasher()
        size = 0
        # With fsync on, ask the kernel to start writing each chunk to disk as soon as it is
        # written, so the disk works while the next chunks are read and hashed and the final
        # fsync has little left to do. Off for the rest of the put once unsupported.
        writeback = self.fsync
        try:
            for chunk, stable in _chunks(data):
                hasher.start(chunk)
                self._write_fully(fd, chunk)
                if writeback and len(chunk) >= _OVERLAP_MIN:
                    writeback = self._sys.start_writeback(fd, size, len(chunk))
                size += len(chunk)
                if not stable:
                    # The producer may refill this buffer for its next chunk (a bytearray, a
                    # reused memoryview): finish hashing it first. Stable chunks may lag.
                    hasher.wait()
                if expected_size is not None and size > expected_size:
                    raise ValueError(
                        f"put({key!r}): data is longer than expected_size={expected_size}"
                    )
            digest = hasher.hexdigest()
        finally:
            hasher.close()
        if expected_size is not None and size != expected_size:
            raise ValueError(f"put({key!r}): got {size} bytes, expected_size={expected_size}")
        if want_sha is not None and digest != want_sha:
            raise ValueError(
                f"put({key!r}): SHA256 {digest} does not match expected_sha256={want_sha}"
            )
        return size, digest

    def _write_fully(self, fd: int, chunk: memoryview) -> None:
        offset = 0
        while offset < len(chunk):
            written = self._sys.write(fd, chunk[offset:])
            if written <= 0:
                raise OSError(
                    errno.EIO, f"write returned {written} with {len(chunk) - offset} bytes left"
                )
            offset += written

    def _wait_visible(self, key: str, path: str, size: int) -> os.stat_result:
        """Stat the published object until it shows the written size (``settle_seconds``)."""
        deadline = self._clock() + self.settle_seconds
        delay = 0.05
        while True:
            try:
                st = self._sys.stat(path)
                if st.st_size == size:
                    return st
                problem = f"reads back {st.st_size} bytes, wrote {size}"
            except OSError as exc:
                if exc.errno != errno.ENOENT and exc.errno not in SETTLING_ERRNOS:
                    raise
                problem = f"is not readable yet ({exc})"
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise OSError(
                    errno.EIO,
                    f"put({key!r}): object {problem} after settle_seconds={self.settle_seconds}",
                    path,
                )
            self._sleep(min(delay, remaining))
            delay = min(delay * 2, 2.0)

    def _verify_bytes(self, key: str, path: str, size: int, digest: str) -> None:
        sha = hashlib.sha256()
        got = 0
        fd = self._sys.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            while True:
                block = self._sys.pread(fd, _CHUNK, got)
                if not block:
                    break
                sha.update(block)
                got += len(block)
        finally:
            self._sys.close(fd)
        if got != size or sha.hexdigest() != digest:
            raise OSError(
                errno.EIO,
                f"put({key!r}): read-back gave {got} bytes with SHA256 {sha.hexdigest()}, "
                f"wrote {size} bytes with SHA256 {digest}",
                path,
            )

    def _makedirs(self, path: str) -> None:
        if os.path.isdir(path):
            return
        parent = os.path.dirname(path)
        if parent != path:
            self._makedirs(parent)
        try:
            os.mkdir(path)
        except FileExistsError:
            if not os.path.isdir(path):
                raise NotADirectoryError(
                    errno.ENOTDIR, "an object is in the way of a directory", path
                ) from None
            return
        if self.fsync:
            self._fsync_dir(parent)  # make the new directory entry itself durable

    def _fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self._sys.fsync(fd)
        finally:
            os.close(fd)


# -- open_store ------------------------------------------------------------------------------

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*")
_FACTORIES: dict[str, Callable[[str], Store]] = {}
ENTRY_POINT_GROUP = "koochak.stores"


def register_store(scheme: str, factory: Callable[[str], Store]) -> None:
    """Map ``scheme://path`` locations to ``factory(path)`` for this process.

    Registered factories win over ``koochak.stores`` entry points and the stores file.
    """
    if not isinstance(scheme, str) or not _SCHEME.fullmatch(scheme):
        raise ValueError(f"register_store: scheme {scheme!r} is not a URI scheme like 'archive'")
    if scheme.lower() == "file":
        raise ValueError("register_store: 'file' always means a LocalStore and cannot be replaced")
    if not callable(factory):
        raise TypeError(f"register_store({scheme!r}): factory must be callable, got {factory!r}")
    _FACTORIES[scheme.lower()] = factory


def _entry_point_factory(scheme: str) -> Callable[[str], Store] | None:
    from importlib.metadata import entry_points

    matches = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name.lower() == scheme]
    if not matches:
        return None
    if len({ep.value for ep in matches}) > 1:
        values = ", ".join(sorted(ep.value for ep in matches))
        raise ValueError(
            f"scheme {scheme!r} is claimed by several {ENTRY_POINT_GROUP!r} entry points: {values}"
        )
    factory = matches[0].load()
    if not callable(factory):
        raise TypeError(f"entry point {matches[0].value!r} for scheme {scheme!r} is not callable")
    return factory


def _file_uri_path(location: str) -> str:
    rest = location[len("file://") :]
    host, slash, path = rest.partition("/")
    if host not in ("", "localhost"):
        raise ValueError(
            f"open_store({location!r}): file:// URIs must name a local path, not host {host!r}"
        )
    return unquote(slash + path) or "/"


def open_store(location: str | os.PathLike[str] | Store) -> Store:
    """Resolve a location to a Store.

    A Store is returned unchanged; plain paths and ``file://`` URIs become a LocalStore; any
    other ``scheme://path`` comes from, in order, a ``register_store`` factory, an installed
    ``koochak.stores`` entry point, or the stores file.
    """
    if isinstance(location, os.PathLike):
        return LocalStore(os.fspath(location))
    if not isinstance(location, str):
        if isinstance(location, Store):
            return location
        raise TypeError(f"open_store: expected a path, URI or Store, got {type(location).__name__}")
    if not location:
        raise ValueError("open_store: location is empty; expected a path or scheme://path")
    scheme, sep, rest = location.partition("://")
    if not sep or not _SCHEME.fullmatch(scheme):
        return LocalStore(location)
    scheme = scheme.lower()
    if scheme == "file":
        return LocalStore(_file_uri_path(location))
    factory = _FACTORIES.get(scheme) or _entry_point_factory(scheme)
    if factory is not None:
        store = factory(rest)
        if not isinstance(store, Store):
            raise TypeError(
                f"open_store({location!r}): the factory for {scheme!r} returned "
                f"{type(store).__name__}, which does not implement the Store protocol"
            )
        return store
    from koochak.storage.stores_file import settings_for_scheme

    settings = settings_for_scheme(scheme, location)
    if settings.backend is not None:  # a plugin store configured in the stores file
        found = _FACTORIES.get(settings.backend) or _entry_point_factory(settings.backend)
        return settings.open_backend(rest, location, found)
    try:
        root = settings.root_for(rest)
    except ValueError as exc:
        raise ValueError(f"open_store({location!r}): {exc}") from None
    return LocalStore(
        root,
        publish=settings.publish,
        fsync=settings.fsync,
        verify_readback=settings.verify_readback,
        settle_seconds=settings.settle_seconds,
        read_settle_seconds=settings.read_settle_seconds,
        profile=settings.profile,
    )
