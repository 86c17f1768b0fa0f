"""The layout seam: how one checkpoint becomes stored objects, and which ranks write them.

A layout is told its role, the way torch DCP's ``StorageWriter`` is: ``writes(role)`` says
whether a rank of that role writes anything, ``freeze`` copies a capture into host buffers for a
save in the background, ``write`` stores it and returns the ``Publication`` once the ready
manifest has committed (on every writing rank). Retention, replication and the announcement are
the saver's, the same for every layout.

- ``Whole``: the coordinator writes the whole checkpoint, as one file (``parts=1``) or as parts
  plus an index (``parts`` N or ``"auto"``) (``publication.publish``);
- ``Sharded``: every rank writes its own shards as parts, the coordinator the index and the
  manifest (``sharded.save_sharded``), for FSDP.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from koochak.storage import artifact
from koochak.storage.store import Store

COORDINATOR = "coordinator"
FOLLOWER = "follower"
ROLES = (COORDINATOR, FOLLOWER)


class Layout(Protocol):
    name: str
    parts: int | str

    def writes(self, role: str) -> bool: ...

    def freeze(self, ckpt: Mapping[str, Any], buffers: Any) -> tuple[Any, Any]: ...

    def write(
        self, store: Store, name: str, data: Any, group: Any = None
    ) -> artifact.Publication: ...


class Whole:
    """One writer (the coordinator): one file, or parts plus an index."""

    name = "whole"

    def __init__(self, parts: int | str = 1) -> None:
        self.parts = parts

    def writes(self, role: str) -> bool:
        return role == COORDINATOR

    def freeze(self, ckpt: Mapping[str, Any], buffers: Any) -> tuple[Any, Any]:
        from koochak.loop.checkpoint.serialization import split_checkpoint

        split = split_checkpoint(ckpt)
        copy = buffers.copy(split.tensors)
        return split.with_tensors(copy.tensors), copy

    def write(self, store: Store, name: str, data: Any, group: Any = None) -> artifact.Publication:
        from koochak.loop.checkpoint.publication import publish

        return publish(store, name, data, parts=self.parts)


class Sharded:
    """Every rank writes its shards (FSDP); a collective save on every rank at once."""

    name = "sharded"

    def __init__(self, parts: int | str = 1) -> None:
        self.parts = parts
        self.last_written: tuple[tuple[str, int, str], ...] = ()  # this rank's parts

    def writes(self, role: str) -> bool:
        return True

    def freeze(self, ckpt: Mapping[str, Any], buffers: Any) -> tuple[Any, Any]:
        from koochak.loop.checkpoint.sharded import freeze

        return freeze(ckpt, buffers)

    def write(self, store: Store, name: str, data: Any, group: Any = None) -> artifact.Publication:
        from koochak.loop.checkpoint.sharded import save_sharded

        written: list[tuple[str, int, str]] = []
        publication = save_sharded(store, name, data, parts=self.parts, group=group,
                                   written=written)  # fmt: skip
        self.last_written = tuple(written)
        return publication


def layout_for(*, sharded: bool, parts: int | str = 1) -> Layout:
    """The layout of a run: ``Sharded`` under FSDP, else ``Whole``."""
    return Sharded(parts) if sharded else Whole(parts)
