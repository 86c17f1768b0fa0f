"""Immutable dataset shards: ShardWriter, the strict ``index.json``, verified reads.

A dataset is a directory (store prefix) of tar shards in the WebDataset layout plus an
``index.json`` listing every shard's key, size, SHA256 and record count. The index is written
last and create-only, so a dataset exists exactly when its index does; the SHA256 of the index
bytes is the dataset version. See docs/formats.md, "Dataset shards and index.json".
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any, BinaryIO

from koochak.data import _tar
from koochak.data._digest import SHA256_HEX, sha256_object
from koochak.data._shard_records import ShardEntry, ShardIndex, _join
from koochak.data.planning import assign_shards, plan_shards, worker_coordinates
from koochak.storage.named import open_named
from koochak.storage.profile import parse_size
from koochak.storage.store import Store, open_store, validate_key
from koochak.storage.strict_json import check_fields, loads_strict, require_version

__all__ = [
    "INDEX_KIND",
    "INDEX_NAME",
    "INDEX_VERSION",
    "ShardEntry",
    "ShardIndex",
    "ShardWriter",
    "TAR",
    "assign_shards",
    "describe_shard",
    "iter_worker_samples",
    "load_index",
    "parse_index",
    "plan_shards",
    "read_shard",
    "read_shards",
    "worker_coordinates",
    "write_index",
]

log = logging.getLogger(__name__)

INDEX_NAME = "index.json"
INDEX_KIND = "koochak.shards"
INDEX_VERSION = 1
TAR = "tar"  # ShardWriter(..., format=TAR): WebDataset-layout tar, the one format so far
FORMATS = (TAR,)
DEFAULT_TARGET_BYTES = 256 << 20

_INDEX_FIELDS = ("format", "kind", "metadata", "shards", "version")
_SHARD_FIELDS = ("key", "records", "sha256", "size")
# Shards are read in pieces that grow from the first to the last size; each is handed to the
# hashing thread as it arrives. Large enough that handing over costs nothing, small enough
# that the hash starts at once and never waits long for bytes.
_FIRST_PIECE = 1 << 20
_READ_PIECE = 8 << 20
_READ_CHUNK = 16 << 20

Sample = dict[str, Any]  # {"__key__": str, "<ext>": memoryview (or bytes with copy=True), ...}


# ---------------------------------------------------------------------------------------------
# Keys and the index document


def _clean_prefix(prefix: str) -> str:
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
    prefix = prefix.rstrip("/")  # "datasets/foo/" means "datasets/foo"; a leading "/" is refused
    return validate_key(prefix) if prefix else ""


def _index_bytes(format: str, metadata: Mapping[str, Any], entries: Iterable[ShardEntry]) -> bytes:
    document = {
        "kind": INDEX_KIND,
        "version": INDEX_VERSION,
        "format": format,
        "metadata": dict(metadata),
        "shards": [
            {"key": e.key, "size": e.size, "sha256": e.sha256, "records": e.records} for e in entries
        ],
    }
    # sort_keys and a fixed layout: the same dataset always gets the same bytes, hence version.
    return (json.dumps(document, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()


def _check_fields(obj: Mapping[str, Any], expected: tuple[str, ...], where: str) -> None:
    check_fields(obj, where, frozenset(expected))


def _count(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where} must be a non-negative integer, got {value!r}")
    return value


def parse_index(data: bytes, *, source: str = INDEX_NAME, prefix: str = "") -> ShardIndex:
    """Validate the bytes of an ``index.json`` and return the ShardIndex they describe.

    Anything but exactly the documented format raises ValueError naming ``source`` and the
    field: unknown or missing fields, another kind or version, unsafe or duplicate shard keys,
    negative sizes or counts, malformed digests.
    """
    document = loads_strict(data, source)
    if not isinstance(document, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(document).__name__}")
    _check_fields(document, _INDEX_FIELDS, source)
    if document["kind"] != INDEX_KIND:
        raise ValueError(f"{source}: field 'kind' must be {INDEX_KIND!r}, got {document['kind']!r}")
    require_version(document, source, INDEX_VERSION)  # exact int: true and 1.0 are refused
    if document["format"] not in FORMATS:
        raise ValueError(f"{source}: field 'format' must be one of {FORMATS}, got {document['format']!r}")
    if not isinstance(document["metadata"], dict):
        raise ValueError(f"{source}: field 'metadata' must be a JSON object")
    shards = document["shards"]
    if not isinstance(shards, list) or not shards:
        raise ValueError(f"{source}: field 'shards' must be a non-empty list")
    entries: list[ShardEntry] = []
    seen: set[str] = set()
    for i, item in enumerate(shards):
        where = f"{source}: shards[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where} must be a JSON object")
        _check_fields(item, _SHARD_FIELDS, where)
        key = item["key"]
        if not isinstance(key, str):
            raise ValueError(f"{where}.key must be a string, got {key!r}")
        try:
            validate_key(key)
        except ValueError as exc:
            raise ValueError(f"{where}.key is not a safe relative key: {exc}") from None
        if key == INDEX_NAME:
            raise ValueError(f"{where}.key must not name the index itself")
        if key in seen:
            raise ValueError(f"{where}.key {key!r} is listed twice")
        seen.add(key)
        sha256 = item["sha256"]
        if not isinstance(sha256, str) or not SHA256_HEX.fullmatch(sha256):
            raise ValueError(f"{where}.sha256 must be 64 lower-case hex digits, got {sha256!r}")
        entries.append(
            ShardEntry(
                key=key,
                size=_count(item["size"], f"{where}.size"),
                sha256=sha256,
                records=_count(item["records"], f"{where}.records"),
            )
        )
    return ShardIndex(
        prefix=prefix,
        format=document["format"],
        metadata=document["metadata"],
        shards=tuple(entries),
        version=hashlib.sha256(data).hexdigest(),
    )


def load_index(store: Store | str, prefix: str = "") -> ShardIndex:
    """Load and validate ``<prefix>/index.json`` from ``store`` (a Store or a location)."""
    store = open_store(store)
    prefix = _clean_prefix(prefix)
    key = _join(prefix, INDEX_NAME)
    data = store.get(key)
    return parse_index(data, source=f"{store.location}/{key}", prefix=prefix)


def _publish_index(
    store: Store, prefix: str, format: str, metadata: Mapping[str, Any], entries: list[ShardEntry]
) -> ShardIndex:
    if not entries:
        raise ValueError(f"{store.location}/{_join(prefix, INDEX_NAME)}: no shards; nothing committed")
    data = _index_bytes(format, metadata, entries)
    key = _join(prefix, INDEX_NAME)
    source = f"{store.location}/{key}"
    index = parse_index(data, source=source, prefix=prefix)  # never commit what we cannot read
    try:
        store.put(key, data, expected_size=len(data))
    except FileExistsError:
        existing = store.get(key)
        if existing != data:
            raise FileExistsError(
                f"{source} already commits a different dataset (version "
                f"{hashlib.sha256(existing).hexdigest()}, this build is {index.version}); "
                "datasets are immutable: write to a new prefix"
            ) from None
        log.info("%s: already committed with identical content", source)
    return index


def _check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise ValueError(f"metadata must be a mapping, got {type(metadata).__name__}")
    try:
        # Round-trip now so a bad value fails before any shard is written.
        return json.loads(json.dumps(dict(metadata), allow_nan=False, sort_keys=True))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"metadata must be JSON-serialisable: {exc}") from None


def _check_format(format: str) -> str:
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    return format


# ---------------------------------------------------------------------------------------------
# Writing


class ShardWriter:
    """Pack samples into ~``target_bytes`` tar shards under ``prefix``; ``close()`` commits.

    Use as a context manager: a clean exit writes ``index.json`` (the commit point); an exception
    leaves the shards written so far uncommitted (a rerun reuses them). Shards are published
    create-only as ``shard-000000.tar``, ... An existing shard with identical bytes (same size
    and SHA256) is reused; a different one raises FileExistsError.

    A sample is ``{"__key__": "some/key", "<ext>": bytes, ...}``. Keys must be unique within a
    shard (duplicates raise ValueError); make them unique across the dataset. The shard being
    filled is held in memory (up to ``target_bytes``, or one larger sample).
    """

    def __init__(
        self,
        store: Store | str,
        prefix: str,
        *,
        target_bytes: int | str = DEFAULT_TARGET_BYTES,
        format: str = TAR,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        self.store = open_store(store)
        self.prefix = _clean_prefix(prefix)
        self.format = _check_format(format)
        self.target_bytes = parse_size(target_bytes)
        if self.target_bytes <= 0:
            raise ValueError(f"target_bytes must be positive, got {target_bytes!r}")
        self.metadata = _check_metadata(metadata)
        self._entries: list[ShardEntry] = []
        self._reused = 0
        self._index: ShardIndex | None = None
        self._closed = False
        self._start_shard()

    # The shard being filled: its bytes so far and the keys it holds.
    def _start_shard(self) -> None:
        self._buffer = bytearray()
        self._keys: set[str] = set()

    @property
    def shards_reused(self) -> int:
        """Shards that already existed with identical bytes (a resumed build)."""
        return self._reused

    def write(self, sample: Mapping[str, Any]) -> None:
        """Add one sample; may publish the current shard first if the sample would overflow it."""
        if self._closed:
            raise ValueError(f"ShardWriter for {self.store.location}/{self.prefix} is closed")
        chunks = _tar.encode_sample(sample)
        nbytes = sum(len(chunk) for chunk in chunks)
        if self._keys and len(self._buffer) + nbytes + len(_tar.END_OF_ARCHIVE) > self.target_bytes:
            self._publish_or_abort()
        key = sample["__key__"]
        if key in self._keys:
            raise ValueError(f"sample key {key!r} was already written to this shard")
        self._keys.add(key)
        # One contiguous buffer per shard: put() then writes it in large pieces and hashes it
        # on its own thread while writing, instead of one write and one hash call per member.
        for chunk in chunks:
            self._buffer += chunk

    def _publish_shard(self) -> None:
        self._buffer += _tar.END_OF_ARCHIVE
        size = len(self._buffer)
        name = f"shard-{len(self._entries):06d}.{self.format}"
        key = _join(self.prefix, name)
        try:
            info = self.store.put(key, self._buffer, expected_size=size)
            # The digest put computed of exactly the bytes it wrote: no second pass of our own
            # (a store that does not report one gets the shard hashed here).
            digest = info.sha256 or hashlib.sha256(self._buffer).hexdigest()
        except FileExistsError:
            digest = hashlib.sha256(self._buffer).hexdigest()
            self._check_existing(key, size, digest)
            self._reused += 1
        self._entries.append(ShardEntry(name, size, digest, len(self._keys)))
        self._start_shard()

    def _check_existing(self, key: str, size: int, digest: str) -> None:
        where = f"{self.store.location}/{key}"
        info = self.store.stat(key)
        if info.size == size and sha256_object(self.store, key, chunk=_READ_CHUNK)[0] == digest:
            log.info("%s: reusing identical shard from an earlier build", where)
            return
        raise FileExistsError(
            f"{where} already exists with different content (size {info.size}; this build "
            f"produced {size} bytes, sha256 {digest}); an earlier build with other records left "
            "it: delete that prefix or write to a new one"
        )

    def close(self) -> ShardIndex:
        """Publish the last shard, then ``index.json``; return the committed index."""
        if self._index is not None:
            return self._index
        if self._closed:
            raise ValueError(f"ShardWriter for {self.store.location}/{self.prefix} was aborted")
        if self._keys:
            self._publish_or_abort()
        self._closed = True
        self._index = _publish_index(
            self.store, self.prefix, self.format, self.metadata, self._entries
        )
        return self._index

    def _publish_or_abort(self) -> None:
        try:
            self._publish_shard()
        except BaseException:
            self.abort()  # a writer whose shard failed to publish accepts nothing more
            raise

    def abort(self) -> None:
        """Stop without committing: published shards stay (a rerun reuses them), no index."""
        self._closed = True
        self._start_shard()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_index(
    store: Store | str,
    prefix: str,
    keys: Iterable[str],
    *,
    format: str = TAR,
    metadata: Mapping[str, Any] | None = None,
) -> ShardIndex:
    """Index pre-existing shard files: describe each of ``keys`` (relative to ``prefix``) and
    commit ``<prefix>/index.json`` create-only. Every shard is read in full once."""
    store = open_store(store)
    prefix = _clean_prefix(prefix)
    _check_format(format)
    meta = _check_metadata(metadata)
    if isinstance(keys, str):
        raise TypeError("keys must be an iterable of shard keys, not a single str")
    names = list(keys)
    seen: set[str] = set()
    for key in names:  # all keys are checked before any shard is read
        validate_key(key)
        if key in seen:
            raise ValueError(f"write_index: shard key {key!r} is listed twice")
        if key == INDEX_NAME:
            raise ValueError(f"write_index: {INDEX_NAME!r} cannot be a shard")
        seen.add(key)
    entries: list[ShardEntry] = []
    for key in names:
        described = describe_shard(store, _join(prefix, key))
        entries.append(ShardEntry(key, described.size, described.sha256, described.records))
    return _publish_index(store, prefix, format, meta, entries)


# ---------------------------------------------------------------------------------------------
# Reading


def describe_shard(store: Store | str, key: str) -> ShardEntry:
    """Size, SHA256 and record count of the tar shard at store key ``key`` (read in full once).

    Memory: the shard's size, for as long as the call runs."""
    store = open_store(store)
    source = f"{store.location}/{key}"
    # The stat'ed size bounds the read, so a hostile header claiming a huge member cannot make
    # the reader allocate more than the object holds.
    size = store.stat(key).size
    samples, digest = _parse_whole(
        store, key, size, source, expected_sha256=None, hash=True, checksums=True,
        expected_by="stat",
    )  # fmt: skip
    return ShardEntry(key, size, digest or "", len(samples))


