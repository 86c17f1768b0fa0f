"""Checkpoint tiers: one checkpoint location backed by a list of stores.

The first tier is ``train.checkpoint_dir`` (else ``out_dir``): every save commits there first,
where it stalls training least (node-local NVMe, ``/dev/shm``, a burst buffer). Each entry of
``train.checkpoint_replicas`` is a durable tier behind it (a parallel filesystem, object
storage). A checkpoint committed in one tier is copied to another with ``copy_objects`` (the only
way bytes move between tiers) and committed there by its own ready manifest, a byte-for-byte copy
of the source's, written last. So every tier is an ordinary checkpoint location: resume, ``load``
and ``best`` read any of them alone.

The first tier may be node-local: a ``{node}`` placeholder in ``train.checkpoint_dir`` is
replaced by this node's index (``node_index``: ``KOOCHAK_NODE_INDEX``, else torchrun's
``GROUP_RANK``, else Slurm's ``SLURM_NODEID``, else 0), so each node writes into a directory of
its own. Under FSDP every rank replicates its own parts itself (whether the first tier is
node-local or shared) and leaves a receipt naming their digests (``part_receipt``); the
coordinator commits the replica's index and ready manifest once every writer's receipt matches
the index, without reading the data back.

This module holds the tier list and the copy of one checkpoint between two tiers;
``replication`` runs the copies in the background, ``resume`` selects across tiers.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from koochak.loop.checkpoint.commit import unpublish_checkpoint
from koochak.loop.checkpoint.layouts import is_single_object, layout_of
from koochak.loop.checkpoint.part_receipt import read_receipt
from koochak.loop.config import TrainConfig, as_train_config, check_replicas
from koochak.storage import artifact
from koochak.storage.store import Store
from koochak.storage.transfer import CopyItem, copy_objects

Location = str | os.PathLike[str] | Store

NODE_PLACEHOLDER = "{node}"
# Where a node's index comes from, first set first: an explicit one (a launcher of one's own,
# tests), torchrun's node rank, Slurm's node id of the job step.
NODE_INDEX_VARIABLES = ("KOOCHAK_NODE_INDEX", "GROUP_RANK", "SLURM_NODEID")


def node_index(environ: Mapping[str, str] | None = None) -> int:
    """This node's index among the job's nodes (0 when no launcher says)."""
    env = os.environ if environ is None else environ
    for variable in NODE_INDEX_VARIABLES:
        value = env.get(variable, "").strip()
        if value:
            try:
                return int(value)
            except ValueError:
                raise ValueError(
                    f"{variable}={value!r}: expected a node index (an integer)"
                ) from None
    return 0


def is_node_local(location: Location | None) -> bool:
    """Whether ``location`` names a directory per node (holds ``{node}``)."""
    return isinstance(location, (str, os.PathLike)) and NODE_PLACEHOLDER in os.fspath(location)


def on_this_node(location: Location, node: int | None = None) -> Location:
    """``location`` with ``{node}`` replaced by this node's index (a Store as it is)."""
    if not is_node_local(location):
        return location
    index = node_index() if node is None else node
    return os.fspath(location).replace(NODE_PLACEHOLDER, str(index))


@dataclass(frozen=True)
class Tier:
    """One checkpoint tier: its place in the list (0 is the first tier), where it is, and how
    many checkpoints it keeps (None: every one)."""

    index: int
    location: Location
    keep_last_k: int | None


def checkpoint_tiers(train_cfg: TrainConfig | Mapping[str, Any]) -> tuple[Tier, ...]:
    """The tiers of a run: ``checkpoint_dir`` (else ``out_dir``) first, then each replica.

    ``{node}`` in ``checkpoint_dir`` is this node's index (``on_this_node``). A replica keeps ``keep_last_k`` checkpoints when its entry says so (0 or null: every one),
    else as many as the first tier (``train.keep_last_k``).
    """
    cfg = as_train_config(train_cfg)
    keep = cfg.keep_last_k or None
    first = on_this_node(cfg.checkpoint_dir or cfg.out_dir)
    tiers = [Tier(0, first, keep)]
    for index, replica in enumerate(check_replicas(cfg.checkpoint_replicas), start=1):
        replica_keep = keep if replica.keep_last_k is None else (replica.keep_last_k or None)
        tiers.append(Tier(index, replica.location, replica_keep))
    return tuple(tiers)


def checkpoint_locations(train_cfg: TrainConfig | Mapping[str, Any]) -> list[Location]:
    """Every tier's location, first tier first: what ``resolve_auto_resume`` takes for a run
    with replicas (a single location when there are none)."""
    return [tier.location for tier in checkpoint_tiers(train_cfg)]


