"""Explicit DDP dataset sharding: each rank (and each DataLoader worker) sees a disjoint slice.

Two modes:

- ``map``: a map-style dataset (``__len__`` + ``__getitem__``) becomes the strided subset
  ``rank, rank + world_size, ...``; no item is repeated or padded, so ranks may differ in length
  by one item unless ``drop_remainder=True`` trims every rank to the same length.
- ``iterable``: any iterable becomes an ``IterableDataset`` that keeps every ``n``-th item, where
  ``n = world_size * num_workers`` and the slot is ``rank * num_workers + worker_id``. So inside a
  DataLoader with workers, each item goes to exactly one worker of one rank. Every worker still
  walks the whole source stream and skips the items it does not own; for large sharded datasets
  deal whole shards instead (``koochak.data.shards.plan_shards``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from torch.utils.data import Dataset, IterableDataset, Subset, get_worker_info

__all__ = ["shard_dataset", "shard_iterable_dataset", "shard_map_dataset"]

MODES = ("iterable", "map")


def _check_rank(rank: Any, world_size: Any) -> None:
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")


class _ShardedIterable(IterableDataset):
    """Round-robin slice of a source iterable for one rank, split again across loader workers."""

    def __init__(self, source: Iterable[Any], rank: int, world_size: int) -> None:
        self.source = source
        self.rank = rank
        self.world_size = world_size

    def __iter__(self) -> Iterator[Any]:
        worker = get_worker_info()
        num_workers, worker_id = (1, 0) if worker is None else (worker.num_workers, worker.id)
        stride = self.world_size * num_workers
        slot = self.rank * num_workers + worker_id
        for index, item in enumerate(self.source):
            if index % stride == slot:
                yield item

    def __repr__(self) -> str:
        return f"shard_iterable_dataset({self.source!r}, rank={self.rank}, world_size={self.world_size})"


def shard_iterable_dataset(dataset: Iterable[Any], rank: int, world_size: int) -> IterableDataset:
    """Keep the items of ``dataset`` that belong to ``rank`` (and to the current loader worker).

    Wrap the *source* of items, not a DataLoader that batches them: sharding a DataLoader works
    but every rank then loads and discards the other ranks' batches.
    """
    _check_rank(rank, world_size)
    if not isinstance(dataset, Iterable):
        raise TypeError(f"shard_iterable_dataset needs an iterable, got {type(dataset).__name__}")
    return _ShardedIterable(dataset, rank, world_size)


def shard_map_dataset(
    dataset: Sequence[Any] | Dataset, rank: int, world_size: int, *, drop_remainder: bool = False
) -> Subset:
    """The strided subset ``dataset[rank::world_size]`` as a ``torch.utils.data.Subset``.

    With ``drop_remainder`` every rank gets ``len(dataset) // world_size`` items, which DDP needs
    when ranks must run the same number of steps; otherwise the remainder is kept, not lost.
    """
    _check_rank(rank, world_size)
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise TypeError(
            f"shard_map_dataset (mode='map') needs __len__ and __getitem__, got "
            f"{type(dataset).__name__}; use mode='iterable' for streams"
        )
    length = len(dataset)  # type: ignore[arg-type]
    stop = (length // world_size) * world_size if drop_remainder else length
    return Subset(dataset, range(rank, stop, world_size))  # type: ignore[arg-type]


def shard_dataset(
    dataset: Any, rank: int, world_size: int, mode: str = "iterable", **kwargs: Any
) -> Any:
    """Shard ``dataset`` for ``rank`` of ``world_size`` with ``mode`` ``iterable`` or ``map``.

    ``kwargs`` go to the mode's function (``drop_remainder`` for ``map``).
    """
    if mode == "map":
        return shard_map_dataset(dataset, rank, world_size, **kwargs)
    if mode == "iterable":
        if kwargs:
            raise TypeError(
                f"shard_dataset(mode='iterable') takes no options, got {sorted(kwargs)}"
            )
        return shard_iterable_dataset(dataset, rank, world_size)
    raise ValueError(f"shard_dataset mode must be one of {', '.join(MODES)}, got {mode!r}")
