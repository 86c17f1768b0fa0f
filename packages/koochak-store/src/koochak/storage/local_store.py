"""LocalStore: the Store on a local or mounted filesystem, and its two publish modes.

A put is admitted once (key, expectations, no existing object, parent directory), its bytes are
written and hashed in one pass (``_payload``) through the fault seam (``_syscalls``) under a
hidden temp name, and then the object appears whole in one of two ways. Link mode hard-links the
written, synced temp file to the key (``link`` never replaces): ``_put_link``, and ``put_many``
for a batch with one flush. Exclusive mode, for object-storage FUSE mounts (no hard links),
renames the closed temp file to the key under a lock on its directory after checking the key is
free, and can read the object back once another client could have replaced it:
``_put_exclusive``, the one place that mode publishes (``put_many`` puts each object in turn).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import pathlib
import stat as _stat
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO, TypeVar

from koochak.storage import _payload
from koochak.storage._syscalls import _Syscalls
from koochak.storage.keys import PUBLISH_MODES, TEMP_PREFIX, _validate_prefix, validate_key
from koochak.storage.protocol import ObjectInfo, StoreCapabilities, check_put_expectations

if TYPE_CHECKING:
    from koochak.storage.profile import StoreProfile

__all__ = ["LocalStore", "ObjectCollision", "SETTLING_ERRNOS"]

_T = TypeVar("_T")
# Named for the module LocalStore lived in before it had its own, so logging set up for
# "koochak.storage.store" still sees its warnings.
_log = logging.getLogger("koochak.storage.store")

# Errors some object-storage mounts return for minutes after another node closed a file (ETIME,
# EIO) or while their client is cut off from the service. Only these are waited out, only on reads.
SETTLING_ERRNOS = frozenset(
    {errno.ETIME, errno.EIO, errno.ECONNABORTED, errno.ECONNRESET, errno.ENOTCONN}
)

# How a put creates its temp file: never an existing one.
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC


class ObjectCollision(FileExistsError):
    """Another writer published the same key: what it holds is not what this put wrote.

    Raised by an exclusive-mode put with ``verify_readback`` when the read-back, done once
    ``settle_seconds`` have passed since the object appeared, finds other bytes there: two
    clients of an object-storage mount both took the name, and the later upload won. Nothing is
    removed (the object is the other writer's).
    """


@dataclass(frozen=True)
class _Admitted:
    """A put that passed admission: where its object goes and what its bytes must match."""

    key: str
    final: str  # the object's path
    parent: str  # its directory, which exists now
    expected_size: int | None
    want_sha: str | None  # expected_sha256, lower-cased


class LocalStore:
    """A Store on a local or mounted filesystem, rooted at ``root``.

    Both publish modes write a hidden temp file in the target directory first (``fsync``ed and
    closed), so a killed writer leaves at most a hidden temp file, never part of an object under
    its key. ``publish="link"`` (POSIX filesystems) then hard-links it to the key (``os.link``
    never replaces) and removes the temp name. ``publish="exclusive"`` (object-storage FUSE
    mounts, which have no hard links but upload a renamed file as one whole object) renames it
    to the key while holding an ``flock`` on the directory, after checking the key is free, so
    writers on this host never both take a name.

    ``fsync=False`` skips fsync for mounts that reject it; ``verify_readback=True`` re-reads and
    re-hashes every object; ``settle_seconds`` is how long other clients may take to see an
    object: a put waits that long for its object to show its full size, and in exclusive mode
    with ``verify_readback`` it reads the object back only once that long has passed since it
    appeared, so that a client which took the same name meanwhile is caught (ObjectCollision).
    ``read_settle_seconds`` retries reads (get, open, stat, list) that fail with one of
    ``SETTLING_ERRNOS`` until that deadline. Writes are never retried.
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

    def capabilities(self) -> StoreCapabilities:
        """Its publish mode, its root, its read settling, ``put_many``, ``list_shallow`` and its
        profile."""
        return StoreCapabilities(
            publish=self.publish,
            root=str(self.root),
            read_settle_seconds=self.read_settle_seconds,
            put_many=True,
            profile=self.profile,
            list_shallow=True,
        )

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
            return os.fdopen(fd, "rb", buffering=_payload._CHUNK)

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
        return self._walk(prefix, None)

    def list_shallow(self, prefix: str, delimiter: str) -> list[ObjectInfo]:
        """``list(prefix)`` less every key with ``delimiter`` after ``prefix``: those entries are
        passed over by name (never stat'ed, their directories never entered)."""
        if not delimiter:
            raise ValueError("list_shallow: delimiter must be a non-empty string")
        return self._walk(prefix, delimiter)

    def _walk(self, prefix: str, delimiter: str | None) -> list[ObjectInfo]:
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
                if delimiter is not None and delimiter in key[len(prefix) :]:
                    continue  # grouped away: not even stat'ed
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
        for dirpath, _, names in self._sys.walk(str(self.root)):
            for name in names:
                if not name.startswith(TEMP_PREFIX):
                    continue
                path = os.path.join(dirpath, name)
                try:
                    if self._sys.stat(path).st_mtime < cutoff:
                        self._sys.unlink(path)
                        removed.append(path)
                except FileNotFoundError:
                    continue  # its writer finished or another sweeper got it
        return sorted(removed)

    # -- writes ----------------------------------------------------------------------------

    def delete(self, key: str) -> None:
        path = self.local_path(key)
        st = self._sys.stat(path)  # FileNotFoundError names the path
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
        target = self._admit(key, expected_size, expected_sha256)
        if self.publish == "link":
            return self._put_link(target, data)
        return self._put_exclusive(target, data)

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
        written: list[tuple[_Admitted, str, int, str]] = []  # (target, temp path, size, SHA256)
        published: list[ObjectInfo] = []
        parents: dict[str, None] = {}
        try:
            for key, data, expected_size, expected_sha256 in batch:
                target = self._admit(key, expected_size, expected_sha256)
                written.append((target, *self._write_temp(target, data, fsync=False)))
            if written and self.fsync:  # the data, before any name points at it
                self._sync_filesystems(
                    dict.fromkeys(target.parent for target, *_ in written),
                    [temp for _, temp, _, _ in written],
                )
            for target, temp, size, digest in written:
                self._sys.link(temp, target.final)  # never replaces: a concurrent writer fails this
                try:
                    st = self._wait_visible(target.key, target.final, size)
                except BaseException:
                    self._remove_failed(target.final)
                    raise
                parents[target.parent] = None
                published.append(
                    ObjectInfo(key=target.key, size=size, mtime_ns=st.st_mtime_ns, sha256=digest)
                )
        finally:
            for _, temp, _, _ in written:
                self._discard_temp(temp)
            if published and self.fsync:
                # The names: one flush for the batch (or each directory where syncfs is missing).
                self._sync_filesystems(parents, [])
        return published

    def _admit(self, key: str, expected_size: int | None, expected_sha256: str | None) -> _Admitted:
        """Check a put before any byte is written, and make its parent directory."""
        validate_key(key)
        want_sha = check_put_expectations(key, expected_size, expected_sha256)
        final = self.local_path(key)
        # Cheap early refusal so a conflicting 1 GiB put fails before writing; the link or
        # O_EXCL below is what actually guarantees create-only.
        if os.path.lexists(final):
            raise FileExistsError(errno.EEXIST, "object already exists", final)
        parent = os.path.dirname(final)
        self._makedirs(parent)
        return _Admitted(key, final, parent, expected_size, want_sha)

    # -- publishing: how each mode makes one object appear under its key ---------------------

    def _put_link(self, target: _Admitted, data: object) -> ObjectInfo:
        temp, size, digest = self._write_temp(target, data)
        try:
            # os.link never replaces: a concurrent writer of the same key makes this fail.
            self._sys.link(temp, target.final)
        finally:
            self._discard_temp(temp)
        try:
            if self.fsync:
                self._fsync_dir(target.parent)
            st = self._wait_visible(target.key, target.final, size)
        except BaseException:
            # The link happened but the object is not known durable and readable: a put that
            # raises must leave nothing behind, and this object is ours alone to remove.
            self._remove_failed(target.final)
            raise
        return ObjectInfo(key=target.key, size=size, mtime_ns=st.st_mtime_ns, sha256=digest)

    def _put_exclusive(self, target: _Admitted, data: object) -> ObjectInfo:
        # Read back before the rename unless the read-back waits for other clients (below).
        later = self.verify_readback and self.settle_seconds > 0
        temp, size, digest = self._write_temp(target, data, verify=not later)
        try:
            lock = self._sys.open(target.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except BaseException:
            self._discard_temp(temp)
            raise
        try:
            # Writers on this host take turns between the check and the rename, which replaces.
            self._sys.lock(lock)
            try:
                if os.path.lexists(target.final):
                    raise FileExistsError(errno.EEXIST, "object already exists", target.final)
                self._sys.rename(temp, target.final)
            except BaseException:
                self._discard_temp(temp)
                raise
            appeared = self._clock()
            try:
                if self.fsync:
                    self._fsync_dir(target.parent)
                # This client sees its own rename at once, so this rarely waits.
                st = self._wait_visible(target.key, target.final, size)
            except BaseException:
                # Not known durable or readable: a put that raises leaves nothing behind. Still
                # under the lock, so no writer on this host can have replaced it meanwhile.
                self._remove_failed(target.final)
                raise
        finally:
            self._sys.close(lock)
        # From here the object may be another client's (a mount cannot refuse a name another
        # client takes), so a failure leaves it where it is.
        if later:
            self._sleep_until(appeared + self.settle_seconds)
            self._verify_bytes(target.key, target.final, size, digest, collision=True)
            st = self._sys.stat(target.final)
        return ObjectInfo(key=target.key, size=size, mtime_ns=st.st_mtime_ns, sha256=digest)

    def _sleep_until(self, moment: float) -> None:
        while (left := moment - self._clock()) > 0:
            self._sleep(left)

    # -- writing the bytes -----------------------------------------------------------------

    def _write_temp(
        self, target: _Admitted, data: object, fsync: bool | None = None, verify: bool = True
    ) -> tuple[str, int, str]:
        """Write ``data`` to a new hidden temp file beside the key; return (temp, size, SHA256).

        The file is checked, fsynced (``fsync``, default the store's setting), closed and, with
        ``verify_readback`` (and ``verify``), read back; if any of that fails the temp name is
        removed again.
        """
        name = os.path.basename(target.final)
        temp = os.path.join(target.parent, f"{TEMP_PREFIX}{uuid.uuid4().hex}-{name[:120]}")
        fd = self._sys.open(temp, _CREATE_FLAGS, 0o644)
        try:
            size, digest = self._fill_and_close(fd, target, data, fsync=fsync)
            if self.verify_readback and verify:
                self._verify_bytes(target.key, temp, size, digest)
        except BaseException:
            self._discard_temp(temp)
            raise
        return temp, size, digest

    def _discard_temp(self, temp: str) -> None:
        try:
            self._sys.unlink(temp)
        except OSError:
            pass  # a leftover temp name is hidden and never listed; the put's outcome stands

    def _fill_and_close(
        self, fd: int, target: _Admitted, data: object, fsync: bool | None = None
    ) -> tuple[int, str]:
        """Write and check ``data`` into a new file, fsync (``fsync``, default the store's
        setting) and close it; return (size, SHA256).

        The descriptor is closed even when writing fails, and a failed close fails the put.
        """
        try:
            size, digest = self._write_checked(target, fd, data)
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

    def _write_checked(self, target: _Admitted, fd: int, data: object) -> tuple[int, str]:
        key, expected_size = target.key, target.expected_size
        hasher = _payload._Hasher()
        size = 0
        # With fsync on, ask the kernel to start writing each chunk to disk as soon as it is
        # written, so the disk works while the next chunks are read and hashed and the final
        # fsync has little left to do. Off for the rest of the put once unsupported.
        writeback = self.fsync
        try:
            for chunk, stable in _payload._chunks(data):
                hasher.start(chunk)
                self._write_fully(fd, chunk)
                if writeback and len(chunk) >= _payload._OVERLAP_MIN:
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
        if target.want_sha is not None and digest != target.want_sha:
            raise ValueError(
                f"put({key!r}): SHA256 {digest} does not match expected_sha256={target.want_sha}"
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

    # -- confirming and making names durable -----------------------------------------------

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

    def _verify_bytes(
        self, key: str, path: str, size: int, digest: str, collision: bool = False
    ) -> None:
        """Read ``path`` back and compare it with what was written; raise on any difference.

        ``collision``: the path is the published key, read once other clients could have
        replaced it, so a difference is an ObjectCollision (nothing is removed).
        """
        sha = hashlib.sha256()
        got = 0
        fd = self._sys.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            while True:
                block = self._sys.pread(fd, _payload._CHUNK, got)
                if not block:
                    break
                sha.update(block)
                got += len(block)
        finally:
            self._sys.close(fd)
        if got == size and sha.hexdigest() == digest:
            return
        found = f"read-back gave {got} bytes with SHA256 {sha.hexdigest()}, wrote {size} bytes "
        found += f"with SHA256 {digest}"
        if collision:
            raise ObjectCollision(
                errno.EEXIST,
                f"put({key!r}): {found}, {self.settle_seconds:g} s after it appeared: another "
                "client published the same key (a mount cannot refuse it) or the storage changed "
                "it; left in place",
                path,
            )
        raise OSError(errno.EIO, f"put({key!r}): {found}", path)

    def _sync_filesystems(self, directories: Iterable[str], files: Sequence[str]) -> None:
        """Make everything written under ``directories`` durable with one ``syncfs`` per
        filesystem they are on; where syncfs is missing, fsync each of ``files`` (or, with
        none given, each directory) instead."""
        anchors: dict[int, str] = {}
        for path in directories:
            # Followed: a directory reached through a symlink is synced on the filesystem it is
            # on; a mount below root is its own filesystem.
            anchors.setdefault(self._sys.stat(path, follow_symlinks=True).st_dev, path)
        synced = True
        for path in anchors.values():
            fd = self._sys.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                synced = self._sys.syncfs(fd) and synced
            finally:
                self._sys.close(fd)
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
        fd = self._sys.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self._sys.fsync(fd)
        finally:
            self._sys.close(fd)
