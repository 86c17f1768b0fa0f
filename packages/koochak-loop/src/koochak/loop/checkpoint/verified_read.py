"""Reading a published checkpoint verified, with no copy of its tensors before restore.

``artifact.read_verified`` returns the object's bytes; a one-file checkpoint then went through
``torch.load`` from memory, which copies every tensor out of them, and ``restore`` copied again
into the parameters. For a one-file checkpoint in a store with local files (``LocalStore``)
this reads it instead as:

1. one descriptor on the object (the store's checked open), its size checked against the
   manifest, its bytes hashed through a read-only mapping (no copy; ``hashlib`` releases the
   interpreter lock) and compared with the manifest's SHA256;
2. only then ``torch.load(mmap=True, weights_only=True)`` of **the same open file**
   (``/proc/self/fd/N``: the inode that was hashed, even if the name is replaced meanwhile), so
   the tensors are views of the verified pages and the one copy left is restore's into the
   parameters.

Published objects are create-only and never rewritten, so the mapped pages stay the verified
bytes; a checkpoint pruned later keeps its pages while the tensors map them.

Everything else (an index of parts, a small object, a store without local files, a platform
without ``/proc/self/fd``) takes the general path: ``read_verified`` then ``read_checkpoint``.
Errors are those of that path: InvalidArtifact for a size or digest that differs, ValueError
for bytes torch cannot load, FileNotFoundError for an object a manifest names but this client
does not see, any other OSError as is.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from typing import Any

from koochak.loop.checkpoint.parts_index import looks_like_index
from koochak.loop.checkpoint.serialization import load_checkpoint_file, read_checkpoint
from koochak.storage import artifact
from koochak.storage.named import open_named
from koochak.storage.store import Store

# Smaller objects (an index, a tiny state) are read whole: a mapping buys nothing there.
_MAP_BYTES = 1 << 20
_HASH_PIECE = 8 << 20
_FD_DIR = "/proc/self/fd"


def read_published_checkpoint(
    store: Store, name: str, source: str
) -> tuple[artifact.Publication, dict[str, Any]]:
    """The publication ``name`` of ``store`` and its checkpoint (either layout), every byte
    checked against the ready manifest (and an index's parts against the index) before any
    tensor is built from it. ``source`` names the checkpoint in errors."""
    publication, _ = artifact.read_manifest(store, name)
    if publication.size >= _MAP_BYTES and store.local_path(name) and os.path.isdir(_FD_DIR):
        try:
            stream = open_named(store, name, named_by=publication.manifest_key)
        except FileNotFoundError:
            stream = None  # unpublished meanwhile, or late: the general path tells which
        if stream is not None:
            with stream:
                found = _read_mapped(store, publication, stream.fileno(), source)
            if found is not None:
                return publication, found
    publication, data = artifact.read_verified(store, name)
    return publication, read_checkpoint(store, name, data, source)


def _read_mapped(
    store: Store, publication: artifact.Publication, fd: int, source: str
) -> dict[str, Any] | None:
    """The one-file checkpoint open on ``fd``, verified then loaded from the mapping; None
    when the object is an index (read it the general way)."""
    where = f"{store.location}/{publication.key}"
    size = os.fstat(fd).st_size
    if size != publication.size:
        raise artifact.InvalidArtifact(f"{where}: {size} bytes, manifest says {publication.size}")
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mapped:
        if looks_like_index(mapped[:1]) or mapped[:2] != b"PK":
            return None  # an index, or not a zip torch can map: read the general way
        if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_SEQUENTIAL"):
            mapped.madvise(mmap.MADV_SEQUENTIAL)
        sha = hashlib.sha256()
        view = memoryview(mapped)
        try:
            for begin in range(0, size, _HASH_PIECE):
                sha.update(view[begin : begin + _HASH_PIECE])
        finally:
            view.release()
    digest = sha.hexdigest()
    if digest != publication.sha256:
        raise artifact.InvalidArtifact(
            f"{where}: SHA256 {digest}, manifest says {publication.sha256}"
        )
    return load_checkpoint_file(f"{_FD_DIR}/{fd}", source)
