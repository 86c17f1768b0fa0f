"""One pull at a time per DEST, and the names of its temp files.

A pull holds an exclusive ``flock`` on ``DEST/.koochak-pull.lock`` while it writes. The lock file
is published whole (a temp file holding the marker line, then a create-only hard link), so an
existing file without that first line is someone else's and is never used or removed. Each run
appends ``run <token> pid <pid>`` after taking the lock and names its temp files
``.koochak-pull-<token>-<32 hex>.tmp``; a run that ends (well or badly) removes the lock file.
So a ``run`` line found in a lock file just taken belongs to a pull that was killed, and the
temp files carrying its token are provably that pull's leftovers: the only files pull ever
removes that it did not create in the same run.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import os
import re
import stat
from collections.abc import Container

__all__ = ["LOCK_NAME", "DestLock"]

LOCK_NAME = ".koochak-pull.lock"
_MAGIC = b"koochak-data pull lock, removed when that pull ends\n"
_TEMP_PREFIX = ".koochak-pull-"
_MAX_LOCK_BYTES = 1 << 20
_RUN_LINE = re.compile(rb"run ([0-9a-f]{32}) pid [0-9]+")
# flock refusals of filesystems that do not support it (some FUSE and network mounts).
_NO_FLOCK = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL})
_log = logging.getLogger(__name__)


class DestLock:
    """The held lock of one pull run into DEST (``root_fd`` is DEST's directory descriptor)."""

    def __init__(self, root_fd: int, root: str) -> None:
        self.token = os.urandom(16).hex()  # 32 hex digits, as a uuid4's (no uuid import)
        self._counter = itertools.count()  # next() is atomic under the GIL: threads may share it
        self._root_fd = root_fd
        self._where = os.path.join(root, LOCK_NAME)
        self._fd, self.killed_runs, self.locked = _take(root_fd, root, self._where, self.token)
        if not self.locked:
            return  # no proof of who is alive: record nothing, so nothing is ever cleaned up
        try:
            os.write(self._fd, f"run {self.token} pid {os.getpid()}\n".encode())
        except BaseException:
            os.close(self._fd)
            raise

    def temp_name(self) -> str:
        """A fresh hidden name no collection file and nothing already in DEST can have.

        The run's random token makes it unique to this run; a counter (32 hex digits, as the
        leftover pattern expects) makes it unique within it, without a random draw per file.
        """
        return f"{_TEMP_PREFIX}{self.token}-{next(self._counter):032x}.tmp"

    def remove_leftovers(self, keep: Container[str]) -> list[str]:
        """Delete the temp files (and staged directories, with what is in them) of killed runs
        anywhere under DEST; return their relative paths (a directory's ends with ``/``).

        Only regular files whose names carry a killed run's token are removed, never a path in
        ``keep`` (the collection's own files), and symlinked directories are not entered.
        """
        if not self.killed_runs:
            return []
        name = re.compile(
            rf"{re.escape(_TEMP_PREFIX)}(?:{'|'.join(self.killed_runs)})-[0-9a-f]{{32}}\.tmp"
        )
        removed = []
        for dirpath, dirs, files, dir_fd in os.fwalk(".", dir_fd=self._root_fd, follow_symlinks=False):
            for sub in [d for d in dirs if name.fullmatch(d)]:
                # A killed pull's staged directory: nothing below it was ever visible.
                rel = os.path.normpath(os.path.join(dirpath, sub))
                if rel in keep:
                    continue
                dirs.remove(sub)
                import shutil  # only a killed pull's staged directory needs it

                shutil.rmtree(sub, dir_fd=dir_fd)
                removed.append(rel + "/")
            for file in files:
                rel = os.path.normpath(os.path.join(dirpath, file))
                if not name.fullmatch(file) or rel in keep:
                    continue
                try:
                    if stat.S_ISREG(os.stat(file, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                        os.unlink(file, dir_fd=dir_fd)
                        removed.append(rel)
                except FileNotFoundError:
                    continue
        return sorted(removed)

    def release(self) -> None:
        """Remove the lock file while still holding its flock, then let go of it."""
        try:
            st = os.fstat(self._fd)
            now = _lstat(self._root_fd)
            if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(LOCK_NAME, dir_fd=self._root_fd)
        finally:
            os.close(self._fd)


def _lstat(root_fd: int) -> os.stat_result | None:
    try:
        return os.stat(LOCK_NAME, dir_fd=root_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _not_ours(where: str, why: str = "") -> ValueError:
    return ValueError(
        f"{where} exists and is not a koochak-data pull lock{why}; move it away (pull never "
        "removes a file it did not create)"
    )


def _take(root_fd: int, root: str, where: str, token: str) -> tuple[int, tuple[str, ...], bool]:
    """Open and flock the lock file; return it, the tokens of killed runs it lists, and whether
    it is really locked (False on a filesystem without flock: a warning, no cleanup)."""
    for _ in range(10):  # a finishing pull may remove the file between our open and flock
        _publish(root_fd, token)
        flags = os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(LOCK_NAME, flags, dir_fd=root_fd)
        except FileNotFoundError:
            continue
        except OSError as exc:  # a symlink (ELOOP), a directory (EISDIR), ...
            raise _not_ours(where, f" ({exc.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_LOCK_BYTES:
                raise _not_ours(where)
            if os.pread(fd, len(_MAGIC), 0) != _MAGIC:
                raise _not_ours(where)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in _NO_FLOCK:
                    # Temp names stay unique, so concurrent pulls still never destroy data;
                    # they are only not kept apart.
                    _log.warning("%s: cannot lock (%s); pulls into %s are not serialized",
                                 where, exc.strerror, root)  # fmt: skip
                    return fd, (), False
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                raise ValueError(
                    f"another pull is writing into {root} (it holds {where}); wait for it to "
                    "finish or pull into another directory"
                ) from None
            now = _lstat(root_fd)
            if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                text = os.pread(fd, _MAX_LOCK_BYTES, 0)
                killed = [m.group(1).decode() for m in _RUN_LINE.finditer(text)]
                return fd, tuple(dict.fromkeys(killed)), True
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # we locked a lock file that its pull had just removed: start again
    raise ValueError(f"could not take {where}: other pulls keep replacing it")


def _publish(root_fd: int, token: str) -> None:
    """Create the lock file complete with its marker line, unless one exists."""
    temp = f"{_TEMP_PREFIX}{token}-{os.urandom(16).hex()}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temp, flags, 0o644, dir_fd=root_fd)
    try:
        try:
            os.write(fd, _MAGIC)
        finally:
            os.close(fd)
        try:
            os.link(temp, LOCK_NAME, src_dir_fd=root_fd, dst_dir_fd=root_fd, follow_symlinks=False)
        except FileExistsError:
            pass  # a lock file is there: _take checks whose it is
    finally:
        os.unlink(temp, dir_fd=root_fd)
