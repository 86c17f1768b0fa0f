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

A checkpoint in parts (an index, read and verified whole) with local part files is read the
same way: each part mapped once (by torch, from its open file), hashed through that mapping,
all parts in parallel, and its tensors made views of the mapping (a tensor whose bytes span
parts, or sit unaligned, is copied out of them once), so again nothing is copied before restore.

Published objects are create-only and never rewritten, so the mapped pages stay the verified
bytes; a checkpoint pruned later keeps its pages while the tensors map them.

Everything else (a small object, a store without local files, a platform without
``/proc/self/fd``, an index whose tensors are sharded boxes) takes the general path:
``read_verified`` then ``layouts.read`` (``read_parts`` for the parts).
Errors are those of that path: InvalidArtifact for a size or digest that differs, ValueError
for bytes torch cannot load, FileNotFoundError for an object a manifest names but this client
does not see, any other OSError as is.
"""

from __future__ import annotations

import hashlib
import io
import mmap
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import torch
from koochak.loop.checkpoint.layouts import is_single_object, read_checkpoint
from koochak.loop.checkpoint.layouts.payload import load_checkpoint_file
from koochak.loop.checkpoint.parts_index import PartsIndex
from koochak.loop.checkpoint.parts_io import MAX_PART_THREADS, read_parts
from koochak.loop.checkpoint.parts_tree import torch_dtype
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
                found = None
                if _plain_file(stream):  # not a wrapper (a throttled or faulty test store)
                    found = _read_mapped(store, publication, stream.fileno(), source)
            if found is not None:
                return publication, found
    publication, data = artifact.read_verified(store, name)
    return publication, read_checkpoint(store, name, data, source, parts_reader=read_parts_mapped)


def read_parts_mapped(
    store: Store, index: PartsIndex, source: str, *, workers: int | None = None
) -> list[torch.Tensor]:
    """``read_parts`` (same checks, same errors) with the parts mapped rather than read, where
    the store has local files and every tensor is whole (not sharded boxes)."""
    if sys.byteorder != "little" or not os.path.isdir(_FD_DIR):  # read_parts refuses big-endian
        return read_parts(store, index, source, workers=workers)
    if not all(store.local_path(p.key) for p in index.parts):
        return read_parts(store, index, source, workers=workers)
    if any(len(e.shards) != 1 or e.shards[0].shape != e.shape for e in index.tensors):
        return read_parts(store, index, source, workers=workers)
    with ExitStack() as stack:
        parts = []  # each part as a flat uint8 tensor over its mapping
        for part in index.parts:
            stream = stack.enter_context(open_named(store, part.key, named_by=source))
            if not _plain_file(stream):
                return read_parts(store, index, source, workers=workers)
            size = os.fstat(stream.fileno()).st_size
            if size != part.size:
                raise ValueError(
                    f"{source}: part {part.key} has {size} bytes; the index says {part.size}"
                )
            try:
                parts.append(_mapped_bytes(stream.fileno(), size))
            except (RuntimeError, OSError):  # a file system that cannot map: read the parts
                return read_parts(store, index, source, workers=workers)
    count = max(1, min(len(parts), workers or MAX_PART_THREADS))
    with ThreadPoolExecutor(max_workers=count, thread_name_prefix="koochak-part") as pool:
        digests = list(pool.map(_sha256_hex, parts))
    for part, digest in zip(index.parts, digests):
        if digest != part.sha256:
            raise ValueError(
                f"{source}: part {part.key} has SHA256 {digest}; the index says {part.sha256}"
            )
    return [_tensor_of(entry, index, parts, source) for entry in index.tensors]


def _mapped_bytes(fd: int, size: int) -> torch.Tensor:
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    storage = torch.UntypedStorage.from_file(f"{_FD_DIR}/{fd}", False, size)  # MAP_PRIVATE
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _sha256_hex(data: torch.Tensor) -> str:
    sha = hashlib.sha256()
    if data.numel():
        view = memoryview(data.numpy()).cast("B")
        for begin in range(0, len(view), _HASH_PIECE):
            sha.update(view[begin : begin + _HASH_PIECE])
    return sha.hexdigest()


def _tensor_of(entry: Any, index: PartsIndex, parts: list[torch.Tensor], source: str) -> Any:
    dtype = torch_dtype(entry.dtype)
    extents = entry.shards[0].extents
    for extent in extents:
        inside = 0 <= extent.part < len(parts) and extent.offset >= 0 and extent.length >= 0
        if not inside or extent.offset + extent.length > index.parts[extent.part].size:
            raise ValueError(f"{source}: a tensor's extent {extent} lies outside its parts")
    item = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for n in entry.shape:
        numel *= n
    if sum(e.length for e in extents) != numel * item:
        raise ValueError(f"{source}: a tensor's extents do not hold its {numel} elements")
    if len(extents) == 1 and extents[0].offset % item == 0 and numel:
        extent = extents[0]
        strides, step = [], 1
        for n in reversed(entry.shape):
            strides.append(step)
            step *= max(n, 1)
        # Its own storage over its bytes (as torch.load(mmap=True) makes them): some readers
        # of a tensor (Generator.set_state) use its storage from the start, not its offset.
        storage = parts[extent.part].untyped_storage()[
            extent.offset : extent.offset + extent.length
        ]
        return torch.empty(0, dtype=dtype).set_(storage, 0, entry.shape, tuple(reversed(strides)))
    tensor = torch.empty(entry.shape, dtype=dtype)
    flat = tensor.reshape(-1).view(torch.uint8)
    start = 0
    for extent in extents:
        flat[start : start + extent.length] = parts[extent.part][
            extent.offset : extent.offset + extent.length
        ]
        start += extent.length
    return tensor


def _plain_file(stream: Any) -> bool:
    """Whether ``stream`` reads a file directly, so its descriptor can be mapped instead."""
    return isinstance(stream, (io.BufferedReader, io.FileIO))


def _read_mapped(
    store: Store, publication: artifact.Publication, fd: int, source: str
) -> dict[str, Any] | None:
    """The one-file checkpoint open on ``fd``, verified then loaded from the mapping; None
    when the object is an index (read it the general way)."""
    where = f"{store.location}/{publication.key}"
    size = os.fstat(fd).st_size
    if size != publication.size:
        raise artifact.InvalidArtifact(f"{where}: {size} bytes, manifest says {publication.size}")
    try:
        mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):  # a file system that cannot map (FUSE direct I/O): read it
        return None
    with mapped:
        if not is_single_object(mapped[:1]) or mapped[:2] != b"PK":
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
