"""The index of a checkpoint stored in parts: which objects hold its bytes, where each tensor is.

A checkpoint in parts is one small index object under the checkpoint's own name
(``step000000100.pt``, the key its ready manifest hashes) plus part objects beside it
(``step000000100.pt.part-WWWWW-NNNNN``: writer ``W``'s ``N``-th part). A part is raw tensor
bytes, nothing else; the index says, for every tensor, its dtype and shape and which byte ranges
(extents) of which parts hold it, and carries the checkpoint's non-tensor data as a weights-only
``torch.save`` skeleton. So one digest (the manifest's, of the index) covers every byte: the index
holds each part's size and SHA256. The layout is specified in docs/formats.md ("Checkpoint
parts"); this module builds, encodes and strictly checks the document and is torch-free.

Tensors are stored as shards of a global tensor (offsets into its shape), and parts name the
writer that wrote them, so several writers (ranks) can each write their own parts and one of them
the index; today's writer is always a single writer with one shard per tensor.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from koochak.storage.artifact import READY_SUFFIX, InvalidArtifact
from koochak.storage.strict_json import check_fields, loads_strict, require_version

PARTS_FORMAT = "koochak-checkpoint-parts"
PARTS_VERSION = 1
# Version 2 is a head that names one index fragment per writer (``index_fragments``).
HEAD_VERSION = 2
PART_INFIX = ".part-"

# The dtypes a part may hold, by the name the index uses (torch's name without "torch.").
# A fixed list: the reader never looks a name up on the torch module.
DTYPE_NAMES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "complex128",
    "complex64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint64",
    "uint32",
    "uint16",
    "uint8",
    "bool",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
)
_ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex128": 16,
    "complex64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
}
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_TOP_KEYS = frozenset({"format", "version", "name", "writers", "parts", "tensors", "skeleton"})
_PART_KEYS = frozenset({"key", "writer", "size", "sha256"})
_TENSOR_KEYS = frozenset({"dtype", "shape", "shards"})
_SHARD_KEYS = frozenset({"offsets", "shape", "extents"})
_EXTENT_KEYS = frozenset({"part", "offset", "length"})
# Shards of one tensor are checked pairwise for overlap unless they are all slabs of the first
# dimension (sorted and checked in one pass); past this many, other layouts are refused.
_MAX_BOX_SHARDS = 4096
# Bounds every count and size is checked against before the reader allocates anything. A part
# may hold at most _MAX_PART_BYTES (torch sizes are int64); a tensor has at most _MAX_DIMS
# dimensions, and the product of its dimensions (zeros counted as 1, so an empty tensor cannot
# hide a 2**70) is at most the parts' bytes, or _MIN_ELEMENT_BOUND for a checkpoint of almost
# no bytes; a checkpoint has at most MAX_WRITERS writers (ranks).
_MAX_PART_BYTES = 1 << 62
_MAX_DIMS = 64
_MIN_ELEMENT_BOUND = 1 << 16
MAX_WRITERS = 1 << 20


@dataclass(frozen=True)
class Part:
    """One part object: its key, the writer (rank) that wrote it, its size and SHA256."""

    key: str
    writer: int
    size: int
    sha256: str


@dataclass(frozen=True)
class Extent:
    """``length`` bytes at ``offset`` in part number ``part`` (an index into ``PartsIndex.parts``)."""

    part: int
    offset: int
    length: int


@dataclass(frozen=True)
class Shard:
    """A box of a tensor: ``shape`` elements starting at ``offsets`` in the tensor's shape.

    Its bytes are the box in C (row-major) order, the concatenation of ``extents``.
    """

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    extents: tuple[Extent, ...]


@dataclass(frozen=True)
class TensorEntry:
    """A tensor of the checkpoint: dtype name, global shape, and the shards that tile it."""

    dtype: str
    shape: tuple[int, ...]
    shards: tuple[Shard, ...]

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * _ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class PartsIndex:
    """The parsed index: tensor ``i`` is the one the skeleton refers to as number ``i``."""

    name: str
    writers: int
    parts: tuple[Part, ...]
    tensors: tuple[TensorEntry, ...]
    skeleton: bytes
    # Version 2: each writer's own RNG state as its fragment carries it (a weights-only
    # ``torch.save`` of the state), by writer; None for a writer whose fragment was not read or
    # holds none. Empty for version 1 (every rank's state is in the skeleton).
    rng: tuple[bytes | None, ...] = ()
    # Fragment version 2: each writer's RNG part (its own state, raw ``torch.save`` bytes, read
    # only by the rank that restores it), by writer; None for a writer whose fragment was not
    # read or names none. Not among ``parts``: no tensor lies in it.
    rng_parts: tuple[Part | None, ...] = ()

    @property
    def size(self) -> int:
        """Bytes in all parts together (the tensors' bytes)."""
        return sum(part.size for part in self.parts)


def part_key(name: str, writer: int, number: int) -> str:
    """The key of ``writer``'s ``number``-th part of checkpoint ``name``."""
    return f"{name}{PART_INFIX}{writer:05d}-{number:05d}"


def parts_prefix(name: str) -> str:
    """The prefix every part key of checkpoint ``name`` starts with (for listing and pruning)."""
    return name + PART_INFIX


def itemsize(dtype: str) -> int:
    """Bytes per element of an index dtype name; ValueError for a name outside DTYPE_NAMES."""
    try:
        return _ITEMSIZE[dtype]
    except (KeyError, TypeError):
        raise ValueError(
            f"dtype {dtype!r} cannot be stored in parts; expected one of {DTYPE_NAMES}"
        ) from None


def object_keys(index: PartsIndex) -> list[str]:
    """Every object of the checkpoint in commit order: parts, the index, its ready manifest.

    Copying them in this order (``koochak.storage.copy_objects``) commits the copy last.
    """
    return [part.key for part in index.parts] + [index.name, index.name + READY_SUFFIX]


def encode_index(index: PartsIndex) -> bytes:
    """The index as compact JSON, keys sorted, with a trailing newline (same input, same bytes)."""
    doc = {
        "format": PARTS_FORMAT,
        "version": PARTS_VERSION,
        "name": index.name,
        "writers": index.writers,
        "parts": [
            {"key": p.key, "writer": p.writer, "size": p.size, "sha256": p.sha256}
            for p in index.parts
        ],
        "tensors": [
            {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "shards": [
                    {
                        "offsets": list(s.offsets),
                        "shape": list(s.shape),
                        "extents": [
                            {"part": e.part, "offset": e.offset, "length": e.length}
                            for e in s.extents
                        ],
                    }
                    for s in t.shards
                ],
            }
            for t in index.tensors
        ],
        "skeleton": base64.b64encode(index.skeleton).decode("ascii"),
    }
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    raw = (text + "\n").encode("ascii")
    parse_index(raw, f"index of {index.name}", index.name)  # never write what we would refuse
    return raw


def parse_index(
    raw: bytes | bytearray | memoryview, where: str, name: str | None = None
) -> PartsIndex:
    """Parse and check an index; InvalidArtifact (a ValueError) naming ``where`` and the field
    on any fault.

    ``name``, when given, is the key the index was read from: the index must say the same, so an
    index copied under another name is refused. Checked besides every field's type: part keys
    are the ones this name and writer give, each tensor's shards tile its shape exactly, every
    shard's extents add up to its bytes, and the extents tile every part exactly (each byte of
    each part belongs to exactly one tensor). Every size, count and dimension is bounded by what
    the parts hold (``_MAX_*`` above), so no index can make a reader allocate more than the
    parts' bytes, or hand torch a shape it cannot represent; nothing is walked recursively.
    """
    try:
        return _parse_index(raw, where, name)
    except InvalidArtifact:
        raise
    except (ValueError, RecursionError) as exc:
        raise InvalidArtifact(str(exc)) from None


def _parse_index(raw: bytes | bytearray | memoryview, where: str, name: str | None) -> PartsIndex:
    doc = loads_strict(raw, where)
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: a parts index must be a JSON object")
    if doc.get("format") != PARTS_FORMAT:
        raise ValueError(
            f"{where}: field 'format' is {doc.get('format')!r}; a parts index says {PARTS_FORMAT!r}"
        )
    if doc.get("version") == HEAD_VERSION and type(doc.get("version")) is int:
        raise ValueError(
            f"{where}: a version-{HEAD_VERSION} index (a head naming per-writer fragments); "
            "read it with index_fragments.read_index, which fetches its fragments"
        )
    require_version(doc, where, PARTS_VERSION)
    return index_of_doc(doc, where, name)


def index_of_doc(
    doc: dict[str, Any], where: str, name: str | None, *, partial: bool = False
) -> PartsIndex:
    """A version-1 index document (already JSON-decoded, version checked) checked field by
    field as ``parse_index`` does; ValueError naming ``where`` and the field. ``partial``: the
    document holds only some writers' shards (assembled from some fragments of a version-2
    head), so a tensor's shards need not tile it (they still may not exceed it), and a tensor
    may have none."""
    check_fields(doc, where, _TOP_KEYS)
    index_name = doc["name"]
    if not isinstance(index_name, str) or not index_name:
        raise ValueError(f"{where}: field 'name' must be a non-empty string")
    if name is not None and index_name != name:
        raise ValueError(
            f"{where}: field 'name' is {index_name!r} but the index was read as {name!r}"
        )
    writers = _int(doc["writers"], f"{where}: field 'writers'", minimum=1)
    if writers > MAX_WRITERS:
        raise ValueError(f"{where}: field 'writers' is {writers}; at most {MAX_WRITERS} are read")
    parts = _parse_parts(doc["parts"], index_name, writers, where, partial=partial)
    bound = max(sum(part.size for part in parts), _MIN_ELEMENT_BOUND)
    tensors = _parse_tensors(doc["tensors"], len(parts), bound, where, partial=partial)
    _check_parts_tiled(parts, tensors, where)
    skeleton = doc["skeleton"]
    if not isinstance(skeleton, str):
        raise ValueError(f"{where}: field 'skeleton' must be a base64 string")
    try:
        skeleton_bytes = base64.b64decode(skeleton.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise ValueError(f"{where}: field 'skeleton' is not valid base64") from None
    return PartsIndex(index_name, writers, parts, tensors, skeleton_bytes)


def _parse_parts(
    value: Any, name: str, writers: int, where: str, *, partial: bool = False
) -> tuple[Part, ...]:
    if not isinstance(value, list) or not (value or partial):
        raise ValueError(f"{where}: field 'parts' must be a non-empty list")
    parts = []
    counts: dict[int, int] = {}
    last_writer = 0
    for number, entry in enumerate(value):
        at = f"{where}: parts[{number}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{at} must be an object {{key, writer, size, sha256}}")
        check_fields(entry, at, _PART_KEYS)
        writer = _int(entry["writer"], f"{at}.writer")
        if writer >= writers:
            raise ValueError(f"{at}.writer is {writer}; the index has writers={writers}")
        if writer < last_writer:
            raise ValueError(f"{at}: parts must be listed by writer, then number")
        last_writer = writer
        expected = part_key(name, writer, counts.get(writer, 0))
        counts[writer] = counts.get(writer, 0) + 1
        if entry["key"] != expected:
            raise ValueError(f"{at}.key is {entry['key']!r}; expected {expected!r}")
        sha = entry["sha256"]
        if not isinstance(sha, str) or not _SHA256_HEX.fullmatch(sha):
            raise ValueError(f"{at}.sha256 must be 64 lower-case hex digits")
        size = _int(entry["size"], f"{at}.size")
        if size > _MAX_PART_BYTES:
            raise ValueError(f"{at}.size is {size}; a part holds at most {_MAX_PART_BYTES} bytes")
        parts.append(Part(expected, writer, size, sha))
    return tuple(parts)


def _parse_tensors(
    value: Any, part_count: int, bound: int, where: str, *, partial: bool = False
) -> tuple[TensorEntry, ...]:
    if not isinstance(value, list):
        raise ValueError(f"{where}: field 'tensors' must be a list")
    tensors = []
    for number, entry in enumerate(value):
        at = f"{where}: tensors[{number}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{at} must be an object {{dtype, shape, shards}}")
        check_fields(entry, at, _TENSOR_KEYS)
        dtype = entry["dtype"]
        if not isinstance(dtype, str) or dtype not in _ITEMSIZE:
            raise ValueError(f"{at}.dtype is {dtype!r}; expected one of {DTYPE_NAMES}")
        shape = _dims(entry["shape"], f"{at}.shape", bound)
        if not isinstance(entry["shards"], list) or not (entry["shards"] or partial):
            raise ValueError(f"{at}.shards must be a non-empty list")
        shards = tuple(
            _parse_shard(shard, shape, _ITEMSIZE[dtype], part_count, f"{at}.shards[{i}]")
            for i, shard in enumerate(entry["shards"])
        )
        if not partial:
            _check_shards_tile(shape, shards, at)
        tensors.append(TensorEntry(dtype, shape, shards))
    return tuple(tensors)


