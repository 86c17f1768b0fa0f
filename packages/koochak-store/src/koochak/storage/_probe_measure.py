"""Throughput and latency measurements for the storage probe, done through the Store API.

Everything here writes under one scratch store (the probe removes it afterwards) and returns
:class:`Measurement` rows. Cold figures come after dropping the page cache for the objects read;
:class:`CacheDropper` says which method worked so a reader knows how cold "cold" was.
"""

from __future__ import annotations

import hashlib
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from koochak.storage.profile import StoreProfile
from koochak.storage.store import ObjectInfo, Store

_CHUNK = 8 << 20  # read/write granularity: large enough that per-call overhead vanishes
_SMALL_BYTES = 4096


@dataclass(frozen=True)
class Measurement:
    """One measured figure. ``unit`` is ``"s"`` (latency) or ``"B/s"`` (throughput)."""

    metric: str
    streams: int
    value: float  # the median of the rounds
    unit: str
    note: str = ""
    low: float | None = None  # the lowest and highest of the rounds, where there were several
    high: float | None = None


class CacheDropper:
    """Evicts objects from the page cache before cold reads, as far as the OS allows.

    Per file: fsync (so pages are clean and can be dropped) then posix_fadvise(DONTNEED), when the
    store has local paths. Globally: /proc/sys/vm/drop_caches when it is writable (root on a node
    that allows it). ``method`` names what worked, or says that nothing did.
    """

    def __init__(self, store: Store, global_drop: bool = True) -> None:
        self.store = store
        self.used: set[str] = set()
        # Dropping every cache on the node slows its other users for a moment; allowed but optional.
        self.global_allowed = global_drop and os.access("/proc/sys/vm/drop_caches", os.W_OK)

    def drop(self, keys: Sequence[str]) -> None:
        if hasattr(os, "posix_fadvise"):
            for key in keys:
                path = self.store.local_path(key)
                if path is None:
                    continue
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError:
                    continue
                try:
                    try:
                        os.fsync(fd)
                    except OSError:
                        pass  # mounts that reject fsync: DONTNEED still drops clean pages
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    self.used.add("posix_fadvise(DONTNEED)")
                except OSError:
                    pass
                finally:
                    os.close(fd)
        if self.global_allowed:
            try:
                os.sync()
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("1\n")
                self.used.add("/proc/sys/vm/drop_caches")
            except OSError:
                self.global_allowed = False

    @property
    def method(self) -> str:
        if not self.used:
            return "none (no local paths, drop_caches not writable): cold figures may be cached"
        return " + ".join(sorted(self.used))


def filler(size: int) -> Iterator[bytes]:
    """``size`` bytes of incompressible data in 8 MiB chunks, generated once and reused."""
    block = os.urandom(min(size, _CHUNK))
    remaining = size
    while remaining > 0:
        n = min(remaining, len(block))
        yield block if n == len(block) else block[:n]
        remaining -= n


def _timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _read_all(store: Store, key: str, sha: Any = None) -> int:
    total = 0
    with store.open(key) as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                return total
            if sha is not None:
                sha.update(block)
            total += len(block)


def _verify_read(store: Store, key: str, size: int, info: ObjectInfo) -> None:
    sha = hashlib.sha256()
    got = _read_all(store, key, sha)
    if got != size or sha.hexdigest() != info.sha256:
        raise OSError(
            f"probe: {key!r} read back {got} bytes with SHA256 {sha.hexdigest()}, wrote {size} bytes"
        )


def _read_range(store: Store, key: str, start: int, end: int) -> int:
    total = 0
    for offset in range(start, end, _CHUNK):
        total += len(store.get(key, offset, min(offset + _CHUNK, end)))
    return total


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def measure_small_objects(store: Store, dropper: CacheDropper, count: int) -> list[Measurement]:
    """Latency of put/stat/get of ``count`` 4 KiB objects, and of listing them."""
    keys = [f"small/{i:06d}" for i in range(count)]
    data = os.urandom(_SMALL_BYTES)
    puts = [_timed(lambda k=key: store.put(k, data)) for key in keys]
    dropper.drop(keys)
    stats = [_timed(lambda k=key: store.stat(k)) for key in keys]
    gets = [_timed(lambda k=key: store.get(k)) for key in keys]
    start = time.perf_counter()
    listed = store.list("small/")
    list_seconds = time.perf_counter() - start
    if len(listed) != count:
        raise OSError(
            f"listing {store.location}/small/ returned {len(listed)} objects, wrote {count}"
        )
    rows = []
    for metric, values in (("small_put", puts), ("small_stat", stats), ("small_get_cold", gets)):
        note = f"median of {count}; p90 {_ms(_quantile(values, 0.9))}"
        rows.append(Measurement(metric, 1, statistics.median(values), "s", note))
    rows.append(
        Measurement(
            "list", 1, list_seconds, "s", f"{count} keys, {_ms(list_seconds / count)} per key"
        )
    )
    return rows


