"""The layout seam: how one checkpoint becomes stored objects and back, one object per layout.

A checkpoint is committed by one object, its *head*, and the ready manifest beside it (``<name>``
and ``<name>.ready.json``); a layout decides what the head is and which other objects it names:

- ``one_file.ONE_FILE``: the head is the whole ``torch.save`` file; nothing else;
- ``parts.Parts``: one writer (the coordinator) writes the tensors as parts; the head is their
  index (version 1, docs/formats.md "Checkpoint parts"); where ``parts="auto"`` comes to one
  part it writes a one-file head (read by ``one_file``);
- ``sharded.Sharded``: every rank writes its own shards as parts plus its index fragment; the
  coordinator writes the head (version 2, "Sharded index") naming each writer's fragment.
  A version-1 index that an older sharded save wrote reads as ``parts`` (the same format).

This module is the one place that tells them apart: ``layout_for(sharded=, parts=)`` on the
write side (from the run's settings), ``layout_of(head)`` on the read side (from the head's
bytes). Nothing else inspects a head's shape. Policies (selection over tiers, retention,
replication, the announcement) live above the layouts and are the same for all of them.

The contract (``Layout``), told its role the way torch DCP's ``StorageWriter`` is: rank 0 is the
*coordinator*, every other rank a *follower*. The call order:

Write (``commit.save`` drives it; the saver and ``publish`` call that):

1. ``writes(role)``, once, when a rank's saver is built: whether a rank of ``role`` writes
   anything. A rank for which it is False never calls 2-4 (it learns nothing of the save).
2. ``freeze(ckpt, buffers)``, an async save only, on the training thread, every writing rank:
   returns ``(frozen, copy)``, the capture copied into host buffers; after it returns, training
   may change the live tensors. ``copy.release()`` once step 3 returned.
3. The coordinator claims the name (``commit.claimed``: the name's publish intent; a finished
   publication under it removed, and a dead publisher's leftovers where the claim took the name
   over from that publisher, nothing looked for otherwise), then every
   writing rank calls ``write(store, name, data, intent=, refused=, group=)`` at once (a
   follower with ``intent=None``). Before: the coordinator holds the name; ``refused`` is the
   one line why it could not (then every rank raises, having written nothing). ``write`` writes
   this rank's objects, each durable when it returns, and returns the head's bytes (an iterable
   of chunks for a streamed head) on the coordinator, None on a follower. A failure on any rank
   raises on every rank that calls ``write`` (a collective layout agrees inside), and nothing is
   committed. ``last_written`` then holds this rank's objects as ``(key, size, sha256)``.
4. The coordinator commits the head (``commit.commit``: head, then the ready manifest; on a
   failure ``commit.discard`` removes the objects ``objects(name, head)`` names, while the claim
   stands), then every writing rank calls ``outcome(result, group)``: the coordinator's
   ``("ok", Publication)`` or ``("error", line)``, the same on every rank after it.

Read (callers: ``load``, resume's selection, export, replication):

- ``read(store, name, head, source, *, workers=, parts_reader=)``: the whole checkpoint, on
  the CPU, weights-only, every byte verified (the head by the caller, against its manifest;
  every other object against the head). Every fault is a ValueError naming ``source``.
- ``open(store, name, head, source, *, rank, world, shard_size)``: the checkpoint as the
  selection needs it on rank ``rank`` of ``world``: a layout whose objects every rank reads a
  share of returns ``StoredTensor`` references and has read and verified only that rank's
  share (the sharded lazy open); the others read it whole.
- ``objects(name, head)``: every object key of the checkpoint in commit order (other objects,
  the head, the ready manifest), named by the head alone: what a copy to another tier moves.
- ``receipts(store, name, head, source, remote)``: for a copy to another tier, ``(local,
  expected)``: the objects other than the head of every writer not in ``remote`` as
  ``(key, size, sha256)``, and for each ``remote`` writer (one that copies its own objects)
  what its part receipt must name. Reads no remote writer's objects.
- ``verify(store, name, head, source)``: every object the head names is present with its size
  and SHA256 (reading each once); ValueError naming ``source`` and the object otherwise.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any, Protocol

from koochak.loop.checkpoint.layouts.roles import COORDINATOR, FOLLOWER, ROLES
from koochak.storage import artifact
from koochak.storage.store import Store

__all__ = ["COORDINATOR", "FOLLOWER", "ROLES", "Layout", "layout_for", "layout_of", "read",
           "read_checkpoint", "objects", "verify_published"]  # fmt: skip

Head = bytes | bytearray | memoryview


class Layout(Protocol):
    name: str  # "one file", "parts" or "sharded"
    parts: int | str  # parts per writer (1 for one file)
    last_written: tuple[tuple[str, int, str], ...]  # this rank's objects of its last write

    def writes(self, role: str) -> bool: ...

    def freeze(self, ckpt: Mapping[str, Any], buffers: Any) -> tuple[Any, Any]: ...

    def write(
        self,
        store: Store,
        name: str,
        data: Any,
        *,
        intent: Any,
        refused: str | None = None,
        group: Any = None,
    ) -> Head | Iterable[bytes] | None: ...

    def outcome(self, result: Any, group: Any = None) -> Any: ...

    def read(
        self,
        store: Store | None,
        name: str | None,
        head: Head,
        source: str,
        *,
        workers: int | None = None,
        parts_reader: Any = None,
    ) -> dict[str, Any]: ...

    def open(
        self,
        store: Store,
        name: str,
        head: Head,
        source: str,
        *,
        rank: int = 0,
        world: int = 1,
        shard_size: int | None = None,
    ) -> dict[str, Any]: ...

    def objects(self, name: str, head: Head) -> list[str]: ...

    def receipts(
        self, store: Store, name: str, head: Head, source: str, remote: Collection[int] = ()
    ) -> tuple[list[tuple[str, int, str]], dict[int, list[tuple[str, int, str]]]]: ...

    def verify(self, store: Store, name: str, head: Head, source: str) -> None: ...


def layout_for(*, sharded: bool, parts: int | str = 1, workers: int | None = None) -> Layout:
    """The layout a run writes: ``Sharded`` under FSDP, ``Parts`` for ``parts`` other than 1
    (each writer's part count, or ``"auto"``; ``workers``: parts written at once), else one
    file. Only the chosen layout's module is imported."""
    if sharded:
        from koochak.loop.checkpoint.layouts.sharded import Sharded

        return Sharded(parts, workers)
    if parts != 1:
        from koochak.loop.checkpoint.layouts.parts import Parts

        return Parts(parts, workers)
    from koochak.loop.checkpoint.layouts.one_file import OneFile

    return OneFile()


def layout_of(head: Head) -> Layout:
    """The layout of a checkpoint whose head (the object its manifest commits) is ``head``.

    A ``torch.save`` file starts with ``PK`` (zip) or a pickle opcode, an index with ``{``; a
    version-2 sharded head is told from a version-1 index by its last bytes (an index is
    written compact with its keys sorted). A one-byte prefix is enough to tell a file from an
    index, but not which index: pass the whole head for that."""
    if bytes(head[:1]) != b"{":
        from koochak.loop.checkpoint.layouts.one_file import ONE_FILE

        return ONE_FILE
    from koochak.loop.checkpoint.index_fragments import is_head

    if is_head(head):
        from koochak.loop.checkpoint.layouts.sharded import SHARDED

        return SHARDED
    from koochak.loop.checkpoint.layouts.parts import PARTS

    return PARTS


def written_by_every_rank(head: Head, where: str, name: str) -> bool:
    """Whether ``head`` commits a checkpoint every rank of its run wrote its own parts of: the
    sharded layout (a version-2 head, even of one writer), or a version-1 index of several
    writers. ValueError (naming ``where``) for an index that does not parse."""
    layout = layout_of(head)
    if layout.name == "sharded":
        return True
    if layout.name != "parts":
        return False
    from koochak.loop.checkpoint.parts_index import parse_index

    return parse_index(head, where, name).writers > 1


def is_single_object(head: Head) -> bool:
    """Whether a head (its first byte is enough) is the whole checkpoint (one file): nothing
    else to read, copy or verify."""
    return bytes(head[:1]) != b"{"


def read(
    store: Store | None,
    name: str | None,
    head: Head,
    source: str,
    *,
    workers: int | None = None,
    parts_reader: Any = None,
) -> dict[str, Any]:
    """The checkpoint whose head is ``head``, by its layout (``Layout.read``)."""
    return layout_of(head).read(
        store, name, head, source, workers=workers, parts_reader=parts_reader
    )


read_checkpoint = read  # the name every reader used before the layouts were cut


def verify_published(store: Store, name: str) -> None:
    """Check published checkpoint ``name`` whole: its head against its ready manifest, then
    every object the head names (``Layout.verify``); InvalidArtifact or ValueError naming the
    object otherwise, FileNotFoundError for a missing head or manifest."""
    publication, head = artifact.read_verified(store, name)
    layout_of(head).verify(store, name, head, f"{store.location}/{publication.key}")


def objects(store: Store, name: str) -> list[str]:
    """Every object key of checkpoint ``name`` in ``store``, in commit order (``Layout.objects``);
    only the head is read (one byte of it for a one-file checkpoint)."""
    head = store.get(name, 0, 1)
    if not is_single_object(head):
        head = store.get(name)
    return layout_of(head).objects(name, head)
