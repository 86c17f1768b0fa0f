"""copy_objects: the one way bytes move between stores.

Several items move at once on a thread pool. An object larger than the part size is read as
byte ranges, a few in parallel, and fed in order into ONE create-only ``target.put``; at most
``range_streams`` parts are held per object, so memory stays bounded however large the object.
The target's ``put`` hashes while it writes and refuses (leaving nothing visible) when the size
or the expected SHA256 does not match, so a copy is verified without a second read. Small objects
go to a target that declares ``put_many`` (a LocalStore) in batches, which pays for durability once
per batch instead of twice per object.

Reruns resume: a target that already exists with the expected size was committed by an earlier
verified put and is skipped; one with a different size is refused, never overwritten.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from koochak.storage.profile import min_object_bytes, profile_of
from koochak.storage.store import Store, capabilities_of, validate_key

__all__ = ["CopyItem", "CopyReport", "copy_objects"]

log = logging.getLogger(__name__)

_SHA256_RE = re.compile(r"[0-9a-f]{64}")

# Range reads of one object, per object, when the source profile says ranges scale. Beyond
# ~8 a single object's ranges rarely add bandwidth and multiply memory (parts in flight).
_MAX_DEFAULT_RANGE_STREAMS = 8
# Where a request costs less than streaming this many bytes (a local or parallel filesystem),
# parts are capped at _PIPELINE_PART_BYTES: reading part n+1 then overlaps with hashing and
# writing part n, and buffers this small are reused by the allocator instead of being freshly
# mapped (and page-faulted) for every part.
_CHEAP_REQUEST_BYTES = 1 << 20
_PIPELINE_PART_BYTES = 16 << 20
# Small objects published together by a target's put_many, at most this many per batch: one
# flush per batch instead of two per object, with a batch's bytes bounded by part_bytes. Only
# objects up to _BATCH_OBJECT_BYTES are batched: for larger ones the two fsyncs are small next
# to moving the bytes, and a batch's filesystem-wide flush would also wait for other writers.
_BATCH_ITEMS = 512
_BATCH_OBJECT_BYTES = 1 << 20


@dataclass(frozen=True)
class CopyItem:
    """One object to copy: its source key, expected size and (optionally) expected SHA256."""

    key: str
    size: int
    sha256: str | None = None
    target_key: str | None = None  # default: the same key as in the source

    @property
    def destination(self) -> str:
        return self.key if self.target_key is None else self.target_key


@dataclass(frozen=True)
class CopyReport:
    """What a copy did: items copied and skipped (already present with the expected size)."""

    copied: int
    skipped: int
    bytes_copied: int
    bytes_skipped: int


class _Interrupted(Exception):
    """Raised inside a part iterator to abort an in-flight put (the put then leaves nothing)."""


def copy_objects(
    source: Store,
    target: Store,
    items: Iterable[CopyItem],
    *,
    streams: int | None = None,
    range_streams: int | None = None,
    part_bytes: int | None = None,
    progress: Callable[[int], None] | None = None,
    show_progress: bool | None = None,
) -> CopyReport:
    """Copy ``items`` from ``source`` to ``target``, verified, create-only and resumable.

    Contract:
    - every target object is written with one create-only ``put`` carrying ``expected_size`` and
      ``expected_sha256`` (when the item has one); a mismatch raises ``ValueError`` and leaves no
      object under the target key;
    - a target that already exists with ``item.size`` bytes is skipped (reruns resume); one with
      another size raises ``FileExistsError`` naming the key, and is left untouched;
    - ``streams`` items move at once; an item larger than ``part_bytes`` is read as byte ranges,
      ``range_streams`` at a time, in order into the put (at most ``range_streams`` parts held);
    - items of at most 1 MiB (and ``part_bytes``) go to a target with ``put_many`` in batches
      (at most _BATCH_ITEMS items and ``part_bytes`` bytes, enough batches for every stream),
      each batch read in item order by one stream;
    - the first failure is raised after the tasks already in flight have finished; items not yet
      started are not started (in a batch, those its stream read before a failing read are
      published, none after it);
    - defaults come from ``profile_of(source)`` and ``profile_of(target)``: ``streams`` is the
      smaller concurrency, ``range_streams`` the source's concurrency (at most 8) when its
      ranges scale and else 1, ``part_bytes`` the source's part size, capped at 16 MiB when the
      source's requests are cheap (so reads overlap with the put);
    - ``progress(n)`` is called (never concurrently) with byte counts as data is handed to the
      target, and with the size of each skipped item; a tqdm bar is shown when ``show_progress``
      is true, or when it is None and stderr is a terminal.
    """
    todo = _validated(items)
    streams, range_streams, part_bytes = _settings(
        source, target, streams, range_streams, part_bytes
    )
    bar = _progress_bar(sum(item.size for item in todo), show_progress)
    lock = threading.Lock()

    def report(n: int) -> None:
        if n <= 0:
            return
        with lock:
            if progress is not None:
                progress(n)
            if bar is not None:
                bar.update(n)

    stop = threading.Event()
    copier = _Copier(source, target, range_streams, part_bytes, report, stop)
    copied = skipped = bytes_copied = bytes_skipped = 0
    first_error: BaseException | None = None
    pending: set[Future[list[tuple[CopyItem, bool]]]] = set()
    pool = ThreadPoolExecutor(max_workers=streams, thread_name_prefix="koochak-copy")
    try:
        queue = iter(_tasks(todo, target, streams, part_bytes))
        while True:
            # Keep at most `streams` tasks in flight so a failure stops new work promptly.
            while first_error is None and len(pending) < streams:
                task = next(queue, None)
                if task is None:
                    break
                if isinstance(task, CopyItem):
                    pending.add(pool.submit(lambda item: [(item, copier.copy(item))], task))
                else:
                    pending.add(pool.submit(copier.copy_batch, task))
            if not pending:
                break
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                error = future.exception()
                if error is not None:
                    if first_error is None:
                        first_error = error
                    else:  # only the first is raised; the others must not vanish silently
                        log.error("copy_objects: another item failed too: %s", error)
                    continue
                for item, was_copied in future.result():
                    if was_copied:
                        copied += 1
                        bytes_copied += item.size
                    else:
                        skipped += 1
                        bytes_skipped += item.size
    except BaseException:
        # Ctrl-C or similar in the caller's thread: abort in-flight puts (they leave nothing
        # visible) rather than waiting for large objects to finish.
        stop.set()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        if bar is not None:
            bar.close()
    if first_error is not None:
        raise first_error
    return CopyReport(copied, skipped, bytes_copied, bytes_skipped)


def _tasks(
    todo: list[CopyItem], target: Store, streams: int, part_bytes: int
) -> Iterator[CopyItem | list[CopyItem]]:
    """The work, in item order: each large item alone; small ones (one read each) in batches
    when the target can publish a batch for one flush (``put_many``), else alone too."""
    limit = min(part_bytes, _BATCH_OBJECT_BYTES)
    small = sum(1 for item in todo if item.size <= limit)
    if small < 2 or not capabilities_of(target).put_many:
        yield from todo
        return
    # Enough batches to keep every stream busy, each at most part_bytes and _BATCH_ITEMS.
    per_batch = max(1, min(_BATCH_ITEMS, -(-small // streams)))
    batch: list[CopyItem] = []
    held = 0
    for item in todo:
        if item.size > limit:
            yield item
            continue
        if batch and (len(batch) >= per_batch or held + item.size > part_bytes):
            yield batch if len(batch) > 1 else batch[0]
            batch, held = [], 0
        batch.append(item)
        held += item.size
    if batch:
        yield batch if len(batch) > 1 else batch[0]


def _validated(items: Iterable[CopyItem]) -> list[CopyItem]:
    todo = list(items)
    seen: set[str] = set()
    for item in todo:
        if not isinstance(item, CopyItem):
            raise TypeError(
                f"copy_objects: items must be CopyItem records, got {type(item).__name__}"
            )
        if isinstance(item.size, bool) or not isinstance(item.size, int) or item.size < 0:
            raise ValueError(
                f"copy_objects: item {item.key!r}: size must be an int >= 0, got {item.size!r}"
            )
        validate_key(item.key)
        validate_key(item.destination)
        if item.sha256 is not None and not _SHA256_RE.fullmatch(item.sha256):
            raise ValueError(
                f"copy_objects: item {item.key!r}: sha256 must be 64 lowercase hex digits, "
                f"got {item.sha256!r}"
            )
        if item.destination in seen:
            raise ValueError(
                f"copy_objects: target key {item.destination!r} appears twice in items"
            )
        seen.add(item.destination)
    return todo


def _settings(
    source: Store,
    target: Store,
    streams: int | None,
    range_streams: int | None,
    part_bytes: int | None,
) -> tuple[int, int, int]:
    src, dst = profile_of(source), profile_of(target)
    if streams is None:
        # The slower side limits how many transfers are useful at once.
        streams = max(1, min(src.concurrency, dst.concurrency))
    if range_streams is None:
        range_streams = (
            max(1, min(src.concurrency, _MAX_DEFAULT_RANGE_STREAMS)) if src.range_reads_scale else 1
        )
    if part_bytes is None:
        part_bytes = max(1, src.part_bytes)
        if min_object_bytes(src) <= _CHEAP_REQUEST_BYTES:
            part_bytes = min(part_bytes, _PIPELINE_PART_BYTES)
    for name, value in (
        ("streams", streams),
        ("range_streams", range_streams),
        ("part_bytes", part_bytes),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"copy_objects: {name} must be an int >= 1, got {value!r}")
    return streams, range_streams, part_bytes


def _progress_bar(total: int, show_progress: bool | None):  # -> tqdm | None
    if show_progress is None:
        show_progress = sys.stderr.isatty()
        if not show_progress:
            return None
        try:
            from tqdm import tqdm
        except ImportError:  # optional: stay quiet without it unless asked explicitly
            return None
    elif not show_progress:
        return None
    else:
        try:
            from tqdm import tqdm
        except ImportError as exc:
            raise ImportError(
                "copy_objects(show_progress=True) needs tqdm: pip install 'koochak-store[tqdm]'"
            ) from exc
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="copy", leave=False)


class _Copier:
    """Copies one item at a time (called from pool threads); shared settings, no per-item state."""

    def __init__(
        self,
        source: Store,
        target: Store,
        range_streams: int,
        part_bytes: int,
        report: Callable[[int], None],
        stop: threading.Event,
    ) -> None:
        self.source = source
        self.target = target
        self.range_streams = range_streams
        self.part_bytes = part_bytes
        self.report = report
        self.stop = stop

    def copy(self, item: CopyItem) -> bool:
        """Return True when copied, False when skipped (already present with the right size)."""
        if self._already_there(item):
            return False
        parts: Generator[bytes, None, None] | None = None
        if item.size <= self.part_bytes:
            data: bytes | Iterator[bytes] = self._read_small(item)
            done = len(data)
        else:
            data = parts = self._parts(item)
            done = 0  # reported part by part as the put consumes them
        try:
            self.target.put(
                item.destination, data, expected_size=item.size, expected_sha256=item.sha256
            )
        except FileExistsError:
            # Another process published the same key since our stat: fine if it is the same size.
            if self._already_there(item):
                return False
            raise
        finally:
            if parts is not None:
                parts.close()  # stop its read-ahead now, not whenever it is garbage collected
        self.report(done)
        return True

    def _read_small(self, item: CopyItem) -> bytes:
        # One byte past the expected end: a longer source fails without being read whole
        # (a stale size must not pull a huge object into memory).
        data = self.source.get(item.key, 0, item.size + 1)
        if len(data) != item.size:
            found = f"more than {item.size}" if len(data) > item.size else str(len(data))
            raise ValueError(
                f"copy_objects: source {self.source.location!r} key {item.key!r} has "
                f"{found} bytes, expected {item.size} (is the item's size right?)"
            )
        if self.stop.is_set():
            raise _Interrupted(f"copy of {item.key!r} interrupted")
        return data

    def copy_batch(self, items: list[CopyItem]) -> list[tuple[CopyItem, bool]]:
        """Copy small items with one ``target.put_many``: (item, copied) for each, in order."""
        results: list[tuple[CopyItem, bool]] = []
        batch: list[tuple[CopyItem, bytes]] = []
        failure: BaseException | None = None
        for item in items:
            try:
                if self._already_there(item):
                    results.append((item, False))
                else:
                    batch.append((item, self._read_small(item)))
            except BaseException as exc:
                # As one stream would: what was read before the failure is still published,
                # nothing after it is started.
                failure = exc
                break
        try:
            self.target.put_many(  # type: ignore[attr-defined]
                [(item.destination, data, item.size, item.sha256) for item, data in batch]
            )
        except FileExistsError:
            if failure is not None:
                raise failure from None
            # Someone published one of these since our stat: those before it are published,
            # the rest go one by one (copy() counts a same-size object as already there, so
            # in this rare race a few of our own may be reported as skipped).
            results.extend((item, self.copy(item)) for item, _ in batch)
            return results
        if failure is not None:
            raise failure
        for item, data in batch:
            self.report(len(data))
            results.append((item, True))
        return results

    def _already_there(self, item: CopyItem) -> bool:
        try:
            info = self.target.stat(item.destination)
        except FileNotFoundError:
            return False
        if info.size != item.size:
            raise FileExistsError(
                f"copy_objects: target {self.target.location!r} already has key "
                f"{item.destination!r} with {info.size} bytes, expected {item.size} "
                f"(copy of source key {item.key!r}); refusing to overwrite it. If it is what "
                f"a killed copy left on a store that publishes on close (publish='exclusive'), "
                f"delete it and rerun"
            )
        self.report(item.size)
        return True

    def _parts(self, item: CopyItem) -> Generator[bytes, None, None]:
        """Yield the object's bytes in order, reading up to `range_streams` ranges ahead."""
        size, part = item.size, self.part_bytes
        starts = iter(range(0, size, part))
        with ThreadPoolExecutor(
            max_workers=self.range_streams, thread_name_prefix="koochak-range"
        ) as pool:
            ahead: deque[tuple[int, Future[bytes]]] = deque()

            def read_ahead() -> None:
                while len(ahead) < self.range_streams:
                    start = next(starts, None)
                    if start is None:
                        return
                    end = min(start + part, size)
                    # One byte past the expected end of the last part: a source object longer
                    # than the item's size must fail, not be silently truncated.
                    ask = end + 1 if end == size else end
                    ahead.append((start, pool.submit(self.source.get, item.key, start, ask)))

            try:
                read_ahead()
                while ahead:
                    start, future = ahead.popleft()
                    data = future.result()
                    read_ahead()
                    expected = min(part, size - start)
                    if len(data) != expected:
                        raise ValueError(
                            f"copy_objects: source {self.source.location!r} key {item.key!r}: "
                            f"range [{start}, {start + expected}) returned {len(data)} bytes, "
                            f"expected {expected} (is the item's size {size} right?)"
                        )
                    if self.stop.is_set():
                        raise _Interrupted(f"copy of {item.key!r} interrupted")
                    yield data
                    self.report(len(data))
            finally:
                for _, future in ahead:
                    future.cancel()