def _write_objects(store: Store, keys: list[str], size: int, streams: int) -> list[str]:
    """Put each key with ``size`` bytes, ``streams`` at once; return their SHA256 digests."""
    with ThreadPoolExecutor(max_workers=max(1, streams)) as pool:
        infos = list(pool.map(lambda k: store.put(k, filler(size), expected_size=size), keys))
    return [info.sha256 or "" for info in infos]


def measure_reads(
    store: Store,
    dropper: CacheDropper,
    total_bytes: int,
    levels: Sequence[int],
    rounds: int = 1,
) -> list[Measurement]:
    """Single-stream cold/cached, concurrent-object and range-parallel read throughput.

    Every figure is the median of ``rounds`` timed passes, the levels interleaved within each
    round so that a burst of load on a shared machine does not land on one level only.
    """
    rows = []
    big = "stream/one.bin"
    _write_objects(store, [big], total_bytes, 1)
    cold, cached = [], []
    for _ in range(rounds):
        dropper.drop([big])
        cold.append(_timed(lambda: _read_all(store, big)))
        cached.append(_timed(lambda: _read_all(store, big)))
    note = _size(total_bytes) + _of(rounds)
    rows.append(Measurement("single_stream_cold", 1, total_bytes / _mid(cold), "B/s", note))
    rows.append(Measurement("single_stream_cached", 1, total_bytes / _mid(cached), "B/s", note))

    # The same object read as N contiguous ranges at once: do ranges of one object add up?
    ranged: dict[int, list[float]] = {n: [] for n in levels}
    for _ in range(rounds):
        for n in levels:
            bounds = [total_bytes * i // n for i in range(n + 1)]
            dropper.drop([big])
            with ThreadPoolExecutor(max_workers=n) as pool:
                start = time.perf_counter()
                got = sum(pool.map(lambda b: _read_range(store, big, *b), zip(bounds, bounds[1:])))
                ranged[n].append(got / (time.perf_counter() - start))
    for n in levels:
        note = f"{n} range(s) of one object" + _of(rounds)
        rows.append(_row("range_parallel_cold", n, ranged[n], note))
    store.delete(big)

    # The same bytes as many objects, read by N streams at once: how much concurrency helps.
    count = max(levels)
    size = max(1, total_bytes // count)
    keys = [f"many/{i:04d}.bin" for i in range(count)]
    _write_objects(store, keys, size, min(count, 8))
    concurrent: dict[int, list[float]] = {n: [] for n in levels}
    for _ in range(rounds):
        for n in levels:
            dropper.drop(keys)
            with ThreadPoolExecutor(max_workers=n) as pool:
                start = time.perf_counter()
                got = sum(pool.map(lambda k: _read_all(store, k), keys))
                concurrent[n].append(got / (time.perf_counter() - start))
    for n in levels:
        note = f"{count} objects of {_size(size)}" + _of(rounds)
        rows.append(_row("concurrent_cold", n, concurrent[n], note))
    for key in keys:
        store.delete(key)
    return rows


def _mid(values: list[float]) -> float:
    return statistics.median(values)


def _row(metric: str, streams: int, values: list[float], note: str) -> Measurement:
    return Measurement(metric, streams, _mid(values), "B/s", note, min(values), max(values))


def _of(rounds: int) -> str:
    return f", median of {rounds}" if rounds > 1 else ""


def measure_checkpoint(
    store: Store, dropper: CacheDropper, total_bytes: int, parts_levels: Sequence[int]
) -> list[Measurement]:
    """A checkpoint-sized write as P concurrent parts (fsync + SHA256), then a verified read-back."""
    rows = []
    for parts in parts_levels:
        sizes = [total_bytes * (i + 1) // parts - total_bytes * i // parts for i in range(parts)]
        keys = [f"checkpoint-{parts}/part-{i:03d}" for i in range(parts)]
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=parts) as pool:
            infos = list(
                pool.map(
                    lambda ks: store.put(ks[0], filler(ks[1]), expected_size=ks[1]),
                    zip(keys, sizes),
                )
            )
        write_seconds = time.perf_counter() - start
        dropper.drop(keys)

        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=parts) as pool:
            list(pool.map(lambda a: _verify_read(store, *a), zip(keys, sizes, infos)))
        read_seconds = time.perf_counter() - start
        note = f"{_size(total_bytes)} in {parts} part(s)"
        rows.append(
            Measurement(
                "checkpoint_write",
                parts,
                total_bytes / write_seconds,
                "B/s",
                note + ", fsync + SHA256",
            )
        )
        rows.append(
            Measurement(
                "checkpoint_read_back",
                parts,
                total_bytes / read_seconds,
                "B/s",
                note + ", cold, verified",
            )
        )
        for key in keys:
            store.delete(key)
    return rows


# More streams are worth it only when the fewer reach at most this share of what they give (half
# as much again), in every round; so the advice does not wander on a flat curve. With a third
# more, two streams on the loopback FUSE mounts (about 1.5x one, median) won in 1 of ~24 probes
# on a loaded machine, and reruns disagreed.
_ENOUGH_OF_BEST = 2 / 3


def on_125_grid(value: float) -> float:
    """``value`` rounded to the nearest of 1, 2, 5 x 10^k (geometrically): reruns agree."""
    if value <= 0:
        return value
    exponent = math.floor(math.log10(value))
    candidates = [m * 10.0**e for e in (exponent, exponent + 1) for m in (1, 2, 5)]
    best = min(candidates, key=lambda c: abs(math.log(c / value)))
    return float(f"{best:.3g}")


def _lowest(row: Measurement) -> float:
    return row.value if row.low is None else row.low


def _highest(row: Measurement) -> float:
    return row.value if row.high is None else row.high


def recommend_profile(rows: list[Measurement]) -> StoreProfile:
    """A StoreProfile from the measurements of :func:`measure_small_objects` and :func:`measure_reads`.

    The request cost and stream bandwidth are rounded to a 1-2-5 grid; more streams (and
    parallel ranges) are recommended only where the worst of the rounds with them beats the best
    without them by a margin, so that reruns on the same mount agree.
    """
    by = {(row.metric, row.streams): row for row in rows}
    request = on_125_grid(by[("small_get_cold", 1)].value)
    stream = on_125_grid(by[("single_stream_cold", 1)].value)
    concurrent = sorted((n, row) for (m, n), row in by.items() if m == "concurrent_cold")
    ranged = {n: row for (m, n), row in by.items() if m == "range_parallel_cold"}
    # More streams only where every round says they pay: the worst round with n streams beats
    # the best round with fewer by the margin. A flat or noisy curve keeps the fewer streams.
    concurrency = concurrent[0][0]
    chosen = concurrent[0][1]
    for n, row in concurrent[1:]:
        if _lowest(row) >= _highest(chosen) / _ENOUGH_OF_BEST:
            concurrency, chosen = n, row
    one = ranged.get(1)
    range_reads_scale = one is not None and any(
        _lowest(row) >= 1.5 * _highest(one) for n, row in ranged.items() if n > 1
    )
    # A part big enough that the per-request cost is under ~5% of streaming it, as a power of
    # two between 8 MiB and 256 MiB.
    want = 20 * request * stream
    part = 8 << 20
    while part < want and part < (256 << 20):
        part *= 2
    # Listing is cheap when it costs well under a request per key (a local directory), not
    # when every page of a listing is a slow remote round trip.
    listed = [row for row in rows if row.metric == "list"]
    listing_cheap = not listed or listed[0].value < 1.0
    return StoreProfile(
        request_seconds=request,
        stream_bytes_per_second=stream,
        concurrency=concurrency,
        range_reads_scale=range_reads_scale,
        part_bytes=part,
        listing_cheap=listing_cheap,
    )


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


human_size = _size
