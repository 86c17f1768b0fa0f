"""Publishing checkpoints through the checkpoint store.

Every save goes through ``koochak.storage.artifact.publish``: the numbered object is written
create-only and synced, then ``<name>.ready.json`` commits it; pruning keeps the last k pairs,
manifest first. A checkpoint without its manifest does not exist as far as resume is concerned.
``checkpoint_store`` turns a location (directory, ``scheme://`` URI, Store) into the Store that
every save, load and selection goes through.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterable, Mapping
from typing import Any

from koochak.loop.checkpoint.format import CHECKPOINT_PATTERN, LATEST_NAME, checkpoint_name
from koochak.loop.checkpoint.serialization import serialize_checkpoint_chunks
from koochak.storage import artifact
from koochak.storage.store import Store, open_store


def checkpoint_store(location: str | os.PathLike[str] | Store) -> Store:
    """The Store behind a checkpoint location: a directory, a ``scheme://`` URI, or a Store.

    A missing directory is fine: looking for checkpoints there finds none and creates nothing,
    and the first publication creates it. URIs resolve through ``open_store`` (register_store,
    entry points, the stores file).
    """
    if isinstance(location, (str, os.PathLike)) and not os.fspath(location):
        raise ValueError("checkpoint location is empty; expected a directory or scheme:// URI")
    return open_store(location)


def publish(
    store: str | os.PathLike[str] | Store,
    name: str,
    data: Mapping[str, Any] | bytes | memoryview | Iterable[bytes],
    *,
    keep_last_k: int | None = None,
    provenance: Mapping[str, Any] | None = None,
) -> artifact.Publication:
    """Publish a checkpoint under ``name`` and prune to the last ``keep_last_k``.

    ``store`` is a Store or a location (directory, ``scheme://`` URI). ``data`` is serialized
    bytes (or an iterable of them), or a checkpoint dict, which is streamed from ``torch.save``.
    Returns the Publication once its ready manifest has committed.
    """
    if keep_last_k is not None and keep_last_k < 1:
        raise ValueError(f"train.keep_last_k must be null or >= 1, got {keep_last_k}")
    if isinstance(data, Mapping):
        data = serialize_checkpoint_chunks(data)
    try:
        return artifact.publish(
            checkpoint_store(store),
            name,
            data,
            kind="checkpoint",
            keep_last_k=keep_last_k,
            pattern=CHECKPOINT_PATTERN,
            latest=LATEST_NAME,
            provenance=dict(provenance) if provenance is not None else None,
        )
    finally:
        if isinstance(data, Generator):
            # A put that failed part-way leaves a streaming serializer waiting; stop it now
            # rather than whenever the generator happens to be collected.
            data.close()


def save(
    ckpt: Mapping[str, Any],
    path_or_location: str | os.PathLike[str] | Store,
    keep_last_k: int | None = None,
) -> artifact.Publication:
    """Serialize ``ckpt`` and publish it; returns the Publication once its manifest has committed.

    The bytes stream from ``torch.save`` into the store (hashed while written), never held whole.

    ``path_or_location`` is either a file path ending in ``.pt`` (published under that name in its
    directory) or a checkpoint location (directory, URI, Store), where the name is
    ``checkpoint_name(ckpt["step"])``.
    """
    store, name = split_checkpoint_path(path_or_location, ckpt)
    return publish(store, name, ckpt, keep_last_k=keep_last_k)


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
