"""``pull``: restore files of a collection into a local directory.

Neighbouring files of a pack are fetched with one ranged ``get`` (a *merged range read*), every
file's SHA256 is checked before it gets its final name, and mode and exact ``mtime_ns`` are
restored. Files already present with the same size, mtime and SHA256 are skipped, so a rerun
after a kill finishes the job.

Safety against a hostile manifest: paths are checked by the reader (no ``..``, no absolute
paths), and every directory below DEST is opened with ``O_NOFOLLOW`` relative to its parent's
descriptor, so a symlink planted anywhere under DEST is refused rather than followed. A
directory DEST lacks is staged under a hidden temp name and renamed into place once every file
below it is whole; in a directory that already exists each file is an unnamed ``O_TMPFILE`` (or a
hidden temp name) linked or renamed into place once whole, so a killed pull never leaves a
partial file under a final name. Temp names carry the run's random token and are created with
``O_EXCL``, so they can never be the name of a restored file, and pull removes only temp files
that a pull provably created (``_dest_lock``): its own, and a killed pull's.

One pull at a time per DEST: pull holds an ``flock`` on ``DEST/.koochak-pull.lock`` (a file it
creates, with a fixed first line, and removes when done); a second pull into the same DEST fails
at once saying so.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import threading
import time
from collections.abc import Callable, Container, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any

from koochak.data._concurrent import wait_all
from koochak.data._dest_lock import LOCK_NAME, DestLock
from koochak.data._digest import CHUNK, sha256_stream
from koochak.data.collection import FILES_KEY, FileEntry, load_collection
from koochak.storage.named import get_named, open_named

__all__ = ["LOCK_NAME", "PullReport", "merge_ranges", "pull_collection"]

DEFAULT_MAX_RANGE_BYTES = 64 << 20
# The smallest cap of a merged range read pull picks for a store of cheap requests (a local or
# parallel filesystem): 16 MiB buffers come back from the allocator already faulted in, a 64 MiB
# one is fresh memory each time (page faults cost about as much as hashing the bytes).
_MIN_AUTO_RANGE_BYTES = 16 << 20
# Threads writing the files of fetched ranges at once; other streams fetch meanwhile. A small
# file costs a few short system calls and a little Python, so more writers mostly hand the GIL
# to each other around every call: two keep two cores busy, eight cost a third more CPU and
# wall time (measured at 4,000 and 20,000 files). Objects, written as they stream in, are not
# limited.
_RANGE_WRITERS = 2
# A store whose request costs less than streaming this many bytes (a local or parallel
# filesystem) serves ranges at memory speed: by default pull runs two streams there, since
# more only hold more buffers of fresh memory ahead of the writers.
_CHEAP_REQUEST_BYTES = 1 << 20
_CHEAP_STORE_STREAMS = 2
# Final-name creates below a staged directory: create-only, never through a symlink.
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# Directory descriptors kept open between files; beyond this the idle ones are closed.
_MAX_OPEN_DIRS = 256
# linkat() through this gives an O_TMPFILE its name (AT_EMPTY_PATH would need a capability).
_LINK_VIA = "/proc/self/fd"
# What open(O_TMPFILE) says where a filesystem (or an old kernel) has no unnamed files.
_NO_TMPFILE = frozenset(
    {errno.EOPNOTSUPP, errno.ENOTSUP, errno.EISDIR, errno.EINVAL, errno.ENOENT, errno.ENOSYS}
)


@dataclass
class PullReport:
    source: str
    dest: str
    files: int = 0  # selected by --include
    bytes: int = 0
    written: int = 0
    bytes_written: int = 0
    present: int = 0  # already there with the same size, mtime and SHA256
    requests: int = 0  # gets and opens against the source, the manifest and file table included
    paths: list[str] = field(default_factory=list)  # written files (for --json)
    leftovers_removed: int = 0  # hidden temp files of a killed pull, removed by this one

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def merge_ranges(
    entries: Sequence[FileEntry], *, gap_bytes: int, max_range_bytes: int
) -> list[tuple[int, int, list[FileEntry]]]:
    """Merge one pack's entries into ``(start, end, entries)`` byte ranges.

    Neighbours share a range when the gap between them is at most ``gap_bytes`` (reading the gap
    costs less than another request) and the range stays within ``max_range_bytes``.
    """
    ranges: list[tuple[int, int, list[FileEntry]]] = []
    members: list[FileEntry] = []
    r_start = r_end = 0
    for e in sorted(entries, key=lambda e: e.offset or 0):
        assert e.offset is not None
        start, end = e.offset, e.offset + e.size
        if members and start - r_end <= gap_bytes and end - r_start <= max_range_bytes:
            members.append(e)  # in place: a range of 10,000 small files stays linear
            r_end = max(r_end, end)
            continue
        if members:
            ranges.append((r_start, r_end, members))
        members, r_start, r_end = [e], start, end
    if members:
        ranges.append((r_start, r_end, members))
    return ranges


class _Dir:
    """One directory under DEST held open for a run of files: what ``_DestTree.write`` needs
    per file, worked out once per directory."""

    __slots__ = ("rel", "fd", "direct", "same_dev")

    def __init__(self, rel: str, fd: int, direct: bool, same_dev: bool) -> None:
        self.rel = rel
        self.fd = fd
        self.direct = direct  # below a staged directory: files get their final names at once
        self.same_dev = same_dev  # on DEST's filesystem, where probe_mtimes holds


class _DestTree:
    """Directory descriptors under DEST, opened without ever following a symlink."""

    def __init__(self, root: str, keep: Container[str] = ()) -> None:
        self.root = root
        self.root_created = not os.path.lexists(root)
        if not self.root_created and not os.path.isdir(root):
            raise ValueError(f"pull DEST {root} exists and is not a directory")
        os.makedirs(root, exist_ok=True)
        self._root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self.dest_lock = DestLock(self._root_fd, root)
        except BaseException:
            os.close(self._root_fd)
            raise
        try:
            # Before anything else: a killed pull's temp files, provably its own (by token).
            self.leftovers_removed = self.dest_lock.remove_leftovers(keep)
        except BaseException:
            self.dest_lock.release()
            os.close(self._root_fd)
            raise
        self._fds: dict[str, int] = {}
        self._users: dict[str, int] = {}
        # Directories this run created: nothing can be present in them yet, so no stat needed.
        # Each lies under a *staged* one: a directory that did not exist, made under a hidden
        # temp name in its (existing) parent and renamed to its own name once every file below
        # it is whole (``publish_staged``). Files below a staged directory are written straight
        # under their final names, as tar writes them: no one sees them before that rename.
        self.created: set[str] = set()
        self.staged: dict[str, str] = {}  # rel_dir -> its temp name in its parent
        self._lock = threading.RLock()
        # Unnamed files (O_TMPFILE) linked in once whole, where the kernel and /proc allow it.
        self._tmpfile = hasattr(os, "O_TMPFILE") and os.path.isdir(_LINK_VIA)
        self._umask = _umask()
        self._exact_mtimes = (1, 0)  # an empty range until probe_mtimes shows one
        self._root_dev = os.fstat(self._root_fd).st_dev
        self._devs: dict[str, int] = {}

    def acquire(self, rel_dir: str) -> int:
        if not rel_dir:
            return self._root_fd
        with self._lock:
            if rel_dir not in self._fds:
                self._evict()
                parent, _, name = rel_dir.rpartition("/")
                parent_fd = self.acquire(parent)
                try:
                    self._fds[rel_dir] = self._open_dir(parent_fd, name, rel_dir)
                finally:
                    self.release(parent)
            self._users[rel_dir] = self._users.get(rel_dir, 0) + 1
            return self._fds[rel_dir]

    def release(self, rel_dir: str) -> None:
        if rel_dir:
            with self._lock:
                self._users[rel_dir] -= 1

    def _evict(self) -> None:
        if len(self._fds) < _MAX_OPEN_DIRS:
            return
        for rel in [r for r, fd in self._fds.items() if not self._users.get(r)]:
            os.close(self._fds.pop(rel))
            self._users.pop(rel, None)

    def _open_dir(self, parent_fd: int, name: str, rel_dir: str) -> int:
        parent = rel_dir.rpartition("/")[0]
        opened = self.staged.get(rel_dir, name)  # opened again after an eviction: as before
        if rel_dir in self.created:
            pass
        elif parent in self.created:  # inside a staged directory: nobody else sees it
            os.mkdir(name, 0o777, dir_fd=parent_fd)
            self.created.add(rel_dir)
        elif _absent(parent_fd, name):
            opened = self.dest_lock.temp_name()
            os.mkdir(opened, 0o777, dir_fd=parent_fd)
            self.staged[rel_dir] = opened
            self.created.add(rel_dir)
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            return os.open(opened, flags, dir_fd=parent_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise ValueError(
                    f"{os.path.join(self.root, rel_dir)} is a symlink or not a directory; "
                    "pull never follows symlinks"
                ) from None
            raise

    def publish_staged(self) -> None:
        """Rename every staged directory to its own name (parents first). Call once no file is
        being written: everything below them is then whole and checked."""
        problems = []
        for rel_dir, temp in sorted(self.staged.items()):
            parent = rel_dir.rpartition("/")[0]
            parent_fd = self.acquire(parent)
            try:
                os.rename(temp, rel_dir.rpartition("/")[2], src_dir_fd=parent_fd,
                          dst_dir_fd=parent_fd)  # fmt: skip
            except OSError as exc:  # something took the name meanwhile: keep the files
                problems.append(f"{os.path.join(self.root, rel_dir)} ({exc.strerror}; its files "
                                f"are in {os.path.join(self.root, parent, temp)})")  # fmt: skip
            finally:
                self.release(parent)
        self.staged.clear()
        if problems:
            raise ValueError("pull could not move staged directories into place: "
                             + "; ".join(problems))  # fmt: skip

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self.dest_lock.release()
            os.close(self._root_fd)

    # -- files -------------------------------------------------------------------------------

    def new_directory(self, rel_dir: str) -> bool:
        """Make (or open) ``rel_dir``; True when this run created it, so nothing can be in the
        way of its files and no stat is needed."""
        self.acquire(rel_dir)
        self.release(rel_dir)
        return rel_dir in self.created or (not rel_dir and self.root_created)

    def probe_mtimes(self, lowest: int, highest: int) -> None:
        """Learn whether DEST's filesystem keeps every mtime in [lowest, highest] exactly.

        It does when both ends and an odd nanosecond value read back as set: the range is then
        inside the filesystem's and its granularity is 1 ns. Files of such mtimes skip the
        per-file ``fstat`` that catches a clamped or rounded mtime; all others keep it.
        """
        values = (lowest, highest, lowest | 1)
        fd, temp = self._create(self._root_fd, 0o600)
        try:
            for value in values:
                os.utime(fd, ns=(value, value))
                if os.fstat(fd).st_mtime_ns != value:
                    return
            self._exact_mtimes = (lowest, highest)
        except (OverflowError, ValueError, OSError):
            return
        finally:
            os.close(fd)
            if temp is not None:
                os.unlink(temp, dir_fd=self._root_fd)

    def open_dir(self, rel_dir: str) -> _Dir:
        """Hold ``rel_dir`` open for writing files into it; give it back with ``close_dir``."""
        fd = self.acquire(rel_dir)
        dev = self._devs.get(rel_dir)  # by path: a descriptor number is reused after eviction
        if dev is None:
            dev = self._devs[rel_dir] = os.fstat(fd).st_dev
        return _Dir(rel_dir, fd, rel_dir in self.created, dev == self._root_dev)

    def close_dir(self, d: _Dir) -> None:
        self.release(d.rel)

    def present(self, entry: FileEntry, overwrite: bool) -> bool:
        """True when ``entry`` is already in place; raises for anything in the way."""
        rel_dir, _, name = entry.path.rpartition("/")
        dir_fd = self.acquire(rel_dir)
        full = os.path.join(self.root, entry.path)
        try:
            if rel_dir in self.created or (not rel_dir and self.root_created):
                return False
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                return False
            if stat.S_ISLNK(st.st_mode):
                raise ValueError(f"{full} is a symlink; pull never follows or replaces symlinks")
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"{full} exists and is not a regular file")
            if (
                st.st_size == entry.size
                and st.st_mtime_ns == entry.mtime_ns
                and _hash_file(dir_fd, name) == entry.sha256
            ):
                return True
            if not overwrite:
                raise ValueError(
                    f"{full} exists with different content; pass --overwrite to replace it"
                )
            return False
        finally:
            self.release(rel_dir)

    def write(
        self, d: _Dir, entry: FileEntry, data: bytes | memoryview | Iterable[bytes], fsync: bool
    ) -> None:
        """Write ``entry`` into the held directory ``d`` where no one sees it, check its size
        and SHA256, then give it its name.

        ``data`` is the file's bytes (checked before anything is created) or an iterable of
        chunks (hashed while written). Below a staged directory the file is created under its
        final name (no one sees it before the directory is renamed into place); elsewhere it is
        an unnamed ``O_TMPFILE`` linked to its name once whole (``linkat``, which never
        replaces), or, where the filesystem has none, a hidden temp name renamed into place.
        Its mode comes with the create when the umask leaves it intact (else ``fchmod``); its
        mtime is set exactly and read back unless ``probe_mtimes`` showed it is kept.
        """
        name = entry.path.rpartition("/")[2]
        mode = entry.mode & 0o777
        exact_mode = self._umask is not None and not mode & self._umask
        whole = isinstance(data, (bytes, memoryview))
        if whole:  # in memory already: a damaged file creates nothing at all
            _check_content(entry, len(data), hashlib.sha256(data).hexdigest())  # type: ignore[arg-type]
        if d.direct:
            fd = os.open(name, _CREATE, mode if exact_mode else 0o600, dir_fd=d.fd)
            temp: str | None = name  # removed unless whole and checked
        else:
            fd, temp = self._create(d.fd, mode if exact_mode else 0o600)
        try:
            if whole:
                _write_all(fd, data)  # type: ignore[arg-type]
            else:
                sha = hashlib.sha256()
                size = 0
                for chunk in data:
                    sha.update(chunk)
                    size += len(chunk)
                    _write_all(fd, chunk)
                _check_content(entry, size, sha.hexdigest())
            if not exact_mode:
                os.fchmod(fd, mode)
            low, high = self._exact_mtimes
            check = not (d.same_dev and low <= entry.mtime_ns <= high)
            _restore_mtime(fd, entry, self.root, check)
            if fsync:
                os.fsync(fd)
            temp = None if d.direct else self._name(fd, temp, d.fd, name)
        finally:
            os.close(fd)
            if temp is not None:  # not renamed: the temp name is ours alone to remove
                try:
                    os.unlink(temp, dir_fd=d.fd)
                except FileNotFoundError:
                    pass

    def _create(self, dir_fd: int, mode: int) -> tuple[int, str | None]:
        """A new file in ``dir_fd`` that no one can see under a final name: ``(fd, temp)``,
        ``temp`` being None for an unnamed O_TMPFILE."""
        if self._tmpfile:
            try:
                flags = os.O_WRONLY | os.O_TMPFILE | os.O_CLOEXEC
                return os.open(".", flags, mode, dir_fd=dir_fd), None
            except OSError as exc:
                if exc.errno not in _NO_TMPFILE:
                    raise
                self._tmpfile = False  # this filesystem has none: temp names from now on
        # Random and O_EXCL: never a file of the collection, never anything already there, so
        # the only file this ever unlinks is the one it just created.
        temp = self.dest_lock.temp_name()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        return os.open(temp, flags, mode, dir_fd=dir_fd), temp

    def _name(self, fd: int, temp: str | None, dir_fd: int, name: str) -> None:
        """Give the whole, checked file its final name; returns None (no temp name left)."""
        if temp is None:
            try:
                os.link(f"{_LINK_VIA}/{fd}", name, dst_dir_fd=dir_fd, follow_symlinks=True)
                return None
            except FileExistsError:
                pass  # --overwrite: name it privately, then rename over the old file
            temp = self.dest_lock.temp_name()
            os.link(f"{_LINK_VIA}/{fd}", temp, dst_dir_fd=dir_fd, follow_symlinks=True)
        try:
            os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except IsADirectoryError:
            os.unlink(temp, dir_fd=dir_fd)
            raise ValueError(
                f"{os.path.join(self.root, name)} is a directory; not replaced"
            ) from None
        except BaseException:
            os.unlink(temp, dir_fd=dir_fd)
            raise
        return None


class _DamagedFile(ValueError):
    """A file whose bytes do not match the manifest: it is skipped, the rest are restored."""


class _Unrestorable(_DamagedFile):
    """A file whose metadata this filesystem cannot hold exactly (an out-of-range mtime_ns): it
    is skipped like a damaged one, so a rerun never finds a clamped copy "with different
    content"."""