@dataclass(frozen=True)
class ReplicationSettings:
    """How a run replicates: the replica tiers and ``train.checkpoint_replication_*``."""

    replicas: tuple[Tier, ...]
    max_lag: int = 2
    retry_s: float = 10.0
    prune_unreplicated: bool = False
    bandwidth_mb_s: float | None = None  # per tier; None: as fast as the stores go


def replication_settings(
    train_cfg: TrainConfig | Mapping[str, Any], tiers: Sequence[Tier] | None = None
) -> ReplicationSettings | None:
    """The run's replication settings, or None without ``train.checkpoint_replicas``. ``tiers``:
    the run's ``checkpoint_tiers``, when the caller has them already."""
    cfg = as_train_config(train_cfg)
    replicas = tuple((tiers if tiers is not None else checkpoint_tiers(cfg))[1:])
    if not replicas:
        return None
    return ReplicationSettings(
        replicas,
        max_lag=cfg.checkpoint_replication_max_lag,
        retry_s=cfg.checkpoint_replication_retry_s,
        prune_unreplicated=cfg.checkpoint_prune_unreplicated,
        bandwidth_mb_s=cfg.checkpoint_replication_bandwidth_mb_s,
    )


def describe_tier(index: int, store: Store) -> str:
    """How messages name a tier: ``tier 1 (archive://runs/exp0)``."""
    return f"tier {index} ({store.location})"


@dataclass(frozen=True)
class Replicated:
    """One checkpoint committed in a target tier: its publication there, and the bytes the copy
    moved (0 when the target already held the very same commit)."""

    publication: artifact.Publication
    bytes_copied: int


def checkpoint_copy_items(
    store: Store, name: str, committed: artifact.Publication
) -> list[CopyItem]:
    """Every object of checkpoint ``name`` in ``store`` except its manifest, in commit order, as
    ``copy_objects`` items carrying the size and SHA256 its commit promises (so every copied
    byte is verified): a one-file checkpoint is its file; one in parts is its parts (and, in
    version 2, each writer's index fragment), then its index (the object the manifest
    describes).

    The index is read once and checked against the manifest before its part digests are
    trusted; ValueError when it does not match (changed or damaged since it was committed).
    """
    local, _ = _committed_objects(store, name, committed)
    return local + [CopyItem(name, committed.size, committed.sha256)]


def _committed_objects(
    store: Store, name: str, committed: artifact.Publication, remote: Collection[int] = ()
) -> tuple[list[CopyItem], dict[int, list[tuple[str, int, str]]]]:
    """``(local, expected)`` for the committed checkpoint ``name`` (nothing for one file): the
    objects of every writer not in ``remote`` (its parts, and its fragment in version 2) as copy
    items, and for each ``remote`` writer the ``(key, size, sha256)`` its receipt must name (its
    parts; in version 2 just its fragment, whose digest covers its parts: no remote writer's
    fragment is read). ValueError when the index does not match its manifest."""
    if committed.size == 0 or is_single_object(store.get(name, 0, 1)):
        return [], {}
    where = f"{store.location}/{name}"
    raw = store.get(name, 0, committed.size + 1)
    if len(raw) != committed.size or hashlib.sha256(raw).hexdigest() != committed.sha256:
        raise ValueError(f"{where}: the index does not match its ready manifest")
    local, expected = layout_of(raw).receipts(store, name, raw, where, remote)
    return [CopyItem(key, size, sha) for key, size, sha in local], expected


# How long the coordinator waits for the parts other ranks replicate themselves, and how often
# it looks.
REMOTE_PARTS_WAIT_S = 300.0
_REMOTE_POLL_S = (0.02, 1.0)
# Receipts read at once (one small object per writer: latency, not bandwidth, at many ranks).
_RECEIPT_READERS = 16


