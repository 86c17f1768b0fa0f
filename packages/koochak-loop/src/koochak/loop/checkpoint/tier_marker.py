"""Tiers know whose they are: a small marker object in every tier, naming the run that owns it.

``claim_tiers`` runs once at the start of a run (rank 0), after the run holds its lease on every
tier (``run_lease.claim_run``) and before any checkpoint is selected or written (with a ``{node}``
first tier, every other node's first rank then claims its node's tier for the same run id,
``claim_node_tier``):

1. the run's id: ``train.run_id``, else that of the checkpoint the caller resumes (a
   ``checkpoint_dict`` passed to ``training_loop``), else the first tier's marker's (a retry),
   else one derived from ``train.out_dir``'s absolute path (``default_run_id``: a retry whose
   node-local first tier is gone is still the same run). A run that starts over
   (``--resume none``) takes ``train.run_id``, else a new id whenever its tiers hold anything
   (a committed checkpoint, or a marker other than the default id's: that marker alone is what
   an attempt that died before its first commit leaves, and it keeps the default id);
2. every tier's marker ``koochak-tier.json`` (docs/formats.md, "Tier marker") is read, and
   written create-only where there is none (first use). A tier whose marker names another run
   and that holds committed checkpoints is refused (ConfigError naming the key and both runs):
   it is never written or pruned. A marker whose run committed nothing there (a first attempt
   that died before its first commit) is taken over with one line, compare-and-swap against
   the marker read. A tier without a marker that holds another run's committed checkpoints
   (written before markers existed) is refused naming that run, never adopted;
3. a run that starts over becomes the owner of every tier: the committed checkpoints it finds
   there (an older run's, or an earlier start's) are moved aside to ``superseded/<run>-<time>/``
   in the same location (one line each), where nothing selects or prunes them, and the tier's
   marker names the new run. So selection and retention, which look only at the location's
   own numbered checkpoints, only ever see the owner's;
4. each marker carries a random ``tier_id``: two tiers showing the same one are one storage
   under two names (two mounts of one bucket, which paths cannot show) and are refused;
5. a tier that cannot be written (a bucket that does not exist, missing credentials) is refused
   naming its key; a directory replica whose parent does not exist too, unless its entry says
   ``create: true`` (a typo must not put a "durable" tier on local disk).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import koochak.loop.checkpoint.retention as retention
from koochak.loop.checkpoint.publication import checkpoint_store
from koochak.loop.checkpoint.tiers import Tier, checkpoint_tiers
from koochak.loop.config import ConfigError, TrainConfig, check_replicas
from koochak.storage.store import Store

log = logging.getLogger("koochak.loop.checkpoint")

MARKER_KEY = "koochak-tier.json"
MARKER_FORMAT = "koochak-tier-marker"
MARKER_VERSION = 1


@dataclass(frozen=True)
class TierMarker:
    run_id: str
    tier_id: str  # random, one per tier: how two names of one storage are told apart
    created: str  # UTC, ISO 8601
    host: str

    def to_bytes(self) -> bytes:
        doc = {"format": MARKER_FORMAT, "version": MARKER_VERSION, "run_id": self.run_id,
               "tier_id": self.tier_id, "created": self.created, "host": self.host}  # fmt: skip
        return (json.dumps(doc, indent=1) + "\n").encode()


_UNREADABLE = TierMarker("", "", "", "")  # a replica down for now


def new_marker(run_id: str) -> TierMarker:
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return TierMarker(run_id, secrets.token_hex(8), created, socket.gethostname())


def read_marker(store: Store) -> TierMarker | None:
    """The tier's marker, or None when it has none; ValueError naming it when it is malformed."""
    try:
        raw = store.get(MARKER_KEY)
    except FileNotFoundError:
        return None
    where = f"{store.location.rstrip('/')}/{MARKER_KEY}"
    try:
        doc = json.loads(raw)
    except ValueError:
        raise ValueError(f"{where}: not a tier marker (not JSON)") from None
    if not isinstance(doc, dict) or doc.get("format") != MARKER_FORMAT:
        raise ValueError(f"{where}: not a tier marker (format is not {MARKER_FORMAT!r})")
    if doc.get("version") != MARKER_VERSION:
        raise ValueError(f"{where}: tier marker version {doc.get('version')!r} is not supported")
    fields = ("run_id", "tier_id", "created", "host")
    bad = [f for f in fields if not isinstance(doc.get(f), str) or not doc.get(f)]
    if bad:
        raise ValueError(f"{where}: tier marker field(s) {bad} missing or not strings")
    return TierMarker(*(doc[f] for f in fields))


