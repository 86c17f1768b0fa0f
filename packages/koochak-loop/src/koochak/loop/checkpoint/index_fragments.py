"""Version 2 of the parts index: a head that names one index fragment per writer.

A sharded (FSDP) save on W ranks used to commit one index listing every part of every rank and
one shard per rank of every tensor: W x tensors entries that rank 0 gathered and encoded and
every resuming rank fetched and parsed. In version 2 each rank writes its own **fragment**
(``<name>.part-WWWWW-index``: its parts with their sizes and SHA256, and where its rows of each
tensor lie in them) beside its parts; rank 0 gathers one ``(key, size, sha256, parts)`` per rank
and commits a **head** under the checkpoint's name: the skeleton, each tensor's dtype, global
shape and split (``whole``: held by writer 0; ``rows``: FSDP2's ``Shard(0)`` over the writers,
writer ``w`` holding rows ``[w*c, min(rows, (w+1)*c))`` with ``c = ceil(rows / writers)``), and
the fragments. Under HSDP (a 2-D mesh: ``S`` ranks shard, the groups of ``S`` replicate) only
the first ``S`` writers hold rows: the head's ``slab_writers`` says ``S`` (absent: every writer)
and the formula splits rows over those; the other writers' fragments carry their RNG state and
no parts. The manifest hashes the head, the head the fragments, the fragments the parts,
so one digest still covers every byte. A resuming rank reads the head and only the fragments of
the writers whose rows it restores (``writers_for``); a one-process reader reads them all and
gets the same ``PartsIndex`` a version-1 index gives (docs/formats.md, "Checkpoint parts").
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any

from koochak.loop.checkpoint.parts_index import (
    DTYPE_NAMES,
    HEAD_VERSION,
    MAX_WRITERS,
    PART_INFIX,
    PARTS_FORMAT,
    PARTS_VERSION,
    Part,
    PartsIndex,
    index_of_doc,
    itemsize,
    parse_index,
    part_key,
)
from koochak.storage.artifact import READY_SUFFIX, InvalidArtifact
from koochak.storage.store import Store
from koochak.storage.strict_json import check_fields, loads_strict, require_version

FRAGMENT_FORMAT = "koochak-checkpoint-fragment"
# Version 2: a writer's RNG state is its own last part (raw ``torch.save`` bytes, field ``rng``
# its number), not base64 in the fragment, and slabs laid back to back from part ``packed`` on
# are found by the head's formula instead of listed. Version 1 (``rng`` base64, ``slabs``
# listed) is still read: older checkpoints resume.
FRAGMENT_VERSION = 2
_FRAGMENT_VERSIONS = (1, 2)
SPLITS = ("whole", "rows")
_HEAD_KEYS = frozenset({"format", "version", "name", "writers", "tensors", "fragments", "skeleton"})
_HEAD_OPTIONAL = frozenset({"slab_writers"})
_HEAD_TENSOR_KEYS = frozenset({"dtype", "shape", "split"})
_REF_KEYS = frozenset({"key", "writer", "size", "sha256", "parts"})
_FRAGMENT_KEYS = frozenset({"format", "version", "name", "writer", "parts", "whole", "slabs"})
_FRAGMENT_OPTIONAL = frozenset({"rng"})
_FRAGMENT_KEYS_V2 = frozenset({"format", "version", "name", "writer", "parts", "whole"})
_FRAGMENT_OPTIONAL_V2 = frozenset({"slabs", "packed", "rng"})
_FRAGMENT_PART_KEYS = frozenset({"key", "size", "sha256"})
_FRAGMENT_TENSOR_KEYS = frozenset({"tensor", "extents"})
_EXTENT_KEYS = frozenset({"part", "offset", "length"})
# An RNG state is tens of kB (Python's, NumPy's and torch's CPU generators, one per CUDA device);
# a larger RNG part is refused before it is read.
_MAX_RNG_BYTES = 64 << 20


@dataclass(frozen=True)
class FragmentRef:
    """One writer's fragment as the head names it: key, size, SHA256 and its part count."""

    key: str
    writer: int
    size: int
    sha256: str
    parts: int


