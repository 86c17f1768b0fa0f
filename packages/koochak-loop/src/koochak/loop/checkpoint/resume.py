"""Choosing and reading checkpoints: load, latest, best, highest valid, auto-resume.

Both layouts (one file, or parts plus an index) are read through
``serialization.read_checkpoint``: for one in parts the manifest verifies the index and the
index verifies every part, each before any of its tensors is used.

Every selection is here, so a checkpoint layout with several objects per checkpoint changes one
module. Resume evidence is only a numbered checkpoint whose exact ready manifest, size, SHA256 and resume
cursor validate, all checked on ONE read of the payload: the bytes that were verified are the bytes
that get loaded. ``latest.pt`` and unmanifested files never count. An invalid candidate is skipped
with a logged reason; any other I/O error (EIO on the newest) propagates, because silently rolling
a run back to an older checkpoint would waste the work since.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

from koochak.loop import ddp, dist
from koochak.loop.checkpoint.format import (
    CHECKPOINT_PATTERN,
    LATEST_NAME,
    check_resume_cursor,
    check_rng_fields,
    checkpoint_name,
    step_of_name,
)
from koochak.loop.checkpoint.publication import checkpoint_store, publication_path
from koochak.loop.checkpoint.serialization import read_checkpoint
from koochak.storage import artifact
from koochak.storage.store import Store, open_store

log = logging.getLogger("koochak.loop.checkpoint")

RESUME_MODES = ("auto", "none")


class ResumePoint(NamedTuple):
    """A checkpoint to continue from and where it was published: ``(path, checkpoint)``, the one
    order every resume helper returns (it unpacks like a tuple)."""

    path: str | None  # None only for a checkpoint dict the caller passed without its path
    checkpoint: dict[str, Any]


def load(path: str | os.PathLike[str] | Store, name: str | None = None) -> dict[str, Any]:
    """Load a checkpoint onto the CPU (weights-only; no code runs).

    ``path`` is a checkpoint file (local path or ``scheme://.../step000000100.pt``), or, with
    ``name``, a location (directory, URI, Store) holding the object ``name``. This does not require
    a ready manifest; use ``resolve_auto_resume`` for resume decisions.
    """
    if name is not None:
        store = open_store(path)
        return read_checkpoint(store, name, store.get(name), f"{store.location}/{name}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"load({path!r}): a Store needs the object's name, e.g. load(store, name)")
    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        parent, _, key = text.rstrip("/").rpartition("/")
        store = open_store(parent)
        return read_checkpoint(store, key, store.get(key), text)
    if text.startswith("file://"):
        text = text[len("file://") :]
    with open(text, "rb") as f:
        data = f.read()
    # An index's parts lie beside the file it really is (latest.pt is a link to it).
    real = os.path.realpath(text)
    store = open_store(os.path.dirname(real))
    return read_checkpoint(store, os.path.basename(real), data, text)


def latest(location: str | os.PathLike[str] | Store) -> str | None:
    """``latest.pt`` if the location has one, else the highest published numbered checkpoint.

    A convenience for people; resume uses ``highest_valid_published``.
    """
    store = checkpoint_store(location)
    local = store.local_path(LATEST_NAME)
    if local is not None and os.path.lexists(local) and os.path.exists(local):
        return local
    candidates = artifact.published_candidates(store, CHECKPOINT_PATTERN)
    if not candidates:
        return None
    return _key_path(store, candidates[0][1])


def best(location: str | os.PathLike[str] | Store, key: str) -> str | None:
    """The published checkpoint with the lowest ``metrics[key]`` (verified reads); None if none.

    Checkpoints that fail verification, or lack the metric, are skipped with a logged reason.
    """
    store = checkpoint_store(location)
    best_value: float | None = None
    best_path: str | None = None
    for _, name in artifact.published_candidates(store, CHECKPOINT_PATTERN):
        try:
            publication, data = artifact.read_verified(store, name)
            ckpt = read_checkpoint(store, name, data, _key_path(store, name))
        except (artifact.InvalidArtifact, ValueError) as exc:
            log.warning("best(): skipping %s: %s", name, exc)
            continue
        value = (ckpt.get("metrics") or {}).get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            log.info("best(): %s has no numeric metric %r (%r)", name, key, value)
            continue
        if best_value is None or float(value) < best_value:
            best_value = float(value)
            best_path = publication_path(store, publication)
    return best_path


def highest_valid_published(location: str | os.PathLike[str] | Store) -> str | None:
    """Path of the highest numbered checkpoint whose manifest, size, SHA256 and cursor validate."""
    found = resolve_auto_resume(location)
    return found.path if found is not None else None


def resolve_auto_resume(location: str | os.PathLike[str] | Store) -> ResumePoint | None:
    """``(path, checkpoint)`` of the highest valid published checkpoint, or None to start fresh.

    The checkpoint comes from the same single read whose manifest, size, SHA256 and resume cursor
    were validated. Invalid candidates are skipped (reason logged); any other OSError propagates.
    """
    store = checkpoint_store(location)
    found = artifact.highest_valid(store, CHECKPOINT_PATTERN, check=_validated_checkpoint(store))
    _log_unmanifested(store, found[1]["step"] if found is not None else -1)
    if found is None:
        return None
    publication, ckpt = found
    return ResumePoint(publication_path(store, publication), ckpt)


def resume_checkpoint(
    resume: str | None,
    location: str | os.PathLike[str] | Store | None,
    checkpoint_dict: Mapping[str, Any] | None = None,
    auto_resume_path: str | None = None,
) -> ResumePoint | None:
    """The checkpoint this run continues from, or None to start fresh (``training_loop``'s lookup).

    A ``checkpoint_dict`` the caller already resolved (``resolve_auto_resume`` before building the
    dataset) wins. Otherwise ``resume="auto"`` selects the highest valid published checkpoint:
    rank 0 chooses, every other rank reads and verifies the same object, so all ranks agree.
    """
    if resume is not None and resume not in RESUME_MODES:
        raise ValueError(
            f"training_loop(resume=...): expected 'auto', 'none' or None, got {resume!r}"
        )
    if checkpoint_dict is not None:
        return ResumePoint(auto_resume_path, dict(checkpoint_dict))
    if resume != "auto":
        return None
    if location is None:
        raise ValueError(
            "resume='auto' needs train.checkpoint_dir or train.out_dir to know where to look"
        )
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return resolve_auto_resume(location)
    found, failure = None, None
    if dist.get_rank() == 0:
        try:
            found = resolve_auto_resume(location)
        except Exception as exc:  # tell the other ranks before raising, or they wait forever
            failure = exc
    chosen = ddp.broadcast_object(
        ("error", f"{type(failure).__name__}: {failure}") if failure is not None
        else (found.path, int(found.checkpoint["step"])) if found is not None else None,
        src=0,
    )  # fmt: skip
    if failure is not None:
        raise failure
    if chosen is None:
        return None
    if chosen[0] == "error":
        raise RuntimeError(f"rank 0 could not resolve the checkpoint to resume: {chosen[1]}")
    if found is not None:
        return found
    path, step = chosen
    store = checkpoint_store(location)
    _, data = artifact.read_verified(store, checkpoint_name(step))
    return ResumePoint(path, read_checkpoint(store, checkpoint_name(step), data, path))


def _log_unmanifested(store: Store, chosen: int) -> None:
    """Say why newer-looking files were passed over: they were never committed by a manifest."""
    keys = {info.key for info in store.list("step")}
    for key in sorted(keys):
        number = step_of_name(key)
        if number is not None and number > chosen and key + artifact.READY_SUFFIX not in keys:
            log.warning(
                "ignoring %s: no ready manifest (an incomplete or interrupted publication)",
                _key_path(store, key),
            )


def _validated_checkpoint(store: Store):
    def check(publication: artifact.Publication, data: bytes) -> dict[str, Any]:
        source = _key_path(store, publication.key)
        try:
            ckpt = read_checkpoint(store, publication.key, data, source)
            check_resume_cursor(ckpt, publication.key)
            check_rng_fields(ckpt, source)
        except ValueError as exc:
            raise artifact.InvalidArtifact(str(exc)) from exc
        return ckpt

    return check


def _key_path(store: Store, key: str) -> str:
    local = store.local_path(key)
    return local if local is not None else f"{store.location.rstrip('/')}/{key}"
