"""koochak.storage: write-once stores, stores file, store profiles, ready manifests and small
durable filesystem helpers (mkdir_p, atomic file writes).

Torch-free; everything durable that Koochak writes is published through a Store. Names are
imported on first use (PEP 562): a command that opens one store (``koochak-data pull``) does
not load publication, ready manifests or the copier.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from koochak.storage.lazy_exports import lazy_exports

_EXPORTS = {
    "READY_SUFFIX": "artifact",
    "InvalidArtifact": "artifact",
    "Publication": "artifact",
    "highest_valid": "artifact",
    "prune_keep_last_k": "artifact",
    "publish": "artifact",
    "read_verified": "artifact",
    "unpublish": "artifact",
    "atomic_write_bytes": "fsutil",
    "atomic_write_text": "fsutil",
    "mkdir_p": "fsutil",
    "LOCAL_PROFILE": "profile",
    "REMOTE_PROFILE": "profile",
    "StoreProfile": "profile",
    "min_object_bytes": "profile",
    "parse_size": "profile",
    "profile_of": "profile",
    "LocalStore": "store",
    "ObjectInfo": "store",
    "Store": "store",
    "StoreCapabilities": "store",
    "capabilities_of": "store",
    "open_store": "store",
    "register_store": "store",
    "validate_key": "store",
    "CopyItem": "transfer",
    "CopyReport": "transfer",
    "copy_objects": "transfer",
}

__all__ = [
    "CopyItem",
    "CopyReport",
    "LOCAL_PROFILE",
    "REMOTE_PROFILE",
    "READY_SUFFIX",
    "InvalidArtifact",
    "LocalStore",
    "ObjectInfo",
    "Publication",
    "Store",
    "StoreCapabilities",
    "StoreProfile",
    "atomic_write_bytes",
    "atomic_write_text",
    "capabilities_of",
    "copy_objects",
    "highest_valid",
    "min_object_bytes",
    "mkdir_p",
    "open_store",
    "parse_size",
    "profile_of",
    "prune_keep_last_k",
    "publish",
    "read_verified",
    "register_store",
    "unpublish",
    "validate_key",
]

if TYPE_CHECKING:
    from koochak.storage.artifact import (
        READY_SUFFIX,
        InvalidArtifact,
        Publication,
        highest_valid,
        prune_keep_last_k,
        publish,
        read_verified,
        unpublish,
    )
    from koochak.storage.fsutil import atomic_write_bytes, atomic_write_text, mkdir_p
    from koochak.storage.profile import (
        LOCAL_PROFILE,
        REMOTE_PROFILE,
        StoreProfile,
        min_object_bytes,
        parse_size,
        profile_of,
    )
    from koochak.storage.store import (
        LocalStore,
        ObjectInfo,
        Store,
        StoreCapabilities,
        capabilities_of,
        open_store,
        register_store,
        validate_key,
    )
    from koochak.storage.transfer import CopyItem, CopyReport, copy_objects


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
