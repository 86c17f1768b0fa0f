"""koochak.storage: write-once stores, stores file, store profiles, ready manifests and small
durable filesystem helpers (mkdir_p, atomic file writes).

Torch-free; everything durable that Koochak writes is published through a Store.
"""

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