def read_shard(
    store: Store | str,
    index: ShardIndex,
    shard: ShardEntry | str,
    *,
    verify: bool = True,
    copy: bool = False,
) -> Iterator[Sample]:
    """Read one shard of ``index`` and return an iterator over its samples.

    The whole shard is read into one buffer and checked before this returns, so no sample of
    a bad shard is ever handed out: its size must match the index, with ``verify`` its SHA256
    too (hashed on a helper thread while the next bytes arrive), and only then are its tar
    structure and record count checked and its samples cut out of that same buffer — bytes
    that change on disk after they were read cannot reach a sample. Any mismatch raises
    ValueError naming the shard and the field. ``verify=False`` skips the SHA256 (the tar
    header checksums are checked instead).

    Field values are read-only ``memoryview`` slices of the shard's buffer (no copy): they stay
    valid for as long as they are referenced, whatever is read next, and keep the whole
    shard's buffer (about its size) in memory while any one of them is. ``bytes(value)`` keeps
    a piece on its own; ``copy=True`` hands out ``bytes`` instead (one copy per field, and
    samples that pickle, e.g. to leave a DataLoader worker undecoded).
    """
    store = open_store(store)
    return iter(_load_shard(store, index, _entry_of(index, shard), verify, copy, _SPARE_BUFFERS))


