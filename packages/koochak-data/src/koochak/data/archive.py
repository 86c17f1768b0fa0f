"""``archive``: pack a local tree into a collection (see :mod:`koochak.data.collection`).

The run reads top to bottom:

1. scan the source (walk it, or take ``--files-from``), refusing symlinks and special files;
2. plan: group files (``--groups`` table, else by directory), put large files aside as objects,
   deal groups into tar packs so each group is contiguous in one pack (larger groups spill);
3. write each pack with one create-only streaming ``put``, then its record
   ``records/pack-NNNNNN.json``; a rerun reuses packs whose record (or content) matches the plan
   and refuses leftovers that do not;
4. copy objects with ``copy_objects`` (SHA256 checked in flight);
5. write ``files.jsonl.gz``, then ``manifest.json`` — the commit point;
6. with ``delete_source``: deep-verify the committed collection, then delete the sources whose
   size and mtime still match.
"""

from __future__ import annotations

import csv
import datetime
import hashlib
import json
import math
import os
import queue
import stat
import tarfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from koochak.data import _tar
from koochak.data._digest import SHA256_HEX, sha256_object
from koochak.data._tar import padded
from koochak.data.collection import (
    FILES_KEY,
    KIND,
    MANIFEST_KEY,
    OBJECT_PREFIX,
    RECORD_PREFIX,
    TAR_BLOCK,
    TAR_END,
    VERSION,
    Collection,
    FileEntry,
    FilesTable,
    Manifest,
    PackInfo,
    check_relative_path,
    encode_files_table,
    encode_manifest,
    load_collection,
    matches_any,
    selected_by,
)
from koochak.storage.strict_json import is_exact_int, loads_strict, require_version

__all__ = [
    "ArchivePlan",
    "ArchiveReport",
    "SourceFile",
    "archive_tree",
    "plan_archive",
    "read_groups",
    "scan_source",
]

DEFAULT_PACK_BYTES = 64 << 20
RECORD_KIND = "koochak.collection.pack-record"
_CHUNK = 1 << 20
# Pack bytes handed to the store per piece: big enough for its hashing to overlap writing.
_STREAM_BUFFER = 4 << 20
Progress = Callable[[int], None]


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the source root, POSIX separators
    size: int
    mtime_ns: int
    mode: int  # permission bits
    # What else the scan saw, to tell (like tar) that the file changed while it was read: a
    # rewrite that keeps size and mtime still moves ctime; a replacement has another inode.
    ctime_ns: int = field(default=-1, compare=False)
    inode: tuple[int, int] = field(default=(-1, -1), compare=False)  # (st_dev, st_ino)


@dataclass(frozen=True)
class Member:
    """A planned pack member: its file, group, and where its data starts inside the pack."""

    file: SourceFile
    group: str
    offset: int


@dataclass(frozen=True)
class PackPlan:
    key: str
    members: tuple[Member, ...]
    size: int

    @property
    def record_key(self) -> str:
        return RECORD_PREFIX + self.key.rsplit("/", 1)[-1].replace(".tar", ".json")


@dataclass(frozen=True)
class ObjectPlan:
    file: SourceFile
    group: str
    key: str


@dataclass(frozen=True)
class ArchivePlan:
    packs: tuple[PackPlan, ...]
    objects: tuple[ObjectPlan, ...]
    pack_bytes: int
    object_bytes: int
    layout: str

    @property
    def files(self) -> int:
        return sum(len(p.members) for p in self.packs) + len(self.objects)

    @property
    def bytes(self) -> int:
        return sum(m.file.size for p in self.packs for m in p.members) + sum(
            o.file.size for o in self.objects
        )


@dataclass
class ArchiveReport:
    """What an archive run found and did. ``to_dict`` is the ``--json`` form."""

    source: str
    dest: str
    files: int = 0
    bytes: int = 0
    packs: int = 0
    pack_bytes: int = 0
    objects: int = 0
    object_bytes: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=dict)
    dry_run: bool = False
    already_committed: bool = False
    packs_reused: int = 0
    objects_reused: int = 0
    verified: bool | None = None
    problems: list[str] = field(default_factory=list)
    deleted: int = 0
    kept_changed: list[str] = field(default_factory=list)
    unmatched_group_rows: int = 0  # groups-table rows naming no archived file (a typo?)
    unmatched_group_paths: list[str] = field(default_factory=list)  # the first 20 of them

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# ----------------------------------------------------------------------------- scanning


@dataclass(frozen=True)
class _Filters:
    include: tuple[str, ...]
    exclude: tuple[str, ...]
    skip_symlinks: bool
    newer_than_ns: int | None  # files modified after this are skipped


