"""Numbered artifacts and ready manifests: an object counts only once its manifest exists.

Two halves share one manifest format (``docs/formats.md``, "Ready manifests"), each in its own
module; this one keeps every name importable from ``koochak.storage.artifact``:

* ``publication`` — store publication: ``publish`` / ``unpublish`` / ``read_manifest`` /
  ``read_verified`` / ``published_candidates`` / ``highest_valid`` / ``prune_keep_last_k``,
  used by checkpoints: the object is put create-only and synced, then ``<name>.ready.json``
  commits it. Removal is always manifest first, so a reader never trusts an object that is
  going away.
* ``local_ready`` — local file/directory manifests: ``write_ready_manifest`` /
  ``read_ready_manifest`` / ``verify_ready``, used by job outputs: targets are read through
  ``O_NOFOLLOW`` descriptors with inode checks, made read-only, and the manifest is published
  with a no-overwrite hard link.
* ``ready_manifest`` — the document both write and parse: ``READY_SUFFIX``,
  ``MANIFEST_VERSION``, ``InvalidArtifact``.
"""

from __future__ import annotations

from koochak.storage.local_ready import read_ready_manifest, verify_ready, write_ready_manifest
from koochak.storage.publication import (
    Publication,
    claimed,
    highest_valid,
    numbered_pattern,
    prune_keep_last_k,
    publish,
    published_candidates,
    read_manifest,
    read_verified,
    unpublish,
)
from koochak.storage.ready_manifest import MANIFEST_VERSION, READY_SUFFIX, InvalidArtifact

__all__ = [
    "READY_SUFFIX",
    "MANIFEST_VERSION",
    "InvalidArtifact",
    "Publication",
    "publish",
    "claimed",
    "unpublish",
    "read_manifest",
    "read_verified",
    "published_candidates",
    "highest_valid",
    "numbered_pattern",
    "prune_keep_last_k",
    "write_ready_manifest",
    "read_ready_manifest",
    "verify_ready",
]
