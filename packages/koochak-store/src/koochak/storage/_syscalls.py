"""The filesystem calls LocalStore makes, in one class: the fault seam.

Every call that can fail on a disk or a mount goes through ``_Syscalls``, so
``koochak.storage.testing.FaultyStore`` can make any of them fail on demand (a subclass that
overrides one method). The two calls Python's ``os`` module lacks, ``sync_file_range`` and
``syncfs``, are found in libc through ctypes here; where they are missing the seam says so with
``False`` and callers fall back.
"""

from __future__ import annotations

import errno
import functools
import os
import sys
from collections.abc import Callable, Iterator

# flock refusals of filesystems that do not support it (some network and FUSE mounts).
_NO_FLOCK = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL})


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

    def stat(self, path: str, *, follow_symlinks: bool = False) -> os.stat_result:
        # Not following by default, like _open_object: a symlink is not an object.
        return os.stat(path, follow_symlinks=follow_symlinks)

    def link(self, src: str, dst: str) -> None:
        os.link(src, dst)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def lock(self, fd: int) -> bool:
        """Take an exclusive ``flock`` on ``fd`` (waiting for it); False where the filesystem
        has no flock. Released when ``fd`` is closed, also by a killed process's exit."""
        import fcntl

        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            if exc.errno in _NO_FLOCK:
                return False
            raise
        return True

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def scandir(self, path: str) -> list[os.DirEntry[str]]:
        with os.scandir(path) as it:
            return list(it)

    def walk(self, path: str) -> Iterator[tuple[str, list[str], list[str]]]:
        """``os.walk(path)``: a directory that cannot be listed is skipped, not an error."""
        return os.walk(path)


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