@dataclass(frozen=True)
class Head:
    """A parsed version-2 head: tensors as ``(dtype, shape, split)``, one fragment per writer."""

    name: str
    writers: int
    tensors: tuple[tuple[str, tuple[int, ...], str], ...]
    fragments: tuple[FragmentRef, ...]
    skeleton: bytes
    slab_writers: int = 0  # the first writers, which hold the rows (0: every writer)

    @property
    def row_writers(self) -> int:
        """How many writers the rows of a tensor split by rows are divided among."""
        return self.slab_writers or self.writers


def fragment_key(name: str, writer: int) -> str:
    """The key of ``writer``'s index fragment of checkpoint ``name``."""
    return f"{name}{PART_INFIX}{writer:05d}-index"


def rows_of(writer: int, writers: int, rows: int) -> tuple[int, int]:
    """``[lo, hi)``: the rows of dimension 0 writer ``writer`` of ``writers`` holds under FSDP2's
    ``Shard(0)`` (``ceil(rows / writers)`` each, in order; the last ones may hold fewer or none)."""
    chunk = -(-rows // writers) if rows else 0
    lo = min(rows, writer * chunk)
    return lo, min(rows, lo + chunk)


def _dumps(doc: dict[str, Any]) -> bytes:
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return (text + "\n").encode("ascii")


Runs = Sequence[tuple[int, Sequence[tuple[int, int, int]]]]


def encode_fragment(
    name: str,
    writer: int,
    parts: Sequence[tuple[str, int, str]],
    whole: Runs,
    slabs: Runs,
    rng_part: int | None = None,
) -> bytes:
    """Writer ``writer``'s fragment (version 2): its ``parts`` ``(key, size, sha256)`` in number
    order, and where its bytes of each tensor lie, as ``(number, extents as (part, offset,
    length))`` (``part`` counting within this writer's parts): ``whole``, by the head's tensor
    number, the tensors writer 0 holds whole; ``slabs``, by ``k`` (the head's ``k``-th tensor
    split by rows), this writer's rows of each. Slabs that lie back to back in ``k`` order
    through the parts from one on (what ``write_parts`` makes) are written as that part's number
    (``packed``), the head's formula giving each one's length; others are listed. ``rng_part``:
    the number of this writer's last part, which holds its own RNG state (a weights-only
    ``torch.save`` of it), so no rank reads another's to resume."""

    def runs(items: Runs) -> list[dict[str, Any]]:
        return [
            {"tensor": n, "extents": [{"part": p, "offset": o, "length": m} for p, o, m in ext]}
            for n, ext in items
        ]

    if rng_part is not None and rng_part != len(parts) - 1:
        raise ValueError(f"writer {writer}'s RNG part must be its last ({len(parts) - 1})")
    end = len(parts) if rng_part is None else rng_part
    doc: dict[str, Any] = {
        "format": FRAGMENT_FORMAT,
        "version": FRAGMENT_VERSION,
        "name": name,
        "writer": writer,
        "parts": [{"key": k, "size": n, "sha256": sha} for k, n, sha in parts],
        "whole": runs(whole),
    }
    packed = _packed_from([n for _, n, _ in parts[:end]], slabs)
    if packed is None:
        doc["slabs"] = runs(slabs)
    else:
        doc["packed"] = packed
    if rng_part is not None:
        doc["rng"] = rng_part
    return _dumps(doc)


def _packed_from(sizes: Sequence[int], slabs: Runs) -> int | None:
    """The first part of the slabs when their extents, in ``k`` order, run back to back from
    its start to the end of the last part of ``sizes`` (None when they do not)."""
    ordinals = [k for k, _ in slabs]
    if ordinals != sorted(set(ordinals)) or not all(ext for _, ext in slabs):
        return None  # out of order, or a slab of no bytes listed: only a list says so
    runs = [run for _, ext in slabs for run in ext]
    if not runs:
        return len(sizes)
    first = part = runs[0][0]
    at = 0
    for p, offset, length in runs:
        if p != part:  # the next run starts the next part, the last one having been filled
            if p != part + 1 or at != sizes[part] or offset != 0:
                return None
            part, at = p, 0
        if offset != at or length <= 0:
            return None
        at += length
    return first if part == len(sizes) - 1 and at == sizes[part] else None


def encode_head(
    name: str,
    writers: int,
    tensors: Sequence[tuple[str, tuple[int, ...], str]],
    fragments: Sequence[FragmentRef],
    skeleton: bytes,
    *,
    slab_writers: int | None = None,
) -> bytes:
    """The head of a version-2 checkpoint in parts (checked by parsing it before it is returned:
    never write what we would refuse); ``slab_writers``: how many of the first writers hold the
    rows (HSDP's shard group), when fewer than ``writers``."""
    extra = {"slab_writers": slab_writers} if slab_writers and slab_writers != writers else {}
    raw = _dumps(
        {
            **extra,
            "format": PARTS_FORMAT,
            "version": HEAD_VERSION,
            "name": name,
            "writers": writers,
            "tensors": [
                {"dtype": dtype, "shape": list(shape), "split": split}
                for dtype, shape, split in tensors
            ],
            "fragments": [
                {
                    "key": f.key,
                    "writer": f.writer,
                    "size": f.size,
                    "sha256": f.sha256,
                    "parts": f.parts,
                }
                for f in fragments
            ],  # fmt: skip
            "skeleton": base64.b64encode(skeleton).decode("ascii"),
        }
    )
    parse_head(raw, f"head of {name}", name)
    return raw


def is_head(raw: bytes | bytearray | memoryview) -> bool:
    """Whether an index object is a version-2 head, from its last bytes alone (an index is
    written compact with its keys sorted, so it ends ``"version":V,"writers":W}``): a version-1
    index, however large, is not parsed twice. Anything else is left to ``parse_index``, which
    refuses a version-2 document it is handed, naming it."""
    return f'"version":{HEAD_VERSION},"writers":'.encode() in bytes(raw[-64:])


def parse_head(raw: bytes | bytearray | memoryview, where: str, name: str | None = None) -> Head:
    """Parse and check a head; InvalidArtifact naming ``where`` and the field on any fault."""
    try:
        return _parse_head(raw, where, name)
    except InvalidArtifact:
        raise
    except (ValueError, RecursionError) as exc:
        raise InvalidArtifact(str(exc)) from None


def _parse_head(raw: bytes | bytearray | memoryview, where: str, name: str | None) -> Head:
    doc = loads_strict(raw, where)
    if not isinstance(doc, dict) or doc.get("format") != PARTS_FORMAT:
        raise ValueError(f"{where}: field 'format' must be {PARTS_FORMAT!r}")
    require_version(doc, where, HEAD_VERSION)
    check_fields(doc, where, _HEAD_KEYS, _HEAD_OPTIONAL)
    head_name = doc["name"]
    if not isinstance(head_name, str) or not head_name or (name is not None and head_name != name):
        raise ValueError(f"{where}: field 'name' is {head_name!r}; expected {name!r}")
    writers = doc["writers"]
    if type(writers) is not int or not 1 <= writers <= MAX_WRITERS:
        raise ValueError(f"{where}: field 'writers' must be an int in 1..{MAX_WRITERS}")
    slab_writers = doc.get("slab_writers", writers)
    if type(slab_writers) is not int or not 1 <= slab_writers <= writers:
        raise ValueError(f"{where}: field 'slab_writers' must be an int in 1..writers ({writers})")
    if not isinstance(doc["tensors"], list):
        raise ValueError(f"{where}: field 'tensors' must be a list")
    tensors = []
    for i, entry in enumerate(doc["tensors"]):
        at = f"{where}: tensors[{i}]"
        check_fields(entry, at, _HEAD_TENSOR_KEYS)
        if entry["dtype"] not in DTYPE_NAMES:
            raise ValueError(f"{at}.dtype is {entry['dtype']!r}; expected one of {DTYPE_NAMES}")
        if entry["split"] not in SPLITS:
            raise ValueError(f"{at}.split is {entry['split']!r}; expected one of {SPLITS}")
        shape = entry["shape"]
        if not isinstance(shape, list) or any(type(n) is not int or n < 0 for n in shape):
            raise ValueError(f"{at}.shape must be a list of ints >= 0")
        if entry["split"] == "rows" and not shape:
            raise ValueError(f"{at}: a tensor split by rows needs a dimension 0")
        tensors.append((entry["dtype"], tuple(shape), entry["split"]))
    refs = doc["fragments"]
    if not isinstance(refs, list) or len(refs) != writers:
        raise ValueError(f"{where}: field 'fragments' must list one fragment per writer")
    fragments = []
    for w, ref in enumerate(refs):
        at = f"{where}: fragments[{w}]"
        check_fields(ref, at, _REF_KEYS)
        if ref["writer"] != w or ref["key"] != fragment_key(head_name, w):
            raise ValueError(f"{at}: expected writer {w}, key {fragment_key(head_name, w)!r}")
        for field in ("size", "parts"):
            if type(ref[field]) is not int or ref[field] < 0:
                raise ValueError(f"{at}.{field} must be an int >= 0")
        if not isinstance(ref["sha256"], str) or len(ref["sha256"]) != 64:
            raise ValueError(f"{at}.sha256 must be 64 lower-case hex digits")
        fragments.append(FragmentRef(ref["key"], w, ref["size"], ref["sha256"], ref["parts"]))
    try:
        skeleton = base64.b64decode(str(doc["skeleton"]).encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise ValueError(f"{where}: field 'skeleton' is not valid base64") from None
    return Head(head_name, writers, tuple(tensors), tuple(fragments), skeleton,
                0 if slab_writers == writers else slab_writers)  # fmt: skip


def head_object_keys(head: Head) -> list[str]:
    """Every object of a version-2 checkpoint in commit order: each writer's parts and fragment,
    the head, its ready manifest (all named by the head alone)."""
    keys = []
    for ref in head.fragments:
        keys += [part_key(head.name, ref.writer, n) for n in range(ref.parts)] + [ref.key]
    return keys + [head.name, head.name + READY_SUFFIX]


def writers_for(head: Head, rank: int, world: int, shard_size: int | None = None) -> list[int]:
    """The writers whose fragments rank ``rank`` of ``world`` reads to restore its rows of each
    tensor split by rows (FSDP2's ``Shard(0)`` on ``world`` ranks; under HSDP with groups of
    ``shard_size``, over the ``shard_size`` ranks of its group), writer 0 (the tensors held
    whole) and writer ``rank`` (its own RNG state); every writer on one process."""
    if world <= 1:
        return list(range(head.writers))
    wanted = {0} | ({rank} if rank < head.writers else set())  # its own RNG state
    size = shard_size or world
    for _, shape, split in head.tensors:
        if split != "rows":
            continue
        lo, hi = rows_of(rank % size, size, shape[0])
        if lo >= hi:
            continue
        chunk = -(-shape[0] // head.row_writers)
        wanted.update(range(lo // chunk, (hi - 1) // chunk + 1))
    return sorted(wanted)


def read_fragment(store: Store, head: Head, writer: int, where: str) -> bytes:
    """Writer ``writer``'s fragment, checked against the head's size and SHA256."""
    ref = head.fragments[writer]
    return _read_checked(store, ref.key, ref.size, ref.sha256, where, "fragment", "the head")


def read_rng_part(store: Store, part: Part, where: str) -> bytes:
    """The bytes of a writer's RNG part (its own RNG state), checked against the size and
    SHA256 its fragment gives."""
    return _read_checked(store, part.key, part.size, part.sha256, where, "RNG part",
                         "its fragment")  # fmt: skip


def _read_checked(
    store: Store, key: str, size: int, sha256: str, where: str, what: str, says: str
) -> bytes:
    import hashlib

    try:
        raw = store.get(key, 0, size + 1)
    except FileNotFoundError:
        raise ValueError(f"{where}: {what} {key} is missing") from None
    if len(raw) != size or hashlib.sha256(raw).hexdigest() != sha256:
        raise ValueError(f"{where}: {what} {key} does not match its size and SHA256 in {says}")
    return raw


def read_index(
    store: Store,
    raw: bytes | bytearray | memoryview,
    where: str,
    name: str | None = None,
    *,
    writers: Collection[int] | None = None,
) -> PartsIndex:
    """The ``PartsIndex`` of an index object of either version: version 1 parsed as it is; a
    version-2 head with the fragments of ``writers`` (None: every writer) fetched from ``store``,
    each checked against the head, and assembled (``assemble``). InvalidArtifact naming the
    object and field on any fault."""
    if not is_head(raw):
        return parse_index(raw, where, name)
    head = parse_head(raw, where, name)
    chosen = range(head.writers) if writers is None else sorted(set(writers))
    try:
        fragments = {w: read_fragment(store, head, w, where) for w in chosen}
        return assemble(head, fragments, where, partial=writers is not None)
    except InvalidArtifact:
        raise
    except ValueError as exc:
        raise InvalidArtifact(str(exc)) from None


def assemble(
    head: Head, fragments: dict[int, bytes], where: str, *, partial: bool = False
) -> PartsIndex:
    """One ``PartsIndex`` from a head and its writers' fragments (raw bytes, by writer), checked
    as a version-1 index is; ``partial``: only some writers' fragments (a tensor's shards then
    need not tile it)."""
    parts: list[dict[str, Any]] = []
    shards: list[list[dict[str, Any]]] = [[] for _ in head.tensors]
    split_rows = [i for i, (_, _, split) in enumerate(head.tensors) if split == "rows"]
    rng: list[bytes | None] = [None] * head.writers
    rng_parts: list[Part | None] = [None] * head.writers
    for writer in sorted(fragments):
        at = f"{where}: fragment {fragment_key(head.name, writer)}"
        doc = loads_strict(fragments[writer], at)
        if not isinstance(doc, dict) or doc.get("format") != FRAGMENT_FORMAT:
            raise ValueError(f"{at}: field 'format' must be {FRAGMENT_FORMAT!r}")
        version = require_version(doc, at, _FRAGMENT_VERSIONS)
        if version == 1:
            check_fields(doc, at, _FRAGMENT_KEYS, _FRAGMENT_OPTIONAL)
        else:
            check_fields(doc, at, _FRAGMENT_KEYS_V2, _FRAGMENT_OPTIONAL_V2)
        if version == 1 and doc.get("rng") is not None:
            try:
                rng[writer] = base64.b64decode(str(doc["rng"]).encode("ascii"), validate=True)
            except (binascii.Error, UnicodeEncodeError):
                raise ValueError(f"{at}: field 'rng' is not valid base64") from None
        if doc["name"] != head.name or doc["writer"] != writer:
            raise ValueError(f"{at}: fields 'name' and 'writer' must be {head.name!r}, {writer}")
        mine = doc["parts"]
        if not isinstance(mine, list) or len(mine) != head.fragments[writer].parts:
            raise ValueError(f"{at}: field 'parts' must list the {head.fragments[writer].parts} "
                             "parts the head says")  # fmt: skip
        if version == 2:
            mine, rng_parts[writer] = _rng_part(doc, mine, head.name, writer, at)
            if ("packed" in doc) == ("slabs" in doc):
                raise ValueError(f"{at}: exactly one of fields 'packed' and 'slabs' expected")
            if "packed" in doc:
                doc["slabs"] = _packed_slabs(head, writer, mine, doc["packed"], split_rows, at)
        base = len(parts)
        for i, part in enumerate(mine):
            check_fields(part, f"{at}: parts[{i}]", _FRAGMENT_PART_KEYS)
            parts.append({**part, "writer": writer})
        for field in ("whole", "slabs"):
            if not isinstance(doc[field], list):
                raise ValueError(f"{at}: field {field!r} must be a list")
        seen = set()
        for field, entry, i in [("whole", e, i) for i, e in enumerate(doc["whole"])] + [
            ("slabs", e, i) for i, e in enumerate(doc["slabs"])
        ]:
            t_at = f"{at}: {field}[{i}]"
            check_fields(entry, t_at, _FRAGMENT_TENSOR_KEYS)
            ordinal = entry["tensor"]
            among = list(range(len(head.tensors))) if field == "whole" else split_rows
            if type(ordinal) is not int or not 0 <= ordinal < len(among):
                raise ValueError(f"{t_at}.tensor must count within the head's tensors")
            number = among[ordinal]
            _, shape, split = head.tensors[number]
            if number in seen or (field == "whole") != (split == "whole"):
                raise ValueError(f"{t_at}: tensor {number} is split {split!r}, listed once")
            seen.add(number)
            if split == "whole":
                if writer != 0:
                    raise ValueError(f"{t_at}: tensor {number} is held whole by writer 0")
                offsets, box = [0] * len(shape), list(shape)
            else:
                if writer >= head.row_writers:
                    raise ValueError(f"{t_at}: writer {writer} holds no rows (slab_writers "
                                     f"{head.row_writers})")  # fmt: skip
                lo, hi = rows_of(writer, head.row_writers, shape[0])
                offsets, box = [lo] + [0] * (len(shape) - 1), [hi - lo, *shape[1:]]
            extents = entry["extents"]
            if not isinstance(extents, list):
                raise ValueError(f"{t_at}.extents must be a list")
            runs = []
            for j, extent in enumerate(extents):
                check_fields(extent, f"{t_at}.extents[{j}]", _EXTENT_KEYS)
                p = extent["part"]
                if type(p) is not int or not 0 <= p < len(mine):
                    raise ValueError(f"{t_at}.extents[{j}].part must count within its parts")
                runs.append({**extent, "part": base + p})
            shards[number].append({"offsets": offsets, "shape": box, "extents": runs})
    for number, (_, shape, _) in enumerate(head.tensors):
        if not shards[number] and 0 in shape:  # no element anywhere: one empty shard
            shards[number].append({"offsets": [0] * len(shape), "shape": list(shape),
                                   "extents": []})  # fmt: skip
    doc = {
        "format": PARTS_FORMAT,
        "version": PARTS_VERSION,
        "name": head.name,
        "writers": head.writers,
        "parts": parts,
        "tensors": [
            {"dtype": dtype, "shape": list(shape), "shards": found}
            for (dtype, shape, _), found in zip(head.tensors, shards)
        ],
        "skeleton": base64.b64encode(head.skeleton).decode("ascii"),
    }
    index = index_of_doc(doc, where, head.name, partial=partial)
    return replace(index, rng=tuple(rng), rng_parts=tuple(rng_parts))


def _rng_part(
    doc: dict[str, Any], parts: list[Any], name: str, writer: int, at: str
) -> tuple[list[Any], Part | None]:
    """``(parts, rng part)`` of a version-2 fragment: its RNG part (field ``rng``, the number
    of its last part) taken out of the parts that hold tensor bytes."""
    number = doc.get("rng")
    if number is None:
        return parts, None
    if type(number) is not int or number != len(parts) - 1:
        raise ValueError(f"{at}: field 'rng' must be the number of its last part "
                         f"({len(parts) - 1})")  # fmt: skip
    entry = parts[number]
    check_fields(entry, f"{at}: parts[{number}]", _FRAGMENT_PART_KEYS)
    key, size, sha = entry["key"], entry["size"], entry["sha256"]
    if key != part_key(name, writer, number):
        raise ValueError(f"{at}: parts[{number}].key must be {part_key(name, writer, number)!r}")
    if type(size) is not int or not 0 < size <= _MAX_RNG_BYTES:
        raise ValueError(f"{at}: parts[{number}].size must be an int in 1..{_MAX_RNG_BYTES}")
    if not isinstance(sha, str) or len(sha) != 64 or sha.strip("0123456789abcdef"):
        raise ValueError(f"{at}: parts[{number}].sha256 must be 64 lower-case hex digits")
    return parts[:number], Part(key, writer, size, sha)


def _packed_slabs(
    head: Head, writer: int, parts: list[Any], first: Any, split_rows: list[int], at: str
) -> list[dict[str, Any]]:
    """The slab entries of a fragment whose slabs lie back to back from part ``first`` on (field
    ``packed``): each of the writer's rows of each tensor split by rows, in order, its length
    from the head's formula, cut where the parts' sizes say."""
    if type(first) is not int or not 0 <= first <= len(parts):
        raise ValueError(f"{at}: field 'packed' must be a part number in 0..{len(parts)}")
    sizes = []
    for i, part in enumerate(parts):
        size = part.get("size") if isinstance(part, dict) else None
        if type(size) is not int or size < 0:
            raise ValueError(f"{at}: parts[{i}].size must be an int >= 0")
        sizes.append(size)
    entries: list[dict[str, Any]] = []
    p, offset = first, 0
    for ordinal, number in enumerate(split_rows):
        dtype, shape, _ = head.tensors[number]
        if writer >= head.row_writers or dtype not in DTYPE_NAMES:
            continue  # no rows here (or a dtype the head check refuses)
        lo, hi = rows_of(writer, head.row_writers, shape[0])
        left = (hi - lo) * itemsize(dtype)
        for n in shape[1:]:
            left *= n
        extents = []
        while left:
            if p >= len(parts):
                raise ValueError(f"{at}: its parts from {first} on hold fewer bytes than its rows")
            length = min(left, sizes[p] - offset)
            if length:
                extents.append({"part": p, "offset": offset, "length": length})
            offset, left = offset + length, left - length
            if offset == sizes[p]:
                p, offset = p + 1, 0
        if extents:
            entries.append({"tensor": ordinal, "extents": extents})
    while p < len(parts) and sizes[p] == 0:
        p += 1
    if p != len(parts) or offset:
        raise ValueError(f"{at}: its parts from {first} on hold more bytes than its rows")
    return entries
