"""The ready manifest document that both halves of ``koochak.storage.artifact`` share.

``<name>.ready.json`` (``docs/formats.md``, "Ready manifests") says an object, a file or a
directory is complete: its type, size, SHA256 and, for a directory, every file. This module
encodes and validates the document; ``publication`` writes and reads it in a Store,
``local_ready`` beside local files and directories. Readers refuse unknown versions and unknown
or missing fields with an ``InvalidArtifact`` naming the file and the field.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from koochak.storage.strict_json import check_fields, loads_strict, require_version

__all__ = ["READY_SUFFIX", "MANIFEST_VERSION", "InvalidArtifact"]

READY_SUFFIX = ".ready.json"
MANIFEST_VERSION = 1

_REQUIRED = {"version", "artifact_id", "key", "type", "size", "sha256", "file_count", "provenance"}
_OPTIONAL = {"files"}
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class InvalidArtifact(ValueError):
    """A candidate artifact that must be skipped: no manifest, a malformed one, or bad bytes."""


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
    check_fields(doc, where, _REQUIRED, _OPTIONAL, error=InvalidArtifact)
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