def _parse_shard(value: Any, shape: tuple[int, ...], size: int, part_count: int, at: str) -> Shard:
    if not isinstance(value, dict):
        raise ValueError(f"{at} must be an object {{offsets, shape, extents}}")
    check_fields(value, at, _SHARD_KEYS)
    offsets = _dims(value["offsets"], f"{at}.offsets", _MAX_PART_BYTES)
    box = _dims(value["shape"], f"{at}.shape", _MAX_PART_BYTES)
    if len(offsets) != len(shape) or len(box) != len(shape):
        raise ValueError(
            f"{at}: offsets and shape need {len(shape)} entries (the tensor's dimensions)"
        )
    for dim, (start, length, whole) in enumerate(zip(offsets, box, shape)):
        if start + length > whole:
            raise ValueError(
                f"{at}: dimension {dim} spans [{start}, {start + length}) outside 0..{whole}"
            )
    if not isinstance(value["extents"], list):
        raise ValueError(f"{at}.extents must be a list")
    extents = []
    total = 0
    for i, extent in enumerate(value["extents"]):
        where = f"{at}.extents[{i}]"
        if not isinstance(extent, dict):
            raise ValueError(f"{where} must be an object {{part, offset, length}}")
        check_fields(extent, where, _EXTENT_KEYS)
        part = _int(extent["part"], f"{where}.part")
        if part >= part_count:
            raise ValueError(f"{where}.part is {part}; the index lists {part_count} parts")
        length = _int(extent["length"], f"{where}.length", minimum=1)
        extents.append(Extent(part, _int(extent["offset"], f"{where}.offset"), length))
        total += length
    if total != _numel(box) * size:
        raise ValueError(f"{at}: extents hold {total} bytes; the shard needs {_numel(box) * size}")
    return Shard(offsets, box, tuple(extents))


