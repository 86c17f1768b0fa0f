"""Ready manifests for local files and directories (job outputs), without a Store.

``write_ready_manifest(path)`` hashes a finished file or directory, makes it read-only and
publishes ``<path>.ready.json`` create-only; ``read_ready_manifest`` reads and validates it;
``verify_ready`` re-hashes the target against it. Targets are read through ``O_NOFOLLOW``
descriptors with inode checks. These checks defend against accidental concurrent writers and
ordinary replacement races among cooperating processes of one user; they are not a defence
against a hostile writer with the same permissions.
"""

from __future__ import annotations

import errno
import hashlib
import os
import pathlib
import stat as _stat
from typing import Any

from koochak.storage.fsutil import atomic_write_bytes
from koochak.storage.ready_manifest import (
    MANIFEST_VERSION,
    READY_SUFFIX,
    InvalidArtifact,
    _check_manifest,
    _directory_digest,
    _manifest_bytes,
    _parse_manifest,
)

__all__ = ["write_ready_manifest", "read_ready_manifest", "verify_ready"]

_CHUNK = 8 << 20


def _manifest_path(path: str | os.PathLike[str]) -> tuple[pathlib.Path, pathlib.Path]:
    """(target, manifest) for either spelling."""
    path = pathlib.Path(os.path.abspath(os.fspath(path)))
    if path.name.endswith(READY_SUFFIX):
        return path.with_name(path.name[: -len(READY_SUFFIX)]), path
    return path, path.with_name(path.name + READY_SUFFIX)


def _hash_file(path: pathlib.Path, *, make_read_only: bool) -> tuple[int, str]:
    """Size and SHA256 of a regular file read through one O_NOFOLLOW descriptor.

    The descriptor's inode must still be the path's inode after reading, and its size must not
    change: otherwise someone replaced or rewrote the file under us.
    """
    try:
        # O_NONBLOCK: opening a FIFO planted in an output must not hang the reader.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InvalidArtifact(f"{path}: is a symlink; outputs must be regular files") from None
        raise
    try:
        before = os.fstat(fd)
        if not _stat.S_ISREG(before.st_mode):
            raise InvalidArtifact(f"{path}: not a regular file")
        sha = hashlib.sha256()
        size = 0
        while block := os.read(fd, _CHUNK):
            sha.update(block)
            size += len(block)
        after = os.fstat(fd)
        if make_read_only:
            os.fchmod(fd, _stat.S_IMODE(after.st_mode) & ~0o222)
    finally:
        os.close(fd)
    now = os.lstat(path)
    if (
        (now.st_dev, now.st_ino) != (before.st_dev, before.st_ino)
        or size != before.st_size
        or after.st_size != before.st_size
        or after.st_mtime_ns != before.st_mtime_ns
    ):
        raise InvalidArtifact(f"{path}: changed or was replaced while it was being read")
    return size, sha.hexdigest()


def _describe(target: pathlib.Path, *, make_read_only: bool) -> dict[str, Any]:
    """Type, size, digest and (for directories) the sorted file list of a target."""
    st = os.lstat(target)  # FileNotFoundError names the missing target
    if _stat.S_ISLNK(st.st_mode):
        raise InvalidArtifact(
            f"{target}: is a symlink; outputs must be a regular file or directory"
        )
    if _stat.S_ISREG(st.st_mode):
        size, digest = _hash_file(target, make_read_only=make_read_only)
        return {"type": "file", "size": size, "sha256": digest, "file_count": 1}
    if not _stat.S_ISDIR(st.st_mode):
        raise InvalidArtifact(f"{target}: neither a regular file nor a directory")
    files = []
    for dirpath, dirnames, filenames in os.walk(target, followlinks=False):
        dirnames.sort()
        for name in dirnames:
            if os.path.islink(os.path.join(dirpath, name)):
                raise InvalidArtifact(
                    f"{os.path.join(dirpath, name)}: symlinks are not allowed in outputs"
                )
        for name in sorted(filenames):
            full = pathlib.Path(dirpath) / name
            size, digest = _hash_file(full, make_read_only=make_read_only)
            files.append(
                {"path": full.relative_to(target).as_posix(), "size": size, "sha256": digest}
            )
    files.sort(key=lambda entry: entry["path"])
    return {
        "type": "directory",
        "size": sum(entry["size"] for entry in files),
        "sha256": _directory_digest(files),
        "file_count": len(files),
        "files": files,
    }


