"""The parts layout: one writer (the coordinator) writes the tensors as parts; the head is their
index (version 1, docs/formats.md "Checkpoint parts"), which names every part with its size and
SHA256. A version-1 index that an older sharded save wrote (several writers) reads here too.

``parts`` is the number of parts, or ``"auto"`` (``parts_plan.resolve_parts``); where that comes
to one part the head is a one-file checkpoint instead (the reader is then ``one_file``'s, by
``layouts.layout_of``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from koochak.loop.checkpoint.layouts.one_file import freeze_split
from koochak.loop.checkpoint.layouts.payload import checkpoint_of_payload, with_fragment_rng
from koochak.loop.checkpoint.layouts.roles import COORDINATOR
from koochak.loop.checkpoint.parts_index import PartsIndex, object_keys, parse_index
from koochak.loop.checkpoint.parts_io import read_parts
from koochak.loop.checkpoint.parts_plan import resolve_parts
from koochak.loop.checkpoint.parts_tree import join_tensors, load_skeleton
from koochak.loop.checkpoint.serialization import (
    SplitCheckpoint,
    split_checkpoint,
    split_checkpoint_chunks,
    write_checkpoint_parts,
)
from koochak.storage.store import Store


class Parts:
    name = "parts"

    def __init__(self, parts: int | str = 2, workers: int | None = None) -> None:
        self.parts = parts
        self.workers = workers
        self.last_written: tuple[tuple[str, int, str], ...] = ()

    def writes(self, role: str) -> bool:
        return role == COORDINATOR

    def freeze(self, ckpt: Mapping[str, Any], buffers: Any) -> tuple[Any, Any]:
        return freeze_split(ckpt, buffers)

    def write(
        self,
        store: Store,
        name: str,
        data: Any,
        *,
        intent: Any,
        refused: str | None = None,
        group: Any = None,
    ) -> Any:
        split = data if isinstance(data, SplitCheckpoint) else split_checkpoint(data)
        count = resolve_parts(self.parts, split.nbytes, store)
        if count == 1:
            return split_checkpoint_chunks(split)
        raw = write_checkpoint_parts(store, name, split, count, workers=self.workers)
        index = parse_index(raw, f"{store.location}/{name}", name)
        self.last_written = tuple((p.key, p.size, p.sha256) for p in index.parts)
        return raw

    def outcome(self, result: Any, group: Any = None) -> Any:
        return result

    def read(self, store, name, head, source, *, workers=None, parts_reader=None) -> dict[str, Any]:
        if store is None:
            raise ValueError(
                f"{source}: a checkpoint in parts needs the store that holds its parts"
            )
        index = parse_index(head, source, name)
        return read_indexed(store, index, source, workers=workers, parts_reader=parts_reader)

    def open(
        self, store, name, head, source, *, rank=0, world=1, shard_size=None
    ) -> dict[str, Any]:
        from koochak.loop.checkpoint.sharded_read import open_lazy

        index = parse_index(head, source, name)
        return open_lazy(store, index, source, rank=rank, world=world, shard_size=shard_size)

    def objects(self, name: str, head: Any) -> list[str]:
        return object_keys(parse_index(head, name, name))

    def receipts(self, store, name, head, source, remote=()) -> tuple[list, dict]:
        local: list[tuple[str, int, str]] = []
        expected: dict[int, list[tuple[str, int, str]]] = {}
        for part in parse_index(head, source, name).parts:
            item = (part.key, part.size, part.sha256)
            if part.writer in remote:
                expected.setdefault(part.writer, []).append(item)
            else:
                local.append(item)
        return local, expected

    def verify(self, store: Store, name: str, head: Any, source: str) -> None:
        verify_indexed(store, parse_index(head, source, name), source)


def read_indexed(
    store: Store,
    index: PartsIndex,
    source: str,
    *,
    workers: int | None = None,
    parts_reader: Any = None,
) -> dict[str, Any]:
    """The checkpoint of a parsed index (a version-2 head's assembled from its writers'
    fragments): every part read and checked against its size and SHA256 before its tensors are
    used (``parts_reader``: ``parts_io.read_parts`` by default, or the resume's mapped reader)."""
    tensors = (parts_reader or read_parts)(store, index, source, workers=workers)
    payload = join_tensors(load_skeleton(index.skeleton, source), tensors, source)
    payload = with_fragment_rng(payload, index, source, store)
    return checkpoint_of_payload(payload, source)


def verify_indexed(store: Store, index: PartsIndex, source: str) -> None:
    """Every part a parsed index names, read once and hashed against it."""
    from koochak.loop.checkpoint.sharded_read import Source, verify_parts

    verify_parts(Source(store, index, source), range(len(index.parts)))


PARTS = Parts()