def read_shards(
    store: Store | str,
    index: ShardIndex,
    shards: Iterable[ShardEntry | str] | None = None,
    *,
    verify: bool = True,
    prefetch: int = 1,
    copy: bool = False,
) -> Iterator[Sample]:
    """Samples of ``shards`` (default: all of ``index``) in order, each shard as read_shard.

    Up to ``prefetch`` shards ahead are read and verified in background threads while the
    current one is consumed, so hashing and I/O overlap with the caller's own work (and with
    each other: hashlib releases the GIL, so ``prefetch`` shards hash on that many cores).
    Memory: about ``prefetch + 1`` shards, plus any shard a sample the caller still holds
    points into. The first bad shard raises ValueError when reached, after every sample before
    it and none from it.
    """
    store = open_store(store)
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an integer >= 0, got {prefetch!r}")
    entries = [_entry_of(index, s) for s in (index.shards if shards is None else shards)]
    # Buffers of shards whose samples are all gone are refilled instead of freshly allocated
    # (new memory costs page faults that can take as long as reading the bytes); the first
    # come from, and the last go back to, the spare buffers that read_shard calls share.
    buffers = _Buffers(prefetch + 2, spare=_SPARE_BUFFERS)
    if prefetch == 0:
        try:
            for entry in entries:
                yield from _load_shard(store, index, entry, verify, copy, buffers)
        finally:
            buffers.close()
        return
    pool = ThreadPoolExecutor(max_workers=prefetch, thread_name_prefix="koochak-shard-read")
    pending: deque[Future[list[Sample]]] = deque()
    try:
        upcoming = iter(entries)
        for entry in upcoming:
            pending.append(pool.submit(_load_shard, store, index, entry, verify, copy, buffers))
            if len(pending) >= prefetch:
                break
        while pending:
            samples = pending.popleft().result()
            for entry in upcoming:
                pending.append(pool.submit(_load_shard, store, index, entry, verify, copy, buffers))
                break
            yield from samples
            del samples  # let the shard's memory go before the next one is awaited
    finally:
        for future in pending:
            future.cancel()
        pool.shutdown(wait=True)
        buffers.close()