def write_ready_manifest(
    path: str | os.PathLike[str],
    *,
    provenance: dict[str, Any] | None = None,
    artifact_id: str | None = None,
) -> pathlib.Path:
    """Hash a finished file or directory, make it read-only, and publish ``<path>.ready.json``.

    The manifest is written under a hidden temp name, fsynced and hard-linked into place, so it
    appears complete or not at all and an existing manifest is never replaced
    (FileExistsError). Returns the manifest's path.
    """
    target, manifest = _manifest_path(path)
    if provenance is not None and not isinstance(provenance, dict):
        raise ValueError(f"{manifest}: provenance must be a dict or None")
    if manifest.exists() or manifest.is_symlink():
        raise FileExistsError(errno.EEXIST, "ready manifest already exists", str(manifest))
    doc = {
        "version": MANIFEST_VERSION,
        "artifact_id": artifact_id if artifact_id is not None else target.name,
        "key": target.name,
        **_describe(target, make_read_only=True),
        "provenance": provenance,
    }
    _check_manifest(doc, str(manifest))
    payload = _manifest_bytes(doc)
    # Create-only: a concurrent publisher of the same manifest makes the hard link fail.
    return atomic_write_bytes(manifest, payload, overwrite=False, mode=0o444)


def read_ready_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and validate the ready manifest of ``path`` (the target or the manifest itself).

    FileNotFoundError when it is missing; InvalidArtifact (a ValueError) naming the file and
    field when it is a symlink, malformed, or of an unknown version.
    """
    _, manifest = _manifest_path(path)
    try:
        # O_NONBLOCK: a FIFO planted as the manifest is refused below instead of hanging here.
        fd = os.open(manifest, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InvalidArtifact(
                f"{manifest}: is a symlink; a ready manifest must be a regular file"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode):
            raise InvalidArtifact(f"{manifest}: not a regular file")
        os.set_blocking(fd, True)
        if st.st_size > 256 << 20:
            raise InvalidArtifact(
                f"{manifest}: {st.st_size} bytes is too large for a ready manifest"
            )
        parts = []
        while block := os.read(fd, _CHUNK):
            parts.append(block)
    finally:
        os.close(fd)
    return _parse_manifest(b"".join(parts), str(manifest))


def verify_ready(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Check a target against its ready manifest, byte for byte; return the manifest.

    Raises InvalidArtifact naming the file when anything differs: a missing, extra, changed or
    symlinked file, a different size or SHA256, or a manifest for another target.
    """
    target, manifest = _manifest_path(path)
    doc = read_ready_manifest(manifest)
    if doc["key"] != target.name:
        raise InvalidArtifact(f"{manifest}: describes {doc['key']!r}, not {target.name!r}")
    try:
        actual = _describe(target, make_read_only=False)
    except FileNotFoundError:
        raise InvalidArtifact(f"{target}: missing although {manifest.name} exists") from None
    if actual["type"] != doc["type"]:
        raise InvalidArtifact(f"{target}: is a {actual['type']}, manifest says {doc['type']}")
    if doc["type"] == "directory":
        listed = {entry["path"]: entry for entry in doc["files"]}
        found = {entry["path"]: entry for entry in actual["files"]}
        for rel in sorted(set(listed) | set(found)):
            if rel not in found:
                raise InvalidArtifact(f"{target / rel}: listed in {manifest.name} but missing")
            if rel not in listed:
                raise InvalidArtifact(f"{target / rel}: present but not listed in {manifest.name}")
            if found[rel] != listed[rel]:
                raise InvalidArtifact(
                    f"{target / rel}: size or SHA256 differs from {manifest.name}"
                )
    if actual["size"] != doc["size"]:
        raise InvalidArtifact(
            f"{target}: {actual['size']} bytes, {manifest.name} says {doc['size']}"
        )
    if actual["sha256"] != doc["sha256"]:
        raise InvalidArtifact(
            f"{target}: SHA256 {actual['sha256']}, {manifest.name} says {doc['sha256']}"
        )
    return doc
