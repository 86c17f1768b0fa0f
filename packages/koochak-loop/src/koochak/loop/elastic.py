"""Elastic data: every record of an epoch consumed exactly once, on any number of ranks.

A run reads one global stream of records. Epoch ``e`` is an ordering of all ``N`` records (by
default a seeded shuffle that depends only on the seed and the epoch), epochs follow one another,
and the stream is cut into global batches of ``global_batch`` records. Rank ``r`` of ``W`` takes
the ``r``-th of ``W`` equal slices of every global batch (so a global batch is the same records on
any number of ranks), and a DataLoader worker ``w`` of ``n`` inside a rank takes that rank's
batches ``w, w + n, ...`` (a DataLoader hands them back in order).

The only state is the global cursor: the number of records the run has consumed. ``training_loop``
stores it in every checkpoint (field ``data``) and puts it back on resume, so a run saved on 4
ranks and resumed on 2 continues at the very next record: no record is repeated or skipped, and on
the same number of ranks the batches are exactly those of an uninterrupted run.

The global batch must stay fixed for a run to be the same run. A resume with another
``global_batch`` still consumes every record exactly once (the cursor counts records, not
batches), but updates then see batches of another size and an epoch takes another number of
updates; rank 0 warns.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from koochak.loop import dist
from torch.utils.data import IterableDataset, get_worker_info

__all__ = ["ELASTIC_STATE_VERSION", "ElasticBatches", "epoch_permutation", "find_elastic"]

ELASTIC_STATE_VERSION = 1
_STATE_FIELDS = ("version", "cursor", "global_batch", "records", "seed", "order")
_MASK64 = (1 << 64) - 1


class ElasticBatches(IterableDataset):  # type: ignore[type-arg]
    """This rank's batches of the global stream over ``records``, from global record ``start``.

    ``records`` is any sequence (``len`` and integer indexing): a list, a map-style dataset, or
    ``koochak.data.records.ShardRecords`` over a shard dataset. ``order(epoch)`` may give each
    epoch's ordering (a permutation of ``range(len(records))``) instead of the seeded shuffle
    (``shuffle=False``: the records' own order). ``collate`` turns a list of records into a
    batch (default: ``torch.utils.data.default_collate``). ``rank``/``world_size`` default to the
    process group's at iteration time. Iterates forever (epoch after epoch); the loop stops it.
    """

    def __init__(
        self,
        records: Sequence[Any],
        *,
        global_batch: int,
        seed: int = 0,
        shuffle: bool = True,
        order: Callable[[int], Sequence[int]] | None = None,
        collate: Callable[[list[Any]], Any] | None = None,
        start: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        _check_int("global_batch", global_batch, 1)
        _check_int("start", start, 0)
        if len(records) < 1:
            raise ValueError("ElasticBatches: records is empty")
        self.records = records
        self.global_batch = global_batch
        self.seed = int(seed)
        self.shuffle = shuffle
        self.order = order
        self.collate = collate
        self.start = start
        self.rank = rank
        self.world_size = world_size

    # -- the global stream

    @property
    def order_name(self) -> str:
        """How epochs are ordered, as the checkpoint records it (a resume must use the same)."""
        if self.order is not None:
            return getattr(self.order, "__qualname__", "custom")
        return "shuffle" if self.shuffle else "sequential"

    def record_at(self, position: int) -> int:
        """The index into ``records`` of global stream position ``position``."""
        epoch, offset = divmod(position, len(self.records))
        if self.order is not None:
            return int(self._epoch_order(epoch)[offset])
        if not self.shuffle:
            return offset
        return epoch_permutation(offset, len(self.records), self.seed, epoch)

    def _epoch_order(self, epoch: int) -> Sequence[int]:
        cached = getattr(self, "_cached_order", None)
        if cached is None or cached[0] != epoch:
            assert self.order is not None
            ordering = self.order(epoch)
            if len(ordering) != len(self.records):
                raise ValueError(f"ElasticBatches: order({epoch}) has {len(ordering)} entries for "
                                 f"{len(self.records)} records")  # fmt: skip
            cached = (epoch, ordering)
            self._cached_order = cached
        return cached[1]

    def positions(self, batch: int, rank: int, world_size: int) -> range:
        """Global stream positions of rank ``rank``'s slice of global batch ``batch`` (counted
        from ``start``)."""
        local = self.local_batch(world_size)
        first = self.start + batch * self.global_batch + rank * local
        return range(first, first + local)

    def local_batch(self, world_size: int) -> int:
        if self.global_batch % world_size:
            raise ValueError(
                f"ElasticBatches: global_batch={self.global_batch} does not split evenly over "
                f"{world_size} ranks; choose a global batch divisible by every world size you "
                "resume on"
            )
        return self.global_batch // world_size

    def __iter__(self) -> Iterator[Any]:
        rank = dist.get_rank() if self.rank is None else self.rank
        world_size = dist.get_world_size() if self.world_size is None else self.world_size
        self.local_batch(world_size)  # refuse an uneven split before reading anything
        worker = get_worker_info()
        workers, worker_id = (1, 0) if worker is None else (worker.num_workers, worker.id)
        collate = self.collate or _default_collate
        batch = worker_id
        while True:
            records = [
                self.records[self.record_at(p)] for p in self.positions(batch, rank, world_size)
            ]
            yield collate(records)
            batch += workers

    # -- the cursor in checkpoints

    def state_after(self, batches: int) -> dict[str, Any]:
        """The ``data`` field of a checkpoint taken after ``batches`` more global batches."""
        return {
            "version": ELASTIC_STATE_VERSION,
            "cursor": self.start + batches * self.global_batch,
            "global_batch": self.global_batch,
            "records": len(self.records),
            "seed": self.seed,
            "order": self.order_name,
        }

    def load_state(self, state: Mapping[str, Any], source: str = "checkpoint") -> None:
        """Continue at the cursor of a checkpoint's ``data`` field.

        The stream must be the same one: the same number of records, seed and ordering (else
        ValueError naming the field). A different global batch is accepted with a warning.
        """
        check_elastic_state(state, source)
        for key, mine in (("records", len(self.records)), ("seed", self.seed),
                          ("order", self.order_name)):  # fmt: skip
            if state[key] != mine:
                raise ValueError(
                    f"{source}: field 'data.{key}' is {state[key]!r} but this dataset has "
                    f"{mine!r}; the cursor only means the same records in another stream. "
                    "Resume with the same records, seed and ordering"
                )
        if state["global_batch"] != self.global_batch and dist.get_rank() == 0:
            warnings.warn(
                f"{source}: the run was saved with global_batch={state['global_batch']} and "
                f"resumes with {self.global_batch}; every record is still consumed once, but "
                "updates now see batches of another size",
                UserWarning,
                stacklevel=2,
            )
        self.start = int(state["cursor"])


def check_elastic_state(state: Any, source: str) -> None:
    """ValueError naming ``source`` and the field unless ``state`` is a version-1 ``data`` field."""
    if not isinstance(state, Mapping):
        raise ValueError(f"{source}: field 'data' must be a dict, got {type(state).__name__}")
    if state.get("version") != ELASTIC_STATE_VERSION or type(state.get("version")) is not int:
        raise ValueError(f"{source}: field 'data.version' is {state.get('version')!r}; this "
                         f"Koochak reads version {ELASTIC_STATE_VERSION}")  # fmt: skip
    unknown = sorted(set(state) - set(_STATE_FIELDS))
    missing = sorted(set(_STATE_FIELDS) - set(state))
    if unknown or missing:
        raise ValueError(f"{source}: field 'data' has unknown {unknown} / missing {missing} keys")
    for key in ("cursor", "global_batch", "records", "seed"):
        if type(state[key]) is not int or (key != "seed" and state[key] < 0):
            raise ValueError(f"{source}: field 'data.{key}' must be a non-negative int, got "
                             f"{state[key]!r}")  # fmt: skip
    if not isinstance(state["order"], str):
        raise ValueError(f"{source}: field 'data.order' must be a str, got {state['order']!r}")


def find_elastic(dataset: Any) -> ElasticBatches | None:
    """The ElasticBatches behind ``dataset`` (itself, or a DataLoader's ``dataset``), or None."""
    for candidate in (dataset, getattr(dataset, "dataset", None)):
        if isinstance(candidate, ElasticBatches):
            return candidate
    return None


def epoch_permutation(index: int, size: int, seed: int, epoch: int) -> int:
    """Where ``index`` goes in epoch ``epoch``'s seeded shuffle of ``range(size)``.

    A four-round Feistel network over the smallest even-bit domain that holds ``size``, walked
    until it lands inside ``range(size)``: a bijection computed per record (no table in memory),
    made of integer arithmetic only, so it is the same on every machine, Python and torch version
    (a resume never meets a different order).
    """
    half = max(1, ((size - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    key = _mix(_mix(seed & _MASK64) ^ epoch)
    x = index
    while True:
        left, right = x >> half, x & mask
        for round_ in range(4):
            left, right = right, left ^ (_mix(right ^ key ^ (round_ << 56)) & mask)
        x = (left << half) | right
        if x < size:
            return x


def _mix(value: int) -> int:
    """splitmix64's finaliser: a fixed, well-spread 64-bit integer hash."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def _check_int(name: str, value: Any, lowest: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise ValueError(f"ElasticBatches: {name} must be an int >= {lowest}, got {value!r}")


def _default_collate(records: list[Any]) -> Any:
    from torch.utils.data import default_collate

    return default_collate(records)


def elastic_cursor(
    dataset: Any, resumed: Mapping[str, Any] | None, start_step: int, grad_accum: int
) -> Callable[[int], dict[str, Any]] | None:
    """The loop's side: put a resumed run's cursor back into ``dataset`` (before it is iterated)
    and return ``next_step -> data field`` for its checkpoints; None unless ``dataset`` is elastic.

    Each update consumes ``grad_accum`` global batches. A checkpoint without a ``data`` field
    (written without elastic data) resumes as if this dataset had fed the run from its start,
    with a warning.
    """
    data = find_elastic(dataset)
    if data is None:
        return None
    if resumed is not None and resumed.get("data") is not None:
        data.load_state(resumed["data"])
    elif resumed is not None:
        data.start = start_step * grad_accum * data.global_batch
        if dist.get_rank() == 0:
            warnings.warn(
                f"the checkpoint has no data cursor (field 'data'); the elastic dataset resumes "
                f"at record {data.start}, as if it had fed the run since step 0",
                UserWarning,
                stacklevel=2,
            )
    return lambda next_step: data.state_after((next_step - start_step) * grad_accum)
