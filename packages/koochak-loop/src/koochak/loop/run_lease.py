"""One live run per checkpoint location: the run's lease (docs/checkpoints.md, "the lease").

`claim_run` is how a run becomes the owner of its locations, once, before anything is written
there: the lease on every place it writes (each tier and ``train.out_dir``), and only then the
tier markers that name the run (``tier_marker``). `hold_location` takes `koochak.storage.lease`
on rank 0 and tells every rank the outcome with
one broadcast at start, so under DDP/FSDP every rank leaves with the refusal (exit 2, the holder
named) instead of waiting in its first collective for rank 0, which left. koochak-train calls it
before building the model (``early=True``); `training_loop` then finds that lease here instead of
taking it again. Before each checkpoint publish the checkpoint component
(``checkpoint.run_checkpoints``) stops the run with `LeaseLost` (exit 2) on every rank once one
of the run's leases is lost: taken over by another run, or not renewed for its
``ttl_seconds``, after which another run may take it over.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from koochak.loop import ddp, dist
from koochak.loop.config import ConfigError, TrainConfig

__all__ = ["LeaseLost", "Leases", "claim_run", "hold_location", "release_unclaimed"]

log = logging.getLogger("koochak.loop.run_lease")

# first tier -> (the leases, the run id) koochak-train took before building the run (leases None
# on ranks > 0)
_TAKEN: dict[str, tuple[Any, str | None]] = {}


class LeaseLost(ConfigError):
    """This run's lease on its checkpoint location is lost: it stopped before publishing."""


def _key(cfg: TrainConfig) -> str:
    return "train.checkpoint_dir" if cfg.checkpoint_dir else "train.out_dir"


def lease_locations(cfg: TrainConfig, tiers: Sequence[Any] | None = None) -> list[tuple[str, Any]]:
    """``(config key, location)`` of every place the run writes, each once: the first tier
    (this node's, for a ``{node}`` one), every replica, and ``train.out_dir`` (its history).
    ``tiers``: the run's ``checkpoint_tiers``, when the caller has them already."""
    from koochak.loop.checkpoint.tier_marker import tier_keys
    from koochak.loop.checkpoint.tiers import checkpoint_tiers

    tiers = tiers if tiers is not None else checkpoint_tiers(cfg)
    found = list(zip(tier_keys(cfg), (tier.location for tier in tiers)))
    found.append(("train.out_dir", cfg.out_dir))
    seen: set[str] = set()
    unique = []
    for key, location in found:
        name = _same_place(location)
        if name not in seen:
            seen.add(name)
            unique.append((key, location))
    return unique


def _same_place(location: Any) -> str:
    import os

    if isinstance(location, (str, os.PathLike)):
        text = os.fspath(location)
        if "://" not in text or text.startswith("file://"):
            return os.path.realpath(os.path.expanduser(text.removeprefix("file://")))
        return text.rstrip("/")
    return f"store:{id(location)}"


class Leases:
    """The run's leases, one per place it writes (``lease_locations``), held and released as one:
    lost as soon as any one of them is lost."""

    def __init__(self, held: list[Any]) -> None:
        self.held = held

    def keep_renewed(self) -> Leases:
        for lease in self.held:
            lease.keep_renewed()
        return self

    def release(self) -> None:
        for lease in reversed(self.held):
            lease.release()


def hold_location(location: Any, cfg: TrainConfig, *, early: bool = False) -> Any:
    """The run's leases (rank 0; None on other ranks) on ``location`` and every other place the
    run writes (``lease_locations``), renewed while it lives.

    Another live run in any of them is a ConfigError naming it and that place, raised on every
    rank of the process group (one broadcast), and whatever was taken meanwhile is released: a
    refused start leaves every file as it found it. ``early``: koochak-train's call before the
    model is built; the loop's later call returns that lease without taking it again.
    """
    if str(location) in _TAKEN:
        return _TAKEN.pop(str(location))[0]
    lease = _take_leases(location, cfg, None)
    if early:
        _TAKEN[str(location)] = (lease, None)
    return lease


