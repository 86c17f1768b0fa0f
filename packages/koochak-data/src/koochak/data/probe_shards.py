"""``koochak-probe --dataset-shards``: build a synthetic dataset and read it with N processes.

The storage probe lives in koochak-store, which sits below koochak-data and never imports it.
This module registers ``measure_dataset`` in the ``koochak.probe_modes`` entry-point group
(``dataset_shards``), and the probe finds it there only when ``--dataset-shards`` is given. The
readers are spawned processes, as DataLoader workers are, each reading the shards
``assign_shards`` gives it and verifying them as training reads do.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from koochak.data.planning import assign_shards
from koochak.data.shards import ShardWriter, load_index, read_shard
from koochak.storage.probe import Measurement, human_size
from koochak.storage.store import Store

__all__ = ["measure_dataset"]

_PREFIX = "dataset"
_TAR_BLOCK = 512
_END_OF_ARCHIVE = 2 * _TAR_BLOCK
_MAX_RECORD = 1 << 20


def measure_dataset(
    store: Store,
    *,
    shards: int,
    shard_bytes: int,
    readers: Sequence[int],
    drop_cache: Callable[[Sequence[str]], None],
    notes: list[str],
) -> list[Measurement]:
    """Build ``shards`` shards of ~``shard_bytes`` with ShardWriter, then read them cold and warm.

    One ``dataset_build`` row, then ``dataset_read_cold`` and ``dataset_read_warm`` for each
    reader count in ``readers`` (``drop_cache(keys)`` runs before each cold read). A reader
    count above the number of shards built is skipped with a line added to ``notes``.
    """
    record = max(1, min(_MAX_RECORD, shard_bytes // 8))
    # One tar header plus the payload padded to whole blocks per record; the writer starts a new
    # shard when the next record would not fit, so this many records fill `shards` shards.
    per_record = _TAR_BLOCK + -(-record // _TAR_BLOCK) * _TAR_BLOCK
    per_shard = max(1, (shard_bytes - _END_OF_ARCHIVE) // per_record)
    payload = bytearray(record)
    start = time.perf_counter()
    with ShardWriter(store, _PREFIX, target_bytes=shard_bytes) as writer:
        for i in range(shards * per_shard):
            payload[:8] = i.to_bytes(8, "little")  # distinct records, cheap to make
            writer.write({"__key__": f"{i:09d}", "bin": bytes(payload)})
    index = writer.close()
    seconds = time.perf_counter() - start
    built = len(index.shards)
    keys = [index.key_of(entry) for entry in index.shards]
    note = f"{built} shards of {human_size(index.size / max(built, 1))}, {index.records} records"
    rows = [Measurement("dataset_build", 1, index.size / seconds, "B/s", note + ", ShardWriter")]
    for n in readers:
        if n > built:
            notes.append(f"dataset read with {n} readers skipped: only {built} shards to share")
            continue
        for metric in ("dataset_read_cold", "dataset_read_warm"):
            if metric == "dataset_read_cold":
                drop_cache(keys)
            got, seconds = _read_with_processes(store, n)
            rows.append(
                Measurement(metric, n, got / seconds, "B/s", f"{n} spawned reader(s), verified")
            )
    return rows


def _read_with_processes(store: Store, n: int) -> tuple[int, float]:
    """Total bytes read and wall seconds, timed from when every reader is ready to start."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(n + 1)
    results = context.Queue()
    procs = [
        context.Process(
            target=_reader, args=(store, _PREFIX, worker, n, barrier, results), daemon=True
        )
        for worker in range(n)
    ]
    for proc in procs:
        proc.start()
    try:
        try:
            barrier.wait(timeout=300)  # imports and index loading are not part of the figure
        except threading.BrokenBarrierError:
            raise OSError(f"dataset reader failed: {results.get(timeout=60)}") from None
        start = time.perf_counter()
        outcomes = [results.get(timeout=3600) for _ in procs]
        seconds = time.perf_counter() - start
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
            proc.join()
    errors = [outcome for outcome in outcomes if isinstance(outcome, str)]
    if errors:
        raise OSError(f"dataset reader failed: {errors[0]}")
    return sum(outcomes), seconds


def _reader(store: Store, prefix: str, worker: int, num: int, barrier: Any, results: Any) -> None:
    try:
        index = load_index(store, prefix)
        mine = assign_shards(index, worker, num)
    except BaseException as exc:
        barrier.abort()
        results.put(f"worker {worker}: {type(exc).__name__}: {exc}")
        return
    barrier.wait(timeout=300)
    try:
        for entry in mine:
            for _sample in read_shard(store, index, entry, verify=True):
                pass  # read_shard has read and verified the whole shard before yielding
        results.put(sum(entry.size for entry in mine))
    except BaseException as exc:
        results.put(f"worker {worker}: {type(exc).__name__}: {exc}")