def _load_shard(
    store: Store,
    index: ShardIndex,
    entry: ShardEntry,
    verify: bool,
    copy: bool,
    buffers: _Buffers | None,
) -> list[Sample]:
    key = index.key_of(entry)
    source = f"{store.location}/{key}"
    buffer = None if buffers is None else buffers.take(entry.size)
    samples, _ = _parse_whole(
        store,
        key,
        entry.size,
        source,
        expected_sha256=entry.sha256 if verify else None,
        checksums=not verify,
        copy=copy,
        buffer=buffer,
    )
    if buffers is not None and buffer is not None:
        buffers.give(buffer)  # reused once the caller has let go of every sample
    if len(samples) != entry.records:
        raise ValueError(
            f"{source}: records mismatch: index says {entry.records}, shard holds {len(samples)}"
        )
    return samples


def _parse_whole(
    store: Store,
    key: str,
    size: int,
    source: str,
    *,
    expected_sha256: str | None,
    hash: bool = False,
    checksums: bool,
    copy: bool = False,
    expected_by: str = "index",
    buffer: bytearray | None = None,
) -> tuple[list[Sample], str | None]:
    """Read object ``key`` whole (see _read_whole) and parse its samples while the hash of the
    last pieces finishes: (samples, hex digest, None unless hashed).

    With ``expected_sha256`` the digest is compared first, so no sample of a shard whose digest
    did not match ever leaves, and a corrupt shard is reported as the root cause (a digest
    mismatch), not as whichever structural error the corruption caused. The samples are cut
    from the very buffer that was hashed: bytes that change on disk later cannot reach one.
    """
    data, digest_of = _read_whole(
        store,
        key,
        size,
        source,
        hash=hash or expected_sha256 is not None,
        expected_by=expected_by,
        buffer=buffer,
    )
    error: ValueError | None = None
    try:
        try:
            # Parsing runs on this thread while the helper thread still hashes.
            samples = _tar.parse_samples(data, source, checksums=checksums, copy=copy)
        except ValueError as exc:
            samples, error = [], exc
    finally:
        digest = digest_of()
    if expected_sha256 is not None and digest != expected_sha256:
        raise ValueError(
            f"{source}: sha256 mismatch: index says {expected_sha256}, shard bytes hash to {digest}"
        )
    if error is not None:
        raise error
    return samples, digest