def replicate_checkpoint(
    source: Store,
    target: Store,
    name: str,
    *,
    streams: int | None = None,
    remote_writers: Collection[int] = (),
    wait_s: float = REMOTE_PARTS_WAIT_S,
    progress: Callable[[int], None] | None = None,
) -> Replicated:
    """Copy the committed checkpoint ``name`` from ``source`` to ``target`` and commit it there.

    The objects move with ``copy_objects`` (a checkpoint's parts in parallel, then its object,
    each verified against its size and SHA256 while it is written); the source's ready manifest
    is copied unchanged, last, so the checkpoint exists in ``target`` only once every byte is
    there. A target that already holds the same commit (an identical manifest) is left as it is.
    Any other ``name`` in the target (an older save of the same step, or what a killed copy
    left) is un-committed first, manifest, then object, then parts, and replaced: the re-save
    rule of a single tier.

    ``remote_writers``: the writers (ranks) that replicate their own parts (every rank but the
    coordinator under FSDP). Those parts are not copied from ``source``: each writer copies its
    own into ``target``, verified as they are written, and leaves a receipt naming their sizes
    and digests; this waits (up to ``wait_s``) until each writer's receipt names exactly the
    parts the index lists for it, before the index and the manifest are copied (TimeoutError
    naming the first writer whose receipt does not, otherwise). Their parts are never read, nor
    deleted, here.

    ``progress(n)``: ``copy_objects``'s callback, for each chunk handed to ``target`` (a
    ``BandwidthBudget.take`` paces the copy by sleeping in it).

    Raises InvalidArtifact when ``source`` has no valid commit of ``name``; ValueError when a
    source object does not match its commit (it changed or was damaged since); any store error
    as it comes. Whatever fails, ``target`` is left without a manifest for ``name``, so nothing
    half-copied is ever resume evidence.
    """
    committed, manifest = artifact.read_manifest(source, name)
    try:
        _, existing = artifact.read_manifest(target, name)
    except artifact.InvalidArtifact:
        existing = None
    if existing != manifest:
        local, remote = _committed_objects(source, name, committed, remote_writers)
        if remote:
            artifact.unpublish(target, name)  # un-commit; other nodes' parts stay
            for item in local:
                _delete_quietly(target, item.key)
        else:
            unpublish_checkpoint(target, name)
        last = CopyItem(name, committed.size, committed.sha256)
        moved = 0
        # Commit order, as in a save: the parts (in parallel), the object, then the manifest,
        # the same document, so one artifact id and digest name the checkpoint in every tier.
        digest = hashlib.sha256(manifest).hexdigest()
        commit = CopyItem(committed.manifest_key, len(manifest), digest)
        for batch in ([local] if local else []) + [[last], [commit]]:
            if batch[0] is last and remote:
                wait_for_parts(target, name, remote, wait_s)
            report = copy_objects(
                source, target, batch, streams=streams, progress=progress, show_progress=False
            )
            moved += report.bytes_copied
    else:
        moved = 0
    publication = artifact.Publication(
        artifact_id=committed.artifact_id,
        key=name,
        size=committed.size,
        sha256=committed.sha256,
        manifest_key=committed.manifest_key,
        path=target.local_path(name),
    )
    return Replicated(publication, moved)


def wait_for_parts(
    store: Store, name: str, expected: Mapping[int, Sequence[tuple[str, int, str]]], wait_s: float
) -> None:
    """Wait until, for each writer of ``expected``, its receipt in ``store`` names each of its
    ``(key, size, sha256)`` (its parts, or its index fragment): one small read per writer, none
    of the data. TimeoutError naming the first writer whose receipt does not, after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    pending = sorted(expected)
    delay = _REMOTE_POLL_S[0]
    while True:
        with ThreadPoolExecutor(
            max_workers=_RECEIPT_READERS, thread_name_prefix="koochak-receipt"
        ) as pool:
            problems = list(
                pool.map(lambda w: _receipt_problem(store, name, w, expected[w]), pending)
            )
        pending = [w for w, problem in zip(pending, problems) if problem]
        if not pending:
            return
        if time.monotonic() >= deadline:
            writer = pending[0]
            raise TimeoutError(
                f"{store.location}: {len(pending)} writer(s) have not replicated their parts of "
                f"{name} after {wait_s:.0f} s: writer {writer} "
                f"({_receipt_problem(store, name, writer, expected[writer])})"
            )
        time.sleep(delay)
        delay = min(delay * 2, _REMOTE_POLL_S[1])


def _receipt_problem(
    store: Store, name: str, writer: int, parts: Sequence[tuple[str, int, str]]
) -> str:
    """Why ``writer``'s receipt does not (yet) vouch for ``parts``; "" when it does."""
    try:
        found = read_receipt(store, name, writer)
    except ValueError as exc:
        return str(exc)
    if found is None:
        return "no receipt yet"
    if not set(parts) <= set(found):
        return "its receipt names other parts or digests (an older save, or one in progress)"
    return ""


def _delete_quietly(store: Store, key: str) -> None:
    try:
        store.delete(key)
    except FileNotFoundError:
        pass
