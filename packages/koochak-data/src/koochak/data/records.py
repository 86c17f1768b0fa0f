"""A shard dataset as a sequence of records, and an epoch order that reads each shard once.

``ShardRecords(store, prefix)`` makes the records of a committed shard dataset addressable by a
global index (record ``i`` is the ``i``-th sample in index order), which is what an elastic data
stream (``koochak.loop.elastic.ElasticBatches``) needs: with a global record cursor in the
checkpoint, any rank can find the record at any position, on any world size. Reads go through
``read_shard`` (size and SHA256 checked before a sample is handed out), whole shards at a time,
keeping the last few in memory.

Random access would read a shard per record. ``shard_order(seed)`` gives an epoch order that
still shuffles (the shards in a seeded per-epoch order, as ``plan_shards`` orders them) but keeps
each shard's records together, so a stream walks one shard at a time. Every rank takes a slice of
every global batch, so each rank reads each shard of the epoch once.

Torch-free: samples are the ``read_shard`` dicts; decode them in your collate function.
"""

from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, overload

from koochak.data._shard_records import ShardEntry
from koochak.data.planning import _order_key
from koochak.data.shards import Sample, load_index, read_shard
from koochak.storage.store import Store, open_store

__all__ = ["ShardRecords"]


class ShardRecords(Sequence[Sample]):
    """The records of the shard dataset at ``prefix`` of ``store``, indexable ``0 .. len - 1``.

    ``cached_shards`` whole shards stay in memory (least recently used goes first). ``copy``
    hands out ``bytes`` (what DataLoader workers can pickle); ``verify`` checks each shard's
    SHA256 as it is read.
    """

    def __init__(
        self,
        store: Store | str,
        prefix: str = "",
        *,
        verify: bool = True,
        copy: bool = True,
        cached_shards: int = 2,
    ) -> None:
        if (
            isinstance(cached_shards, bool)
            or not isinstance(cached_shards, int)
            or cached_shards < 1
        ):
            raise ValueError(
                f"ShardRecords: cached_shards must be an int >= 1, got {cached_shards!r}"
            )
        self.store = open_store(store)
        self.index = load_index(self.store, prefix)
        self.verify, self.copy, self.cached_shards = verify, copy, cached_shards
        self._starts = list(itertools.accumulate((s.records for s in self.index.shards), initial=0))
        self._cache: OrderedDict[str, list[Sample]] = OrderedDict()

    def __len__(self) -> int:
        return self._starts[-1]

    @overload
    def __getitem__(self, i: int) -> Sample: ...

    @overload
    def __getitem__(self, i: slice) -> list[Sample]: ...

    def __getitem__(self, i: int | slice) -> Sample | list[Sample]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"ShardRecords indices are ints, got {type(i).__name__}")
        if not -len(self) <= i < len(self):
            raise IndexError(f"record {i} out of range: the dataset holds {len(self)}")
        i %= len(self)
        shard = bisect.bisect_right(self._starts, i) - 1
        return self._samples(self.index.shards[shard])[i - self._starts[shard]]

    def _samples(self, entry: ShardEntry) -> list[Sample]:
        samples = self._cache.get(entry.key)
        if samples is None:
            samples = list(
                read_shard(self.store, self.index, entry, verify=self.verify, copy=self.copy)
            )
            self._cache[entry.key] = samples
            while len(self._cache) > self.cached_shards:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(entry.key)
        return samples

    def shard_order(self, seed: int = 0) -> Callable[[int], Sequence[int]]:
        """``epoch -> order``: the shards in a seeded per-epoch order, each shard's records
        together and in place. Pass it as ``ElasticBatches(records, order=...)``."""
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"shard_order: seed must be an int, got {seed!r}")
        return _ShardOrder(self.index.shards, self._starts, seed)

    def __getstate__(self) -> dict[str, Any]:
        # A DataLoader worker gets its own (empty) cache, not a copy of the parent's shards.
        return {**self.__dict__, "_cache": OrderedDict()}


class _ShardOrder:
    """A picklable ``epoch -> order`` whose orders are computed per lookup (memory: the shards)."""

    def __init__(self, shards: Sequence[ShardEntry], starts: list[int], seed: int) -> None:
        self.shards, self.starts, self.seed = tuple(shards), starts, seed
        self.__qualname__ = f"shard_order(seed={seed})"  # how a checkpoint names the order

    def __call__(self, epoch: int) -> Sequence[int]:
        ranked = sorted(
            range(len(self.shards)), key=lambda s: _order_key(self.seed, epoch, self.shards[s].key)
        )
        return _EpochOrder(ranked, [self.shards[s].records for s in ranked], self.starts)


class _EpochOrder(Sequence[int]):
    def __init__(self, ranked: list[int], counts: list[int], starts: list[int]) -> None:
        self.ranked, self.starts = ranked, starts
        self.offsets = list(itertools.accumulate(counts, initial=0))

    def __len__(self) -> int:
        return self.offsets[-1]

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not 0 <= i < len(self):
            raise IndexError(i)
        position = bisect.bisect_right(self.offsets, i) - 1
        return self.starts[self.ranked[position]] + (i - self.offsets[position])
