"""Verified reads for packed groups: whole packs (with retries and a shared cache) and scattered
single files (merged ranges, one open per pack).

Every byte handed out here has been checked against the manifest: a whole pack by its size and
SHA256, a single file by its own size and SHA256.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from koochak.data._concurrent import wait_all
from koochak.data.collection import FILES_KEY, FileEntry, PackInfo
from koochak.data.pull import merge_ranges
from koochak.storage.named import get_named, open_named

__all__ = ["PackCache", "fetch_object", "fetch_pack", "read_files"]

# Pause before retry n is _RETRY_WAIT * 2**n seconds (capped): a mount that just dropped a
# connection needs a moment, a corrupt read usually does not. Tests set it to 0.
_RETRY_WAIT = 0.05
_RETRY_WAIT_MAX = 2.0
DEFAULT_MAX_RANGE_BYTES = 64 << 20
# Neighbouring pack members are apart by their tar header (one 512-byte block, a few for long
# names): a gap this small is read along rather than costing another request. Larger gaps are
# not read, so scattered files cost their own bytes and never their whole groups.
NEIGHBOUR_GAP_BYTES = 4 << 10


class PackCache:
    """An LRU of verified pack bytes, at most ``max_bytes`` in all; safe to share between
    threads and streams (and across passes, which is the point: a hit skips the fetch).

    Entries are keyed by store location, pack key and SHA256, so one cache can serve several
    collections. A pack larger than ``max_bytes`` is never cached.
    """

    def __init__(self, max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"PackCache max_bytes={max_bytes!r}: expected a whole number >= 0")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._items: OrderedDict[tuple[str, str, str], bytes] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def get(self, key: tuple[str, str, str]) -> bytes | None:
        with self._lock:
            data = self._items.get(key)
            if data is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return data

    def put(self, key: tuple[str, str, str], data: bytes) -> None:
        if len(data) > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= len(old)
            self._items[key] = data
            self.bytes += len(data)
            while self.bytes > self.max_bytes:
                _, evicted = self._items.popitem(last=False)
                self.bytes -= len(evicted)


def _with_retries(what: str, retries: int, attempt_once: Any) -> bytes:
    last: BaseException | None = None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(min(_RETRY_WAIT * 2 ** (attempt - 1), _RETRY_WAIT_MAX))
        try:
            return attempt_once()
        except (OSError, ValueError) as exc:
            last = exc
    raise OSError(f"{what}: failed {retries + 1} time(s); last error: {last}") from last


def _checked(data: bytes, size: int, sha256: str, where: str) -> bytes:
    if len(data) != size:
        raise ValueError(f"{where}: got {len(data)} bytes, the manifest says {size}")
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise ValueError(f"{where}: SHA256 {digest} does not match the manifest's {sha256}")
    return data


def fetch_pack(store: Any, pack: PackInfo, *, retries: int, cache: PackCache | None) -> bytes:
    """The whole pack with one ``get``, its size and SHA256 checked against the manifest; a
    failed or corrupt fetch is retried ``retries`` times, then raises OSError naming the pack."""
    where = f"{store.location}/{pack.key}"
    cache_key = (store.location, pack.key, pack.sha256)
    if cache is not None:
        hit = cache.get(cache_key)
        if hit is not None:
            return hit
    data = _with_retries(
        f"pack {where}", retries, lambda: _checked(get_named(store, pack.key, named_by=FILES_KEY), pack.size, pack.sha256, where)
    )
    if cache is not None:
        cache.put(cache_key, data)
    return data


def fetch_object(store: Any, entry: FileEntry, *, retries: int) -> bytes:
    """A standalone object's bytes with one ``get``, checked like a pack."""
    where = f"{store.location}/{entry.key} ({entry.path})"
    return _with_retries(
        f"object {where}",
        retries,
        lambda: _checked(
            get_named(store, entry.key, named_by=FILES_KEY), entry.size, entry.sha256, where
        ),
    )


def _read_exact(handle: Any, start: int, length: int, where: str) -> bytes:
    # Read through the unbuffered stream where there is one: a buffered reader would read a
    # whole buffer ahead (8 MiB for LocalStore) for every range, not just the range's bytes.
    raw = getattr(handle, "raw", None) or handle
    raw.seek(start)
    parts: list[bytes] = []
    got = 0
    while got < length:
        chunk = raw.read(length - got)
        if not chunk:
            raise ValueError(
                f"{where}: bytes [{start}, {start + length}) requested, only {got} there; "
                "the pack is shorter than the manifest says"
            )
        parts.append(chunk)
        got += len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def read_files(
    store: Any,
    entries: Iterable[FileEntry],
    *,
    streams: int = 32,
    gap_bytes: int | None = None,
    max_range_bytes: int = DEFAULT_MAX_RANGE_BYTES,
) -> dict[str, bytes]:
    """``{path: bytes}`` of ``entries``: each pack opened once, neighbours merged into one range
    read, objects read with one ``get``, every file's size and SHA256 checked."""
    if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
        raise ValueError(f"streams={streams!r}: expected a whole number >= 1")
    if gap_bytes is None:
        gap_bytes = NEIGHBOUR_GAP_BYTES
    if isinstance(gap_bytes, bool) or not isinstance(gap_bytes, int) or gap_bytes < 0:
        raise ValueError(f"gap_bytes={gap_bytes!r}: expected a whole number >= 0")
    by_pack: dict[str, list[FileEntry]] = {}
    objects: list[FileEntry] = []
    seen: set[str] = set()
    for e in entries:
        if not isinstance(e, FileEntry):
            raise TypeError(f"read_files: expected FileEntry records, got {type(e).__name__}")
        if e.path in seen:
            continue
        seen.add(e.path)
        if e.pack is not None:
            by_pack.setdefault(e.pack, []).append(e)
        else:
            objects.append(e)
    out: dict[str, bytes] = {}
    lock = threading.Lock()

    def keep(e: FileEntry, data: bytes) -> None:
        _checked(data, e.size, e.sha256, f"{store.location}/{e.key} ({e.path})")
        with lock:
            out[e.path] = data

    def read_pack(job: tuple[str, list[FileEntry]]) -> None:
        key, members = job
        where = f"{store.location}/{key}"
        with open_named(store, key, named_by=FILES_KEY) as handle:
            for start, end, group in merge_ranges(
                members, gap_bytes=gap_bytes, max_range_bytes=max_range_bytes
            ):
                data = _read_exact(handle, start, end - start, where)
                if len(group) == 1:
                    keep(group[0], data)
                    continue
                view = memoryview(data)
                for e in group:
                    assert e.offset is not None
                    keep(e, bytes(view[e.offset - start : e.offset - start + e.size]))

    def read_object(e: FileEntry) -> None:
        keep(e, get_named(store, e.key, named_by=FILES_KEY))

    with ThreadPoolExecutor(max_workers=streams) as pool:
        futures = [pool.submit(read_pack, job) for job in sorted(by_pack.items())]
        futures += [pool.submit(read_object, e) for e in objects]
        wait_all(futures)
    return out


def as_entries(files: Mapping[str, FileEntry], items: Iterable[FileEntry | str]) -> list[FileEntry]:
    """Entries for a mix of FileEntry records and paths; an unknown path raises KeyError naming it."""
    chosen: list[FileEntry] = []
    for item in items:
        if isinstance(item, str):
            try:
                item = files[item]
            except KeyError:
                raise KeyError(f"read_files: {item!r} is not a file of the collection") from None
        chosen.append(item)
    return chosen