def _check_shards_tile(shape: tuple[int, ...], shards: Sequence[Shard], at: str) -> None:
    """The shards cover the tensor exactly once: volumes add up and no two overlap."""
    if sum(_numel(s.shape) for s in shards) != _numel(shape):
        raise ValueError(f"{at}: shards do not add up to the tensor's {_numel(shape)} elements")
    boxes = [s for s in shards if _numel(s.shape) > 0]
    if len(boxes) < 2:
        return
    if all(s.offsets[1:] == (0,) * (len(shape) - 1) and s.shape[1:] == shape[1:] for s in boxes):
        ordered = sorted(boxes, key=lambda s: s.offsets[0])  # slabs of dim 0: one sweep
        for before, after in zip(ordered, ordered[1:]):
            if before.offsets[0] + before.shape[0] > after.offsets[0]:
                raise ValueError(f"{at}: shards overlap along dimension 0")
        return
    if len(boxes) > _MAX_BOX_SHARDS:
        raise ValueError(
            f"{at}: {len(boxes)} shards that are not slabs of dimension 0; at most "
            f"{_MAX_BOX_SHARDS} are read"
        )
    for i, first in enumerate(boxes):
        for second in boxes[i + 1 :]:
            if all(
                a < b + m and b < a + n
                for a, n, b, m in zip(first.offsets, first.shape, second.offsets, second.shape)
            ):
                raise ValueError(f"{at}: shards at {first.offsets} and {second.offsets} overlap")


