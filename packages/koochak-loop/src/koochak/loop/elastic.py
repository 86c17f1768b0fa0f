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

``shuffle_window=W`` shuffles, in addition, each window of ``W`` consecutive positions of an
epoch's ordering (seeded by the seed, the epoch and the window): an ordering that keeps a
shard's records together (``ShardRecords.shard_order``) then still mixes them within a batch,
while the reads stay inside a window. It is a bijection of each epoch's positions, a function
of the position alone, so exactly-once and exact resume on any number of ranks are kept; the
window is part of the ordering the checkpoint records (``order``), so a resume with another
window is refused.

``lanes=k`` cuts each epoch's ordering into ``k`` contiguous ranges (lanes) walked side by side:
every global batch takes ``global_batch / k`` consecutive positions from each lane, in lane
order. Rank ``r`` of ``W`` (``W`` dividing ``k``) then takes lanes ``r k / W .. (r + 1) k / W -
1`` of every batch, so over an epoch it reads one contiguous ``1 / W`` of the ordering: with
``ShardRecords.shard_order`` that is ``1 / W`` of the shards plus the few its lane boundaries
fall in, instead of every shard (see docs/data.md, "Reads per rank"). The stream is still one
world-size-independent function of the position, so the cursor, exactly-once and a resume on any
number of ranks are as before; ``lanes`` is part of the recorded ordering, and the global batch
may not change on resume. A rank walks ``k / W`` lanes at once, each chunk possibly straddling two
shards: give ``ShardRecords`` ``cached_shards=2 k / W + 1``.

``keys=True`` hands ``collate`` ``(SampleKey(epoch, index), record)`` pairs instead of bare
records: the key is the same for a record wherever and whenever it is read (any rank, any
worker, after any resume), so ``koochak.loop.seed.sample_generator(seed, *key)`` gives its
augmentation a generator that an uninterrupted and a resumed run share.
``elastic_sampler`` is the same stream as a DataLoader ``batch_sampler`` of indices, for a
map-style dataset read by the DataLoader's own workers.

``UnpackedRecords`` makes records stored several to a sample (small records, packed densely
into one tar member each ``per_sample`` of them) addressable one by one, so the cursor still
counts records: see docs/data.md ("Small records").

The global batch must stay fixed for a run to be the same run. A resume with another
``global_batch`` still consumes every record exactly once (the cursor counts records, not
batches), but updates then see batches of another size and an epoch takes another number of
updates; rank 0 warns.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from koochak.loop import dist
from torch.utils.data import IterableDataset, get_worker_info

__all__ = [
    "ELASTIC_STATE_VERSION",
    "ElasticBatches",
    "SampleKey",
    "UnpackedRecords",
    "elastic_sampler",
    "epoch_permutation",
    "find_elastic",
]

ELASTIC_STATE_VERSION = 1
_STATE_FIELDS = ("version", "cursor", "global_batch", "records", "seed", "order")
_MASK64 = (1 << 64) - 1


class SampleKey(NamedTuple):
    """Which record a stream position holds, and in which epoch: the same on every rank, worker
    and attempt (``ElasticBatches(keys=True)``)."""

    epoch: int
    index: int  # into the records