def _take_leases(location: Any, cfg: TrainConfig, tiers: Sequence[Any] | None) -> Leases | None:
    """Rank 0 takes the lease on every place the run writes; with a node-local first tier
    (``{node}``) the first rank of every other node (LOCAL_RANK 0) takes its node's. One
    all-gather tells every rank the first refusal; then every rank releases what it took."""
    from koochak.loop.checkpoint.publication import checkpoint_store
    from koochak.loop.checkpoint.tier_marker import check_parents, lasting
    from koochak.loop.checkpoint.tiers import is_node_local, on_this_node
    from koochak.storage import lease as leases

    rank = dist.get_rank()
    places: list[tuple[str, Any]] = []
    if rank == 0:
        check_parents(cfg, tiers)  # a typo'd replica is refused before taking a lease creates it
        places = list(lease_locations(cfg, tiers))
        if not any(_same_place(loc) == _same_place(location) for _, loc in places):
            places.insert(0, (_key(cfg), location))
    elif is_node_local(cfg.checkpoint_dir) and dist.get_local_rank() == 0:
        places = [("train.checkpoint_dir", on_this_node(cfg.checkpoint_dir))]  # this node's
    held: list[tuple[str, Any, Any]] = []
    failure, refusal = None, None
    for key, place in places:
        try:
            taken = leases.acquire_lease(
                checkpoint_store(place),
                ttl_seconds=leases.TTL_SECONDS,
                renew_seconds=leases.RENEW_SECONDS,
                purpose=f"koochak run in {cfg.out_dir}",
            )
            held.append((key, place, taken))
        except leases.LeaseHeld as exc:
            refusal = f"{key}: {exc}"
            token = exc.holder.token if exc.holder is not None else None
            for other, other_place, taken in held:
                if taken.record.token != token:
                    continue
                # Our own lease, seen under another name: out_dir may well be the first tier
                # (held already); a replica must be another storage.
                refusal = None if key == "train.out_dir" else (
                    f"{key} ({place}): is the same storage as {other} ({other_place}): it "
                    "shows this run's lease; a replica must be another storage")  # fmt: skip
        except Exception as exc:  # the others must not wait for a rank that leaves
            if key.startswith("train.checkpoint_replicas") and not lasting(exc):
                # A replica down for now (EIO, a host down): replication retries it, and its
                # marker claim refuses it if another run owns it meanwhile.
                log.warning("%s (%s): cannot take the run's lease there now (%s: %s)",
                            key, place, type(exc).__name__, exc)  # fmt: skip
                continue
            failure, refusal = exc, f"{key}: rank {rank} could not take the run's lease: {exc}"
        if refusal is not None:
            break
    if dist.get_world_size() > 1:
        refusal = ddp.first_of_any_rank(refusal)  # the one collective: every rank learns it now
    if refusal is not None:
        for _, _, taken in reversed(held):  # a refused start changes nothing anywhere
            taken.release()
        if failure is not None:
            raise failure
        raise ConfigError(refusal)
    return Leases([taken for _, _, taken in held]).keep_renewed() if held else None


def claim_run(
    cfg: TrainConfig,
    rank: int,
    resumed: Any = None,
    *,
    fresh: bool = False,
    early: bool = False,
    tiers: Sequence[Any] | None = None,
) -> tuple[Leases | None, str]:
    """One owner per location, decided once before anything is written: the run's leases on
    every place it writes (``hold_location``), and only then its tier markers
    (``tier_marker.run_identity``, which also names the run). Returns ``(leases, run_id)``.

    ``fresh``: the run starts over (``--resume none``) and becomes the owner of its tiers (see
    ``tier_marker.claim_tiers``). A refusal releases the leases again and raises ConfigError on
    every rank. ``early``: koochak-train's call before building the run; the loop's later call
    gets the same answer without claiming again. ``tiers``: the run's ``checkpoint_tiers``
    (``CheckpointConfig.tiers``), when the caller has them already.
    """
    from koochak.loop.checkpoint.tier_marker import run_identity
    from koochak.loop.checkpoint.tiers import checkpoint_tiers

    tiers = tiers if tiers is not None else checkpoint_tiers(cfg)
    first = str(tiers[0].location)
    if first in _TAKEN and _TAKEN[first][1] is not None:
        lease, run_id = _TAKEN.pop(first)
        return lease, str(run_id)
    lease = _take_leases(tiers[0].location, cfg, tiers)
    try:
        run_id = run_identity(cfg, rank, resumed, fresh=fresh, tiers=tiers)
    except BaseException:
        if lease is not None:
            lease.release()
        raise
    if early:
        _TAKEN[first] = (lease, run_id)
    return lease, run_id


def release_unclaimed() -> None:
    """Release a lease koochak-train took for a run that never reached the loop."""
    while _TAKEN:
        _, (lease, _run) = _TAKEN.popitem()
        if lease is not None:
            lease.release()