def _entry_of(index: ShardIndex, shard: ShardEntry | str) -> ShardEntry:
    name = shard.key if isinstance(shard, ShardEntry) else shard
    entry = index.entries_by_key.get(name)
    if entry is None:
        raise ValueError(f"shard {name!r} is not listed in the index at {index.prefix or '.'!r}")
    if isinstance(shard, ShardEntry) and shard != entry:
        raise ValueError(f"shard {name!r} does not match its entry in the index")
    return entry


def _read_whole(
    store: Store,
    key: str,
    size: int,
    source: str,
    *,
    hash: bool,
    expected_by: str = "index",
    buffer: bytearray | None = None,
) -> tuple[memoryview, Callable[[], str | None]]:
    """Exactly ``size`` bytes of object ``key`` in one buffer (``buffer``, at least ``size``
    long and referenced by no view, or a new one) as a read-only view, and a function that
    waits for their SHA256 (None without ``hash``); call it exactly once, also after a failure
    in between. A shorter or longer object raises ValueError.

    The buffer is filled piece by piece, and each piece is hashed on a helper thread while the
    next one is read (hashlib releases the GIL on large buffers); a piece is never written
    again once read, so the hash may lag behind the reads and the caller may parse the view
    before it finishes. Nothing reads past ``size``, so a lying size costs no more memory than
    it claims.
    """
    expected = f"{expected_by} says {size} bytes"
    view = memoryview(bytearray(size) if buffer is None else buffer)[:size]
    digest = hashlib.sha256() if hash else None
    hasher = (
        ThreadPoolExecutor(1, thread_name_prefix="koochak-shard-hash")
        if hash and size > _FIRST_PIECE
        else None
    )
    updates: list[Future[None]] = []

    def finish() -> str | None:
        if hasher is not None:
            hasher.shutdown(wait=True)
            for update in updates:
                update.result()
        return None if digest is None else digest.hexdigest()

    try:
        with open_named(store, key, named_by=expected_by) as f:
            readinto = _readinto_of(f)
            got, piece = 0, _FIRST_PIECE
            while got < size:
                n = readinto(view[got : got + piece])
                if not n:
                    raise ValueError(f"{source}: size mismatch: {expected}, shard has {got}")
                if hasher is not None:
                    # One worker runs the updates in submission order: the digest is sequential.
                    updates.append(hasher.submit(digest.update, view[got : got + n]))  # type: ignore[union-attr]
                elif digest is not None:
                    digest.update(view[got : got + n])
                got += n
                piece = min(piece * 2, _READ_PIECE)  # small first, so hashing starts at once
            if readinto(memoryview(bytearray(1))):
                raise ValueError(f"{source}: size mismatch: {expected}, shard is longer")
    except BaseException:
        if hasher is not None:
            # The digest of a failed read is not wanted: drop the updates not yet run.
            hasher.shutdown(wait=True, cancel_futures=True)
        raise
    return view.toreadonly(), finish