class ElasticBatches(IterableDataset):  # type: ignore[type-arg]
    """This rank's batches of the global stream over ``records``, from global record ``start``.

    ``records`` is any sequence (``len`` and integer indexing): a list, a map-style dataset, or
    ``koochak.data.records.ShardRecords`` over a shard dataset. ``order(epoch)`` may give each
    epoch's ordering (a permutation of ``range(len(records))``) instead of the seeded shuffle
    (``shuffle=False``: the records' own order). ``collate`` turns a list of records into a
    batch (default: ``torch.utils.data.default_collate``). ``rank``/``world_size`` default to the
    process group's at iteration time. ``shuffle_window`` (0 or 1: none) shuffles each window of
    that many consecutive positions of the epoch's ordering, seeded, and ``lanes`` (dividing
    ``global_batch``) cuts the epoch into that many contiguous lanes walked side by side, so a
    rank reads only its share of the shards (see the module docstring). ``keys`` hands
    ``collate`` ``(SampleKey, record)`` pairs. Iterates forever (epoch after epoch); the loop
    stops it.
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
        shuffle_window: int = 0,
        lanes: int = 1,
        keys: bool = False,
    ) -> None:
        _check_int("global_batch", global_batch, 1)
        _check_int("start", start, 0)
        _check_int("shuffle_window", shuffle_window, 0)
        _check_int("lanes", lanes, 1)
        if global_batch % lanes:
            raise ValueError(f"ElasticBatches: lanes={lanes} does not divide global_batch="
                             f"{global_batch}; every batch takes as many records from each lane")  # fmt: skip
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
        self.shuffle_window = shuffle_window
        self.lanes = lanes
        self.keys = keys

    # -- the global stream

    @property
    def order_name(self) -> str:
        """How epochs are ordered, as the checkpoint records it (a resume must use the same)."""
        if self.order is not None:
            name = getattr(self.order, "__qualname__", "custom")
        else:
            name = "shuffle" if self.shuffle else "sequential"
        if self.shuffle_window > 1:
            name = f"{name}+window{self.shuffle_window}"
        return f"{name}+lanes{self.lanes}" if self.lanes > 1 else name

    def record_at(self, position: int) -> int:
        """The index into ``records`` of global stream position ``position``."""
        epoch, offset = divmod(position, len(self.records))
        if self.lanes > 1:
            size = len(self.records)
            offset = lane_offset(offset, size, self.lanes, self.global_batch,
                                 epoch * size % self.global_batch)  # fmt: skip
        if self.shuffle_window > 1:
            offset = _window_shuffle(offset, len(self.records), self.shuffle_window, self.seed,
                                     epoch)  # fmt: skip
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
        batch, size = worker_id, len(self.records)
        while True:
            positions = self.positions(batch, rank, world_size)
            if self.keys:
                records = [(SampleKey(p // size, i), self.records[i])
                           for p, i in zip(positions, map(self.record_at, positions))]  # fmt: skip
            else:
                records = [self.records[self.record_at(p)] for p in positions]
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
        ValueError naming the field). A different global batch is accepted with a warning
        (refused with ``lanes``, whose layout follows the batch's slots).
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
        if state["global_batch"] != self.global_batch and self.lanes > 1:
            raise ValueError(
                f"{source}: field 'data.global_batch' is {state['global_batch']} but this stream "
                f"has {self.global_batch} with lanes={self.lanes}; the lanes deal each batch's "
                "slots, so another global batch would repeat and skip records. Resume with "
                f"global_batch={state['global_batch']}"
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


def elastic_sampler(
    size: int,
    *,
    global_batch: int,
    seed: int = 0,
    shuffle: bool = True,
    shuffle_window: int = 0,
    lanes: int = 1,
    keys: bool = False,
    rank: int | None = None,
    world_size: int | None = None,
) -> ElasticBatches:
    """The elastic stream over ``range(size)`` as a DataLoader ``batch_sampler``: each item is
    the list of this rank's indices of one global batch (``(SampleKey, index)`` pairs with
    ``keys``). ``DataLoader(dataset, batch_sampler=elastic_sampler(len(dataset), ...))`` then
    resumes exactly, workers included: the sampler runs in the main process and the loop keeps
    its cursor in every checkpoint, like ``ElasticBatches``'s."""
    return ElasticBatches(
        range(size), global_batch=global_batch, seed=seed, shuffle=shuffle, collate=list,
        rank=rank, world_size=world_size, shuffle_window=shuffle_window, lanes=lanes, keys=keys,
    )  # fmt: skip


def find_elastic(dataset: Any) -> ElasticBatches | None:
    """The ElasticBatches behind ``dataset`` (itself, or a DataLoader's ``dataset`` or
    ``batch_sampler``), or None."""
    for candidate in (dataset, getattr(dataset, "dataset", None),
                      getattr(dataset, "batch_sampler", None)):  # fmt: skip
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


def lane_offset(offset: int, size: int, lanes: int, global_batch: int, phase: int = 0) -> int:
    """Where stream offset ``offset`` of an epoch of ``size`` reads in the epoch's ordering when
    the ordering is cut into ``lanes`` contiguous lanes walked side by side: slot ``s`` of every
    global batch reads the next record of lane ``s // (global_batch / lanes)``.

    ``phase`` is the slot of the global batch the epoch starts in (``epoch * size %
    global_batch``: an epoch need not start a batch). Each lane is as long as the number of
    slots the epoch asks of it (``size / lanes`` give or take a chunk), so every slot of every
    batch reads from its own lane and a rank's slice stays on its lanes in every epoch. Two
    prefix counts, no table: a bijection of ``range(size)``, the identity for one lane.
    """
    chunk = global_batch // lanes
    lane = (phase + offset) % global_batch // chunk
    low, high = lane * chunk, (lane + 1) * chunk  # the lane's slots of a global batch

    def in_lane(until: int) -> int:  # stream offsets before `until` in the lane's slots
        return _below(until, high, global_batch) - _below(until, low, global_batch)

    # The lane starts after every record the epoch's lower slots ask for.
    lane_start = _below(phase + size, low, global_batch) - _below(phase, low, global_batch)
    return lane_start + in_lane(phase + offset) - in_lane(phase)


def _below(until: int, slot: int, global_batch: int) -> int:
    """How many of ``0 .. until - 1`` fall below slot ``slot`` of their global batch."""
    rows, rest = divmod(until, global_batch)
    return rows * slot + min(rest, slot)


