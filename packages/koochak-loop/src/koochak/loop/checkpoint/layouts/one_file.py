"""The one-file layout: the head is the whole ``torch.save`` file, and nothing else is stored.

The coordinator alone writes; its ``write`` streams the file (``torch.save`` into the store,
hashed while written, never held whole), so the head it returns is an iterable of chunks. Kept
light: a plain periodic save imports nothing of the parts or sharded layouts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from koochak.loop.checkpoint.layouts.payload import deserialize_checkpoint
from koochak.loop.checkpoint.layouts.roles import COORDINATOR
from koochak.loop.checkpoint.serialization import (
    SplitCheckpoint,
    serialize_checkpoint_chunks,
    split_checkpoint,
    split_checkpoint_chunks,
)
from koochak.storage.artifact import READY_SUFFIX
from koochak.storage.store import Store


class OneFile:
    name = "one file"
    parts: int | str = 1
    last_written: tuple[tuple[str, int, str], ...] = ()

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
    ) -> Iterable[bytes]:
        if isinstance(data, SplitCheckpoint):  # frozen by ``freeze``
            return split_checkpoint_chunks(data)
        return serialize_checkpoint_chunks(data)

    def outcome(self, result: Any, group: Any = None) -> Any:
        return result

    def read(self, store, name, head, source, *, workers=None, parts_reader=None) -> dict[str, Any]:
        return deserialize_checkpoint(head, source)

    def open(
        self, store, name, head, source, *, rank=0, world=1, shard_size=None
    ) -> dict[str, Any]:
        return deserialize_checkpoint(head, source)

    def objects(self, name: str, head: Any) -> list[str]:
        return [name, name + READY_SUFFIX]

    def receipts(self, store, name, head, source, remote=()) -> tuple[list, dict]:
        return [], {}  # the head is everything

    def verify(self, store: Store, name: str, head: Any, source: str) -> None:
        """Nothing besides the head, which the caller checked against its manifest."""


def freeze_split(ckpt: Mapping[str, Any], buffers: Any) -> tuple[SplitCheckpoint, Any]:
    """``(frozen, copy)`` for a one-writer layout: the capture split into its skeleton and its
    tensors, the tensors copied into ``buffers`` (``host_buffers.HostBuffers``)."""
    split = split_checkpoint(ckpt)
    copy = buffers.copy(split.tensors)
    return split.with_tensors(copy.tensors), copy


ONE_FILE = OneFile()