def write_marker(store: Store, marker: TierMarker) -> TierMarker:
    """Write ``marker`` create-only; return the marker the tier holds afterwards (another
    writer's, if one got there first: the same storage under another name, or a racing run)."""
    try:
        store.put(MARKER_KEY, marker.to_bytes())
    except FileExistsError:
        found = read_marker(store)
        assert found is not None
        return found
    return marker


class MarkerRaced(Exception):
    """The marker changed between reading it and replacing it: another run claimed the tier."""


def replace_marker(store: Store, expected: TierMarker | None, marker: TierMarker) -> None:
    """Replace the tier's marker by ``marker``, compare-and-swap against ``expected`` (the one
    read): MarkerRaced when the tier holds another by now, or another is written in between
    (the new one is put create-only after the old is deleted). Runs under the run's lease."""
    if read_marker(store) != expected:
        raise MarkerRaced()
    if expected is not None:
        try:
            store.delete(MARKER_KEY)
        except FileNotFoundError:
            pass
    try:
        store.put(MARKER_KEY, marker.to_bytes())
    except FileExistsError:
        raise MarkerRaced() from None


def default_run_id(cfg: TrainConfig) -> str:
    """The run id when neither ``train.run_id`` nor the first tier's marker gives one: derived
    from ``train.out_dir``'s absolute path, so every attempt of one run agrees on it."""
    where = os.path.abspath(os.path.expanduser(cfg.out_dir))
    digest = hashlib.sha256(where.encode()).hexdigest()[:12]
    return f"{os.path.basename(where.rstrip('/')) or 'run'}-{digest}"


