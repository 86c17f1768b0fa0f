"""A writer's receipt for its own parts in a replica tier: what it copied there, verified.

Under FSDP every rank but the coordinator copies its own parts of a checkpoint into each replica
(``copy_objects``: every byte checked against the size and SHA256 its save computed, each object
put create-only), then puts a small receipt beside them naming those parts with their sizes and
digests. The coordinator commits the replica's index and ready manifest once each writer's
receipt names exactly the parts the index lists for it: it reads one small object per writer
and none of the data (docs/formats.md, "Part receipt"). A receipt of an older save of the same
step names other digests, so it is never taken for this one.

The key, ``<name>.part-<writer>-receipt``, sits under the checkpoint's parts prefix, so removing
a checkpoint (``delete_parts``) removes its receipts too; nothing copies receipts between tiers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from koochak.loop.checkpoint.parts_index import PART_INFIX
from koochak.storage.store import Store
from koochak.storage.strict_json import check_fields, loads_strict, require_version

RECEIPT_FORMAT = "koochak-part-receipt"
RECEIPT_VERSION = 1
_KEYS = frozenset({"format", "version", "name", "writer", "parts"})
_PART_KEYS = frozenset({"key", "size", "sha256"})

PartDigest = tuple[str, int, str]  # (key, size, sha256)


def receipt_key(name: str, writer: int) -> str:
    """The key of ``writer``'s receipt for its parts of checkpoint ``name``."""
    return f"{name}{PART_INFIX}{writer:05d}-receipt"


def encode_receipt(name: str, writer: int, parts: Sequence[PartDigest]) -> bytes:
    doc = {
        "format": RECEIPT_FORMAT,
        "version": RECEIPT_VERSION,
        "name": name,
        "writer": writer,
        "parts": [{"key": k, "size": n, "sha256": sha} for k, n, sha in parts],
    }
    return (json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n").encode("ascii")


def parse_receipt(raw: bytes, where: str) -> tuple[str, int, tuple[PartDigest, ...]]:
    """``(name, writer, parts)`` of a receipt; ValueError naming ``where`` and the field."""
    doc = loads_strict(raw, where)
    if not isinstance(doc, dict) or doc.get("format") != RECEIPT_FORMAT:
        raise ValueError(f"{where}: field 'format' must be {RECEIPT_FORMAT!r}")
    require_version(doc, where, RECEIPT_VERSION)
    check_fields(doc, where, _KEYS)
    if not isinstance(doc["name"], str) or type(doc["writer"]) is not int:
        raise ValueError(f"{where}: fields 'name' (a string) and 'writer' (an integer) expected")
    if not isinstance(doc["parts"], list):
        raise ValueError(f"{where}: field 'parts' must be a list")
    parts = []
    for i, part in enumerate(doc["parts"]):
        at = f"{where}: parts[{i}]"
        check_fields(part, at, _PART_KEYS)
        key, size, sha = part["key"], part["size"], part["sha256"]
        if not isinstance(key, str) or type(size) is not int or not isinstance(sha, str):
            raise ValueError(f"{at} must be {{key: string, size: integer, sha256: string}}")
        parts.append((key, size, sha))
    return doc["name"], doc["writer"], tuple(parts)


def read_receipt(store: Store, name: str, writer: int) -> tuple[PartDigest, ...] | None:
    """The parts ``writer``'s receipt in ``store`` names for checkpoint ``name``; None when it
    has none there (yet). ValueError for a receipt that is not one of ``name`` by ``writer``."""
    key = receipt_key(name, writer)
    try:
        raw = store.get(key)
    except FileNotFoundError:
        return None
    where = f"{store.location}/{key}"
    found_name, found_writer, parts = parse_receipt(raw, where)
    if (found_name, found_writer) != (name, writer):
        raise ValueError(f"{where}: a receipt of {found_name!r} by writer {found_writer}")
    return parts


def put_receipt(store: Store, name: str, writer: int, parts: Sequence[PartDigest]) -> None:
    """Replace ``writer``'s receipt for ``name`` in ``store`` (put last, once its parts are)."""
    key = receipt_key(name, writer)
    try:
        store.delete(key)
    except FileNotFoundError:
        pass
    store.put(key, encode_receipt(name, writer, parts))
