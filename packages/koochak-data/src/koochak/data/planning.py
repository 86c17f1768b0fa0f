"""Dealing whole shards to data-loading workers.

Every process (each DDP rank, each DataLoader worker inside it) computes the same plan from the
same index, epoch and seed, and then reads only its own part. Nothing is exchanged between
processes and nothing is read before the plan exists, so a plan that cannot work (fewer shards
than workers) fails on every worker alike instead of leaving one rank waiting for another.
"""

from __future__ import annotations

import bisect
import hashlib
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from koochak.data._shard_records import ShardEntry, ShardIndex

__all__ = ["assign_shards", "plan_shards", "worker_coordinates"]


def _entries(index: ShardIndex | Sequence[ShardEntry]) -> tuple[ShardEntry, ...]:
    entries = tuple(getattr(index, "shards", index))
    for entry in entries:
        if not isinstance(getattr(entry, "key", None), str) or not isinstance(
            getattr(entry, "records", None), int
        ):
            raise TypeError(f"expected ShardEntry items (key, records), got {type(entry).__name__}")
        if entry.records < 0:
            raise ValueError(f"shard {entry.key!r} has a negative record count ({entry.records})")
    return entries


def _check_int(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _order_key(seed: int, epoch: int, key: str) -> bytes:
    # A keyed hash gives a permutation that depends only on (seed, epoch, shard key): the same on
    # every process and Python version, and independent of the order the shards were listed in.
    return hashlib.sha256(f"{seed}\x00{epoch}\x00{key}".encode()).digest()


def plan_shards(
    index: ShardIndex | Sequence[ShardEntry], *, num_workers: int, epoch: int = 0, seed: int = 0
) -> list[list[ShardEntry]]:
    """Deal every shard to exactly one of ``num_workers`` workers for this epoch.

    The shards are put in a seeded per-epoch order, then cut into ``num_workers`` contiguous
    runs whose record counts are as even as whole shards allow. The result depends only on the
    set of shards, ``epoch`` and ``seed``. ``index`` is a ShardIndex or a sequence of ShardEntry.

    Raises ValueError when there are fewer shards than workers (some worker would get nothing),
    identically on every worker, before anything is read.
    """
    num_workers = _check_int(num_workers, "num_workers", 1)
    epoch = _check_int(epoch, "epoch", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    entries = _entries(index)
    keys = [entry.key for entry in entries]
    if len(set(keys)) != len(keys):
        duplicate = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"plan_shards: shard key {duplicate!r} is listed twice")
    if len(entries) < num_workers:
        raise ValueError(
            f"plan_shards: {len(entries)} shard(s) cannot be dealt to {num_workers} workers "
            "(every worker needs at least one whole shard); write smaller shards "
            "(ShardWriter target_bytes) or use fewer ranks/DataLoader workers"
        )
    ordered = sorted(entries, key=lambda e: _order_key(seed, epoch, e.key))
    bounds = _balanced_cuts([e.records for e in ordered], num_workers)
    return [list(ordered[a:b]) for a, b in zip(bounds, bounds[1:])]


def _balanced_cuts(weights: list[int], parts: int) -> list[int]:
    """Cut ``weights`` into ``parts`` non-empty contiguous runs with near-equal sums.

    Cut i goes where the running total comes closest to i/parts of the whole, kept far enough
    from its neighbours that every run holds at least one shard. Each run then differs from an
    even share by about one shard's weight at most.
    """
    n = len(weights)
    prefix = [0]
    for weight in weights:
        prefix.append(prefix[-1] + weight)
    total = prefix[-1]
    cuts = [0]
    for i in range(1, parts):
        lowest = cuts[-1] + 1
        highest = n - (parts - i)
        target = total * i / parts
        # The cut nearest the target is one of the two around bisect's insertion point.
        above = min(max(bisect.bisect_left(prefix, target, lowest, highest + 1), lowest), highest)
        below = max(above - 1, lowest)
        cuts.append(below if target - prefix[below] <= prefix[above] - target else above)
    cuts.append(n)
    return cuts


def assign_shards(
    index: ShardIndex | Sequence[ShardEntry], worker_id: int, num_workers: int, *, epoch: int = 0, seed: int = 0
) -> list[ShardEntry]:
    """The shards worker ``worker_id`` of ``num_workers`` reads this epoch (see plan_shards)."""
    num_workers = _check_int(num_workers, "num_workers", 1)
    worker_id = _check_int(worker_id, "worker_id", 0)
    if worker_id >= num_workers:
        raise ValueError(f"worker_id must be in [0, {num_workers}), got {worker_id}")
    return plan_shards(index, num_workers=num_workers, epoch=epoch, seed=seed)[worker_id]


def worker_coordinates(*, rank: int = 0, world_size: int = 1) -> tuple[int, int]:
    """``(worker_id, num_workers)`` of the calling process across all ranks and DataLoader workers.

    Call it where the data is read (inside ``__iter__``), passing the rank and world size
    captured in the main process when the dataset was built. Inside a DataLoader worker, worker
    ``w`` of ``W`` on rank ``r`` is global worker ``r * W + w`` of ``world_size * W``; outside one
    it is ``rank`` of ``world_size``.
    """
    world_size = _check_int(world_size, "world_size", 1)
    rank = _check_int(rank, "rank", 0)
    if rank >= world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    # A DataLoader worker always runs with torch imported, so if torch is not loaded yet this
    # process is no DataLoader worker and we need not pay for importing it.
    if "torch" not in sys.modules:
        return rank, world_size
    from torch.utils.data import get_worker_info  # the one lazy torch import in koochak.data

    info = get_worker_info()
    if info is None:
        return rank, world_size
    return rank * info.num_workers + info.id, world_size * info.num_workers
