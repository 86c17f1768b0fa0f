"""Build the strict publication record of a numbered checkpoint, from the loop or from disk.

Duck-typed on purpose (koochak.events imports no other koochak package): the loop's
``on_checkpoint`` info carries a Publication with ``artifact_id``, ``size``, ``sha256`` and
``manifest_key``; at resume only the checkpoint's path is known, and its ready manifest
``<path>.ready.json`` (docs/formats.md) supplies the rest.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
from collections.abc import Mapping
from typing import Any

from koochak.events.envelope import publication_record

STRICT_CHECKPOINT = re.compile(r"checkpoint/step\d{9}\.pt")
_MAX_MANIFEST_BYTES = 1 << 20


def from_checkpoint_info(info: Mapping[str, Any]) -> dict[str, Any] | None:
    """The record for an ``on_checkpoint`` info dict, or None when it cannot gate anything
    (an unnumbered file, a store without local paths). A malformed record raises ValueError."""
    pub = info.get("publication")
    artifact_id = getattr(pub, "artifact_id", None)
    path = info.get("path") or getattr(pub, "path", None)
    if not _strict(artifact_id, path):
        return None
    assert isinstance(path, str) and isinstance(artifact_id, str)
    path = os.path.abspath(path)
    # The ready manifest sits beside the object: same directory, its own basename.
    manifest = os.path.join(
        os.path.dirname(path), posixpath.basename(str(getattr(pub, "manifest_key", "")))
    )
    return publication_record(
        artifact_id, path, getattr(pub, "size", None), getattr(pub, "sha256", None), manifest
    )


def from_ready_manifest(path: str) -> dict[str, Any] | None:
    """The record for the checkpoint file at ``path`` from its ``<path>.ready.json``; None when
    there is no readable, matching version-1 file manifest (then nothing is republished)."""
    path = os.path.abspath(path)
    manifest = path + ".ready.json"
    try:
        with open(manifest, "rb") as f:
            raw = f.read(_MAX_MANIFEST_BYTES + 1)
        doc = json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("version") != 1 or doc.get("type") != "file":
        return None
    artifact_id = doc.get("artifact_id")
    if doc.get("key") != os.path.basename(path) or not _strict(artifact_id, path):
        return None
    try:
        return publication_record(artifact_id, path, doc.get("size"), doc.get("sha256"), manifest)
    except ValueError:
        return None


def _strict(artifact_id: Any, path: Any) -> bool:
    return (
        isinstance(artifact_id, str)
        and STRICT_CHECKPOINT.fullmatch(artifact_id) is not None
        and isinstance(path, str)
        and os.path.isabs(path)
    )
