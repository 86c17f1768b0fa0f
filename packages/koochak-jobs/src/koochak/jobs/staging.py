"""Write-once staging of a prepared run's files (config, then the launch manifest last).

Each file is written under a hidden temp name in its own directory, fsynced, made read-only
(0444) *before* it becomes visible, hard-linked into place (a link never replaces) and the
directory fsynced. `LocalStore.put` does the same dance but publishes 0644 files and has no
"identical bytes are fine" rule; staging needs both, so it has this small writer of its own.

A rerun with identical bytes is a no-op (a loosened mode is re-hardened); different bytes, a
symlink or anything that is not a regular file in the way are refused with FileExistsError.
"""

from __future__ import annotations

import errno
import os
import stat
import uuid
from collections.abc import Sequence
from typing import Protocol

from koochak.storage.store import TEMP_PREFIX


class _File(Protocol):
    path: str
    content: bytes


class _Staged(Protocol):
    """What staging needs of a `koochak.jobs.PreparedRun` (kept structural so that the
    manifest module imports this one, never the other way round)."""

    @property
    def artifacts(self) -> Sequence[_File]: ...

__all__ = ["stage_run", "write_once"]

_MODE = 0o444
_MAX_COMPARE = 64 << 20


def stage_run(prepared: _Staged) -> list[str]:
    """Write ``prepared.artifacts`` in order (the manifest is last); return the paths written
    now (empty when everything was already staged with identical bytes)."""
    written = []
    for artifact in prepared.artifacts:
        if write_once(artifact.path, artifact.content):
            written.append(artifact.path)
    return written


def write_once(path: str, content: bytes) -> bool:
    """Create ``path`` with ``content`` read-only and durable; True if this call created it.

    False when the file already holds exactly ``content``; FileExistsError when it holds
    anything else or is not a regular file.
    """
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    if _matches_existing(path, content):
        return False
    temp = os.path.join(parent, f"{TEMP_PREFIX}{uuid.uuid4().hex}-{os.path.basename(path)[:100]}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _MODE)
    try:
        try:
            view = memoryview(content)
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, _MODE)  # whatever the umask did
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(temp, path)
        except FileExistsError:
            # Lost a race with a concurrent stager: fine if it wrote the same bytes.
            if _matches_existing(path, content):
                return False
            raise
    finally:
        try:
            os.unlink(temp)
        except OSError:
            pass
    _fsync_dir(parent)
    return True


def _matches_existing(path: str, content: bytes) -> bool:
    """False when nothing is at ``path``; True when a regular file with ``content`` is (made
    0444 again if its mode was loosened); FileExistsError otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        if os.path.islink(path):  # a dangling symlink
            raise FileExistsError(errno.EEXIST, "refusing to stage over a symlink", path) from None
        if os.path.lexists(path):  # a concurrent stager linked it in just now: compare
            return _matches_existing(path, content)
        return False
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise FileExistsError(errno.EEXIST, "refusing to stage over a symlink", path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileExistsError(errno.EEXIST, "refusing to stage over a non-regular file", path)
        if st.st_size != len(content) or st.st_size > _MAX_COMPARE:
            raise FileExistsError(errno.EEXIST, "refusing to replace different content", path)
        parts = []
        while block := os.read(fd, 1 << 20):
            parts.append(block)
        if b"".join(parts) != content:
            raise FileExistsError(errno.EEXIST, "refusing to replace different content", path)
        if stat.S_IMODE(st.st_mode) != _MODE:
            os.fchmod(fd, _MODE)
    finally:
        os.close(fd)
    return True


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
