"""Committing a checkpoint a layout wrote: claim the name, commit the head, or undo.

Every save, in every layout, goes through these (``save`` drives them, in the order the
layouts' contract gives, ``layouts``): ``claimed``
holds the name's publish intent and removes what lay under the name, ``commit`` puts the head
the layout produced and the ready manifest, ``discard`` removes the layout's objects after a
failed commit. ``unpublish_checkpoint`` un-commits a checkpoint of any layout (manifest first).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Generator, Iterable, Iterator, Mapping
from typing import Any

from koochak.loop.checkpoint.format import CHECKPOINT_PATTERN, LATEST_NAME
from koochak.loop.checkpoint.layouts.roles import FOLLOWER
from koochak.loop.checkpoint.parts_io import delete_parts
from koochak.storage import artifact
from koochak.storage.store import Store, exists

log = logging.getLogger("koochak.loop.checkpoint")


@contextlib.contextmanager
def claimed(store: Store, name: str) -> Iterator[Any]:
    """Hold ``name``'s publish intent (``koochak.storage.artifact.claimed``) for the block, with
    what lay under the name removed: a finished publication of it (un-committed, manifest
    first, then its objects), or, only where the claim took the name over from a dead
    publisher (the intent's ``took_over``), that publisher's leftovers (its uncommitted head
    and parts, found by listing). A name found free costs one stat, no listing.

    A leftover without any intent record (a plain put, or a failed save's cleanup cut short) is
    not looked for: a create-only put onto it fails naming the object, and nothing is lost."""
    with artifact.claimed(store, name) as intent:
        if exists(store, name + artifact.READY_SUFFIX):
            unpublish_checkpoint(store, name)
        elif intent.took_over:
            leftover = delete_parts(store, name, also_object=True)
            if leftover:
                log.warning("removed %d object(s) of %s/%s without a ready manifest, left by "
                            "%s, which is gone", len(leftover), store.location, name,
                            intent.took_over)  # fmt: skip
        yield intent


def commit(
    store: Store,
    name: str,
    head: bytes | bytearray | memoryview | Iterable[bytes],
    intent: Any,
    provenance: Mapping[str, Any] | None = None,
) -> artifact.Publication:
    """Commit a checkpoint whose layout wrote its objects: put its ``head`` under ``name``
    (create-only), then the ready manifest; ``intent``: the claim held on ``name``
    (``claimed``). The Publication once the manifest has committed."""
    return artifact.publish(
        store, name, head, kind="checkpoint", pattern=CHECKPOINT_PATTERN, latest=LATEST_NAME,
        intent=intent, provenance=dict(provenance) if provenance is not None else None,
    )  # fmt: skip


def discard(store: Store, name: str, layout: Any, head: Any, intent: Any) -> None:
    """After a failed commit: remove the objects ``layout`` wrote for ``head`` (all but the
    ready manifest), only while ``intent`` still stands (before its deadline nobody can have
    proven this publisher dead and taken the name over)."""
    if time.time() > intent.deadline:
        return
    try:
        keys = layout.objects(name, head)
    except (ValueError, OSError):
        return
    _delete_quietly(store, [key for key in keys if key != name + artifact.READY_SUFFIX])


def _delete_quietly(store: Store, keys: Iterable[str]) -> None:
    for key in keys:
        try:
            store.delete(key)
        except FileNotFoundError:
            pass
        except OSError as exc:  # the publish's own error is what matters; an orphan is harmless
            log.warning("could not remove %s/%s of a failed save: %s", store.location, key, exc)


def unpublish_checkpoint(store: Store, name: str) -> None:
    """Remove checkpoint ``name`` of either layout: its manifest, then its object (file or
    index), then every part (found by listing, so an interrupted save's leftovers go too).
    Missing objects are fine."""
    artifact.unpublish(store, name)
    delete_parts(store, name)


def save(
    layout: Any,
    store: Store,
    name: str,
    data: Any,
    *,
    coordinator: bool = True,
    group: Any = None,
    provenance: Mapping[str, Any] | None = None,
) -> artifact.Publication:
    """Save ``data`` (a capture, or ``freeze``'s frozen copy) as checkpoint ``name`` in
    ``layout``, on every writing rank at once (see the call order in ``layouts``); the Publication on
    every writing rank once the ready manifest has committed, else raises on every one.

    The coordinator claims the name, the layout writes its objects, the coordinator commits the
    head; a failure after the layout wrote removes what it wrote (only while the claim stands)."""
    if not coordinator:
        layout.write(store, name, data, intent=None, group=group)
        return _settle(layout.outcome(None, group), name)
    collective = layout.writes(FOLLOWER)  # then every rank must hear every outcome
    with contextlib.ExitStack() as held:
        try:
            intent = held.enter_context(claimed(store, name))
        except Exception as exc:
            if not collective:
                raise
            # The collective write raises on every rank, writing nothing.
            layout.write(store, name, data, intent=None, refused=_line(exc), group=group)
            raise  # (not reached: the write raised)
        head: Any = None
        try:
            head = layout.write(store, name, data, intent=intent, group=group)
            result: Any = ("ok", commit(store, name, head, intent, provenance))
        except BaseException as exc:
            # FileExistsError: another publisher committed the name meanwhile, so nothing
            # under it is ours to remove.
            if head is not None and not isinstance(exc, FileExistsError):
                discard(store, name, layout, head, intent)
            if head is None or not collective:  # the write failed on every rank, or one writer
                raise
            result = ("error", _line(exc))
        finally:
            if isinstance(head, Generator):  # a streaming serializer a failed put left waiting
                head.close()
    return _settle(layout.outcome(result, group), name)


def _line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def _settle(result: Any, name: str) -> artifact.Publication:
    if result[0] == "error":
        raise RuntimeError(f"checkpoint {name} was not saved: {result[1]}")
    return result[1]


def remove_checkpoints(store: Store, names: Iterable[str]) -> list[str]:
    """Remove each checkpoint of ``names`` from ``store`` (manifest, object, parts); the names.

    How a retention verdict (``retention.to_drop``) is applied, in every tier."""
    removed = []
    for name in names:
        unpublish_checkpoint(store, name)
        removed.append(name)
    return removed


def publication_path(store: Store, publication: artifact.Publication) -> str:
    """A human-usable path: the local file when the store has one, else ``location/key``."""
    if publication.path:
        return publication.path
    return f"{store.location.rstrip('/')}/{publication.key}"
