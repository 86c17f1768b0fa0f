"""Publishing, removing and listing checkpoints of either layout through a Store.

A checkpoint is one object under its name (a ``torch.save`` file, or the index of a checkpoint in
parts), committed by its ready manifest; a checkpoint in parts also has part objects beside it.
Publication writes parts, then the index, then the manifest (``koochak.storage.artifact``);
removal goes the other way: manifest, then the object, then every part. So at every moment a
reader that finds a manifest finds everything it commits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from koochak.loop._parts_index import (
    encode_index,
    looks_like_index,
    object_keys,
    parse_index,
)
from koochak.loop._parts_io import delete_parts, host_tensor, read_parts, write_parts
from koochak.loop._parts_tree import join_tensors, load_skeleton, skeleton_bytes, split_tensors
from koochak.storage import artifact
from koochak.storage.store import Store


def split_payload(payload: Any) -> tuple[bytes, list[torch.Tensor]]:
    """``(skeleton bytes, tensors)`` of a payload: the non-tensor data frozen at once."""
    skeleton, tensors = split_tensors(payload)
    return skeleton_bytes(skeleton), tensors


def write_payload_parts(
    store: Store,
    name: str,
    skeleton: bytes,
    tensors: Sequence[torch.Tensor],
    parts: int,
    *,
    workers: int | None = None,
) -> bytes:
    """Write the parts of checkpoint ``name``; return its index (to publish as ``name``)."""
    index = write_parts(
        store, name, [host_tensor(t) for t in tensors], skeleton, parts, workers=workers
    )
    return encode_index(index)


def read_payload(
    store: Store, name: str, index_bytes: bytes, source: str, *, workers: int | None = None
) -> Any:
    """The payload of a checkpoint in parts whose index (already read) is ``index_bytes``.

    ``name`` is the key the index was read under, or None when it was read by path (then the
    index's own name locates the parts). ValueError naming ``source`` for any fault in the
    index, a part, or the skeleton; other OSErrors propagate.
    """
    index = parse_index(index_bytes, source, name)
    tensors = read_parts(store, index, source, workers=workers)
    return join_tensors(load_skeleton(index.skeleton, source), tensors, source)


def unpublish_checkpoint(store: Store, name: str) -> None:
    """Remove checkpoint ``name``: its manifest, then its object, then any parts. Missing is fine.

    Parts are found by listing, so the leftovers of an interrupted save go too.
    """
    artifact.unpublish(store, name)
    delete_parts(store, name)


def prune_checkpoints(store: Store, pattern: str, keep: int) -> list[str]:
    """Keep the ``keep`` highest committed checkpoints matching ``pattern``; return removed names.

    Only committed ones (with a manifest) are counted and removed, each manifest first, so a
    checkpoint still being published is never touched.
    """
    removed = []
    for _, name in artifact.published_candidates(store, pattern)[keep:]:
        unpublish_checkpoint(store, name)
        removed.append(name)
    return removed


def checkpoint_objects(store: Store, name: str) -> list[str]:
    """Every object of checkpoint ``name`` in commit order (parts, object, manifest).

    A single-file checkpoint is its file and its manifest. The index of one in parts names its
    parts; nothing is listed, so this works on stores where listing is slow. For copying a
    checkpoint to another tier with ``copy_objects``, which commits it there last.
    """
    head = store.get(name, 0, 1)
    if not looks_like_index(head):
        return [name, name + artifact.READY_SUFFIX]
    return object_keys(parse_index(store.get(name), f"{store.location}/{name}", name))
