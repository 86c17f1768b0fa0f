"""Tiers know whose they are: a small marker object in every tier, naming the run that owns it.

``claim_tiers`` runs once at the start of a run (rank 0), before any checkpoint is selected or
written:

1. the run's id: ``train.run_id``, else that of the checkpoint the caller resumes (a
   ``checkpoint_dict`` passed to ``training_loop``), else the first tier's marker's (a retry),
   else one derived from ``train.out_dir``'s absolute path (``default_run_id``: a retry whose
   node-local first tier is gone is still the same run);
2. every tier's marker ``koochak-tier.json`` (docs/formats.md, "Tier marker") is read, and
   written create-only where there is none (first use). A tier whose marker names another run
   and that holds committed checkpoints is refused (ConfigError naming the key and both runs):
   it is never written or pruned. A marker whose run committed nothing there (a first attempt
   that died before its first commit) is taken over with one line;
3. each marker carries a random ``tier_id``: two tiers showing the same one are one storage
   under two names (two mounts of one bucket, which paths cannot show) and are refused;
4. a tier that cannot be written (a bucket that does not exist, missing credentials) is refused
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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from koochak.loop.checkpoint import retention
from koochak.loop.checkpoint.publication import checkpoint_store
from koochak.loop.checkpoint.tiers import checkpoint_tiers
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


def replace_marker(store: Store, marker: TierMarker) -> None:
    try:
        store.delete(MARKER_KEY)
    except FileNotFoundError:
        pass
    write_marker(store, marker)


def default_run_id(cfg: TrainConfig) -> str:
    """The run id when neither ``train.run_id`` nor the first tier's marker gives one: derived
    from ``train.out_dir``'s absolute path, so every attempt of one run agrees on it."""
    where = os.path.abspath(os.path.expanduser(cfg.out_dir))
    digest = hashlib.sha256(where.encode()).hexdigest()[:12]
    return f"{os.path.basename(where.rstrip('/')) or 'run'}-{digest}"


def tier_keys(cfg: TrainConfig) -> list[str]:
    """How errors name each tier: the config key it comes from."""
    first = "train.checkpoint_dir" if cfg.checkpoint_dir else "train.out_dir"
    return [first] + [f"train.checkpoint_replicas[{i}]" for i in range(len(cfg.checkpoint_replicas))]


def _fail(key: str, location: Any, what: str, exc: BaseException | None = None) -> ConfigError:
    why = f": {type(exc).__name__}: {' '.join(str(exc).split())}" if exc is not None else ""
    return ConfigError(f"{key} ({location}): {what}{why}")


def claim_tiers(cfg: TrainConfig, *, write: bool = True, resumed_run: str | None = None) -> str:
    """Check and mark every tier of the run; return the run's id (see the module's docstring).
    ConfigError naming the key for every refusal. ``write=False`` (a rank other than 0 in a
    preflight): every check that needs no write, nothing written. ``resumed_run``: the run id
    of a checkpoint the caller already chose to resume (it names the run, after ``train.run_id``)."""
    tiers = checkpoint_tiers(cfg)
    keys = tier_keys(cfg)
    replicas = check_replicas(cfg.checkpoint_replicas)
    stores: list[Store] = []
    markers: list[TierMarker | None] = []
    for i, (tier, key) in enumerate(zip(tiers, keys)):
        if i > 0 and not replicas[i - 1].create:
            _check_parent(key, tier.location, [tiers[0].location, cfg.out_dir])
        store = None
        try:
            store = checkpoint_store(tier.location)
            store.list(MARKER_KEY)  # a bucket that does not exist fails here, not as "no marker"
            markers.append(read_marker(store))
            stores.append(store)
        except ValueError as exc:
            raise _fail(key, tier.location, "cannot read its tier marker", exc) from None
        except Exception as exc:  # a bucket that does not exist, missing credentials, ...
            if store is None or i == 0 or _lasting(exc):
                raise _fail(key, tier.location, "cannot be read", exc) from None
            log.warning("%s (%s): cannot read its tier marker now (%s: %s); replication retries "
                        "the tier", key, tier.location, type(exc).__name__, exc)  # fmt: skip
            stores.append(store)
            markers.append(_UNREADABLE)
    first = markers[0] if markers[0] is not _UNREADABLE else None
    run_id = (cfg.run_id or resumed_run or (first.run_id if first is not None else None)
              or default_run_id(cfg))  # fmt: skip
    held: list[tuple[int, TierMarker]] = []
    if write and first is None and markers[0] is not _UNREADABLE:
        _say_if_gone(stores, markers, keys, tiers, run_id)
    for i, (store, marker, key) in enumerate(zip(stores, markers, keys)):
        location = tiers[i].location
        if marker is _UNREADABLE:
            continue
        if marker is not None and marker.run_id != run_id:
            try:
                committed = retention.committed_names(store)
            except Exception as exc:
                raise _fail(key, location, "cannot be listed", exc) from None
            if committed:
                raise _fail(key, location, f"holds {len(committed)} checkpoint(s) of run "
                            f"{marker.run_id!r}, not of this run {run_id!r}; refusing to write "
                            "or prune it (use another location, or set train.run_id="
                            f"{marker.run_id} if this is that run)")  # fmt: skip
            if not write:
                continue
            log.warning("%s (%s): taking over the tier marker of run %r, which committed "
                        "nothing there, for run %r", key, location, marker.run_id, run_id)  # fmt: skip
            marker = None
            try:
                replace_marker(store, new_marker(run_id))
            except Exception as exc:
                raise _fail(key, location, "cannot be written", exc) from None
        if marker is None:
            if not write:
                continue
            try:
                marker = write_marker(store, new_marker(run_id))
            except Exception as exc:
                if i == 0 or _lasting(exc):
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


def _lasting(exc: BaseException) -> bool:
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
            if _lasting(exc):
                raise _fail(key, tier.location, "cannot be read", exc) from None


def _local_path(location: Any) -> str | None:
    if not isinstance(location, (str, os.PathLike)):
        return None
    text = os.fspath(location)
    if "://" in text and not text.startswith("file://"):
        return None
    return os.path.realpath(os.path.expanduser(text.removeprefix("file://")))


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


def run_identity(cfg: TrainConfig, rank: int, resumed: Mapping[str, Any] | None = None) -> str:
    """The run's id on every rank; with replicas, rank 0 first claims the tiers (``claim_tiers``)
    and every rank raises the same ConfigError when it refuses one. ``resumed``: a checkpoint
    the caller already chose to resume; its ``run_id`` names the run unless ``train.run_id``
    does."""
    resumed_run = resumed.get("run_id") if resumed is not None else None
    resumed_run = resumed_run if isinstance(resumed_run, str) and resumed_run else None
    if len(checkpoint_tiers(cfg)) < 2:
        return cfg.run_id or resumed_run or default_run_id(cfg)
    from koochak.loop import ddp

    outcome: tuple[str, str] | None = None
    if rank == 0:
        try:
            outcome = ("ok", claim_tiers(cfg, resumed_run=resumed_run))
        except ConfigError as exc:
            outcome = ("refused", str(exc))
        except Exception as exc:  # tell the other ranks before raising, or they wait forever
            outcome = ("error", f"{type(exc).__name__}: {exc}")
    outcome = ddp.broadcast_object(outcome, src=0)
    assert outcome is not None
    kind, value = outcome
    if kind == "ok":
        return value
    if kind == "refused":
        raise ConfigError(value)
    raise RuntimeError(f"rank 0 could not check the checkpoint tiers: {value}")