def new_run_id(cfg: TrainConfig) -> str:
    """A run id no earlier start has: ``default_run_id`` plus the UTC start time and a random
    suffix, for a run that starts over where another (or an earlier start) left checkpoints."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return f"{default_run_id(cfg)}-{stamp}-{secrets.token_hex(2)}"


def tier_keys(cfg: TrainConfig) -> list[str]:
    """How errors name each tier: the config key it comes from."""
    first = "train.checkpoint_dir" if cfg.checkpoint_dir else "train.out_dir"
    return [first] + [
        f"train.checkpoint_replicas[{i}]" for i in range(len(cfg.checkpoint_replicas))
    ]


def _fail(key: str, location: Any, what: str, exc: BaseException | None = None) -> ConfigError:
    why = f": {type(exc).__name__}: {' '.join(str(exc).split())}" if exc is not None else ""
    return ConfigError(f"{key} ({location}): {what}{why}")


def claim_tiers(
    cfg: TrainConfig,
    *,
    write: bool = True,
    resumed_run: str | None = None,
    fresh: bool = False,
    tiers: Sequence[Tier] | None = None,
    run_id: str | None = None,
    created: list[Store] | None = None,
) -> str:
    """Check and mark every tier of the run; return the run's id (see the module's docstring).
    ConfigError naming the key for every refusal. ``write=False`` (a rank other than 0 in a
    preflight): every check that needs no write, nothing written. ``resumed_run``: the run id
    of a checkpoint the caller already chose to resume (it names the run, after ``train.run_id``).
    ``fresh``: the run starts over and becomes the owner of every tier (point 3). ``tiers``: the
    run's ``checkpoint_tiers``, when the caller has them already. ``run_id``: the id rank 0
    decided, for another node's first rank claiming its node's own first tier (``tiers`` is
    that one tier; nothing is recorded in out_dir's history from there). ``created``: the
    stores whose marker this call wrote afresh are appended to it (a refused start removes
    them again, ``remove_created``)."""
    tiers = tiers if tiers is not None else checkpoint_tiers(cfg)
    keys = tier_keys(cfg)[: len(tiers)]
    decided = run_id
    if decided is None:
        check_parents(cfg, tiers)
    stores: list[Store] = []
    markers: list[TierMarker | None] = []
    for i, (tier, key) in enumerate(zip(tiers, keys)):
        store = None
        try:
            store = checkpoint_store(tier.location)
            store.list(MARKER_KEY)  # a bucket that does not exist fails here, not as "no marker"
            markers.append(read_marker(store))
            stores.append(store)
        except ValueError as exc:
            raise _fail(key, tier.location, "cannot read its tier marker", exc) from None
        except Exception as exc:  # a bucket that does not exist, missing credentials, ...
            if store is None or i == 0 or lasting(exc):
                raise _fail(key, tier.location, "cannot be read", exc) from None
            log.warning("%s (%s): cannot read its tier marker now (%s: %s); replication retries "
                        "the tier", key, tier.location, type(exc).__name__, exc)  # fmt: skip
            stores.append(store)
            markers.append(_UNREADABLE)
    first = markers[0] if markers[0] is not _UNREADABLE else None
    if decided is not None:
        run_id = decided
    elif fresh:
        # A marker of this very run (its default id) over nothing committed is what an attempt
        # that died before its first commit leaves: it does not make the place used.
        same = default_run_id(cfg)
        used = any(m is not None and m.run_id != same for m in markers) or any(
            _committed(s, k, t.location) for s, k, t, m in zip(stores, keys, tiers, markers)
            if m is not _UNREADABLE
        )  # fmt: skip
        run_id = cfg.run_id or (new_run_id(cfg) if used else default_run_id(cfg))
    else:
        run_id = (cfg.run_id or resumed_run or (first.run_id if first is not None else None)
                  or default_run_id(cfg))  # fmt: skip
    held: list[tuple[int, TierMarker]] = []
    if write and first is None and markers[0] is not _UNREADABLE and not fresh:
        _say_if_gone(stores, markers, keys, tiers, run_id)
    for i, (store, marker, key) in enumerate(zip(stores, markers, keys)):
        location = tiers[i].location
        if marker is _UNREADABLE:
            continue
        if fresh and write:
            moved = _supersede(store, key, location, marker, run_id)
            if moved is not None and decided is None:  # the run's story says it (koochak-report)
                from koochak.loop.run_history import record_supersede

                record_supersede(cfg.out_dir, i, *moved)
            if marker is not None and marker.run_id != run_id:
                if moved is None:
                    log.warning("%s (%s): taking over the tier marker of run %r, which committed "
                                "nothing there, for run %r", key, location, marker.run_id,
                                run_id)  # fmt: skip
                marker = _take_marker(store, key, location, marker, run_id)
        elif marker is not None and marker.run_id != run_id:
            committed = _committed(store, key, location)
            if committed:
                raise _fail(key, location, f"holds {len(committed)} checkpoint(s) of run "
                            f"{marker.run_id!r}, not of this run {run_id!r}; refusing to write "
                            "or prune it (use another location, --resume none to start over "
                            f"there, or set train.run_id={marker.run_id} if this is that run)")  # fmt: skip
            if not write:
                continue
            log.warning("%s (%s): taking over the tier marker of run %r, which committed "
                        "nothing there, for run %r", key, location, marker.run_id, run_id)  # fmt: skip
            marker = _take_marker(store, key, location, marker, run_id)
        elif marker is None:
            committed = _committed(store, key, location)
            if committed:
                found = _run_of(store, committed[0])
                if found is not None and found != run_id:
                    raise _fail(key, location, f"has no tier marker but holds "
                                f"{len(committed)} checkpoint(s) of run {found!r}, not of this "
                                f"run {run_id!r}; refusing to adopt them (use another location, "
                                f"--resume none to start over there, or set train.run_id={found} "
                                "if this is that run)")  # fmt: skip
        if marker is None:
            if not write:
                continue
            try:
                written = new_marker(run_id)
                marker = write_marker(store, written)
                if marker == written and created is not None:
                    created.append(store)
            except Exception as exc:
                if i == 0 or lasting(exc):
                    raise _fail(key, location, "cannot be written", exc) from None
                # A replica down for now (EIO, a host down): replication retries it meanwhile.
                log.warning("%s (%s): cannot write its tier marker now (%s: %s); replication "
                            "retries the tier", key, location, type(exc).__name__, exc)  # fmt: skip
                continue
        held.append((i, marker))
    for n, (i, marker) in enumerate(held):
        for j, other in held[:n]:
            if other.tier_id == marker.tier_id:
                raise _fail(keys[i], tiers[i].location, f"is the same storage as {keys[j]} "
                            f"({tiers[j].location}): both show tier marker {marker.tier_id}; "
                            "a replica must be another storage")  # fmt: skip
        if marker.run_id != run_id:
            raise _fail(keys[i], tiers[i].location, f"belongs to run {marker.run_id!r}, not to "
                        f"this run {run_id!r} (another run marked it just now)")  # fmt: skip
    return run_id


def _committed(store: Store, key: str, location: Any) -> list[str]:
    try:
        return retention.committed_names(store)
    except Exception as exc:
        raise _fail(key, location, "cannot be listed", exc) from None


def _take_marker(
    store: Store, key: str, location: Any, found: TierMarker, run_id: str
) -> TierMarker:
    """Replace ``found`` by this run's marker (compare-and-swap); ConfigError when raced."""
    marker = new_marker(run_id)
    try:
        replace_marker(store, found, marker)
    except MarkerRaced:
        raise _fail(key, location, f"its tier marker changed while run {run_id!r} claimed it "
                    "(another run marked it just now)") from None  # fmt: skip
    except Exception as exc:
        raise _fail(key, location, "cannot be written", exc) from None
    return marker


def _run_of(store: Store, name: str) -> str | None:
    """The run id checkpoint ``name`` of ``store`` records (None: a checkpoint from before run
    ids, or one that cannot be read: then it is not evidence of another run)."""
    from koochak.loop.checkpoint.resume import read_published

    try:
        found = read_published(store, name).checkpoint.get("run_id")
    except Exception as exc:
        log.warning("%s/%s: cannot read which run it belongs to (%s: %s)", store.location, name,
                    type(exc).__name__, exc)  # fmt: skip
        return None
    return found if isinstance(found, str) and found else None


SUPERSEDED_PREFIX = "superseded"


def _supersede(store: Store, key: str, location: Any, marker: TierMarker | None,
               run_id: str) -> tuple[str, str, list[int]] | None:  # fmt: skip
    """A run starting over owns the tier: move its committed checkpoints (an older run's, or
    an earlier start's) to ``superseded/<run>-<time>/`` in the same location, each verified
    there before it is removed here, and say so in one line. Nothing selects or prunes them
    there; they are the user's to keep or delete. Returns what moved, for the run history:
    ``(the older run, where its checkpoints went, their steps)``; None when nothing did."""
    from koochak.loop.checkpoint.commit import unpublish_checkpoint
    from koochak.loop.checkpoint.format import LATEST_NAME, step_of_name
    from koochak.loop.checkpoint.tiers import replicate_checkpoint

    names = _committed(store, key, location)
    if not names:
        return None
    owner = marker.run_id if marker is not None else (_run_of(store, names[0]) or "unknown-run")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = f"{store.location.rstrip('/')}/{SUPERSEDED_PREFIX}/{owner}-{stamp}"
    try:
        target = checkpoint_store(aside)
        for name in reversed(names):  # oldest first: an interrupted move leaves the newest here
            replicate_checkpoint(store, target, name)
            unpublish_checkpoint(store, name)
    except Exception as exc:
        raise _fail(key, location, f"cannot move run {owner!r}'s checkpoints aside to {aside} "
                    f"for the new run {run_id!r}", exc) from None  # fmt: skip
    local = store.local_path(LATEST_NAME)
    if local is not None and os.path.islink(local):
        os.unlink(local)  # it pointed at one of them
    log.warning("%s (%s): run %r starts over here and owns it now; the %d checkpoint(s) of run "
                "%r found there (%s) were moved to %s, where no run selects or prunes them",
                key, location, run_id, len(names), owner, ", ".join(names), aside)  # fmt: skip
    return owner, aside, [step for step in map(step_of_name, names) if step is not None]


def _say_if_gone(stores: list[Store], markers: list[Any], keys: list[str], tiers: Any,
                 run_id: str) -> None:  # fmt: skip
    """One line when the first tier holds no marker while a replica holds this run's
    checkpoints: the first tier is gone (node-local storage on another node, wiped)."""
    for i in range(1, len(stores)):
        marker = markers[i]
        if marker is None or marker is _UNREADABLE or marker.run_id != run_id:
            continue
        try:
            held = retention.committed_names(stores[i])
        except Exception:
            continue
        if held:
            log.warning("checkpoint tier 0 (%s) holds nothing of run %r although %s does: it is "
                        "gone (node-local storage on another node?); resuming from the durable "
                        "tiers", tiers[0].location, run_id, keys[i])  # fmt: skip
            return


def lasting(exc: BaseException) -> bool:
    """An error a retry will not cure: no such bucket or directory, no access, no credentials
    (a store's transient errors are OSErrors: EIO, a host down, a timeout)."""
    if isinstance(exc, (FileNotFoundError, PermissionError, NotADirectoryError, ValueError)):
        return True
    text = str(exc).lower()
    return not isinstance(exc, OSError) or "credential" in text or "does not exist" in text


def check_reachable(cfg: TrainConfig) -> None:
    """Every tier can be listed (a bucket that does not exist, missing credentials: refused,
    ConfigError naming the key); what ``claim_tiers`` checks first, for a run without replicas."""
    for tier, key in zip(checkpoint_tiers(cfg), tier_keys(cfg)):
        try:
            checkpoint_store(tier.location).list(MARKER_KEY)
        except Exception as exc:
            if lasting(exc):
                raise _fail(key, tier.location, "cannot be read", exc) from None


def _local_path(location: Any) -> str | None:
    if not isinstance(location, (str, os.PathLike)):
        return None
    text = os.fspath(location)
    if "://" in text and not text.startswith("file://"):
        return None
    return os.path.realpath(os.path.expanduser(text.removeprefix("file://")))


def check_parents(cfg: TrainConfig, tiers: Sequence[Tier] | None = None) -> None:
    """Every directory replica without ``create: true`` exists, or its parent does (or is one
    the run creates anyway); else ConfigError naming its key (a typo)."""
    tiers = tiers if tiers is not None else checkpoint_tiers(cfg)
    replicas = check_replicas(cfg.checkpoint_replicas)
    for i, key in enumerate(tier_keys(cfg)[1:], start=1):
        if not replicas[i - 1].create:
            _check_parent(key, tiers[i].location, [tiers[0].location, cfg.out_dir])


def _check_parent(key: str, location: Any, run_dirs: list[Any]) -> None:
    """A directory replica must exist, or its parent, or its parent must be one this run creates
    anyway (it holds ``run_dirs``: the first tier, out_dir); else it is a typo, unless
    ``create: true``."""
    path = _local_path(location)
    if path is None:
        return
    text = os.fspath(location)
    parent = os.path.dirname(path.rstrip("/"))
    ours = [p for p in map(_local_path, run_dirs) if p is not None]
    if any(os.path.commonpath([parent, p]) == parent for p in ours):
        return
    if not os.path.isdir(path) and not os.path.isdir(parent):
        raise ConfigError(
            f"{key} ({text}): neither it nor its parent directory {parent} exists (a typo?); "
            "create the parent, or give the entry create: true"
        )


def run_identity(
    cfg: TrainConfig,
    rank: int,
    resumed: Mapping[str, Any] | None = None,
    *,
    fresh: bool = False,
    tiers: Sequence[Tier] | None = None,
) -> str:
    """The run's id on every rank: rank 0 first claims the tiers (``claim_tiers``; call it
    holding the run's leases, ``run_lease.claim_run``) and every rank raises the same
    ConfigError when it refuses one. ``resumed``: a checkpoint the caller already chose to
    resume; its ``run_id`` names the run unless ``train.run_id`` does. ``fresh``: the run
    starts over and owns its tiers. With a node-local first tier (``{node}``) the first rank of
    every other node then claims its node's first tier for that id (``claim_node_tier``)."""
    resumed_run = resumed.get("run_id") if resumed is not None else None
    resumed_run = resumed_run if isinstance(resumed_run, str) and resumed_run else None
    from koochak.loop import ddp

    outcome: tuple[str, str] | None = None
    created: list[Store] = []
    if rank == 0:
        try:
            run_id = claim_tiers(cfg, resumed_run=resumed_run, fresh=fresh, tiers=tiers,
                                 created=created)  # fmt: skip
            outcome = ("ok", run_id)
        except ConfigError as exc:
            outcome = ("refused", str(exc))
        except Exception as exc:  # tell the other ranks before raising, or they wait forever
            outcome = ("error", f"{type(exc).__name__}: {exc}")
    outcome = ddp.broadcast_object(outcome, src=0)
    assert outcome is not None
    kind, value = outcome
    if kind == "ok":
        try:
            claim_node_tier(cfg, rank, value, fresh=fresh, tiers=tiers)
        except BaseException:
            remove_created(created, value)  # a refused start leaves no marker of this run
            raise
        return value
    if kind == "refused":
        raise ConfigError(value)
    raise RuntimeError(f"rank 0 could not check the checkpoint tiers: {value}")


def claim_node_tier(
    cfg: TrainConfig, rank: int, run_id: str, *, fresh: bool = False,
    tiers: Sequence[Tier] | None = None,
) -> None:  # fmt: skip
    """With a node-local first tier (``{node}`` in ``train.checkpoint_dir``), the first rank of
    every node but rank 0's (LOCAL_RANK 0) claims its node's first tier for ``run_id``, the id
    rank 0 decided, by the rules ``claim_tiers`` applies to rank 0's tiers. One all-gather:
    every rank raises the first refusal (ConfigError naming the tier), a rank whose claim failed
    otherwise raises its own error. Nothing (no collective) without a ``{node}`` first tier or
    with one process."""
    from koochak.loop import dist
    from koochak.loop.checkpoint.tiers import is_node_local
    from koochak.loop.ddp import first_of_any_rank

    if dist.get_world_size() <= 1 or not is_node_local(cfg.checkpoint_dir):
        return
    refusal, failure = None, None
    if rank != 0 and dist.get_local_rank() == 0:
        tiers = tiers if tiers is not None else checkpoint_tiers(cfg)
        try:
            claim_tiers(cfg, run_id=run_id, fresh=fresh, tiers=tiers[:1])
        except ConfigError as exc:
            refusal = str(exc)
        except Exception as exc:  # the others must not wait for a rank that leaves
            failure = exc
            refusal = f"train.checkpoint_dir: rank {rank} could not claim its node's tier: {exc}"
    refusal = first_of_any_rank(refusal)
    if failure is not None:
        raise failure
    if refusal is not None:
        raise ConfigError(refusal)


def remove_created(created: Sequence[Store], run_id: str) -> None:
    """Remove the markers of run ``run_id`` a refused start wrote afresh (best effort: a marker
    of a run that committed nothing is taken over by the next run anyway)."""
    for store in created:
        try:
            marker = read_marker(store)
            if marker is not None and marker.run_id == run_id:
                store.delete(MARKER_KEY)
        except Exception as exc:
            log.warning("%s: cannot remove this refused run's tier marker (%s: %s)",
                        store.location, type(exc).__name__, exc)  # fmt: skip