def scan_source(
    src: str | os.PathLike[str],
    *,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    skip_symlinks: bool = False,
    min_age_hours: float | None = None,
    files_from: Sequence[str] | None = None,
    listed_in: str = "--files-from",
    now_ns: int | None = None,
) -> tuple[list[SourceFile], dict[str, int]]:
    """The regular files to archive under ``src`` (sorted by path) and counts of what was skipped.

    Excluded directories are pruned (never entered); ``include`` keeps only files that a glob
    matches, or whose parent directory it matches (``train`` keeps the tree); an ``include``
    glob that keeps nothing is a ValueError.
    A symlink raises ValueError unless ``skip_symlinks`` or excluded; a special file (FIFO,
    socket, device) always raises unless excluded. ``files_from`` names the exact relative paths
    to take instead of walking (its lines; errors name ``listed_in`` and the line number).
    """
    root = os.fspath(src)
    if not os.path.isdir(root):
        raise ValueError(f"archive SRC {root!r} is not a directory")
    if min_age_hours is not None and not (
        isinstance(min_age_hours, (int, float))
        and not isinstance(min_age_hours, bool)
        and math.isfinite(min_age_hours)
        and min_age_hours >= 0
    ):
        raise ValueError(f"--min-age-hours {min_age_hours}: expected a finite number >= 0")
    now_ns = time.time_ns() if now_ns is None else now_ns
    filters = _Filters(
        include=tuple(include),
        exclude=tuple(exclude),
        skip_symlinks=skip_symlinks,
        newer_than_ns=None if min_age_hours is None else now_ns - int(min_age_hours * 3600e9),
    )
    skipped = {"excluded": 0, "not_included": 0, "symlinks": 0, "too_new": 0}
    if files_from is not None:
        files = _scan_listed(root, files_from, filters, skipped, listed_in)
    else:
        files = _walk(root, filters, skipped)
    files.sort(key=lambda f: f.path)
    for pattern in include:
        # A glob that selects nothing is almost always a typo; saying so beats "0 files".
        if not any(selected_by(f.path, [pattern]) for f in files):
            raise ValueError(f"--include {pattern!r} selects no file to archive under {root}")
    return files, skipped


def _consider(
    root: str, rel: str, st: os.stat_result, filters: _Filters, skipped: dict[str, int]
) -> SourceFile | None:
    """Apply the filters to one non-directory entry; None when it is skipped."""
    if filters.exclude and matches_any(rel, filters.exclude):
        skipped["excluded"] += 1
        return None
    if stat.S_ISLNK(st.st_mode):
        if filters.skip_symlinks:
            skipped["symlinks"] += 1
            return None
        raise ValueError(
            f"{os.path.join(root, rel)} is a symlink; pass --skip-symlinks or --exclude it"
        )
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(
            f"{os.path.join(root, rel)} is a special file (not a regular file); --exclude it"
        )
    if filters.include and not selected_by(rel, filters.include):
        skipped["not_included"] += 1
        return None
    if filters.newer_than_ns is not None and st.st_mtime_ns > filters.newer_than_ns:
        skipped["too_new"] += 1
        return None
    return SourceFile(
        rel,
        st.st_size,
        st.st_mtime_ns,
        stat.S_IMODE(st.st_mode),
        st.st_ctime_ns,
        (st.st_dev, st.st_ino),
    )


def _utf8(root: str, rel: str) -> str:
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            f"{os.path.join(root, rel)!r}: file name is not valid UTF-8; rename or --exclude it"
        ) from None
    return rel


def _walk(root: str, filters: _Filters, skipped: dict[str, int]) -> list[SourceFile]:
    files: list[SourceFile] = []
    pending = [""]
    while pending:
        rel_dir = pending.pop()
        with os.scandir(os.path.join(root, rel_dir) if rel_dir else root) as it:
            entries = list(it)
        for entry in entries:
            rel = _utf8(root, f"{rel_dir}/{entry.name}" if rel_dir else entry.name)
            if entry.is_dir(follow_symlinks=False):
                if filters.exclude and matches_any(rel, filters.exclude):
                    skipped["excluded"] += 1  # pruned: nothing below it is visited
                else:
                    pending.append(rel)
                continue
            found = _consider(root, rel, entry.stat(follow_symlinks=False), filters, skipped)
            if found is not None:
                files.append(found)
    return files


