"""The read side of the layout seam: one reader contract, one place that picks the reader.

A checkpoint's object (the key its ready manifest commits) is its *head*: a ``torch.save`` file
for the one-file layout, or a parts index (JSON) for the parts layout, whether one writer wrote
the parts or every rank of an FSDP run did (sharded: the same index, several writers). Every
read goes through ``read(store, name, head, source)``: ``layout_of(head)`` picks the reader
from the head's first byte (the only place that looks), and the reader turns the head (plus,
for parts, the parts it names) into the checkpoint dict. Callers (``load``, resume, the sharded
selection, export, replication's object list) never inspect shapes or formats themselves. The
sharded selection reads an index lazily instead (``sharded_read.open_lazy``: references that
each rank reads its slabs of at restore), anything else by its reader; it asks ``layout_of``.

Here too: what every read payload gets (``checkpoint_of_payload``: nesting bounded, format
checked, RNG states decoded) and the one-file reader's ``deserialize_checkpoint``.

A reader has:

- ``name``: ``"one file"`` or ``"parts"``;
- ``read(store, name, head, source, *, workers=None) -> checkpoint``: verified, weights-only,
  on the CPU. Every fault is a ValueError (``InvalidArtifact`` for a malformed index) naming
  ``source``; other OSErrors propagate;
- ``objects(name, head, where) -> keys``: every object of the checkpoint in commit order
  (parts, head, ready manifest), what a copy to another tier moves.
"""

from __future__ import annotations

import io
import re
from collections.abc import Collection, Mapping
from typing import Any, Protocol

import torch
from koochak.loop.checkpoint.format import check_checkpoint_format
from koochak.loop.checkpoint.index_fragments import (
    head_object_keys,
    is_head,
    parse_head,
    read_index,
    read_rng_part,
)
from koochak.loop.checkpoint.parts_index import (
    PartsIndex,
    looks_like_index,
    object_keys,
    parse_index,
)
from koochak.loop.checkpoint.parts_io import read_parts
from koochak.loop.checkpoint.parts_tree import check_depth, join_tensors, load_skeleton
from koochak.storage.artifact import READY_SUFFIX
from koochak.storage.store import Store

NDARRAY_TAG = "__koochak_ndarray__"

__all__ = ["Reader", "ONE_FILE", "PARTS", "layout_of", "read", "objects",
           "deserialize_checkpoint", "load_checkpoint_file", "checkpoint_of_payload"]  # fmt: skip


class Reader(Protocol):
    name: str

    def read(
        self,
        store: Store | None,
        name: str | None,
        head: bytes | bytearray | memoryview,
        source: str,
        *,
        workers: int | None = None,
        parts_reader: Any = read_parts,
    ) -> dict[str, Any]: ...

    def objects(self, name: str, head: bytes | bytearray | memoryview, where: str) -> list[str]: ...


class _OneFile:
    name = "one file"

    def read(self, store, name, head, source, *, workers=None, parts_reader=None) -> dict[str, Any]:
        return deserialize_checkpoint(head, source)

    def objects(self, name, head, where) -> list[str]:
        return [name, name + READY_SUFFIX]


class _Parts:
    name = "parts"

    def read(
        self, store, name, head, source, *, workers=None, parts_reader=read_parts
    ) -> dict[str, Any]:
        if store is None:
            raise ValueError(
                f"{source}: a checkpoint in parts needs the store that holds its parts"
            )
        index = read_index(store, head, source, name)  # a version-2 head: with its fragments
        tensors = parts_reader(store, index, source, workers=workers)  # read_parts' contract
        payload = join_tensors(load_skeleton(index.skeleton, source), tensors, source)
        payload = with_fragment_rng(payload, index, source, store)
        return checkpoint_of_payload(payload, source)

    def objects(self, name, head, where) -> list[str]:
        if is_head(head):  # version 2: the head names every object
            return head_object_keys(parse_head(head, where, name))
        return object_keys(parse_index(head, where, name))


def with_fragment_rng(
    payload: Any,
    index: PartsIndex,
    source: str,
    store: Store | None = None,
    ranks: Collection[int] | None = None,
) -> Any:
    """``payload`` with ``rng_per_rank`` rebuilt from the writers' own RNG states (index
    version 2, where the head holds none of them): a state per writer whose fragment was read,
    None for the others. Fragment version 1 carries the state itself; version 2 names the
    writer's RNG part, read (verified) from ``store`` for the writers in ``ranks`` only (None:
    every one read): a resuming rank reads its own and nobody else's. Writer 0's state is the
    checkpoint's ``rng`` field, as in a one-process checkpoint."""
    if not isinstance(payload, dict) or payload.get("rng_per_rank") is not None:
        return payload
    states = index.rng
    if any(states):
        payload["rng_per_rank"] = [
            None if blob is None else load_skeleton(blob, source) for blob in states
        ]
    elif any(index.rng_parts):
        per_rank: list[Any] = [None] * len(index.rng_parts)
        per_rank[0] = payload.get("rng")
        for writer, part in enumerate(index.rng_parts):
            if part is None or (ranks is not None and writer not in ranks):
                continue
            if store is None:
                raise ValueError(f"{source}: RNG part {part.key} needs the store that holds it")
            per_rank[writer] = load_skeleton(read_rng_part(store, part, source), source)
        payload["rng_per_rank"] = per_rank
    return payload


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
    workers: int | None = None,
    parts_reader: Any = read_parts,
) -> dict[str, Any]:
    """The checkpoint whose object holds ``head``, by its layout's reader (see the module).
    ``parts_reader`` reads a parts index's tensors (``parts_io.read_parts``, or the resume's
    mapped reader, ``verified_read.read_parts_mapped``)."""
    return layout_of(head).read(
        store, name, head, source, workers=workers, parts_reader=parts_reader
    )