class _Buffers:
    """Shard buffers, refilled once no sample points into them any more.

    A bytearray cannot be resized while a memoryview of it exists, so a failed one-byte
    shrink is proof that some sample still holds the buffer; only a buffer that shrinks is
    reused. At most ``keep`` buffers (and ``max_bytes`` in all) are kept.
    """

    def __init__(
        self, keep: int, max_bytes: int | None = None, spare: _Buffers | None = None
    ) -> None:
        self._keep, self._max_bytes, self._spare = keep, max_bytes, spare
        self._buffers: list[bytearray] = []
        self._lock = threading.Lock()

    def clear(self) -> None:
        self._buffers = []
        self._lock = threading.Lock()

    def take(self, size: int) -> bytearray:
        with self._lock:
            for i, buffer in enumerate(self._buffers):
                if len(buffer) >= size and _unreferenced(buffer):
                    return self._buffers.pop(i)
        if self._spare is not None:
            return self._spare.take(size)
        # Room to spare, so the buffer also fits the next shard, which is rarely the same size.
        return bytearray(size + (size >> 4))

    def close(self) -> None:
        """Hand the buffers kept here to the spare pool (which keeps what its bounds allow)."""
        with self._lock:
            buffers, self._buffers = self._buffers, []
        if self._spare is not None:
            for buffer in buffers:
                self._spare.give(buffer)

    def give(self, buffer: bytearray) -> None:
        with self._lock:
            if self._max_bytes is not None and len(buffer) > self._max_bytes:
                return
            self._buffers.append(buffer)
            while len(self._buffers) > self._keep or (
                self._max_bytes is not None and sum(map(len, self._buffers)) > self._max_bytes
            ):
                # Forget the smallest: the next shard is likelier to fit a large one.
                self._buffers.remove(min(self._buffers, key=len))