def _check_content(entry: FileEntry, size: int, digest: str) -> None:
    if size != entry.size or digest != entry.sha256:
        raise _DamagedFile(
            f"{entry.path} (in {entry.key}): got {size} bytes with SHA256 {digest}, the manifest "
            f"says {entry.size} bytes with {entry.sha256}; not written"
        )


def _write_all(fd: int, data: bytes | memoryview) -> None:
    written = os.write(fd, data)
    if written < len(data):  # a short write (a signal, a full disk): go on from there
        view = memoryview(data)[written:]
        while view:
            view = view[os.write(fd, view) :]


def _restore_mtime(fd: int, entry: FileEntry, root: str, check: bool = True) -> None:
    """Set ``entry.mtime_ns`` exactly, or raise _Unrestorable naming the file (under ``root``).
    ``check=False`` skips reading it back, for a value the filesystem is known to keep
    (``probe_mtimes``)."""
    try:
        os.utime(fd, ns=(time.time_ns(), entry.mtime_ns))
    except (OverflowError, ValueError, OSError) as exc:
        raise _Unrestorable(
            f"{os.path.join(root, entry.path)}: mtime_ns={entry.mtime_ns} cannot be set on this "
            f"filesystem ({exc}); not written"
        ) from None
    if not check:
        return
    stored = os.fstat(fd).st_mtime_ns
    if stored != entry.mtime_ns:  # the filesystem clamped it to its range
        raise _Unrestorable(
            f"{os.path.join(root, entry.path)}: mtime_ns={entry.mtime_ns} is outside what this "
            f"filesystem can store (it kept {stored}); not written"
        )


