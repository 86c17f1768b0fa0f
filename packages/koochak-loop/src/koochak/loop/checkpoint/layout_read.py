"""The read side of the layout seam: one reader contract, one place that picks the reader.

A checkpoint's object (the key its ready manifest commits) is its *head*: a ``torch.save`` file
for the one-file layout, or a parts index (JSON) for the parts layout, whether one writer wrote
the parts or every rank of an FSDP run did (sharded: the same index, several writers). Every
read goes through ``read(store, name, head, source)``: ``layout_of(head)`` picks the reader
from the head's first byte (the only place that looks), and the reader turns the head (plus,
for parts, the parts it names) into the checkpoint dict. Callers (``load``, resume, the sharded
selection, export, replication's object list) never inspect shapes or formats themselves.

A reader has:

- ``name``: ``"one file"`` or ``"parts"``;
- ``read(store, name, head, source, *, lazy=False, workers=None) -> checkpoint``: verified,
  weights-only; ``lazy`` (sharded resume) leaves the large tensors as references that each
  rank reads its slabs of later (``sharded_read.materialize``); a one-file checkpoint is read
  whole either way. Every fault is a ValueError (``InvalidArtifact`` for a malformed index)
  naming ``source``; other OSErrors propagate;
- ``objects(name, head, where) -> keys``: every object of the checkpoint in commit order
  (parts, head, ready manifest), what a copy to another tier moves.
"""

from __future__ import annotations

from typing import Any, Protocol

from koochak.loop.checkpoint.parts_index import looks_like_index, object_keys, parse_index
from koochak.storage.artifact import READY_SUFFIX
from koochak.storage.store import Store

__all__ = ["Reader", "ONE_FILE", "PARTS", "layout_of", "read", "objects"]


class Reader(Protocol):
    name: str

    def read(
        self,
        store: Store | None,
        name: str | None,
        head: bytes | bytearray | memoryview,
        source: str,
        *,
        lazy: bool = False,
        workers: int | None = None,
    ) -> dict[str, Any]: ...

    def objects(self, name: str, head: bytes | bytearray | memoryview, where: str) -> list[str]: ...


class _OneFile:
    name = "one file"

    def read(self, store, name, head, source, *, lazy=False, workers=None) -> dict[str, Any]:
        from koochak.loop.checkpoint.serialization import deserialize_checkpoint

        return deserialize_checkpoint(head, source)

    def objects(self, name, head, where) -> list[str]:
        return [name, name + READY_SUFFIX]


class _Parts:
    name = "parts"

    def read(self, store, name, head, source, *, lazy=False, workers=None) -> dict[str, Any]:
        if store is None:
            raise ValueError(
                f"{source}: a checkpoint in parts needs the store that holds its parts"
            )
        index = parse_index(head, source, name)
        if lazy:
            from koochak.loop.checkpoint.sharded_read import open_lazy

            return open_lazy(store, index, source)
        from koochak.loop.checkpoint.parts_io import read_parts
        from koochak.loop.checkpoint.parts_tree import join_tensors, load_skeleton
        from koochak.loop.checkpoint.serialization import checkpoint_of_payload

        tensors = read_parts(store, index, source, workers=workers)
        payload = join_tensors(load_skeleton(index.skeleton, source), tensors, source)
        return checkpoint_of_payload(payload, source)

    def objects(self, name, head, where) -> list[str]:
        return object_keys(parse_index(head, where, name))


ONE_FILE: Reader = _OneFile()
PARTS: Reader = _Parts()


def layout_of(head: bytes | bytearray | memoryview) -> Reader:
    """The reader for a checkpoint whose object starts with ``head`` (a byte is enough)."""
    return PARTS if looks_like_index(head) else ONE_FILE


def read(
    store: Store | None,
    name: str | None,
    head: bytes | bytearray | memoryview,
    source: str,
    *,
    lazy: bool = False,
    workers: int | None = None,
) -> dict[str, Any]:
    """The checkpoint whose object holds ``head``, by its layout's reader (see the module)."""
    return layout_of(head).read(store, name, head, source, lazy=lazy, workers=workers)


def objects(store: Store, name: str) -> list[str]:
    """Every object key of checkpoint ``name`` in ``store``, in commit order (parts, object,
    ready manifest); only the object is read (one byte of it for a one-file checkpoint)."""
    where = f"{store.location}/{name}"
    reader = layout_of(store.get(name, 0, 1))
    head = store.get(name) if reader is PARTS else b""
    return reader.objects(name, head, where)