def _scan_listed(
    root: str, listed: Sequence[str], filters: _Filters, skipped: dict[str, int], listed_in: str
) -> list[SourceFile]:
    files: list[SourceFile] = []
    seen: set[str] = set()
    safe_dirs: set[str] = set()
    for number, line in enumerate(listed, start=1):
        rel = line.rstrip("\r\n")
        if not rel:
            continue
        where = f"{listed_in} line {number}"
        while rel.startswith("./"):
            rel = rel[2:]
        check_relative_path(rel, where)
        if rel in seen:
            raise ValueError(f"{where}: {rel!r} is listed twice")
        seen.add(rel)
        _check_parents(root, rel, safe_dirs, where)
        try:
            st = os.lstat(os.path.join(root, rel))
        except FileNotFoundError:
            raise ValueError(f"{where}: {os.path.join(root, rel)} does not exist") from None
        if stat.S_ISDIR(st.st_mode):
            raise ValueError(f"{where}: {rel!r} is a directory; list files, not directories")
        found = _consider(root, rel, st, filters, skipped)
        if found is not None:
            files.append(found)
    return files


def _check_parents(root: str, rel: str, safe: set[str], where: str) -> None:
    # A listed path must not reach its file through a symlinked directory.
    parts = rel.split("/")[:-1]
    for i in range(1, len(parts) + 1):
        parent = "/".join(parts[:i])
        if parent in safe:
            continue
        try:
            st = os.lstat(os.path.join(root, parent))
        except FileNotFoundError:
            raise ValueError(f"{where}: {os.path.join(root, parent)} does not exist") from None
        if not stat.S_ISDIR(st.st_mode):
            raise ValueError(f"{where}: {os.path.join(root, parent)} is not a plain directory")
        safe.add(parent)


# ----------------------------------------------------------------------------- planning


def read_groups(path: str | os.PathLike[str]) -> dict[str, tuple[str, int]]:
    """Read a groups table (``path,group[,order]``; an optional header row) -> path: (group, order).

    Without an ``order`` column, files keep the order of their rows.
    """
    table: dict[str, tuple[str, int]] = {}
    name = os.fspath(path)
    # utf-8-sig: a table saved by a spreadsheet starts with a byte-order mark.
    with open(name, newline="", encoding="utf-8-sig") as handle:
        for number, row in enumerate(csv.reader(handle), start=1):
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            if number == 1 and [c.strip().lower() for c in row[:2]] == ["path", "group"]:
                continue
            where = f"{name} line {number}"
            if len(row) not in (2, 3):
                raise ValueError(f"{where}: expected path,group[,order], got {len(row)} columns")
            rel = row[0]
            while rel.startswith("./"):
                rel = rel[2:]
            check_relative_path(rel, where)
            if rel in table:
                raise ValueError(f"{where}: path {rel!r} is listed twice")
            if len(row) == 3:
                try:
                    order = int(row[2])
                except ValueError:
                    raise ValueError(f"{where}: order {row[2]!r} is not an integer") from None
            else:
                order = number
            table[rel] = (row[1], order)
    return table


def _object_key(path: str) -> str | None:
    """``objects/<path>`` when the path is a valid store key as-is, else None (pack it instead)."""
    from koochak.storage.store import validate_key

    try:
        return validate_key(OBJECT_PREFIX + path)
    except ValueError:
        return None


def tar_header(path: str, size: int, mode: int, mtime_ns: int) -> bytes:
    """The deterministic header block(s) of one regular-file pack member (uid/gid 0, no user
    names). A member that fits plain ustar gets the one block ``_tar.member_header`` writes;
    long or non-ASCII names, huge sizes and odd mtimes get tarfile's PAX records. (tarfile
    spends ~40 µs per header, which would dominate small files, so it is kept for the rare case.)
    """
    mtime = mtime_ns // 1_000_000_000
    if _plain_ustar(path, size, mtime):
        return _tar.member_header(path, size, mode=mode & 0o7777, mtime=mtime)
    info = tarfile.TarInfo(path)
    info.size = size
    info.mode = mode
    info.mtime = mtime
    info.type = tarfile.REGTYPE
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")


def _plain_ustar(path: str, size: int, mtime: int) -> bool:
    """Whether one 512-byte ustar block holds the member (no pax record needed)."""
    return len(path) <= 100 and path.isascii() and size < 8**11 and 0 <= mtime < 8**11


