"""Publishing, pruning and listing checkpoints through the checkpoint store, in either layout.

Every save is claimed (``claimed``), written by its layout (``layouts``), and committed by
``commit``: the head the layout produced (the file, or the index of a checkpoint in parts, whose
parts it wrote first) is written create-only and synced, then ``<name>.ready.json`` commits it; pruning keeps the last k checkpoints, each
manifest first, then its object, then its parts. A checkpoint without its manifest does not
exist as far as resume is concerned.
``checkpoint_store`` turns a location (directory, ``scheme://`` URI, Store) into the Store that
every save, load and selection goes through.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

import koochak.loop.checkpoint.retention as retention
from koochak.loop.checkpoint.commit import (  # they live with the commit; importable here too
    publication_path,  # noqa: F401  (docs/migrating.md names it here)
    remove_checkpoints,
    unpublish_checkpoint,  # noqa: F401
)
from koochak.loop.checkpoint.format import CHECKPOINT_PATTERN, checkpoint_name
from koochak.loop.checkpoint.layouts import COORDINATOR
from koochak.loop.checkpoint.layouts import objects as _objects_by_layout
from koochak.storage import artifact
from koochak.storage.store import Store, open_store

log = logging.getLogger("koochak.loop.checkpoint")


def checkpoint_store(location: str | os.PathLike[str] | Store) -> Store:
    """The Store behind a checkpoint location: a directory, a ``scheme://`` URI, or a Store.

    A missing directory is fine: looking for checkpoints there finds none and creates nothing,
    and the first publication creates it. URIs resolve through ``open_store`` (register_store,
    entry points, the stores file).
    """
    if isinstance(location, (str, os.PathLike)):
        if not os.fspath(location):
            raise ValueError("checkpoint location is empty; expected a directory or scheme:// URI")
    elif isinstance(location, Store):
        return location  # a save passes its Store on every call: no hop through open_store
    return open_store(location)


def publish(
    store: str | os.PathLike[str] | Store,
    name: str,
    data: Mapping[str, Any] | bytes | memoryview | Iterable[bytes],
    *,
    keep_last_k: int | None = None,
    provenance: Mapping[str, Any] | None = None,
    parts: int | str = 1,
    workers: int | None = None,
) -> artifact.Publication:
    """Publish a checkpoint under ``name`` and prune to the last ``keep_last_k``.

    ``store`` is a Store or a location (directory, ``scheme://`` URI). ``data`` is a checkpoint
    dict, saved in the layout ``parts`` picks (``layouts.layout_for``: 1 is one file, streamed
    from ``torch.save``; an int above 1, or ``"auto"``: ``parts_plan.resolve_parts``, that many
    parts written in parallel, at most ``workers`` at once, plus their index, docs/formats.md
    "Checkpoint parts"). Or ``data`` is a head already serialized (bytes, or an iterable of
    them: a ``torch.save`` file, or an index whose parts the caller wrote), committed as it is.
    Returns the Publication once its ready manifest has committed.

    The name is claimed first (``claimed``): while another live publisher holds it,
    FileExistsError and nothing touched. A finished publication of the name is replaced, and a
    dead publisher's leftovers are removed only when the claim took the name over from it.
    """
    from koochak.loop.checkpoint.commit import save
    from koochak.loop.checkpoint.layouts import layout_for

    if keep_last_k is not None and keep_last_k < 1:
        raise ValueError(f"train.keep_last_k must be null or >= 1, got {keep_last_k}")
    store = checkpoint_store(store)
    if keep_last_k is not None and re.fullmatch(CHECKPOINT_PATTERN, name) is None:
        raise ValueError(
            f"publish: name {name!r} does not fully match pattern {CHECKPOINT_PATTERN!r}, so "
            "keep_last_k cannot prune by it; pass keep_last_k=None or a step{N:09d}.pt name"
        )
    if isinstance(data, Mapping):
        layout: Any = layout_for(sharded=False, parts=parts, workers=workers)
    elif parts not in (1, "auto"):
        raise ValueError(
            f"publish(parts={parts!r}): parts need the checkpoint dict; serialized bytes are "
            "always one file"
        )
    else:
        layout = _Serialized()
    publication = save(layout, store, name, data, provenance=provenance)
    if keep_last_k is not None:
        prune_checkpoints(store, keep_last_k)
    return publication


class _Serialized:
    """A head its caller serialized (and whose other objects, if any, it wrote): committed as
    given. Only the write side of a layout (``commit.save`` drives it)."""

    name = "serialized"
    last_written: tuple[tuple[str, int, str], ...] = ()

    def writes(self, role: str) -> bool:
        return role == COORDINATOR

    def write(self, store: Store, name: str, data: Any, *, intent: Any, refused: Any = None,
              group: Any = None) -> Any:  # fmt: skip
        return data

    def outcome(self, result: Any, group: Any = None) -> Any:
        return result

    def objects(self, name: str, head: Any) -> list[str]:
        return [name]  # its other objects are its caller's


def save(
    ckpt: Mapping[str, Any],
    path_or_location: str | os.PathLike[str] | Store,
    keep_last_k: int | None = None,
    *,
    parts: int | str = 1,
) -> artifact.Publication:
    """Serialize ``ckpt`` and publish it; returns the Publication once its manifest has committed.

    The bytes stream from ``torch.save`` into the store (hashed while written), never held whole;
    with ``parts`` above 1 (or ``"auto"``), the tensors go to that many parts written in parallel
    straight from the tensors' memory, plus an index (see ``publish``).

    ``path_or_location`` is either a file path ending in ``.pt`` (published under that name in its
    directory) or a checkpoint location (directory, URI, Store), where the name is
    ``checkpoint_name(ckpt["step"])``.
    """
    store, name = split_checkpoint_path(path_or_location, ckpt)
    return publish(store, name, ckpt, keep_last_k=keep_last_k, parts=parts)


def prune_checkpoints(store: Store, keep: int) -> list[str]:
    """Keep the ``keep`` highest committed numbered checkpoints; return the names removed.

    Only committed checkpoints (with a manifest) are counted and removed, each manifest first,
    then its object, then its parts, so a checkpoint still being published is never touched.
    """
    names = retention.committed_names(store)
    return remove_checkpoints(store, retention.to_drop(names, keep_last_k=keep))


def checkpoint_objects(location: str | os.PathLike[str] | Store, name: str) -> list[str]:
    """Every object key of checkpoint ``name``, in commit order: parts, object, ready manifest.

    A one-file checkpoint is its file and its manifest; one in parts is read from its index
    (nothing is listed, so this is cheap on object storage); its layout says which
    (``layouts.objects``). What ``copy_objects`` needs to copy
    a checkpoint to another store and commit it there last.
    """
    return _objects_by_layout(checkpoint_store(location), name)


def split_checkpoint_path(
    path_or_location: str | os.PathLike[str] | Store, ckpt: Mapping[str, Any] | None = None
) -> tuple[Store, str]:
    """(store, name) for a ``.pt`` file path, or for a location plus the checkpoint's step."""
    if isinstance(path_or_location, (str, os.PathLike)):
        text = os.fspath(path_or_location).rstrip("/")
        if text.endswith(".pt") and not os.path.isdir(text):
            parent, _, name = text.rpartition("/")
            return checkpoint_store(parent or "."), name
    if ckpt is None:
        raise ValueError(f"{path_or_location!s}: expected a checkpoint file path ending in .pt")
    return checkpoint_store(path_or_location), checkpoint_name(int(ckpt["step"]))
