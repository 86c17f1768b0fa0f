"""Collections: many files under one prefix, described by ``manifest.json`` and ``files.jsonl.gz``.

Layout under the collection prefix::

    manifest.json                 written last: the commit point
    files.jsonl.gz                one JSON object per file (its path, size, SHA256, mode, mtime_ns,
                                  group, and either pack + offset or object)
    packs/pack-NNNNNN.tar         small files, as plain tar archives (`tar -xf` reads them)
    objects/<path>                large files, stored as-is
    records/pack-NNNNNN.json      per-pack records that let an interrupted archive resume

Everything in here treats the manifest and the file table as *untrusted* input: a reader gets
either a fully checked :class:`Collection` or a :class:`ValueError` that names the file and field.
Listing and stat come from the manifest, never from listing storage (listing is slow or forbidden
on object-storage mounts).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from koochak.data._digest import SHA256_HEX
from koochak.data._tar import _UNSAFE_POSIX_PATH, BLOCK, END_OF_ARCHIVE, check_path, padded
from koochak.storage.named import get_named
from koochak.storage.strict_json import check_fields, loads_strict, require_version

__all__ = [
    "FILES_KEY",
    "MANIFEST_KEY",
    "Collection",
    "FileEntry",
    "FilesTable",
    "Manifest",
    "PackInfo",
    "check_relative_path",
    "encode_files_table",
    "encode_manifest",
    "load_collection",
    "matches_any",
    "selected_by",
    "parse_files_table",
    "parse_manifest",
]

VERSION = 1
KIND = "koochak.collection"
MANIFEST_KEY = "manifest.json"
FILES_KEY = "files.jsonl.gz"
PACK_PREFIX = "packs/"
OBJECT_PREFIX = "objects/"
RECORD_PREFIX = "records/"
TAR_BLOCK = BLOCK
# A tar archive ends with two zero blocks; member data can never reach into them.
TAR_END = len(END_OF_ARCHIVE)

_PACK_KEY = re.compile(r"packs/pack-[0-9]{6,}\.tar")
# A hostile manifest must not make the reader build huge structures; no real manifest nests deep.
_MAX_TABLE_BYTES = 1 << 34


@dataclass(frozen=True)
class FileEntry:
    """One file of a collection: where its bytes live and what they must hash to."""

    path: str  # relative POSIX path inside the collection (and under a pull's DEST)
    size: int
    sha256: str
    mode: int  # permission bits (st_mode & 0o7777)
    mtime_ns: int  # exact modification time, restored by pull
    group: str  # files of one group are stored contiguously in one pack
    pack: str | None = None  # key of the tar pack holding the bytes, or None for an object
    offset: int | None = None  # byte offset of the member *data* inside the pack
    object: str | None = None  # key of the standalone object, or None for a packed file

    @property
    def key(self) -> str:
        """The store key holding this file's bytes (its pack or its object)."""
        return self.pack if self.pack is not None else self.object  # type: ignore[return-value]


@dataclass(frozen=True)
class PackInfo:
    key: str
    size: int
    sha256: str
    files: int


@dataclass(frozen=True)
class FilesTable:
    key: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    version: int
    kind: str
    created: str
    files: int
    bytes: int
    objects: int
    packs: tuple[PackInfo, ...]
    files_table: FilesTable
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Collection:
    """A committed collection: its manifest and every file entry, in storage order."""

    manifest: Manifest
    entries: tuple[FileEntry, ...]

    def select(self, include: Sequence[str] = ()) -> list[FileEntry]:
        """Entries matching any ``include`` glob (all when empty), sorted by path.

        A glob selects a file when it matches the file's path (or base name, for a glob without
        ``/``) or one of its parent directories, so ``train`` or ``data/train`` selects a tree.
        """
        chosen = [e for e in self.entries if not include or selected_by(e.path, include)]
        return sorted(chosen, key=lambda e: e.path)

    def by_path(self) -> dict[str, FileEntry]:
        return {e.path: e for e in self.entries}


def matches_any(path: str, globs: Iterable[str]) -> bool:
    """True when ``path`` matches a glob; a glob without ``/`` may also match the base name."""
    base = path.rsplit("/", 1)[-1]
    for pattern in globs:
        if fnmatch.fnmatchcase(path, pattern):
            return True
        if "/" not in pattern and fnmatch.fnmatchcase(base, pattern):
            return True
    return False


