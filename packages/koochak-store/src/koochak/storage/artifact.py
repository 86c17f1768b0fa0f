"""Numbered artifacts and ready manifests: an object counts only once its manifest exists.

Two halves share one manifest format (``docs/formats.md``, "Ready manifests"):

* Store publication — ``publish`` / ``unpublish`` / ``read_verified`` / ``highest_valid`` — used by
  checkpoints: the object is put create-only and synced, then ``<name>.ready.json`` commits it.
  Removal is always manifest first, so a reader never trusts an object that is going away.
* Local file/directory manifests — ``write_ready_manifest`` / ``read_ready_manifest`` /
  ``verify_ready`` — used by job outputs: targets are read through ``O_NOFOLLOW`` descriptors with
  inode checks, made read-only, and the manifest is published with a no-overwrite hard link.

These checks defend against accidental concurrent writers and ordinary replacement races among
cooperating processes of one user; they are not a defence against a hostile writer with the
same permissions.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import pathlib
import re
import stat as _stat
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeVar

from koochak.storage.fsutil import atomic_write_bytes, fsync_dir
from koochak.storage.keys import TEMP_PREFIX, validate_key
from koochak.storage.store import LocalStore, Store, open_store
from koochak.storage.strict_json import loads_strict, require_version

__all__ = [
    "READY_SUFFIX",
    "MANIFEST_VERSION",
    "InvalidArtifact",
    "Publication",
    "publish",
    "unpublish",
    "read_verified",
    "published_candidates",
    "highest_valid",
    "numbered_pattern",
    "prune_keep_last_k",
    "write_ready_manifest",
    "read_ready_manifest",
    "verify_ready",
]

READY_SUFFIX = ".ready.json"
MANIFEST_VERSION = 1

_log = logging.getLogger(__name__)
_T = TypeVar("_T")
_CHUNK = 8 << 20
_REQUIRED = {"version", "artifact_id", "key", "type", "size", "sha256", "file_count", "provenance"}
_OPTIONAL = {"files"}
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_KIND = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


class InvalidArtifact(ValueError):
    """A candidate artifact that must be skipped: no manifest, a malformed one, or bad bytes."""


@dataclass(frozen=True)
class Publication:
    """A committed object and its ready manifest."""

    artifact_id: str  # f"{kind}/{name}", e.g. "checkpoint/step000000100.pt"
    key: str  # object key in the store
    size: int
    sha256: str
    manifest_key: str  # key + READY_SUFFIX
    path: str | None  # absolute local path when the store has one


# -- the manifest document --------------------------------------------------------------------


def _manifest_bytes(doc: dict[str, Any]) -> bytes:
    try:
        text = json.dumps(doc, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"ready manifest for {doc.get('key')!r}: provenance is not JSON: {exc}"
        ) from None
    return (text + "\n").encode("utf-8")


def _check_manifest(doc: Any, where: str) -> dict[str, Any]:
    """Validate a parsed manifest; InvalidArtifact names ``where`` and the field."""
    if not isinstance(doc, dict):
        raise InvalidArtifact(f"{where}: a ready manifest must be a JSON object")
    try:
        require_version(doc, where, MANIFEST_VERSION)  # exact int: true and 1.0 are refused
    except ValueError as exc:
        raise InvalidArtifact(str(exc)) from None
    unknown = sorted(set(doc) - _REQUIRED - _OPTIONAL)
    if unknown:
        raise InvalidArtifact(f"{where}: unknown field {unknown[0]!r}")
    missing = sorted(_REQUIRED - set(doc))
    if missing:
        raise InvalidArtifact(f"{where}: missing field {missing[0]!r}")
    for name in ("artifact_id", "key"):
        if not isinstance(doc[name], str) or not doc[name]:
            raise InvalidArtifact(f"{where}: field {name!r} must be a non-empty string")
    if doc["type"] not in ("file", "directory"):
        raise InvalidArtifact(
            f"{where}: field 'type'={doc['type']!r}; expected 'file' or 'directory'"
        )
    for name in ("size", "file_count"):
        value = doc[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidArtifact(f"{where}: field {name!r}={value!r}; expected an int >= 0")
    if not isinstance(doc["sha256"], str) or not _SHA256_HEX.fullmatch(doc["sha256"]):
        raise InvalidArtifact(f"{where}: field 'sha256' must be 64 lower-case hex digits")
    if doc["provenance"] is not None and not isinstance(doc["provenance"], dict):
        raise InvalidArtifact(f"{where}: field 'provenance' must be an object or null")
    if doc["type"] == "directory":
        _check_files(doc, where)
    elif "files" in doc:
        raise InvalidArtifact(f"{where}: field 'files' is only for type 'directory'")
    elif doc["file_count"] != 1:
        raise InvalidArtifact(f"{where}: field 'file_count' must be 1 for a file")
    return doc


def _check_files(doc: dict[str, Any], where: str) -> None:
    files = doc.get("files")
    if not isinstance(files, list):
        raise InvalidArtifact(f"{where}: field 'files' (a list) is required for a directory")
    paths = []
    for index, entry in enumerate(files):
        if (
            not isinstance(entry, dict)
            or set(entry) != {"path", "size", "sha256"}
            or not isinstance(entry["path"], str)
            or isinstance(entry["size"], bool)
            or not isinstance(entry["size"], int)
            or not isinstance(entry["sha256"], str)
        ):
            raise InvalidArtifact(f"{where}: files[{index}] must be {{path, size, sha256}}")
        paths.append(entry["path"])
    if paths != sorted(paths) or len(set(paths)) != len(paths):
        raise InvalidArtifact(f"{where}: field 'files' must be sorted by path without repeats")
    if doc["file_count"] != len(files) or doc["size"] != sum(e["size"] for e in files):
        raise InvalidArtifact(f"{where}: 'file_count'/'size' disagree with 'files'")
    if doc["sha256"] != _directory_digest(files):
        raise InvalidArtifact(f"{where}: field 'sha256' does not match the digest of 'files'")


def _directory_digest(files: list[dict[str, Any]]) -> str:
    """A directory's digest: SHA256 of its sorted file list as compact, key-sorted JSON."""
    canonical = json.dumps(files, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _parse_manifest(raw: bytes, where: str) -> dict[str, Any]:
    try:
        doc = loads_strict(raw, where)  # duplicate fields, NaN and deep nesting are refused
    except ValueError as exc:
        raise InvalidArtifact(str(exc)) from None
    return _check_manifest(doc, where)


# -- store publication ------------------------------------------------------------------------


def _check_name(name: str) -> str:
    validate_key(name)
    if name.endswith(READY_SUFFIX):
        raise ValueError(f"artifact name {name!r} ends in {READY_SUFFIX!r}, which marks manifests")
    return name


def publish(
    store: Store,
    name: str,
    data: bytes | bytearray | memoryview | BinaryIO | Iterable[bytes],
    *,
    kind: str = "checkpoint",
    keep_last_k: int | None = None,
    pattern: str | None = None,
    latest: str | bool | None = True,
    provenance: dict[str, Any] | None = None,
) -> Publication:
    """Publish ``data`` as ``name`` and commit it with ``name + READY_SUFFIX``.

    The object is put create-only and is durable before its manifest is written, so a reader
    that finds the manifest finds the whole object. If ``name`` already exists it is first
    un-committed (manifest, then object). ``keep_last_k`` prunes older publications whose keys
    fully match ``pattern`` (group 1 = the number), manifest before object; without
    ``pattern`` it is derived from a numbered ``name`` (``numbered_pattern``:
    ``step000000100.pt`` -> ``step(\\d+)\\.pt``). ``latest`` names a symlink to the new
    object; the default (True) is ``latest<suffix>`` beside a numbered name (``latest.pt``),
    False or None keeps none. It is kept only on ``LocalStore(publish="link")`` stores:
    write-once stores cannot replace it atomically, so they never get one.
    """
    _check_name(name)
    if not isinstance(kind, str) or not _KIND.fullmatch(kind):
        raise ValueError(f"publish: kind={kind!r}; expected a word such as 'checkpoint'")
    regex = None
    if keep_last_k is not None:
        if isinstance(keep_last_k, bool) or not isinstance(keep_last_k, int) or keep_last_k < 1:
            raise ValueError(f"publish: keep_last_k={keep_last_k!r}; expected an int >= 1 or None")
        if pattern is None:
            pattern = numbered_pattern(name)
        regex = _compile(pattern)
        if regex.fullmatch(name) is None:
            raise ValueError(f"publish: name {name!r} does not fully match pattern {pattern!r}")
    derived_latest = latest is True
    latest = _latest_name(name, latest)
    if provenance is not None and not isinstance(provenance, dict):
        raise ValueError(
            f"publish: provenance must be a dict or None, got {type(provenance).__name__}"
        )
    manifest_key = name + READY_SUFFIX

    if _exists(store, manifest_key) or _exists(store, name):
        unpublish(store, name)
    info = store.put(name, data)
    sha256 = info.sha256 if info.sha256 is not None else _sha_of_object(store, name)
    doc = {
        "version": MANIFEST_VERSION,
        "artifact_id": f"{kind}/{name}",
        "key": name,
        "type": "file",
        "size": info.size,
        "sha256": sha256,
        "file_count": 1,
        "provenance": provenance,
    }
    try:
        store.put(manifest_key, _manifest_bytes(doc))
    except BaseException:
        # Without its manifest the object is invisible to readers; remove it so a failed publish
        # leaves no stray bytes, then report the original error.
        try:
            store.delete(name)
        except OSError:
            pass
        raise
    publication = Publication(
        artifact_id=doc["artifact_id"],
        key=name,
        size=info.size,
        sha256=sha256,
        manifest_key=manifest_key,
        path=store.local_path(name),
    )
    if latest is not None and isinstance(store, LocalStore) and store.publish == "link":
        try:
            _point_latest(store, latest, name)
        except FileExistsError:
            if not derived_latest:
                raise
            # Only the default pointer: a real file of that name (an older tool's copy) is the
            # user's; the publication stands, and the file is neither replaced nor an error.
            _log.warning("%s/%s is a real file, not a symlink; not pointing it at %s",
                         store.location, latest, name)  # fmt: skip
    if regex is not None:
        _prune(store, regex, pattern, keep_last_k)  # type: ignore[arg-type]
    return publication


# The last run of digits in a key's final segment is its number: step000000100.pt -> 100.
_NUMBERED = re.compile(r"(?P<head>(?:.*/)?[^/]*?)(?P<number>[0-9]+)(?P<tail>[^/0-9]*)")


def numbered_pattern(name: str) -> str:
    """The pattern matching every sibling of a numbered ``name``, group 1 being the number.

    The number is the last run of digits in the final path segment; the text around it is
    kept literally: ``"runs/a/step000000100.pt"`` -> ``r"runs/a/step(\\d+)\\.pt"``. ValueError
    when the final segment has no digits (pass ``pattern=`` for such names).
    """
    match = _NUMBERED.fullmatch(name)
    if match is None:
        raise ValueError(
            f"publish: name {name!r} has no number in its last segment to prune by; pass "
            "pattern=, a regex whose group 1 is the number (e.g. r'model-(\\d+)\\.bin')"
        )
    return re.escape(match["head"]) + r"(\d+)" + re.escape(match["tail"])


def _latest_name(name: str, latest: str | bool | None) -> str | None:
    """The ``latest`` symlink's key for ``publish``: derived (True), none, or given."""
    if latest is None or latest is False:
        return None
    if latest is True:
        match = _NUMBERED.fullmatch(name)
        if match is None:
            return None  # an unnumbered name is already stable; nothing to point at it
        latest = f"{match['head'].rpartition('/')[0]}/latest{match['tail']}".lstrip("/")
        if latest == name:
            return None
        return latest
    if not isinstance(latest, str):
        raise ValueError(f"publish: latest={latest!r}; expected a name, True or False")
    _check_name(latest)
    if latest == name:
        raise ValueError(f"publish: latest={latest!r} is the artifact's own name")
    return latest


def prune_keep_last_k(directory: str | os.PathLike[str] | Store, pattern: str, k: int) -> list[str]:
    """Keep the ``k`` highest-numbered publications under ``directory``; return removed keys.

    ``directory`` is a directory, a ``scheme://`` location or a Store; ``pattern`` is a regex
    whose group 1 is the number and which must match a whole key (``r"step(\\d+)\\.pt"``).
    Only committed pairs (an object with its ready manifest) are counted and removed, each
    manifest before its object, so an object still being published is never touched.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"prune_keep_last_k: k={k!r}; expected an int >= 0")
    store = open_store(directory)
    regex = _compile(pattern)
    return _prune(store, regex, pattern, k)


def unpublish(store: Store, name: str) -> None:
    """Un-commit ``name``: delete its manifest, then the object. Missing parts are fine."""
    _check_name(name)
    for key in (name + READY_SUFFIX, name):
        try:
            store.delete(key)
        except FileNotFoundError:
            pass


def read_verified(store: Store, name: str) -> tuple[Publication, bytes]:
    """Read ``name`` once and check it against its ready manifest.

    Raises InvalidArtifact when the manifest is missing, malformed or of an unknown version, or
    when the object is missing or its size or SHA256 differ. Any other OSError propagates: an
    unreadable object is not evidence that it is invalid.
    """
    _check_name(name)
    manifest_key = name + READY_SUFFIX
    where = f"{store.location}/{manifest_key}"
    try:
        raw = store.get(manifest_key)
    except FileNotFoundError:
        raise InvalidArtifact(f"{where}: no ready manifest; {name!r} is not committed") from None
    doc = _parse_manifest(raw, where)
    if doc["key"] != name or doc["type"] != "file":
        raise InvalidArtifact(
            f"{where}: manifest describes {doc['key']!r} ({doc['type']}), not {name!r}"
        )
    try:
        data = store.get(name)
    except FileNotFoundError:
        raise InvalidArtifact(
            f"{store.location}/{name}: object missing although its manifest exists"
        ) from None
    if len(data) != doc["size"]:
        raise InvalidArtifact(
            f"{store.location}/{name}: {len(data)} bytes, manifest says {doc['size']}"
        )
    digest = hashlib.sha256(data).hexdigest()
    if digest != doc["sha256"]:
        raise InvalidArtifact(
            f"{store.location}/{name}: SHA256 {digest}, manifest says {doc['sha256']}"
        )
    publication = Publication(
        artifact_id=doc["artifact_id"],
        key=name,
        size=doc["size"],
        sha256=digest,
        manifest_key=manifest_key,
        path=store.local_path(name),
    )
    return publication, data


def published_candidates(store: Store, pattern: str) -> list[tuple[int, str]]:
    """``(number, key)`` for every key fully matching ``pattern`` that has a manifest, highest first."""
    return _candidates(store, _compile(pattern), pattern)


def highest_valid(
    store: Store,
    pattern: str,
    *,
    check: Callable[[Publication, bytes], _T] | None = None,
) -> tuple[Publication, _T | bytes] | None:
    """The highest-numbered publication that validates, or None when there is none.

    Candidates are tried in descending order; one whose manifest, size or SHA256 is wrong (or
    for which ``check`` raises InvalidArtifact) is logged and skipped. Every other error is
    raised, so an unreadable newest artifact never silently rolls back to an older one.
    """
    for number, key in published_candidates(store, pattern):
        try:
            publication, data = read_verified(store, key)
            if check is None:
                return publication, data
            return publication, check(publication, data)
        except InvalidArtifact as exc:
            _log.warning("skipping %s #%d (%s): %s", key, number, store.location, exc)
    return None


def _compile(pattern: str) -> re.Pattern[str]:
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"pattern {pattern!r} is not a regular expression: {exc}") from None
    if regex.groups < 1:
        raise ValueError(
            f"pattern {pattern!r} needs a group capturing the number, e.g. r'step(\\d+)\\.pt'"
        )
    return regex


def _literal_prefix(pattern: str) -> str:
    """Plain text every match of ``pattern`` starts with, so listing can be narrowed to it.

    Conservative: stops at the first metacharacter, drops a character a quantifier makes
    optional, and gives up on alternation (a prefix that is too short only costs listing time).
    """
    body = pattern[1:] if pattern.startswith("^") else pattern
    if "|" in body:
        return ""
    prefix = []
    for index, char in enumerate(body):
        if char in ".^$*+?{}[]\\|()":
            break
        following = body[index + 1 : index + 2]
        if following in ("?", "*", "{"):
            break
        prefix.append(char)
        if following == "+":
            break
    return "".join(prefix)


def _candidates(store: Store, regex: re.Pattern[str], pattern: str) -> list[tuple[int, str]]:
    listed = {info.key for info in store.list(_literal_prefix(pattern))}
    found = []
    for key in listed:
        if key.endswith(READY_SUFFIX) or key + READY_SUFFIX not in listed:
            continue
        match = regex.fullmatch(key)
        if match is None:
            continue
        try:
            number = int(match.group(1))
        except (TypeError, ValueError):
            raise ValueError(
                f"pattern {pattern!r}: group 1 matched {match.group(1)!r} in {key!r}, not a number"
            ) from None
        found.append((number, key))
    found.sort(reverse=True)
    return found


def _prune(store: Store, regex: re.Pattern[str], pattern: str, keep: int) -> list[str]:
    removed = []
    for _, key in _candidates(store, regex, pattern)[keep:]:
        unpublish(store, key)
        removed.append(key)
    return removed


def _exists(store: Store, key: str) -> bool:
    try:
        store.stat(key)
    except FileNotFoundError:
        return False
    return True


def _sha_of_object(store: Store, key: str) -> str:
    """For third-party stores whose put() does not report a digest: hash what was stored."""
    sha = hashlib.sha256()
    with store.open(key) as stream:
        while block := stream.read(_CHUNK):
            sha.update(block)
    return sha.hexdigest()


def _point_latest(store: LocalStore, latest: str, name: str) -> None:
    """Swing the ``latest`` symlink to ``name`` atomically (symlink under a temp name, rename)."""
    link_path = store.root / latest
    target = os.path.relpath(store.root / name, link_path.parent)
    link_path.parent.mkdir(parents=True, exist_ok=True)
    if link_path.exists() and not link_path.is_symlink():
        raise FileExistsError(
            errno.EEXIST, "latest= names a real object, not a symlink", str(link_path)
        )
    temp = link_path.parent / f"{TEMP_PREFIX}{uuid.uuid4().hex}-{link_path.name[:120]}"
    os.symlink(target, temp)
    try:
        os.replace(temp, link_path)  # the alias is the one thing meant to change
    except BaseException:
        os.unlink(temp)
        raise
    if store.fsync:
        fsync_dir(link_path.parent)


# -- local file and directory manifests -------------------------------------------------------


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
