"""Choosing and reading checkpoints: load, latest, best, highest valid, auto-resume.

Every layout is read through its own reader (``layouts.read``): for one in parts the manifest verifies the index and the
index verifies every part, each before any of its tensors is used.

Every selection is here, so a checkpoint layout with several objects per checkpoint changes one
module. Resume evidence is only a numbered checkpoint whose exact ready manifest, size, SHA256 and resume
cursor validate, all checked on ONE read of the payload: the bytes that were verified are the bytes
that get loaded. ``latest.pt`` and unmanifested files never count. An invalid candidate is skipped
with a logged reason, and so is one whose object (file, index or a part) is still missing once the
store's ``read_settle_seconds`` have passed (the spec: "A missing or invalid candidate falls back
to a lower one"); any other I/O error (EIO on the newest) propagates, because silently rolling
a run back to an older checkpoint would waste the work since.

Resume considers every tier of a location with replicas (``tiers``): the highest step that
validates in any of them, the first tier first for equal steps (it is the fastest to read). A
tier that cannot be listed (unreachable) or is gone (node-local storage after a requeue elsewhere)
is skipped with one line. An I/O error on a candidate tries the same step in the other tiers and
is raised when none of them has it: never a silent step back.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from koochak.loop import ddp, dist
from koochak.loop.checkpoint.commit import publication_path
from koochak.loop.checkpoint.format import (
    CHECKPOINT_PATTERN,
    LATEST_NAME,
    check_resume_cursor,
    check_rng_fields,
    checkpoint_name,
)
from koochak.loop.checkpoint.layouts import read_checkpoint
from koochak.loop.checkpoint.parts_index import PART_INFIX
from koochak.loop.checkpoint.publication import checkpoint_store
from koochak.loop.checkpoint.selection import missing_object, walk
from koochak.loop.checkpoint.tiers import Location
from koochak.loop.checkpoint.verified_read import read_published_checkpoint
from koochak.storage import artifact
from koochak.storage.store import Store, open_store

log = logging.getLogger("koochak.loop.checkpoint")

RESUME_MODES = ("auto", "none")

# One location, or a run's tiers: the first tier, then each replica (``checkpoint_locations``).
Locations = Location | Sequence[Location]


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
    candidates = artifact.published_candidates(store, CHECKPOINT_PATTERN, leave_out=PART_INFIX)
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
    for _, name in artifact.published_candidates(store, CHECKPOINT_PATTERN, leave_out=PART_INFIX):
        try:
            publication, data = artifact.read_verified(store, name)
            ckpt = read_checkpoint(store, name, data, _key_path(store, name))
        except (artifact.InvalidArtifact, ValueError) as exc:
            log.warning("best(): skipping %s: %s", name, exc)
            continue
        except FileNotFoundError as exc:
            log.warning("best(): skipping %s: %s", name, missing_object(exc, store))
            continue
        value = (ckpt.get("metrics") or {}).get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            log.info("best(): %s has no numeric metric %r (%r)", name, key, value)
            continue
        if best_value is None or float(value) < best_value:
            best_value = float(value)
            best_path = publication_path(store, publication)
    return best_path


def highest_valid_published(location: Locations) -> str | None:
    """Path of the highest numbered checkpoint whose manifest, size, SHA256 and cursor validate."""
    found = resolve_auto_resume(location)
    return found.path if found is not None else None


def resolve_auto_resume(
    location: Locations, passed: list[dict[str, Any]] | None = None
) -> ResumePoint | None:
    """``(path, checkpoint)`` of the highest valid published checkpoint, or None to start fresh.

    The checkpoint comes from the same single read whose manifest, size, SHA256 and resume cursor
    were validated. Invalid candidates are skipped (reason logged); any other OSError propagates.
    ``location`` may be a list of tiers (first tier first): the highest step valid in any of
    them wins, read from the first tier that has it. ``passed`` (a list) receives one
    ``{"tier", "step", "why"}`` per candidate passed over (the run history's resume record).
    """
    found = highest_valid(_tier_stores(location), passed)
    if found is None:
        return None
    return ResumePoint(publication_path(found.store, found.publication), found.checkpoint)


class _Found(NamedTuple):
    tier: int
    store: Store
    publication: artifact.Publication
    checkpoint: dict[str, Any]


def _tier_stores(location: Locations) -> list[Store]:
    if isinstance(location, (list, tuple)):
        if not location:
            raise ValueError("resume: expected a checkpoint location or a list of tiers, got []")
        return [checkpoint_store(tier) for tier in location]
    return [checkpoint_store(location)]  # type: ignore[arg-type]


def highest_valid(
    stores: Sequence[Store], passed: list[dict[str, Any]] | None = None
) -> _Found | None:
    """The newest checkpoint that validates in any of ``stores`` (tiers, first tier first),
    each candidate read whole and verified in one read (``_read_validated``), by the one walk
    over tiers (``selection.walk``: steps newest first, within a step the tiers in order; an
    invalid copy is passed over; with several tiers an OSError too, but when no tier yields
    that step the first such error is raised instead of stepping back; a single location raises
    every OSError). ``passed`` receives ``{"tier", "step", "why"}`` for each copy or tier
    passed over."""
    found = walk(stores, _read_validated, passed)
    if found is None:
        return None
    publication, ckpt = found.opened
    return _Found(found.tier, found.store, publication, ckpt)


def resume_publication_path(
    locations: Sequence[Location], path: str | None, checkpoint: Mapping[str, Any] | None
) -> str | None:
    """Where the checkpoint a run resumed from is announced: its path in the first replica tier
    (the tier ``on_checkpoint`` names) when that tier holds the very commit the run read, else
    None (not announced there yet: replication commits it there and announces it then)."""
    if checkpoint is None or len(locations) < 2:
        return path
    name = checkpoint_name(int(checkpoint["step"]))
    stores = [checkpoint_store(location) for location in locations]
    try:
        _, announced = artifact.read_manifest(stores[1], name)
    except (artifact.InvalidArtifact, OSError):
        return None
    for store in stores:
        if path is not None and path == _key_path(store, name):
            try:
                _, read = artifact.read_manifest(store, name)
            except (artifact.InvalidArtifact, OSError):
                return None
            return _key_path(stores[1], name) if read == announced else None
    return None


def resume_checkpoint(
    resume: str | None,
    location: Locations | None,
    checkpoint_dict: Mapping[str, Any] | None = None,
    auto_resume_path: str | None = None,
    *,
    sharded: bool = False,
    shard_size: int | None = None,
) -> ResumePoint | None:
    """The checkpoint this run continues from, or None to start fresh (``training_loop``'s lookup).

    A ``checkpoint_dict`` the caller already resolved (``resolve_auto_resume`` before building the
    dataset) wins. Otherwise ``resume="auto"`` selects the highest valid published checkpoint
    (over every tier when ``location`` is a list): rank 0 chooses, every other rank reads and
    verifies the same commit (the same SHA256, from whichever tier it can reach), so all ranks
    agree. ``sharded`` (FSDP): ``selection.resolve_sharded`` instead, whose checkpoint holds
    references that ``restore_training_state`` reads
    as this rank's slabs (over every tier, as above); ``shard_size``: under HSDP the ranks of
    one shard group (``fsdp.shard_size``), so each rank reads the rows it will hold.
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
    if sharded:  # FSDP: every rank verifies a share of the parts; tensors read at restore
        from koochak.loop.checkpoint.selection import resolve_sharded

        found_sharded = resolve_sharded(location, shard_size)  # every tier
        return ResumePoint(*found_sharded) if found_sharded is not None else None
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return resolve_auto_resume(location)
    found, failure = None, None
    if dist.get_rank() == 0:
        try:
            found = highest_valid(_tier_stores(location))
        except Exception as exc:  # tell the other ranks before raising, or they wait forever
            failure = exc
    chosen = ddp.broadcast_object(
        ("error", f"{type(failure).__name__}: {failure}") if failure is not None
        else (found.tier, int(found.checkpoint["step"]), found.publication.sha256)
        if found is not None else None,
        src=0,
    )  # fmt: skip
    if failure is not None:
        raise failure
    if chosen is None:
        return None
    if chosen[0] == "error":
        raise RuntimeError(f"rank 0 could not resolve the checkpoint to resume: {chosen[1]}")
    if found is not None:
        return ResumePoint(publication_path(found.store, found.publication), found.checkpoint)
    return _read_same(_tier_stores(location), *chosen)


def _read_same(stores: Sequence[Store], tier: int, step: int, sha256: str) -> ResumePoint:
    """Rank 0's choice, read by another rank: the same commit from rank 0's tier, or else from
    any tier that holds it (a node-local first tier is not on every node)."""
    name = checkpoint_name(step)
    order = [tier] + [i for i in range(len(stores)) if i != tier]
    problems = []
    for index in order:
        store = stores[index]
        try:
            publication, data = artifact.read_verified(store, name)
            if publication.sha256 != sha256:
                problems.append(f"tier {index} ({store.location}): another commit of {name}")
                continue
            path = publication_path(store, publication)
            return ResumePoint(path, read_checkpoint(store, name, data, path))
        except (ValueError, OSError) as exc:  # InvalidArtifact, a damaged part, unreachable
            problems.append(f"tier {index} ({store.location}): {exc}")
    raise RuntimeError(
        f"rank 0 resumes from {name} (SHA256 {sha256}) but this rank cannot read that commit: "
        + "; ".join(problems)
    )


def read_published(store: Store, name: str) -> ResumePoint:
    """The published checkpoint ``name`` of ``store`` (either layout), read once and checked
    against its ready manifest (size, SHA256) and format; InvalidArtifact or ValueError naming
    it otherwise."""
    publication, data = artifact.read_verified(store, name)
    path = publication_path(store, publication)
    return ResumePoint(path, read_checkpoint(store, name, data, path))


def _read_validated(store: Store, key: str) -> tuple[artifact.Publication, dict[str, Any]]:
    """One verified read of ``key`` (``verified_read``), its format, cursor and RNG checked;
    InvalidArtifact for anything that makes it no resume point."""
    source = _key_path(store, key)
    try:
        publication, ckpt = read_published_checkpoint(store, key, source)
        check_resume_cursor(ckpt, key)
        check_rng_fields(ckpt, source)
    except artifact.InvalidArtifact:
        raise
    except ValueError as exc:
        raise artifact.InvalidArtifact(str(exc)) from exc
    return publication, ckpt


def _key_path(store: Store, key: str) -> str:
    local = store.local_path(key)
    return local if local is not None else f"{store.location.rstrip('/')}/{key}"