def selected_by(path: str, globs: Sequence[str]) -> bool:
    """True when a glob matches ``path`` or one of its parent directories (``train`` selects
    ``train/a/b.png``): what ``--include`` means for archive, pull and ls alike."""
    if matches_any(path, globs):
        return True
    parts = path.split("/")
    return any(matches_any("/".join(parts[:i]), globs) for i in range(1, len(parts)))


def check_relative_path(path: object, where: str) -> str:
    """Return ``path`` if it is a safe relative POSIX path, else raise ValueError naming ``where``.

    Safe means: a non-empty string, not absolute, no empty, ``.`` or ``..`` segments and no NUL,
    so joining it under a destination directory can never leave that directory.
    """
    if not isinstance(path, str) or not path:
        raise ValueError(f"{where}: expected a non-empty relative path, got {path!r}")
    check_path(path, f"{where}: path", backslash=True)
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{where}: path {path!r} is not valid UTF-8") from None
    return path


def _check_key(key: object, where: str) -> str:
    key = check_relative_path(key, where)
    if "?" in key or "#" in key:
        raise ValueError(f"{where}: store key {key!r} contains '?' or '#'")
    return key


# ----------------------------------------------------------------------------- field checks


def _int(value: object, where: str, *, minimum: int | None = None) -> int:
    # bool is an int subclass; a manifest saying `"size": true` is malformed, not 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{where}: expected an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{where}: expected an integer >= {minimum}, got {value}")
    return value


def _str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected a string, got {value!r}")
    return value


def _sha(value: object, where: str) -> str:
    if not isinstance(value, str) or not SHA256_HEX.fullmatch(value):
        raise ValueError(f"{where}: expected 64 lowercase hex digits (SHA256), got {value!r}")
    return value


def _keys(obj: object, where: str, required: set[str], optional: set[str] = frozenset()) -> dict:
    return check_fields(obj, where, required, optional)  # called once per file-table line


# ----------------------------------------------------------------------------- manifest

_MANIFEST_FIELDS = {
    "version", "kind", "created", "files", "bytes", "objects", "packs", "files_table", "metadata",
}


def parse_manifest(data: bytes | str) -> Manifest:
    """Parse and check ``manifest.json``; ValueError naming the field on anything unexpected."""
    where = MANIFEST_KEY
    raw = _keys(loads_strict(data, where), where, _MANIFEST_FIELDS)
    require_version(raw, where, VERSION)  # exact int: true and 1.0 are refused
    if raw["kind"] != KIND:
        raise ValueError(f"{where}: field 'kind': expected {KIND!r}, got {raw['kind']!r}")
    packs_raw = raw["packs"]
    if not isinstance(packs_raw, list):
        raise ValueError(f"{where}: field 'packs': expected a list, got {packs_raw!r}")
    packs: list[PackInfo] = []
    seen: set[str] = set()
    for i, item in enumerate(packs_raw):
        w = f"{where}: packs[{i}]"
        item = _keys(item, w, {"key", "size", "sha256", "files"})
        key = _check_key(item["key"], f"{w}.key")
        if not _PACK_KEY.fullmatch(key):
            raise ValueError(f"{w}.key: expected 'packs/pack-NNNNNN.tar', got {key!r}")
        if key in seen:
            raise ValueError(f"{w}.key: duplicate pack {key!r}")
        seen.add(key)
        packs.append(
            PackInfo(
                key=key,
                size=_int(item["size"], f"{w}.size", minimum=TAR_END),
                sha256=_sha(item["sha256"], f"{w}.sha256"),
                files=_int(item["files"], f"{w}.files", minimum=0),
            )
        )
    table = _keys(raw["files_table"], f"{where}: files_table", {"key", "size", "sha256"})
    if table["key"] != FILES_KEY:
        raise ValueError(f"{where}: files_table.key: expected {FILES_KEY!r}, got {table['key']!r}")
    metadata = raw["metadata"]
    if not isinstance(metadata, dict):
        raise ValueError(f"{where}: field 'metadata': expected a JSON object, got {metadata!r}")
    return Manifest(
        version=VERSION,
        kind=KIND,
        created=_str(raw["created"], f"{where}: field 'created'"),
        files=_int(raw["files"], f"{where}: field 'files'", minimum=0),
        bytes=_int(raw["bytes"], f"{where}: field 'bytes'", minimum=0),
        objects=_int(raw["objects"], f"{where}: field 'objects'", minimum=0),
        packs=tuple(packs),
        files_table=FilesTable(
            key=FILES_KEY,
            size=_int(table["size"], f"{where}: files_table.size", minimum=0),
            sha256=_sha(table["sha256"], f"{where}: files_table.sha256"),
        ),
        metadata=metadata,
    )


