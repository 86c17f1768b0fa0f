"""Small, durable filesystem helpers for plain local paths (no Store involved).

``mkdir_p`` makes a directory and its parents and syncs every entry it created;
``atomic_write_bytes`` / ``atomic_write_text`` write a file under a hidden temp name in the same
directory, fsync it, then rename it into place (or hard-link it, create-only) and fsync the
directory, so a reader sees the old file or the whole new one and a crash leaves no torn file.
``fsync_dir`` is the directory sync they share. Torch-free.
"""

from __future__ import annotations

import errno
import os
import pathlib
import uuid

from koochak.storage.keys import TEMP_PREFIX

__all__ = ["atomic_write_bytes", "atomic_write_text", "fsync_dir", "mkdir_p"]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the entries of directory ``path`` (a create, rename or unlink in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def mkdir_p(path: str | os.PathLike[str]) -> pathlib.Path:
    """Create directory ``path`` and any missing parents, like ``mkdir -p``; return its path.

    An existing directory is fine. Every directory this call creates is made durable (its
    parent is fsynced). NotADirectoryError names the path when a non-directory is in the way.
    """
    target = pathlib.Path(os.path.abspath(os.fspath(path)))
    missing = []
    current = target
    while not current.is_dir():
        if os.path.lexists(current):
            raise NotADirectoryError(errno.ENOTDIR, "mkdir_p: not a directory", str(current))
        missing.append(current)
        current = current.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory)
        except FileExistsError:
            if not directory.is_dir():  # lost a race to a file, not to another mkdir_p
                raise NotADirectoryError(
                    errno.ENOTDIR, "mkdir_p: not a directory", str(directory)
                ) from None
            continue
        fsync_dir(directory.parent)
    return target


def atomic_write_bytes(
    path: str | os.PathLike[str],
    data: bytes | bytearray | memoryview,
    *,
    overwrite: bool = True,
    mode: int = 0o644,
) -> pathlib.Path:
    """Write ``data`` to ``path`` so that it appears complete or not at all; return the path.

    The bytes go to a hidden temp file in ``path``'s directory (same filesystem), which is
    fsynced and then renamed over ``path`` (``overwrite=True``) or hard-linked to it
    (``overwrite=False``: create-only, FileExistsError if ``path`` exists, nothing replaced).
    The directory is fsynced last. ``mode`` is applied before the file becomes visible (the
    umask does not narrow it). The temp file never outlives a failed call.
    """
    if isinstance(data, str):
        raise TypeError(
            f"atomic_write_bytes({os.fspath(path)!r}): data is str; use atomic_write_text"
        )
    target = pathlib.Path(os.path.abspath(os.fspath(path)))
    if not target.name:
        raise ValueError(f"atomic_write_bytes({os.fspath(path)!r}): expected a file path")
    temp = target.with_name(f"{TEMP_PREFIX}{uuid.uuid4().hex}-{target.name[:120]}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            view = memoryview(data).cast("B")
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        if overwrite:
            os.replace(temp, target)
        else:
            os.link(temp, target)  # never replaces: an existing file makes this fail
    finally:
        try:
            os.unlink(temp)
        except FileNotFoundError:
            pass  # renamed into place
    fsync_dir(target.parent)
    return target


def atomic_write_text(
    path: str | os.PathLike[str],
    text: str,
    *,
    encoding: str = "utf-8",
    overwrite: bool = True,
    mode: int = 0o644,
) -> pathlib.Path:
    """``atomic_write_bytes`` of ``text`` encoded with ``encoding`` (UTF-8 by default)."""
    if not isinstance(text, str):
        raise TypeError(f"atomic_write_text({os.fspath(path)!r}): text must be str")
    return atomic_write_bytes(path, text.encode(encoding), overwrite=overwrite, mode=mode)
