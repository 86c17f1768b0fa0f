"""Publishing, pruning and listing checkpoints through the checkpoint store, in either layout.

Every save goes through ``koochak.storage.artifact.publish``: the numbered object (the file, or
the index of a checkpoint in parts, whose parts are written first) is written create-only and
synced, then ``<name>.ready.json`` commits it; pruning keeps the last k checkpoints, each
manifest first, then its object, then its parts. A checkpoint without its manifest does not
exist as far as resume is concerned.
``checkpoint_store`` turns a location (directory, ``scheme://`` URI, Store) into the Store that
every save, load and selection goes through.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Generator, Iterable, Mapping
from typing import Any

import koochak.loop.checkpoint.retention as retention
from koochak.loop.checkpoint.format import CHECKPOINT_PATTERN, LATEST_NAME, checkpoint_name
from koochak.loop.checkpoint.layout_read import objects as _objects_by_layout
from koochak.loop.checkpoint.parts_index import parse_index
from koochak.loop.checkpoint.parts_io import delete_parts
from koochak.loop.checkpoint.parts_plan import resolve_parts
from koochak.loop.checkpoint.serialization import (
    SplitCheckpoint,
    serialize_checkpoint_chunks,
    split_checkpoint,
    split_checkpoint_chunks,
    write_checkpoint_parts,
)
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
    data: Mapping[str, Any] | SplitCheckpoint | bytes | memoryview | Iterable[bytes],
    *,
    keep_last_k: int | None = None,
    provenance: Mapping[str, Any] | None = None,
    parts: int | str = 1,
    workers: int | None = None,
    intent: Any = None,
) -> artifact.Publication:
    """Publish a checkpoint under ``name`` and prune to the last ``keep_last_k``.

    ``store`` is a Store or a location (directory, ``scheme://`` URI). ``data`` is serialized
    bytes (or an iterable of them), or a checkpoint dict, which is streamed from ``torch.save``.
    ``parts`` (an int, or ``"auto"``: ``parts_plan.resolve_parts``) above 1 stores a checkpoint
    dict as that many parts written in parallel (at most ``workers`` at once; default one
    each) plus an index under ``name`` (docs/formats.md, "Checkpoint parts"); 1 is one file.
    Returns the Publication once its ready manifest has committed. ``intent``: the caller
    already holds the name (``koochak.storage.artifact.claimed``; the sharded save, whose ranks
    write their parts first); otherwise the name is claimed here.
    """
    if keep_last_k is not None and keep_last_k < 1:
        raise ValueError(f"train.keep_last_k must be null or >= 1, got {keep_last_k}")
    store = checkpoint_store(store)
    if keep_last_k is not None and re.fullmatch(CHECKPOINT_PATTERN, name) is None:
        raise ValueError(
            f"publish: name {name!r} does not fully match pattern {CHECKPOINT_PATTERN!r}, so "
            "keep_last_k cannot prune by it; pass keep_last_k=None or a step{N:09d}.pt name"
        )
    count = 1
    if isinstance(data, Mapping) and parts != 1:
        data = split_checkpoint(data)
    if isinstance(data, SplitCheckpoint):
        count = resolve_parts(parts, data.nbytes, store)
    elif parts not in (1, "auto"):
        raise ValueError(
            f"publish(parts={parts!r}): parts need the checkpoint dict; serialized bytes are "
            "always one file"
        )
    # From a checkpoint dict, this publisher writes every object of the checkpoint, so it may
    # clear what lies under the name. Bytes are an object someone else's objects may belong to
    # (a sharded index whose parts every rank wrote first): only that object is published.
    writes_all = isinstance(data, (Mapping, SplitCheckpoint))
    if count == 1:
        if isinstance(data, SplitCheckpoint):
            data = split_checkpoint_chunks(data)
        elif isinstance(data, Mapping):
            data = serialize_checkpoint_chunks(data)
    try:
        # The name first: while another live publisher holds it, FileExistsError and nothing
        # touched (not its parts, not its index). Holding it, what lies under the name is a
        # finished publication (un-committed, manifest first, parts last) or a dead publisher's
        # leftovers, and goes; then this publisher's objects are written and committed.
        held = contextlib.nullcontext(intent) if intent is not None else None
        with held or artifact.claimed(store, name) as intent:
            if writes_all:
                _clear_under(store, name)
            if count > 1:
                publication = _publish_parts(store, name, data, count, workers, provenance, intent)
            else:
                publication = artifact.publish(
                    store, name, data, kind="checkpoint", pattern=CHECKPOINT_PATTERN,
                    latest=LATEST_NAME, intent=intent,
                    provenance=dict(provenance) if provenance is not None else None,
                )  # fmt: skip
    finally:
        if isinstance(data, Generator):
            # A put that failed part-way leaves a streaming serializer waiting; stop it now
            # rather than whenever the generator happens to be collected.
            data.close()
    if keep_last_k is not None:
        prune_checkpoints(store, keep_last_k)
    return publication


def _publish_parts(
    store: Store,
    name: str,
    split: SplitCheckpoint,
    count: int,
    workers: int | None,
    provenance: Mapping[str, Any] | None,
    intent: Any,
) -> artifact.Publication:
    """Holding ``name`` (``intent``), write ``split`` as ``count`` parts and commit their index.

    A failure deletes only the parts this publisher wrote, and only while its claim still
    stands (before its deadline nobody can have proven it dead and taken the name over).
    """
    raw = write_checkpoint_parts(store, name, split, count, workers=workers)
    written = [part.key for part in parse_index(raw, f"{store.location}/{name}", name).parts]
    try:
        return artifact.publish(
            store,
            name,
            raw,
            kind="checkpoint",
            pattern=CHECKPOINT_PATTERN,
            latest=LATEST_NAME,
            provenance=dict(provenance) if provenance is not None else None,
            intent=intent,
        )
    except FileExistsError:
        raise  # a manifest someone else committed meanwhile: its objects are not ours to judge
    except BaseException:
        if time.time() <= intent.deadline:  # no index committed them: only clutter now
            _delete_quietly(store, written)
        raise


def _clear_under(store: Store, name: str) -> None:
    """Holding ``name``'s intent: remove a finished publication of it (manifest first), or the
    objects a dead publisher left (an uncommitted index and its parts)."""
    if _exists(store, name + artifact.READY_SUFFIX):
        unpublish_checkpoint(store, name)
        return
    leftover = delete_parts(store, name, also_object=True)
    if leftover:
        log.warning("removed %d object(s) of %s/%s without a ready manifest, left by a publisher "
                    "that is gone", len(leftover), store.location, name)  # fmt: skip


def _exists(store: Store, key: str) -> bool:
    try:
        store.stat(key)
    except FileNotFoundError:
        return False
    return True


def _delete_quietly(store: Store, keys: Iterable[str]) -> None:
    for key in keys:
        try:
            store.delete(key)
        except FileNotFoundError:
            pass
        except OSError as exc:  # the publish's own error is what matters; an orphan is harmless
            log.warning("could not remove %s/%s of a failed save: %s", store.location, key, exc)


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


def unpublish_checkpoint(store: Store, name: str) -> None:
    """Remove checkpoint ``name`` of either layout: its manifest, then its object (file or
    index), then every part (found by listing, so an interrupted save's leftovers go too).
    Missing objects are fine."""
    artifact.unpublish(store, name)
    delete_parts(store, name)


def prune_checkpoints(store: Store, keep: int) -> list[str]:
    """Keep the ``keep`` highest committed numbered checkpoints; return the names removed.

    Only committed checkpoints (with a manifest) are counted and removed, each manifest first,
    then its object, then its parts, so a checkpoint still being published is never touched.
    """
    names = retention.committed_names(store)
    return remove_checkpoints(store, retention.to_drop(names, keep_last_k=keep))


def remove_checkpoints(store: Store, names: Iterable[str]) -> list[str]:
    """Remove each checkpoint of ``names`` from ``store`` (manifest, object, parts); the names.

    How a retention verdict (``retention.to_drop``) is applied, in every tier."""
    removed = []
    for name in names:
        unpublish_checkpoint(store, name)
        removed.append(name)
    return removed


def checkpoint_objects(location: str | os.PathLike[str] | Store, name: str) -> list[str]:
    """Every object key of checkpoint ``name``, in commit order: parts, object, ready manifest.

    A one-file checkpoint is its file and its manifest; one in parts is read from its index
    (nothing is listed, so this is cheap on object storage); its layout's reader says which
    (``layout_read.objects``). What ``copy_objects`` needs to copy
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


def publication_path(store: Store, publication: artifact.Publication) -> str:
    """A human-usable path: the local file when the store has one, else ``location/key``."""
    if publication.path:
        return publication.path
    return f"{store.location.rstrip('/')}/{publication.key}"