def encode_manifest(manifest: Manifest) -> bytes:
    doc = {
        "version": manifest.version,
        "kind": manifest.kind,
        "created": manifest.created,
        "files": manifest.files,
        "bytes": manifest.bytes,
        "objects": manifest.objects,
        "packs": [
            {"key": p.key, "size": p.size, "sha256": p.sha256, "files": p.files}
            for p in manifest.packs
        ],
        "files_table": {
            "key": manifest.files_table.key,
            "size": manifest.files_table.size,
            "sha256": manifest.files_table.sha256,
        },
        "metadata": manifest.metadata,
    }
    return (json.dumps(doc, indent=1, sort_keys=False) + "\n").encode("utf-8")


# ----------------------------------------------------------------------------- files table

_ENTRY_REQUIRED = {"path", "size", "sha256", "mode", "mtime_ns", "group"}
_ENTRY_OPTIONAL = {"pack", "offset", "object"}


def _entry_doc(e: FileEntry) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "path": e.path,
        "size": e.size,
        "sha256": e.sha256,
        "mode": e.mode,
        "mtime_ns": e.mtime_ns,
        "group": e.group,
    }
    if e.pack is not None:
        doc["pack"] = e.pack
        doc["offset"] = e.offset
    else:
        doc["object"] = e.object
    return doc


def encode_files_table(entries: Iterable[FileEntry]) -> bytes:
    """Deterministic gzip of one JSON line per entry (same entries -> same bytes, so reruns match)."""
    import gzip  # writing only: a reader inflates with zlib
    import io

    text = "".join(
        json.dumps(_entry_doc(e), ensure_ascii=False, separators=(",", ":")) + "\n" for e in entries
    )
    buffer = io.BytesIO()
    # mtime=0 and no file name keep the gzip header identical between runs.
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0, compresslevel=6) as gz:
        gz.write(text.encode("utf-8"))
    return buffer.getvalue()


def _gunzip(data: bytes, where: str) -> bytes:
    try:
        decompressor = zlib.decompressobj(16 + zlib.MAX_WBITS)
        out = decompressor.decompress(data, _MAX_TABLE_BYTES)
        if decompressor.unconsumed_tail:
            raise ValueError(f"{where}: decompresses to more than {_MAX_TABLE_BYTES} bytes")
        if not decompressor.eof:
            raise ValueError(f"{where}: truncated gzip stream")
        if decompressor.unused_data:
            raise ValueError(f"{where}: trailing data after the gzip stream")
        return out
    except zlib.error as exc:
        raise ValueError(f"{where}: not a valid gzip stream ({exc})") from None


def _decode_lines(lines: list[bytes], where: str) -> list[object]:
    """Every line of a JSON-lines table, decoded strictly in one call (as one JSON array).

    One decode of the whole table instead of one per line: a 20,000-file table parses in a
    fraction of the time. Anything wrong (a blank line, bad JSON, a duplicate field) is then
    found again line by line, so the error still names its line.
    """
    try:
        return loads_strict(b"[" + b",".join(lines) + b"]", where)  # type: ignore[no-any-return]
    except ValueError:
        return [loads_strict(line, f"{where} line {n}") for n, line in enumerate(lines, start=1)]