def _umask() -> int | None:
    """This process's umask, read without changing it (Linux 4.7+), or None."""
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _parent(entry: FileEntry) -> str:
    return entry.path.rpartition("/")[0]


def _absent(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return True
    return False


def _hash_file(dir_fd: int, name: str) -> str:
    # O_NONBLOCK: a FIFO swapped in after the stat must not hang the pull.
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(name, flags, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{name} under DEST is not a regular file")
        os.set_blocking(fd, True)
        return sha256_stream(lambda n: os.read(fd, n))[0]
    finally:
        os.close(fd)


def pull_collection(
    source: Any,
    dest: str | os.PathLike[str],
    *,
    include: Sequence[str] = (),
    overwrite: bool = False,
    fsync: bool = False,
    streams: int | None = None,
    gap_bytes: int | None = None,
    max_range_bytes: int | None = None,
    progress: Callable[[int], None] | None = None,
    show_progress: bool | None = None,
) -> PullReport:
    """Restore the files of the collection ``source`` matching ``include`` under ``dest``.

    Raises ValueError for a malformed manifest, an ``include`` glob that matches no file, a
    symlink or a differing file in the way (unless ``overwrite``), and for bytes whose SHA256
    does not match: such files are not written, but every other file is restored before the
    error is raised.

    ``streams``, ``gap_bytes`` and ``max_range_bytes`` default from the source's profile: its
    concurrency (at most 16; 2 where a request costs less than streaming 1 MiB, a local or
    parallel filesystem), a gap worth one request, and ranges of up to 64 MiB, less for a store
    of cheap requests (32 requests' worth of streamed bytes, at least 16 MiB).
    """
    from koochak.data._progress import progress_bar
    from koochak.storage.profile import profile_of
    from koochak.storage.store import open_store

    store = open_store(source)
    profile = profile_of(store)
    request_bytes = profile.request_seconds * profile.stream_bytes_per_second
    if streams is None:
        most = _CHEAP_STORE_STREAMS if request_bytes <= _CHEAP_REQUEST_BYTES else 16
        streams = max(1, min(profile.concurrency, most))
    if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
        raise ValueError(f"streams={streams!r}: expected a whole number >= 1")
    if gap_bytes is None:
        # Reading a gap is cheaper than another request while it takes less than a request.
        gap_bytes = int(min(max(request_bytes, 64 << 10), 16 << 20))
    if max_range_bytes is None:
        # Big enough that a request costs little beside its bytes, small enough on a cheap
        # store that each range's buffer is reused memory rather than fresh pages.
        cap = 32 * request_bytes
        max_range_bytes = int(min(max(cap, _MIN_AUTO_RANGE_BYTES), DEFAULT_MAX_RANGE_BYTES))
    collection = load_collection(store)
    selected = collection.select(include)
    for pattern in include:
        # A glob that selects nothing is almost always a typo; saying so beats "0 files".
        if not collection.select([pattern]):
            raise ValueError(f"--include {pattern!r} matches no file in {store.location}")
    if any(e.path == LOCK_NAME for e in selected):
        raise ValueError(
            f"{store.location} holds a file named {LOCK_NAME} at its top, the name pull keeps its "
            "lock under in DEST; pull the other files with --include"
        )
    root = os.path.abspath(os.fspath(dest))
    report = PullReport(source=store.location, dest=root, files=len(selected))
    report.bytes = sum(e.size for e in selected)
    report.requests = 2
    tree = _DestTree(root, keep={e.path for e in collection.entries})
    report.leftovers_removed = len(tree.leftovers_removed)
    try:
        # Directories first, in one pass; only files in directories that already existed are
        # checked (a stat, maybe a hash) on the pool. A fresh DEST costs no per-file task.
        parents = [e.path.rpartition("/")[0] for e in selected]
        fresh = {d for d in sorted(set(parents)) if tree.new_directory(d)}
        if selected:
            tree.probe_mtimes(min(e.mtime_ns for e in selected), max(e.mtime_ns for e in selected))
        existing = [e for e, parent in zip(selected, parents) if parent not in fresh]
        todo = selected
        if existing:
            with ThreadPoolExecutor(max_workers=streams) as pool:
                there = dict(zip((e.path for e in existing),
                                 pool.map(lambda e: tree.present(e, overwrite), existing)))
            todo = [e for e in selected if not there.get(e.path, False)]
        report.present = len(selected) - len(todo)
        by_pack: dict[str, list[FileEntry]] = {}
        objects: list[FileEntry] = []
        for e in todo:
            if e.pack is not None:
                by_pack.setdefault(e.pack, []).append(e)
            else:
                objects.append(e)
        ranges = [
            (key, r)
            for key, entries in sorted(by_pack.items())
            for r in merge_ranges(entries, gap_bytes=gap_bytes, max_range_bytes=max_range_bytes)
        ]
        report.requests += len(ranges) + len(objects)
        total = sum(e.size for e in todo)
        with progress_bar(total, "pull", enabled=show_progress, also=progress) as advance:
            lock = threading.Lock()
            writers = threading.BoundedSemaphore(_RANGE_WRITERS)
            damaged: list[_DamagedFile] = []

            def restored(entries: list[FileEntry]) -> None:
                with lock:
                    report.written += len(entries)
                    report.bytes_written += sum(e.size for e in entries)
                    report.paths += [e.path for e in entries]

            def fetch_range(job: tuple[str, tuple[int, int, list[FileEntry]]]) -> None:
                key, (start, end, entries) = job
                data = get_named(store, key, start, end, named_by=FILES_KEY)
                if len(data) != end - start:
                    raise ValueError(
                        f"{store.location}/{key}: bytes [{start}, {end}) requested, "
                        f"{len(data)} returned; the pack is shorter than the manifest says"
                    )
                view = memoryview(data)
                done: list[FileEntry] = []
                try:
                    with writers:
                        # One directory held per run of its files (a pack keeps them together).
                        for rel_dir, run in groupby(entries, key=_parent):
                            d = tree.open_dir(rel_dir)
                            try:
                                for e in run:
                                    offset = e.offset - start  # type: ignore[operator]
                                    if restore(d, e, view[offset : offset + e.size]):
                                        done.append(e)
                            finally:
                                tree.close_dir(d)
                finally:
                    restored(done)

            def fetch_object(e: FileEntry) -> None:
                d = tree.open_dir(_parent(e))
                try:
                    with open_named(store, e.key, named_by=FILES_KEY) as handle:
                        if restore(d, e, iter(lambda: handle.read(CHUNK), b"")):
                            restored([e])
                finally:
                    tree.close_dir(d)

            def restore(d: _Dir, e: FileEntry, data: bytes | memoryview | Iterable[bytes]) -> bool:
                try:
                    tree.write(d, e, data, fsync)
                except _DamagedFile as exc:
                    # One damaged file must not keep the rest of the collection from coming
                    # back: note it, finish everything else, then fail.
                    with lock:
                        damaged.append(exc)
                    return False
                advance(e.size)
                return True

            with ThreadPoolExecutor(max_workers=streams) as pool:
                futures = [pool.submit(fetch_range, job) for job in ranges]
                futures += [pool.submit(fetch_object, e) for e in objects]
                wait_all(futures)
    finally:
        try:
            tree.publish_staged()  # every write has ended: what is below them is whole
        finally:
            tree.close()
    if damaged:
        damaged.sort(key=str)
        unrestorable = sum(isinstance(exc, _Unrestorable) for exc in damaged)
        if unrestorable == len(damaged):
            what, hint = "could not be restored exactly", ""
        else:
            what = "failed their SHA256 check" if not unrestorable else "could not be restored"
            hint = f". `koochak-data verify --deep {store.location}` lists the damage"
        raise ValueError(
            f"{len(damaged)} file(s) {what} and were not written; every other "
            f"selected file was restored ({report.written} written, {report.present} already "
            f"there). First: {damaged[0]}{hint}"
        )
    report.paths.sort()
    return report