def _check_parts_tiled(parts: Sequence[Part], tensors: Sequence[TensorEntry], where: str) -> None:
    """Every byte of every part belongs to exactly one extent."""
    spans: list[list[tuple[int, int]]] = [[] for _ in parts]
    for tensor in tensors:
        for shard in tensor.shards:
            for extent in shard.extents:
                spans[extent.part].append((extent.offset, extent.length))
    for part, found in zip(parts, spans):
        cursor = 0
        for offset, length in sorted(found):
            if offset != cursor:
                problem = "overlap" if offset < cursor else "leave a gap"
                raise ValueError(
                    f"{where}: extents in part {part.key} {problem} at byte {min(offset, cursor)}"
                )
            cursor += length
        if cursor != part.size:
            raise ValueError(
                f"{where}: extents in part {part.key} cover {cursor} bytes; it has {part.size}"
            )


def _int(value: Any, where: str, minimum: int = 0) -> int:
    if type(value) is not int or value < minimum:
        raise ValueError(f"{where} must be an int >= {minimum}, got {value!r}")
    return value


def _dims(value: Any, where: str, bound: int) -> tuple[int, ...]:
    """A shape (or offsets): at most _MAX_DIMS ints >= 0 whose product, zeros counted as 1, is
    at most ``bound``, so torch can allocate it and it cannot claim more than the parts hold."""
    if not isinstance(value, list) or len(value) > _MAX_DIMS:
        raise ValueError(
            f"{where} must be a list of at most {_MAX_DIMS} ints >= 0, got {_brief(value)}"
        )
    dims = tuple(_int(v, f"{where}[{i}]") for i, v in enumerate(value))
    product = 1
    for dim in dims:
        product *= max(dim, 1)
        if product > bound:
            raise ValueError(
                f"{where} is {_brief(value)}: more elements than the checkpoint's parts hold "
                f"(at most {bound})"
            )
    return dims


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count
