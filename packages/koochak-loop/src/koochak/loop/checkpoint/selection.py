"""Selection over tiers, written once: the newest checkpoint that opens, in any tier.

``walk(stores, open_one)`` is the one walk every selection takes (resume's ``highest_valid`` in
one process, ``resolve_sharded`` on every rank of an FSDP run): the candidates are the published
checkpoints of every tier (the first tier first, then each replica), tried newest step first and,
within a step, tier by tier. ``open_one(store, name)`` opens a candidate, asking its layout
(``open_candidate``: ``layouts.layout_of(head).open``) or reading it whole:

- InvalidArtifact or ValueError (damaged, malformed, a part missing or of another digest), or a
  FileNotFoundError once the store's ``read_settle_seconds`` are waited out: that copy is passed
  over with its reason (logged, and in ``passed``) and the next is tried;
- any other error (EIO, a hung mount): with one tier it is raised; with several, the same step
  is tried in the other tiers, and raised when none yields it: never a silent step back.

Collective (``collective=True``): rank 0 lists, every rank opens each candidate its own way, and
the ranks agree on each outcome, so every rank passes over (or fails on) the same candidates.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from koochak.loop import dist
from koochak.loop.checkpoint.collectives import broadcast_from_rank0, error_line
from koochak.loop.checkpoint.commit import publication_path
from koochak.loop.checkpoint.format import (
    CHECKPOINT_PATTERN,
    check_resume_cursor,
    check_rng_fields,
    step_of_name,
)
from koochak.loop.checkpoint.layouts import layout_of
from koochak.loop.checkpoint.parts_index import PART_INFIX
from koochak.loop.checkpoint.publication import checkpoint_store
from koochak.storage import artifact
from koochak.storage.named import read_settle_seconds
from koochak.storage.store import Store, capabilities_of, list_shallow

log = logging.getLogger("koochak.loop.checkpoint")


class Chosen(NamedTuple):
    tier: int
    store: Store
    name: str
    opened: Any  # what ``open_one`` returned


def walk(
    stores: Sequence[Store],
    open_one: Callable[[Store, str], Any],
    passed: list[dict[str, Any]] | None = None,
    *,
    collective: bool = False,
) -> Chosen | None:
    """The newest candidate ``open_one`` opens in any of ``stores`` (see the module); None when
    none does. ``passed`` receives ``{"tier", "step", "why"}`` for each copy or tier passed
    over."""
    passed = passed if passed is not None else []
    together = collective
    candidates: dict[int, list[tuple[int, str]]] = {}
    listed: list[Store] = []
    if not together or dist.get_rank() == 0:
        candidates, listed = _candidates(stores, passed)
    if together:
        candidates = broadcast_from_rank0(candidates)
    chosen = -1
    found = None
    for number in sorted(candidates, reverse=True):
        error: BaseException | None = None
        for tier, name in candidates[number]:
            store = stores[tier]
            kind, value = _attempt(open_one, store, name)
            if together:
                kind, value = _agree(kind, value, name)
            if kind == "ok":
                found = Chosen(tier, store, name, value)
                break
            why = value if kind == "skip" else f"cannot read it ({error_line(value)})"
            if kind == "fatal" and len(stores) == 1:
                raise value
            if kind == "fatal":
                error = error or value
            if not together or dist.get_rank() == 0:
                log.warning("skipping %s #%d (%s): %s", name, number, store.location, why)
            passed.append({"tier": tier, "step": number, "why": why})
        if found is not None:
            chosen = number
            break
        if error is not None:
            raise error  # this step exists but cannot be read anywhere: never step back silently
    for store in listed:
        _log_unmanifested(store, chosen)
    return found


def open_candidate(
    store: Store, name: str, *, rank: int = 0, world: int = 1, shard_size: int | None = None
) -> tuple[str, dict[str, Any]]:
    """``(path, checkpoint)`` of published checkpoint ``name`` opened for rank ``rank`` of
    ``world`` by its layout (``Layout.open``: the sharded lazy open reads and verifies only this
    rank's share, with ``StoredTensor`` references; one file is read whole), its manifest,
    cursor and RNG states checked. InvalidArtifact or ValueError when any of that does not
    hold."""
    publication, head = artifact.read_verified(store, name)
    path = publication_path(store, publication)
    ckpt = layout_of(head).open(store, name, head, path, rank=rank, world=world,
                               shard_size=shard_size)  # fmt: skip
    check_resume_cursor(ckpt, name)
    check_rng_fields(ckpt, path)
    return path, ckpt


def resolve_sharded(
    location: Any, shard_size: int | None = None, passed: list[dict[str, Any]] | None = None
) -> tuple[str, dict[str, Any]] | None:
    """The newest published checkpoint every rank finds its share of sound, chosen by every
    rank together (``walk(collective=True)`` over ``open_candidate``): ``(path, checkpoint)``
    with ``StoredTensor`` references, or None to start fresh. ``location``: one location or a
    run's tiers (each rank passes its own, ``{node}`` resolved)."""
    locations = list(location) if isinstance(location, (list, tuple)) else [location]
    stores = [checkpoint_store(where) for where in locations]
    rank, world = dist.get_rank(), dist.get_world_size()

    def open_one(store: Store, name: str) -> tuple[str, dict[str, Any]]:
        return open_candidate(store, name, rank=rank, world=world, shard_size=shard_size)

    found = walk(stores, open_one, passed, collective=True)
    return found.opened if found is not None else None


def missing_object(exc: FileNotFoundError, store: Store) -> str:
    """One line for a candidate whose object is missing: which object, and that the store's
    ``read_settle_seconds`` were waited out first (the named reads wait before they raise)."""
    where = exc.filename or str(exc)
    return (f"{where} is missing (after waiting read_settle_seconds="
            f"{read_settle_seconds(store):g}), so the checkpoint is not whole")  # fmt: skip


def _attempt(open_one: Callable[[Store, str], Any], store: Store, name: str) -> tuple[str, Any]:
    """``("ok", result)``, ``("skip", why)`` for a candidate that is no resume point, or
    ``("fatal", exception)``."""
    try:
        return ("ok", open_one(store, name))
    except (artifact.InvalidArtifact, ValueError) as exc:
        return ("skip", " ".join(str(exc).split()))
    except FileNotFoundError as exc:  # the head or a part, missing after read_settle_seconds
        return ("skip", missing_object(exc, store))
    except Exception as exc:
        return ("fatal", exc)


def _agree(kind: str, value: Any, name: str) -> tuple[str, Any]:
    """Every rank's outcome of one candidate: any rank's fatal error is every rank's (an
    OSError naming the ranks), else any rank's skip, else this rank's result."""
    import torch

    mine = (kind, None if kind == "ok" else value if kind == "skip" else error_line(value))
    outcomes: list[Any] = [mine]
    if dist.get_world_size() > 1:
        outcomes = [None] * dist.get_world_size()
        torch.distributed.all_gather_object(outcomes, mine)
    fatal = [f"rank {r}: {m}" for r, (k, m) in enumerate(outcomes) if k == "fatal"]
    if fatal:
        return ("fatal", OSError(f"checkpoint {name} could not be read: {'; '.join(fatal)}"))
    bad = [f"rank {r}: {m}" for r, (k, m) in enumerate(outcomes) if k == "skip"]
    if bad:
        return ("skip", "; ".join(bad))
    return (kind, value)


def _candidates(
    stores: Sequence[Store], passed: list[dict[str, Any]]
) -> tuple[dict[int, list[tuple[int, str]]], list[Store]]:
    """``({step: [(tier, name), ...]}, the stores listed)``: one listing per tier. A tier that
    cannot be listed is passed over (raised when it is the only one); one that is gone while
    another holds checkpoints (node-local storage after a requeue elsewhere) is said once."""
    candidates: dict[int, list[tuple[int, str]]] = {}
    listed_stores = []
    gone: list[tuple[int, Store]] = []
    for tier, store in enumerate(stores):
        try:
            listed = artifact.published_candidates(store, CHECKPOINT_PATTERN, leave_out=PART_INFIX)
        except OSError as exc:
            if len(stores) == 1:
                raise
            log.warning("skipping checkpoint tier %d (%s): cannot list it (%s: %s)",
                        tier, store.location, type(exc).__name__, exc)  # fmt: skip
            passed.append({"tier": tier, "step": None,
                           "why": f"cannot list it ({type(exc).__name__}: {exc})"})  # fmt: skip
            continue
        if not listed and len(stores) > 1 and _vanished(store):
            gone.append((tier, store))
        listed_stores.append(store)
        for number, key in listed:
            candidates.setdefault(number, []).append((tier, key))
    # Only a tier missing while another holds the run's checkpoints is "gone": in a fresh run
    # none exists yet, and that is no news.
    for tier, store in gone if candidates else ():
        log.warning("skipping checkpoint tier %d (%s): it is gone (node-local storage on "
                    "another node?)", tier, store.location)  # fmt: skip
        passed.append({"tier": tier, "step": None, "why": "it is gone (node-local storage on "
                       "another node?)"})  # fmt: skip
    return candidates, listed_stores


def _vanished(store: Store) -> bool:
    root = capabilities_of(store).root
    return root is not None and not os.path.isdir(root)


def _log_unmanifested(store: Store, chosen: int) -> None:
    """Say why newer-looking files were passed over: they were never committed by a manifest."""
    keys = {info.key for info in list_shallow(store, "step", PART_INFIX)}  # not their parts
    for key in sorted(keys):
        number = step_of_name(key)
        if number is not None and number > chosen and key + artifact.READY_SUFFIX not in keys:
            local = store.local_path(key)
            log.warning(
                "ignoring %s: no ready manifest (an incomplete or interrupted publication)",
                local if local is not None else f"{store.location.rstrip('/')}/{key}",
            )
