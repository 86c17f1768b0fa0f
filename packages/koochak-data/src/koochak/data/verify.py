"""``verify``: check a committed collection against its manifest.

Shallow: every pack and object exists with the size the manifest gives (one stat each).
Deep: every byte is read once; each pack's SHA256 and each file's SHA256 are checked.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from koochak.data._digest import CHUNK, sha256_object
from koochak.data.collection import FILES_KEY, Collection, FileEntry, PackInfo, load_collection
from koochak.storage.named import open_named, stat_named

__all__ = ["Problem", "VerifyReport", "verify_collection"]


@dataclass(frozen=True)
class Problem:
    key: str  # the pack or object key
    path: str | None  # the file, when the problem is one file's bytes
    message: str

    def __str__(self) -> str:
        where = f"{self.key} ({self.path})" if self.path else self.key
        return f"{where}: {self.message}"


@dataclass(frozen=True)
class VerifyReport:
    location: str
    deep: bool
    files: int
    bytes: int
    packs: int
    objects: int
    bytes_read: int
    problems: tuple[Problem, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "location": self.location,
            "deep": self.deep,
            "ok": self.ok,
            "files": self.files,
            "bytes": self.bytes,
            "packs": self.packs,
            "objects": self.objects,
            "bytes_read": self.bytes_read,
            "problems": [
                {"key": p.key, "path": p.path, "message": p.message} for p in self.problems
            ],
        }


def verify_collection(
    store: Any,
    *,
    deep: bool = False,
    streams: int | None = None,
    progress: Callable[[int], None] | None = None,
    show_progress: bool | None = None,
) -> VerifyReport:
    """Verify the collection in ``store`` (a Store, path or ``scheme://``).

    A malformed manifest or file table raises ValueError (nothing can be checked against it);
    everything found wrong in the stored bytes is returned as problems.
    """
    from koochak.data._progress import progress_bar
    from koochak.storage.profile import profile_of
    from koochak.storage.store import open_store

    store = open_store(store)
    collection = load_collection(store)
    if streams is None:
        streams = max(1, min(profile_of(store).concurrency, os.cpu_count() or 1, 8))
    if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
        raise ValueError(f"streams={streams!r}: expected a whole number >= 1")
    members: dict[str, list[FileEntry]] = {p.key: [] for p in collection.manifest.packs}
    objects = []
    for e in collection.entries:
        if e.pack is not None:
            members[e.pack].append(e)
        else:
            objects.append(e)
    total = sum(p.size for p in collection.manifest.packs) + sum(e.size for e in objects)
    # Only a deep verify moves bytes; a size check is one stat per key and needs no bar.
    enabled = show_progress if deep else False
    with progress_bar(total, "verify", enabled=enabled, also=progress) as advance:
        def check_pack(pack: PackInfo) -> tuple[list[Problem], int]:
            return _check_pack(store, pack, members[pack.key], deep, advance)

        def check_object(entry: FileEntry) -> tuple[list[Problem], int]:
            return _check_object(store, entry, deep, advance)

        with ThreadPoolExecutor(max_workers=streams) as pool:
            results = list(pool.map(check_pack, collection.manifest.packs))
            results += list(pool.map(check_object, objects))
    problems = tuple(p for found, _ in results for p in found)
    return _report(store.location, collection, deep, sum(n for _, n in results), problems)


def _report(
    location: str, collection: Collection, deep: bool, read: int, problems: Sequence[Problem]
) -> VerifyReport:
    m = collection.manifest
    return VerifyReport(
        location=location, deep=deep, files=m.files, bytes=m.bytes, packs=len(m.packs),
        objects=m.objects, bytes_read=read, problems=tuple(problems),
    )


def _stat_problem(store: Any, key: str, size: int) -> Problem | None:
    try:
        found = stat_named(store, key, named_by=FILES_KEY).size
    except FileNotFoundError:
        return Problem(key, None, "missing")
    if found != size:
        return Problem(key, None, f"size {found}, manifest says {size}")
    return None


def _check_pack(
    store: Any, pack: PackInfo, members: list[FileEntry], deep: bool, advance: Callable[[int], None]
) -> tuple[list[Problem], int]:
    problem = _stat_problem(store, pack.key, pack.size)
    if problem is not None or not deep:
        return ([problem] if problem else []), 0
    problems: list[Problem] = []
    pack_sha = _PackHasher()  # the pack's digest on a helper thread, the files' on this one
    position = 0
    try:
        with open_named(store, pack.key, named_by=FILES_KEY) as handle:

            def read(n: int, file_sha: Any = None) -> int:
                nonlocal position
                got = 0
                while got < n:
                    chunk = handle.read(min(CHUNK, n - got))
                    if not chunk:
                        break
                    pack_sha.update(chunk)
                    if file_sha is not None:
                        file_sha.update(chunk)
                    got += len(chunk)
                    advance(len(chunk))
                position += got
                return got

            for e in sorted(members, key=lambda e: e.offset or 0):
                assert e.offset is not None
                read(e.offset - position)
                file_sha = hashlib.sha256()
                if read(e.size, file_sha) != e.size:
                    problems.append(Problem(pack.key, e.path, "pack ends inside this file"))
                    break
                if file_sha.hexdigest() != e.sha256:
                    problems.append(Problem(pack.key, e.path, "SHA256 differs from the manifest"))
            read(pack.size - position)
            if handle.read(1):
                problems.append(Problem(pack.key, None, "longer than the manifest says"))
        pack_digest = pack_sha.hexdigest()
    finally:
        pack_sha.close()
    if position != pack.size:
        problems.append(Problem(pack.key, None, f"read {position} bytes, manifest says {pack.size}"))
    elif pack_digest != pack.sha256:
        problems.append(Problem(pack.key, None, "pack SHA256 differs from the manifest"))
    return problems, position


class _PackHasher:
    """SHA256 of a pack's chunks on one helper thread, fed in batches of about a MiB, so it runs
    beside the per-file hashes on the reading thread (hashlib releases the GIL)."""

    _BATCH = 1 << 20

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="koochak-verify-pack")
        self._batch: list[bytes] = []
        self._held = 0
        self._pending: list[Any] = []

    def update(self, chunk: bytes) -> None:
        self._batch.append(chunk)  # bytes: never changed, so the hash may lag behind
        self._held += len(chunk)
        if self._held >= self._BATCH:
            self._flush()

    def _flush(self) -> None:
        if self._batch:
            batch, self._batch, self._held = self._batch, [], 0
            self._pending.append(self._pool.submit(_update_all, self._sha, batch))

    def hexdigest(self) -> str:
        self._flush()
        for future in self._pending:
            future.result()  # one worker: the updates ran in order
        self._pending = []
        return self._sha.hexdigest()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _update_all(sha: Any, chunks: list[bytes]) -> None:
    for chunk in chunks:
        sha.update(chunk)


def _check_object(
    store: Any, entry: FileEntry, deep: bool, advance: Callable[[int], None]
) -> tuple[list[Problem], int]:
    key = entry.key
    problem = _stat_problem(store, key, entry.size)
    if problem is not None or not deep:
        return ([problem] if problem else []), 0
    digest, got = sha256_object(store, key, progress=advance)
    if got != entry.size:
        return [Problem(key, entry.path, f"read {got} bytes, manifest says {entry.size}")], got
    if digest != entry.sha256:
        return [Problem(key, entry.path, "SHA256 differs from the manifest")], got
    return [], got