def objects(store: Store, name: str) -> list[str]:
    """Every object key of checkpoint ``name`` in ``store``, in commit order (parts, object,
    ready manifest); only the object is read (one byte of it for a one-file checkpoint)."""
    where = f"{store.location}/{name}"
    reader = layout_of(store.get(name, 0, 1))
    head = store.get(name) if reader is PARTS else b""
    return reader.objects(name, head, where)


# -- the one-file layout's bytes, and the checks every read payload gets ------------------


def deserialize_checkpoint(data: bytes | bytearray | memoryview, source: str) -> dict[str, Any]:
    """Load checkpoint bytes onto the CPU with ``weights_only=True`` and check the format.

    ``source`` names the file in errors. Every way the payload can fail to decode is a
    ValueError naming ``source``: bytes torch cannot load, a payload that needs arbitrary
    unpickling (a code object, a class), a dict of an unknown version or with unknown keys, a
    field of the wrong type, an array record that does not decode. (Resume relies on this: a
    candidate that raises ValueError is skipped, never a crash.)
    """
    return _loaded(
        lambda: torch.load(io.BytesIO(bytes(data)), map_location="cpu", weights_only=True), source
    )


def load_checkpoint_file(path: str, source: str) -> dict[str, Any]:
    """``deserialize_checkpoint`` of a ``torch.save`` zip file, mapped rather than read: the
    tensors are views of the file's pages (``torch.load(mmap=True)``), so nothing is copied
    until they are restored. Verify the file first (``verified_read``); errors as there."""
    return _loaded(
        lambda: torch.load(path, map_location="cpu", weights_only=True, mmap=True), source
    )


def _loaded(load: Any, source: str) -> dict[str, Any]:
    try:
        ckpt = load()
    except (MemoryError, OSError):
        raise
    except Exception as exc:  # torch raises many types for hostile bytes; all mean "not loadable"
        raise ValueError(
            f"{source}: not a loadable weights-only checkpoint ({_first_line(exc)})"
        ) from exc
    return checkpoint_of_payload(ckpt, source)


def checkpoint_of_payload(ckpt: Any, source: str) -> dict[str, Any]:
    """Check a loaded payload's format and decode its RNG states; ValueError naming ``source``
    (InvalidArtifact for containers nested past ``parts_tree.MAX_DEPTH``, measured without
    recursion before anything walks them)."""
    check_depth(ckpt, source)
    check_checkpoint_format(ckpt, source)
    for key in ("rng", "rng_per_rank"):
        if ckpt.get(key) is not None:
            try:
                ckpt[key] = _decode(ckpt[key])
            except (MemoryError, RecursionError):
                raise
            except Exception as exc:
                raise ValueError(
                    f"{source}: field {key!r} does not decode ({_first_line(exc)})"
                ) from exc
    return ckpt


def _first_line(exc: BaseException) -> str:
    # torch's messages carry terminal escapes (bold); a log line should not.
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _decode(value: Any) -> Any:
    return walk_tree(value, _untag_ndarray)


def walk_tree(value: Any, leaf: Any) -> Any:
    """Rebuild dicts, lists and tuples, replacing whatever ``leaf`` turns into something else."""
    replaced = leaf(value)
    if replaced is not value:
        return replaced
    if isinstance(value, Mapping):
        return {k: walk_tree(v, leaf) for k, v in value.items()}
    if isinstance(value, list):
        return [walk_tree(v, leaf) for v in value]
    if isinstance(value, tuple):
        return tuple(walk_tree(v, leaf) for v in value)
    return value


def _untag_ndarray(value: Any) -> Any:
    if isinstance(value, tuple) and len(value) == 4 and value[0] == NDARRAY_TAG:
        import numpy as np

        _, dtype, shape, raw = value
        if not isinstance(dtype, str) or not isinstance(raw, bytes):
            raise ValueError(f"array record: dtype must be a str and data bytes, got {dtype!r}")
        if not isinstance(shape, (list, tuple)) or not all(
            type(n) is int and n >= 0 for n in shape
        ):
            raise ValueError(f"array record: shape must be non-negative ints, got {shape!r}")
        try:
            kind = np.dtype(dtype)
        except TypeError as exc:
            raise ValueError(f"array record: dtype {dtype!r} is not a NumPy dtype") from exc
        if kind.hasobject:  # would need unpickling; an RNG state never holds objects
            raise ValueError(f"array record: dtype {dtype!r} holds Python objects")
        return np.frombuffer(raw, dtype=kind).reshape(shape).copy()
    return value