def _header_size(f: SourceFile) -> int:
    if _plain_ustar(f.path, f.size, f.mtime_ns // 1_000_000_000):
        return TAR_BLOCK
    return len(tar_header(f.path, f.size, f.mode, f.mtime_ns))


def plan_archive(
    files: Sequence[SourceFile],
    *,
    groups: dict[str, tuple[str, int]] | None = None,
    pack_bytes: int = DEFAULT_PACK_BYTES,
    object_bytes: int,
    layout: str = "packs",
) -> ArchivePlan:
    """Deal files into packs and objects; deterministic for the same inputs.

    Groups go in name order; inside a group files go by (order, path). A group that does not fit
    the rest of the current pack starts a new one; a group larger than ``pack_bytes`` spills over
    several packs. Files of ``object_bytes`` or more become objects (all files with
    ``layout="objects"``), except paths that cannot be store keys, which are always packed.
    """
    if layout not in ("packs", "objects"):
        raise ValueError(f"--layout {layout!r}: expected 'packs' or 'objects'")
    if pack_bytes < TAR_BLOCK * 4:
        raise ValueError(f"--pack-bytes {pack_bytes}: expected at least {TAR_BLOCK * 4}")
    if object_bytes < 0:
        raise ValueError(f"--object-bytes {object_bytes}: expected a size >= 0")
    groups = groups or {}
    objects: list[ObjectPlan] = []
    grouped: dict[str, list[tuple[int, str, SourceFile]]] = {}
    for f in files:
        group, order = groups.get(f.path, (_directory_group(f.path), 0))
        key = _object_key(f.path) if (layout == "objects" or f.size >= object_bytes) else None
        if key is not None:
            objects.append(ObjectPlan(f, group, key))
        elif layout == "objects":
            raise ValueError(
                f"{f.path!r} cannot be stored as an object (not a valid store key); "
                "use the default packed layout"
            )
        else:
            grouped.setdefault(group, []).append((order, f.path, f))
    packs: list[PackPlan] = []
    current: list[Member] = []
    used = 0

    def close() -> None:
        nonlocal current, used
        if current:
            key = f"packs/pack-{len(packs):06d}.tar"
            packs.append(PackPlan(key, tuple(current), used + TAR_END))
            current, used = [], 0

    for group in sorted(grouped):
        items = [
            (f, _header_size(f)) for _, _, f in sorted(grouped[group], key=lambda t: (t[0], t[1]))
        ]
        need = sum(header + padded(f.size) for f, header in items)
        if current and used + need + TAR_END > pack_bytes:
            close()
        for f, header in items:
            span = header + padded(f.size)
            # Only a group larger than a whole pack reaches this: it spills file by file.
            if current and used + span + TAR_END > pack_bytes:
                close()
            current.append(Member(f, group, used + header))
            used += span
    close()
    objects.sort(key=lambda o: o.file.path)
    return ArchivePlan(tuple(packs), tuple(objects), pack_bytes, object_bytes, layout)


def _directory_group(path: str) -> str:
    head = path.rpartition("/")[0]
    return head or "."


# ----------------------------------------------------------------------------- pack writing


def _read_source(root: str, f: SourceFile) -> Iterator[bytes]:
    """The bytes of a source file in chunks, refusing a file that changed since the scan."""
    fd = _open_source(root, f)
    try:
        remaining = f.size
        while remaining:
            chunk = os.read(fd, min(remaining, _CHUNK))
            if not chunk:
                raise ValueError(f"{os.path.join(root, f.path)} shrank while it was read")
            remaining -= len(chunk)
            yield chunk
        _check_unchanged(root, f, fd)
    finally:
        os.close(fd)


def _unchanged(f: SourceFile, st: os.stat_result) -> bool:
    """True when ``st`` still describes the file the scan saw (size, mtime, ctime, inode)."""
    return (
        stat.S_ISREG(st.st_mode)
        and st.st_size == f.size
        and st.st_mtime_ns == f.mtime_ns
        and (f.ctime_ns == -1 or st.st_ctime_ns == f.ctime_ns)
        and (f.inode == (-1, -1) or (st.st_dev, st.st_ino) == f.inode)
    )


def _open_source(root: str, f: SourceFile) -> int:
    """Open a source file without following a symlink, refusing one that changed since the scan.

    O_NONBLOCK so that a FIFO put in the file's place cannot hang the archive; the fstat then
    refuses it like any other change.
    """
    full = os.path.join(root, f.path)
    fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    st = os.fstat(fd)
    if not _unchanged(f, st):
        os.close(fd)
        raise ValueError(
            f"{full} changed since it was scanned (size/mtime/ctime/inode differ); rerun archive"
        )
    os.set_blocking(fd, True)
    return fd


def _check_unchanged(root: str, f: SourceFile, fd: int | None = None) -> None:
    """After reading a source file: refuse it if it changed meanwhile (tar's "file changed as we
    read it"), so a collection never commits bytes that were part old, part new."""
    full = os.path.join(root, f.path)
    try:
        now = os.stat(full, follow_symlinks=False)
    except FileNotFoundError:
        now = None
    if (
        now is None
        or not _unchanged(f, now)
        or (fd is not None and not _unchanged(f, os.fstat(fd)))
    ):
        raise ValueError(
            f"{full}: file changed as we read it (size/mtime/ctime/inode differ); nothing of it "
            "was committed, rerun archive"
        )


def _pack_stream(
    root: str, pack: PackPlan, digests: dict[str, str], progress: Progress
) -> Iterator[memoryview]:
    """The bytes of one tar pack, in fresh ~4 MiB buffers, recording each member's SHA256.

    Files are read straight into the zero-filled output buffer (``readv``), so each byte is
    copied once on its way in and the zeros already there are the tar padding. Buffers are never
    reused: the store may still be hashing one after asking for the next.
    """
    size = _STREAM_BUFFER
    buffer = memoryview(bytearray(size))
    used = 0
    for m in pack.members:
        f = m.file
        header = tar_header(f.path, f.size, f.mode, f.mtime_ns)
        if used + len(header) > size:
            yield buffer[:used]
            buffer, used = memoryview(bytearray(size)), 0
        buffer[used : used + len(header)] = header
        used += len(header)
        sha = hashlib.sha256()
        fd = _open_source(root, f)
        try:
            remaining = f.size
            while remaining:
                if used == size:
                    yield buffer
                    buffer, used = memoryview(bytearray(size)), 0
                want = min(remaining, size - used)
                got = os.readv(fd, [buffer[used : used + want]])
                if got <= 0:
                    raise ValueError(f"{os.path.join(root, f.path)} shrank while it was read")
                sha.update(buffer[used : used + got])
                used += got
                remaining -= got
            _check_unchanged(root, f, fd)  # the pack put fails: no pack holds a torn member
        finally:
            os.close(fd)
        pad = padded(f.size) - f.size
        if used + pad > size:  # the padding straddles buffers: finish it in the next one
            pad -= size - used
            yield buffer
            buffer, used = memoryview(bytearray(size)), 0
        used += pad
        digests[f.path] = sha.hexdigest()
        progress(f.size)
    end = TAR_END
    if used + end > size:
        end -= size - used
        yield buffer
        buffer, used = memoryview(bytearray(size)), 0
    yield buffer[: used + end]


class _End:
    """What the producer thread sends last: None when done, else the exception it raised."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


def _read_ahead(chunks: Iterator[memoryview], depth: int = 2) -> Iterator[memoryview]:
    """Run ``chunks`` on a helper thread, at most ``depth`` buffers ahead of the consumer.

    Reading and hashing the source files then overlaps with the store writing (and hashing)
    the previous buffer. If the consumer stops early (a failed put), the producer is told to
    stop and the source generator is closed, so no file descriptor is left open.
    """
    ready: queue.Queue[memoryview | _End] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def offer(item: memoryview | _End) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for chunk in chunks:
                if not offer(chunk):
                    return
            offer(_End(None))
        except BaseException as exc:  # handed to the consumer, which re-raises it
            offer(_End(exc))
        finally:
            chunks.close()  # type: ignore[attr-defined]

    worker = threading.Thread(target=produce, name="koochak-pack-reader", daemon=True)
    worker.start()
    try:
        while True:
            item = ready.get()
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return
            yield item
    finally:
        stop.set()
        worker.join()


def _record_doc(pack: PackPlan, size: int, sha256: str, digests: dict[str, str]) -> bytes:
    doc = {
        "version": VERSION,
        "kind": RECORD_KIND,
        "pack": pack.key,
        "size": size,
        "sha256": sha256,
        "members": [
            {
                "path": m.file.path,
                "size": m.file.size,
                "mtime_ns": m.file.mtime_ns,
                "mode": m.file.mode,
                "offset": m.offset,
                "sha256": digests[m.file.path],
            }
            for m in pack.members
        ],
    }
    return (json.dumps(doc, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")


def _parse_record(data: bytes, pack: PackPlan, where: str) -> tuple[str, dict[str, str]]:
    """Check a pack record against the plan; returns (pack sha256, member digests)."""
    doc = loads_strict(data, where)
    require_version(doc, where, VERSION)  # exact int: true and 1.0 are refused
    if doc.get("kind") != RECORD_KIND:
        raise ValueError(f"{where}: not a version-{VERSION} {RECORD_KIND}")
    if set(doc) != {"version", "kind", "pack", "size", "sha256", "members"}:
        raise ValueError(f"{where}: unexpected fields {sorted(doc)}")
    planned = [
        {
            "path": m.file.path,
            "size": m.file.size,
            "mtime_ns": m.file.mtime_ns,
            "mode": m.file.mode,
            "offset": m.offset,
        }
        for m in pack.members
    ]
    members = doc["members"]
    if not isinstance(members, list) or not all(isinstance(x, dict) for x in members):
        raise ValueError(f"{where}: field 'members' is not a list of objects")
    # 1.0 == 1 and True == 1 in Python: numbers must be exact ints before comparing to the plan.
    numbers = [
        doc["size"],
        *(x.get(k) for x in members for k in ("size", "mtime_ns", "mode", "offset")),
    ]
    if not all(is_exact_int(n) for n in numbers):
        raise ValueError(f"{where}: sizes, offsets, modes and mtime_ns must be integers")
    found = [{k: v for k, v in x.items() if k != "sha256"} for x in members]
    if doc["pack"] != pack.key or doc["size"] != pack.size or found != planned:
        raise _leftover(pack.key, _first_difference(planned, found))
    digests = {x["path"]: x.get("sha256") for x in members}
    for value in (doc["sha256"], *digests.values()):
        if not isinstance(value, str) or not SHA256_HEX.fullmatch(value):
            raise ValueError(f"{where}: {value!r} is not a SHA256 (64 lowercase hex digits)")
    return doc["sha256"], digests  # type: ignore[return-value]


def _first_difference(planned: list[dict], found: list[dict]) -> str:
    for want, got in zip(planned, found):
        if want != got:
            return f"planned {want}, found {got}"
    return f"planned {len(planned)} members, found {len(found)}"


def _leftover(key: str, why: str) -> ValueError:
    return ValueError(
        f"{key} is left over from an earlier archive and does not match this plan ({why}); "
        "the source changed: archive to a new DEST, or delete the uncommitted collection first"
    )


def _adopt_pack(target: Any, pack: PackPlan) -> tuple[str, dict[str, str]]:
    """A pack without a record (killed between its put and its record): check its bytes."""
    data = target.get(pack.key)
    if len(data) != pack.size:
        raise _leftover(pack.key, f"{len(data)} bytes, planned {pack.size}")
    digests: dict[str, str] = {}
    position = 0
    for m in pack.members:
        f = m.file
        header = tar_header(f.path, f.size, f.mode, f.mtime_ns)
        if data[position : position + len(header)] != header or m.offset != position + len(header):
            raise _leftover(pack.key, f"member {f.path!r} has a different tar header")
        digests[f.path] = hashlib.sha256(data[m.offset : m.offset + f.size]).hexdigest()
        position = m.offset + padded(f.size)
    return hashlib.sha256(data).hexdigest(), digests


def _write_pack(
    root: str, target: Any, pack: PackPlan, progress: Progress
) -> tuple[PackInfo, dict[str, str], bool]:
    """Write (or reuse) one pack and its record. Returns (info, member digests, reused)."""
    try:
        sha, digests = _parse_record(target.get(pack.record_key), pack, pack.record_key)
        if target.stat(pack.key).size != pack.size:
            raise _leftover(pack.key, "its size differs from its record")
        progress(sum(m.file.size for m in pack.members))
        return PackInfo(pack.key, pack.size, sha, len(pack.members)), digests, True
    except FileNotFoundError:
        pass
    reused = False
    digests = {}
    try:
        info = target.put(
            pack.key,
            _read_ahead(_pack_stream(root, pack, digests, progress)),
            expected_size=pack.size,
        )
        sha = info.sha256 or hashlib.sha256(target.get(pack.key)).hexdigest()
    except FileExistsError:
        sha, digests = _adopt_pack(target, pack)
        progress(sum(m.file.size for m in pack.members))
        reused = True
    try:
        target.put(pack.record_key, _record_doc(pack, pack.size, sha, digests))
    except FileExistsError:
        # Another run wrote the record between our get and put; it must agree with us.
        _parse_record(target.get(pack.record_key), pack, pack.record_key)
    return PackInfo(pack.key, pack.size, sha, len(pack.members)), digests, reused


# ----------------------------------------------------------------------------- objects


def _hash_source(root: str, f: SourceFile) -> str:
    sha = hashlib.sha256()
    for chunk in _read_source(root, f):
        sha.update(chunk)
    return sha.hexdigest()


class _DigestRecorder:
    """The target store, keeping the SHA256 that each ``put`` computed while writing.

    copy_objects reports counts, not digests; recording them here spares reading and hashing
    every object a second time (64 MiB objects would otherwise cost an extra full pass).
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self.digests: dict[str, str | None] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def put(self, key: str, data: Any, **kwargs: Any) -> Any:
        info = self._inner.put(key, data, **kwargs)
        with self._lock:
            self.digests[key] = info.sha256
        return info


def _copy_objects(
    root: str, target: Any, objects: Sequence[ObjectPlan], streams: int, progress: Progress
) -> tuple[dict[str, str], int]:
    """Move the objects with copy_objects; returns (path -> SHA256, objects already there).

    Each digest is the one the target's put computed while writing. Objects already present
    (a resumed run) are hashed in the target and compared with their source file, because
    copy_objects skips any object of the expected size and a leftover from an older source
    could have that size too. A source that changed during the copy fails the archive.
    """
    from koochak.storage.store import LocalStore
    from koochak.storage.transfer import CopyItem, copy_objects

    if not objects:
        return {}, 0
    recorder = _DigestRecorder(target)
    source = LocalStore(root, fsync=False)
    items = [CopyItem(o.file.path, o.file.size, None, o.key) for o in objects]
    copy_objects(source, recorder, items, streams=streams, progress=progress, show_progress=False)
    digests: dict[str, str] = {}
    existing = 0
    for o in objects:
        written = recorder.digests.get(o.key)
        if o.key in recorder.digests:
            digests[o.file.path] = written or sha256_object(target, o.key)[0]
        else:
            existing += 1
            digests[o.file.path] = _hash_source(root, o.file)
            if sha256_object(target, o.key)[0] != digests[o.file.path]:
                raise _leftover(o.key, "its SHA256 differs from the source file")
        try:
            _check_unchanged(root, o.file)
        except ValueError:
            if o.key in recorder.digests:
                # Ours, written this run from a file that changed under the copy: remove it so
                # the rerun copies the new version instead of refusing a leftover.
                try:
                    target.delete(o.key)
                except FileNotFoundError:
                    pass
            raise
    return digests, existing


# ----------------------------------------------------------------------------- the run


def _entries(plan: ArchivePlan, digests: dict[str, str]) -> list[FileEntry]:
    entries = [
        FileEntry(
            path=m.file.path,
            size=m.file.size,
            sha256=digests[m.file.path],
            mode=m.file.mode,
            mtime_ns=m.file.mtime_ns,
            group=m.group,
            pack=p.key,
            offset=m.offset,
        )
        for p in plan.packs
        for m in p.members
    ]
    entries += [
        FileEntry(
            path=o.file.path,
            size=o.file.size,
            sha256=digests[o.file.path],
            mode=o.file.mode,
            mtime_ns=o.file.mtime_ns,
            group=o.group,
            object=o.key,
        )
        for o in plan.objects
    ]
    return entries


def _same_files(collection: Collection, plan: ArchivePlan) -> bool:
    planned = {
        (m.file.path, m.file.size, m.file.mtime_ns, m.file.mode)
        for p in plan.packs
        for m in p.members
    }
    planned |= {(o.file.path, o.file.size, o.file.mtime_ns, o.file.mode) for o in plan.objects}
    found = {(e.path, e.size, e.mtime_ns, e.mode) for e in collection.entries}
    return planned == found


def _fill_counts(report: ArchiveReport, plan: ArchivePlan) -> None:
    report.files = plan.files
    report.bytes = plan.bytes
    report.packs = len(plan.packs)
    report.pack_bytes = sum(p.size for p in plan.packs)
    report.objects = len(plan.objects)
    report.object_bytes = sum(o.file.size for o in plan.objects)
    # Requests against the target: each pack + its record, each object, the table, the manifest.
    report.requests = {
        "source_files_read": plan.files,
        "target_puts": 2 * len(plan.packs) + len(plan.objects) + 2,
        "pull_gets": len(plan.packs) + len(plan.objects) + 2,
        "pull_gets_unpacked": plan.files + 2,
    }


def archive_tree(
    src: str | os.PathLike[str],
    dest: Any,
    *,
    groups: str | os.PathLike[str] | None = None,
    pack_bytes: int = DEFAULT_PACK_BYTES,
    object_bytes: int | None = None,
    layout: str = "packs",
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    skip_symlinks: bool = False,
    min_age_hours: float | None = None,
    files_from: str | os.PathLike[str] | None = None,
    delete_source: bool = False,
    dry_run: bool = False,
    streams: int | None = None,
    metadata: dict[str, Any] | None = None,
    progress: Progress | None = None,
    show_progress: bool | None = None,
) -> ArchiveReport:
    """Archive the tree ``src`` into the collection at ``dest`` (a Store, path or ``scheme://``).

    Returns an :class:`ArchiveReport`; raises ValueError for bad input, refused files and
    leftovers that do not match the plan. With ``dry_run`` nothing is written anywhere.
    """
    from koochak.storage.profile import min_object_bytes, profile_of
    from koochak.storage.store import capabilities_of, open_store

    root = os.path.abspath(os.fspath(src))
    target = open_store(dest)
    dest_root = capabilities_of(target).root
    if dest_root is not None and os.path.exists(dest_root) and not os.path.isdir(dest_root):
        raise ValueError(f"archive DEST {target.location} is a file; expected a directory")
    if dest_root is not None:
        inside = os.path.realpath(dest_root)
        if os.path.commonpath([inside, os.path.realpath(root)]) == os.path.realpath(root):
            raise ValueError(
                f"archive DEST {target.location} lies inside SRC {root}; the archive would "
                "pick up its own packs on a rerun — choose a DEST outside SRC"
            )
    profile = profile_of(target)
    if object_bytes is None:
        object_bytes = min_object_bytes(profile)
    if streams is None:
        streams = max(1, min(profile.concurrency, 16))
    if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
        raise ValueError(f"streams={streams!r}: expected a whole number >= 1")
    listed = None
    if files_from is not None:
        with open(files_from, encoding="utf-8-sig") as handle:
            listed = handle.read().split("\n")
    files, skipped = scan_source(
        root,
        include=include,
        exclude=exclude,
        skip_symlinks=skip_symlinks,
        min_age_hours=min_age_hours,
        files_from=listed,
        listed_in=f"--files-from {files_from}",
    )
    table = read_groups(groups) if groups is not None else None
    plan = plan_archive(
        files, groups=table, pack_bytes=pack_bytes, object_bytes=object_bytes, layout=layout
    )
    report = ArchiveReport(source=root, dest=target.location, skipped=skipped, dry_run=dry_run)
    if table is not None:
        unmatched = sorted(set(table) - {f.path for f in files})
        report.unmatched_group_rows = len(unmatched)
        report.unmatched_group_paths = unmatched[:20]
    _fill_counts(report, plan)
    if dry_run:
        return report

    try:
        committed = load_collection(target)
    except FileNotFoundError:
        committed = None
    if committed is not None:
        if not _same_files(committed, plan):
            raise ValueError(
                f"{target.location} already holds a committed collection with different files; "
                "archive to a new DEST"
            )
        report.already_committed = True
    else:
        _write_collection(root, target, plan, report, streams, metadata, progress, show_progress)
    if delete_source:
        _delete_sources(root, target, report, streams, show_progress)
    return report


def _write_collection(
    root: str,
    target: Any,
    plan: ArchivePlan,
    report: ArchiveReport,
    streams: int,
    metadata: dict[str, Any] | None,
    progress: Progress | None,
    show_progress: bool | None,
) -> None:
    from koochak.data._progress import progress_bar

    digests: dict[str, str] = {}
    packs: list[PackInfo] = []
    with progress_bar(plan.bytes, "archive", enabled=show_progress, also=progress) as advance:
        # One extra worker moves the objects (copy_objects runs its own streams) while the
        # packs are written, so neither phase waits for the other.
        with ThreadPoolExecutor(max_workers=streams + 1) as pool:
            moving = pool.submit(_copy_objects, root, target, plan.objects, streams, advance)
            futures = [pool.submit(_write_pack, root, target, p, advance) for p in plan.packs]
            try:
                for future in futures:
                    info, pack_digests, reused = future.result()
                    packs.append(info)
                    digests.update(pack_digests)
                    report.packs_reused += reused
                object_digests, report.objects_reused = moving.result()
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
        digests.update(object_digests)
    table = encode_files_table(_entries(plan, digests))
    try:
        target.put(FILES_KEY, table)
    except FileExistsError:
        if target.get(FILES_KEY) != table:
            raise _leftover(FILES_KEY, "its content differs from this run's file table") from None
    meta = {
        "source": root,
        "layout": plan.layout,
        "pack_bytes": plan.pack_bytes,
        "object_bytes": plan.object_bytes,
    }
    meta.update(metadata or {})
    manifest = Manifest(
        version=VERSION,
        kind=KIND,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        files=plan.files,
        bytes=plan.bytes,
        objects=len(plan.objects),
        packs=tuple(packs),
        files_table=FilesTable(FILES_KEY, len(table), hashlib.sha256(table).hexdigest()),
        metadata=meta,
    )
    target.put(MANIFEST_KEY, encode_manifest(manifest))


def _delete_sources(
    root: str, target: Any, report: ArchiveReport, streams: int, show_progress: bool | None
) -> None:
    """Delete sources only after a deep verify; files changed since archiving are kept."""
    from koochak.data.verify import verify_collection

    result = verify_collection(target, deep=True, streams=streams, show_progress=show_progress)
    report.verified = result.ok
    if not result.ok:
        report.problems = [str(p) for p in result.problems]
        return
    touched: set[str] = set()
    for entry in load_collection(target).entries:
        full = os.path.join(root, entry.path)
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            continue
        if (
            not stat.S_ISREG(st.st_mode)
            or st.st_size != entry.size
            or st.st_mtime_ns != entry.mtime_ns
        ):
            report.kept_changed.append(entry.path)
            continue
        os.unlink(full)
        report.deleted += 1
        touched.add(os.path.dirname(entry.path))
    # Remove directories the move emptied (deepest first); never the source root itself.
    parents: set[str] = set()
    for rel in touched:
        while rel:
            parents.add(rel)
            rel = os.path.dirname(rel)
    for rel in sorted(parents, key=lambda p: p.count("/"), reverse=True):
        try:
            os.rmdir(os.path.join(root, rel))
        except OSError:
            pass