def parse_files_table(data: bytes, manifest: Manifest) -> tuple[FileEntry, ...]:
    """Parse and check ``files.jsonl.gz`` against its manifest.

    Checks every field's type, that paths are safe, unique and never nested under another file,
    that every pack member lies inside its pack without overlapping another, that object keys are
    unique, and that the counts and byte totals agree with the manifest.
    """
    where = FILES_KEY
    digest = hashlib.sha256(data).hexdigest()
    if len(data) != manifest.files_table.size or digest != manifest.files_table.sha256:
        raise ValueError(
            f"{where}: size/sha256 ({len(data)}, {digest}) do not match manifest.json files_table "
            f"({manifest.files_table.size}, {manifest.files_table.sha256})"
        )
    text = _gunzip(data, where)
    packs = {p.key: p for p in manifest.packs}
    entries: list[FileEntry] = []
    paths: set[str] = set()
    objects: set[str] = set()
    lines = text.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    # check_path's test for collection paths (a backslash is an ordinary character there).
    unsafe, sha256_hex = _UNSAFE_POSIX_PATH.search, SHA256_HEX.fullmatch
    for number, doc in enumerate(_decode_lines(lines, where), start=1):
        # The common line, a packed file with every field well-formed, is checked here without
        # building one error message; a line that fails any of these checks (or is an object)
        # is checked again below, which names what is wrong.
        if type(doc) is dict and doc.keys() == _PACKED_FIELDS:
            path, size, mode, offset = doc["path"], doc["size"], doc["mode"], doc["offset"]
            sha, mtime_ns, group, pack = doc["sha256"], doc["mtime_ns"], doc["group"], doc["pack"]
            info = packs.get(pack) if type(pack) is str else None
            if (
                type(path) is str and path and not unsafe(path) and path not in paths
                and (path.isascii() or _is_utf8(path))
                and type(size) is int and size >= 0
                and type(mode) is int and 0 <= mode <= 0o7777
                and type(sha) is str and sha256_hex(sha)
                and type(mtime_ns) is int and type(group) is str
                and info is not None and type(offset) is int and offset >= TAR_BLOCK
                and not offset % TAR_BLOCK and offset + size <= info.size - TAR_END
            ):  # fmt: skip
                paths.add(path)
                entries.append(FileEntry(path, size, sha, mode, mtime_ns, group, pack, offset))
                continue
        entries.append(_parse_entry(doc, f"{where} line {number}", packs, paths, objects))
    _check_nesting(paths)
    _check_pack_members(entries, packs)
    _check_totals(entries, manifest)
    return tuple(entries)


# The fields of a packed file's line.
_PACKED_FIELDS = frozenset(_ENTRY_REQUIRED | {"pack", "offset"})


def _is_utf8(path: str) -> bool:
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _parse_entry(
    doc: object, w: str, packs: dict[str, PackInfo], paths: set[str], objects: set[str]
) -> FileEntry:
    """One line of the file table, every field checked; ValueError naming the line and field."""
    raw = _keys(doc, w, _ENTRY_REQUIRED, _ENTRY_OPTIONAL)
    path = check_relative_path(raw["path"], f"{w}: field 'path'")
    if path in paths:
        raise ValueError(f"{w}: field 'path': duplicate path {path!r}")
    paths.add(path)
    size = _int(raw["size"], f"{w}: field 'size'", minimum=0)
    mode = _int(raw["mode"], f"{w}: field 'mode'", minimum=0)
    if mode > 0o7777:
        raise ValueError(f"{w}: field 'mode': expected permission bits <= 0o7777, got {mode:#o}")
    entry_kw = {
        "path": path,
        "size": size,
        "sha256": _sha(raw["sha256"], f"{w}: field 'sha256'"),
        "mode": mode,
        "mtime_ns": _int(raw["mtime_ns"], f"{w}: field 'mtime_ns'"),
        "group": _str(raw["group"], f"{w}: field 'group'"),
    }
    if "pack" in raw:
        if "object" in raw:
            raise ValueError(f"{w}: field 'object': a file has either pack+offset or object, not both")
        if "offset" not in raw:
            raise ValueError(f"{w}: missing field 'offset' (required with 'pack')")
        pack = raw["pack"]
        if not isinstance(pack, str) or pack not in packs:
            raise ValueError(f"{w}: field 'pack': {pack!r} is not a pack listed in manifest.json")
        offset = _int(raw["offset"], f"{w}: field 'offset'", minimum=TAR_BLOCK)
        if offset % TAR_BLOCK:
            raise ValueError(f"{w}: field 'offset': {offset} is not a multiple of {TAR_BLOCK}")
        if offset + size > packs[pack].size - TAR_END:
            raise ValueError(
                f"{w}: field 'offset': bytes [{offset}, {offset + size}) lie outside pack "
                f"{pack!r} of {packs[pack].size} bytes"
            )
        return FileEntry(**entry_kw, pack=pack, offset=offset)
    if "object" in raw:
        if "offset" in raw:
            raise ValueError(f"{w}: field 'offset': only packed files have an offset")
        key = _check_key(raw["object"], f"{w}: field 'object'")
        if not key.startswith(OBJECT_PREFIX):
            raise ValueError(f"{w}: field 'object': expected a key under {OBJECT_PREFIX!r}, got {key!r}")
        if key in objects:
            raise ValueError(f"{w}: field 'object': duplicate object key {key!r}")
        objects.add(key)
        return FileEntry(**entry_kw, object=key)
    raise ValueError(f"{w}: missing field 'pack' or 'object'")