def _window_shuffle(offset: int, size: int, window: int, seed: int, epoch: int) -> int:
    """Where ``offset`` goes when each ``window`` consecutive offsets of ``range(size)`` are
    shuffled on their own (the last window may be shorter): a bijection that stays in its window."""
    first = offset - offset % window
    span = min(window, size - first)
    key = _mix((seed & _MASK64) ^ 0x77696E646F77) ^ first  # "window", and which one
    return first + epoch_permutation(offset - first, span, key, epoch)


class UnpackedRecords(Sequence[Any]):
    """Records stored ``per_sample`` to a sample, addressable one by one.

    Record ``i`` is item ``i % per_sample`` of ``unpack(samples[i // per_sample])``, where
    ``samples`` is any sequence (e.g. ``ShardRecords``) and ``unpack`` turns one sample into the
    list of its records. Every sample holds ``per_sample`` records except the last, which holds
    what is left of ``total`` (default: all full). The last ``cached_samples`` unpacked samples
    are kept, so a batch or a shuffle window reads each sample once. Use it as
    ``ElasticBatches``'s records: the cursor then counts records, and a resume on any number of
    ranks continues at the next record, also inside a sample. ``expand(order)`` turns an
    ordering of the samples (``ShardRecords.shard_order(seed)``) into one of the records.
    """

    def __init__(
        self,
        samples: Sequence[Any],
        per_sample: int,
        unpack: Callable[[Any], Sequence[Any]],
        *,
        total: int | None = None,
        cached_samples: int = 64,
    ) -> None:
        _check_int("per_sample", per_sample, 1)
        _check_int("cached_samples", cached_samples, 1)
        full = len(samples) * per_sample
        total = full if total is None else total
        if (
            isinstance(total, bool)
            or not isinstance(total, int)
            or not (full - per_sample < total <= full)
        ):
            raise ValueError(
                f"UnpackedRecords: total={total!r} does not fit {len(samples)} samples of "
                f"{per_sample} records (expected {max(0, full - per_sample + 1)}..{full})"
            )
        self.samples, self.per_sample, self.unpack, self.total = samples, per_sample, unpack, total
        self.cached_samples = cached_samples
        self._cache: OrderedDict[int, Sequence[Any]] = OrderedDict()

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, i: int) -> Any:  # type: ignore[override]
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"UnpackedRecords indices are ints, got {type(i).__name__}")
        if not -self.total <= i < self.total:
            raise IndexError(f"record {i} out of range: there are {self.total}")
        sample, item = divmod(i % self.total, self.per_sample)
        records = self._cache.get(sample)
        if records is None:
            records = self.unpack(self.samples[sample])
            want = min(self.per_sample, self.total - sample * self.per_sample)
            if len(records) != want:
                raise ValueError(f"UnpackedRecords: sample {sample} unpacks to {len(records)} "
                                 f"records, expected {want}")  # fmt: skip
            self._cache[sample] = records
            while len(self._cache) > self.cached_samples:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(sample)
        return records[item]

    def expand(self, order: Callable[[int], Sequence[int]]) -> Callable[[int], Sequence[int]]:
        """``epoch -> record order`` from ``order`` (``epoch -> order of the samples``): each
        sample's records together and in place, in the samples' order."""
        return _ExpandedOrder(order, self.per_sample, self.total, len(self.samples))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": OrderedDict()}


class _ExpandedOrder:
    def __init__(self, order: Callable[[int], Sequence[int]], per: int, total: int, n: int):
        self.order, self.per, self.total, self.n = order, per, total, n

    def __call__(self, epoch: int) -> Sequence[int]:
        return _Expanded(self.order(epoch), self.per, self.total, self.n)


class _Expanded(Sequence[int]):
    """Record positions of one epoch: sample ``base[q]`` covers records ``base[q] * per + j``;
    the short last sample (if any) covers fewer, wherever the order puts it."""

    def __init__(self, base: Sequence[int], per: int, total: int, n: int) -> None:
        if len(base) != n:
            raise ValueError(f"UnpackedRecords.expand: the order has {len(base)} entries for "
                             f"{n} samples")  # fmt: skip
        self.base, self.per, self.total = base, per, total
        self.short = total - (n - 1) * per  # records of the last sample
        self.short_at = None if self.short == per else list(base).index(n - 1)

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, i: int) -> int:  # type: ignore[override]
        if not 0 <= i < self.total:
            raise IndexError(i)
        if self.short_at is not None and i >= self.short_at * self.per:
            if i < self.short_at * self.per + self.short:
                return int(self.base[self.short_at]) * self.per + i - self.short_at * self.per
            i += self.per - self.short  # as though the short sample were full
        sample, item = divmod(i, self.per)
        return int(self.base[sample]) * self.per + item


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