# read_shard's spare buffers, shared by every call in the process: a loop of read_shard calls
# then refills the buffers of shards it is done with instead of paying for fresh memory (page
# faults cost about as much as reading the bytes). Bounded so that an idle process keeps at
# most this much; larger shards get fresh buffers, as a plain f.read() of them would.
_SPARE_BUFFERS = _Buffers(keep=2, max_bytes=128 << 20)
if hasattr(os, "register_at_fork"):  # a forked DataLoader worker starts with none (and a free lock)
    os.register_at_fork(after_in_child=_SPARE_BUFFERS.clear)


def _unreferenced(buffer: bytearray) -> bool:
    if not buffer:
        return True  # nothing in it to overwrite
    try:
        last = buffer.pop()  # raises BufferError while any memoryview of it is alive
    except BufferError:
        return False
    buffer.append(last)  # within the allocation: no copy
    return True


def _readinto_of(f: BinaryIO) -> Callable[[memoryview], int | None]:
    """A ``readinto`` for ``f`` that puts bytes straight into the caller's buffer."""
    raw = getattr(f, "raw", None)
    if isinstance(f, io.BufferedReader) and raw is not None:
        try:
            if f.tell() == raw.tell():  # nothing buffered yet: read around the buffer
                return raw.readinto
        except (OSError, ValueError):
            pass  # not seekable: stay on the buffered reader
    readinto = getattr(f, "readinto", None)
    if callable(readinto):
        return readinto

    def copy_into(view: memoryview) -> int:
        data = f.read(len(view))
        view[: len(data)] = data
        return len(data)

    return copy_into


# ---------------------------------------------------------------------------------------------
# PyTorch adapter, built on first use so that importing koochak.data never imports torch.


def iter_worker_samples(
    store: Store | str,
    index: ShardIndex,
    *,
    rank: int = 0,
    world_size: int = 1,
    epoch: int = 0,
    seed: int = 0,
    verify: bool = True,
    prefetch: int = 1,
    copy: bool = False,
) -> Iterator[Sample]:
    """Samples of the shards this process's worker owns this epoch (see plan_shards), read
    with read_shards; call it inside the DataLoader worker, where the data is read."""
    worker_id, num_workers = worker_coordinates(rank=rank, world_size=world_size)
    shards = assign_shards(index, worker_id, num_workers, epoch=epoch, seed=seed)
    yield from read_shards(store, index, shards, verify=verify, prefetch=prefetch, copy=copy)


def _make_shard_dataset() -> type:
    from torch.utils.data import IterableDataset

    class ShardDataset(IterableDataset):  # type: ignore[misc, type-arg]
        """A ``torch.utils.data.IterableDataset`` over a committed shard dataset.

        Build it in the main process with the DDP rank and world size; each DataLoader worker
        then reads only the shards plan_shards deals it. Call ``set_epoch`` before each epoch.
        Samples hold ``bytes`` by default (``copy=True``): DataLoader workers pickle what they
        yield, and a memoryview cannot be pickled; a subclass that decodes in the worker can
        pass ``copy=False`` and skip the copy.
        """

        def __init__(
            self,
            store: Store | str,
            prefix: str = "",
            *,
            rank: int = 0,
            world_size: int = 1,
            epoch: int = 0,
            seed: int = 0,
            verify: bool = True,
            prefetch: int = 1,
            copy: bool = True,
        ) -> None:
            self.store = open_store(store)
            self.index = load_index(self.store, prefix)
            self.rank, self.world_size = rank, world_size
            self.epoch, self.seed, self.verify, self.prefetch = epoch, seed, verify, prefetch
            self.copy = copy
            worker_coordinates(rank=rank, world_size=world_size)  # validate now, not in a worker

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __iter__(self) -> Iterator[Sample]:
            return iter_worker_samples(
                self.store,
                self.index,
                rank=self.rank,
                world_size=self.world_size,
                epoch=self.epoch,
                seed=self.seed,
                verify=self.verify,
                prefetch=self.prefetch,
                copy=self.copy,
            )

    ShardDataset.__module__ = __name__
    ShardDataset.__qualname__ = "ShardDataset"
    return ShardDataset


def __getattr__(name: str) -> Any:
    # ShardDataset subclasses torch's IterableDataset, so the class is built (and torch imported)
    # only when someone asks for it. Cached in the module so pickling finds the same class.
    if name == "ShardDataset":
        cls = _make_shard_dataset()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