def _check_nesting(paths: set[str]) -> None:
    # "a" and "a/b" cannot both be files: a pull would have to turn one into a directory. Every
    # directory is added once (a walk up stops at one already seen), so this stays linear.
    dirs: set[str] = set()
    for path in paths:
        parent = path.rpartition("/")[0]
        while parent and parent not in dirs:
            dirs.add(parent)
            parent = parent.rpartition("/")[0]
    clash = dirs & paths
    if clash:
        parent = min(clash)
        path = min(p for p in paths if p.startswith(parent + "/"))
        raise ValueError(f"{FILES_KEY}: field 'path': {path!r} lies under the file {parent!r}")


def _check_pack_members(entries: list[FileEntry], packs: dict[str, PackInfo]) -> None:
    by_pack: dict[str, list[FileEntry]] = {}
    for e in entries:
        if e.pack is not None:
            by_pack.setdefault(e.pack, []).append(e)
    for key, info in packs.items():
        members = sorted(by_pack.get(key, ()), key=lambda e: e.offset or 0)
        if len(members) != info.files:
            raise ValueError(
                f"{MANIFEST_KEY}: pack {key!r} field 'files': says {info.files}, "
                f"{FILES_KEY} places {len(members)} files in it"
            )
        end = 0  # every member needs at least one header block after the previous member's data
        for e in members:
            assert e.offset is not None
            if e.offset < end + TAR_BLOCK:
                raise ValueError(
                    f"{FILES_KEY}: field 'offset': {e.path!r} at {e.offset} overlaps the previous "
                    f"member of pack {key!r} (which ends at {end})"
                )
            end = e.offset + padded(e.size)


def _check_totals(entries: list[FileEntry], manifest: Manifest) -> None:
    total = sum(e.size for e in entries)
    objects = sum(1 for e in entries if e.object is not None)
    for name, said, found in (
        ("files", manifest.files, len(entries)),
        ("bytes", manifest.bytes, total),
        ("objects", manifest.objects, objects),
    ):
        if said != found:
            raise ValueError(f"{MANIFEST_KEY}: field {name!r}: says {said}, {FILES_KEY} has {found}")


def load_collection(store: Any) -> Collection:
    """Read and check a committed collection from a Store (or a location for ``open_store``).

    Raises FileNotFoundError when there is no ``manifest.json`` (nothing committed), ValueError
    when the manifest or the file table is malformed or they disagree.
    """
    from koochak.storage.store import open_store

    store = open_store(store)
    try:
        data = store.get(MANIFEST_KEY)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{store.location} holds no collection: {MANIFEST_KEY} not found (an interrupted "
            "archive commits nothing; rerun it to finish)"
        ) from None
    manifest = parse_manifest(data)
    try:
        table = get_named(store, FILES_KEY, named_by=MANIFEST_KEY)
    except FileNotFoundError:
        raise ValueError(
            f"{store.location}: manifest.json is committed but {FILES_KEY} is missing"
        ) from None
    return Collection(manifest=manifest, entries=parse_files_table(table, manifest))
