"""Deterministic WebDataset-layout tar encoding and a strict, streaming tar reader.

A sample ``{"__key__": "a/b", "jpg": ..., "cls": ...}`` becomes the members ``a/b.cls`` and
``a/b.jpg`` (fields in sorted order), each a POSIX ustar regular file with fixed mode, owner and
mtime, so the same samples always give byte-identical shards. We write the headers ourselves
rather than through :mod:`tarfile`: the bytes are then fixed by this file alone, not by the
defaults of whichever Python version built the dataset.

The reader parses a shard held whole in one buffer and hands out each member's bytes as a
slice of it (no copy); it accepts what common writers produce (ustar and GNU headers, pax and GNU long names, directory
entries) and refuses anything a dataset shard must not contain (links,
devices, unsafe paths, duplicate members, data after the end of the archive) with a ValueError.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NoReturn

BLOCK = 512
END_OF_ARCHIVE = bytes(2 * BLOCK)

# Fixed header fields: a shard member differs from another only by its name and size.
_ZERO_ID = b"0000000\x00"
# Bytes 156..345 of every header we write: typeflag "0" (regular file), no link name, magic
# "ustar\0" version "00", no user or group name, device numbers 0.
_AFTER_CHECKSUM = b"0" + bytes(100) + b"ustar\x0000" + bytes(64) + _ZERO_ID + _ZERO_ID
_PADDING = bytes(12)
# The checksum counts its own field as eight spaces.
_CONSTANT_SUM = sum(_AFTER_CHECKSUM) + 8 * 32
_MAX_SIZE = 8**11 - 1  # the largest size an 11-digit octal field holds (8 GiB - 1)

# WebDataset splits a member name into key and extension at the first dot of the last path
# segment (``base_plus_ext``), and lower-cases the extension. Keys and field names are
# restricted so that every sample we write splits back into exactly what was written.
_FIELD_RE = re.compile(r"[a-z0-9_][a-z0-9_.\-]*")
_MEMBER_RE = re.compile(r"^((?:.*/|)[^./][^./]*)\.([^/]+)$", re.DOTALL)


# Any of: NUL or backslash, a leading "/", or an empty, "." or ".." segment.
_UNSAFE_PATH = re.compile(r"[\x00\\]|^/|(?:^|/)\.{0,2}(?:/|\Z)")
# The same but for POSIX file names, where a backslash is an ordinary character.
_UNSAFE_POSIX_PATH = re.compile(r"\x00|^/|(?:^|/)\.{0,2}(?:/|\Z)")


def check_path(path: str, what: str, *, backslash: bool = False) -> None:
    """Raise ValueError unless ``path`` is a plain relative path (no ``..``, ``.``, or ``//``).

    The one path check of koochak.data: tar member names and sample keys (which must not
    contain a backslash either), and collection paths (``backslash=True``: a POSIX file name may).
    """
    unsafe = _UNSAFE_POSIX_PATH if backslash else _UNSAFE_PATH
    if path and not unsafe.search(path):
        return  # the common case, in one regex call
    if not path:
        raise ValueError(f"{what} must be a non-empty relative path, got {path!r}")
    if "\x00" in path:
        raise ValueError(f"{what} must not contain NUL, got {path!r}")
    if "\\" in path and not backslash:
        raise ValueError(f"{what} must not contain a backslash, got {path!r}")
    if path.startswith("/"):
        raise ValueError(f"{what} must be relative, got absolute {path!r}")
    raise ValueError(f"{what} must not contain empty, '.' or '..' segments, got {path!r}")


def check_sample_key(key: object) -> str:
    if not isinstance(key, str):
        raise ValueError(f"sample '__key__' must be a str, got {type(key).__name__}")
    check_path(key, f"sample '__key__' {key!r}")
    if "." in key.rsplit("/", 1)[-1]:
        # A dot in the last segment would move the key/extension split when read back.
        raise ValueError(
            f"sample '__key__' {key!r}: the last path segment must not contain '.', "
            "because WebDataset splits keys from extensions at the first dot"
        )
    return key


def encode_sample(sample: Mapping[str, object]) -> list[bytes]:
    """Return the tar blocks of one sample (headers, data, padding) as a list of chunks."""
    if not isinstance(sample, Mapping):
        raise ValueError(f"a sample must be a mapping of field -> bytes, got {type(sample).__name__}")
    if "__key__" not in sample:
        raise ValueError("sample has no '__key__' field")
    key = check_sample_key(sample["__key__"])
    names = [name for name in sample if name != "__key__"]
    for name in names:
        if not isinstance(name, str):
            raise ValueError(f"sample {key!r}: field names must be str, got {name!r}")
    fields = sorted(names)
    if not fields:
        raise ValueError(f"sample {key!r} has no data fields besides '__key__'")
    chunks: list[bytes] = []
    for field in fields:
        if not _FIELD_RE.fullmatch(field) or field.startswith("__"):
            raise ValueError(
                f"sample {key!r}: field name {field!r} must be a lower-case extension such as "
                "'jpg' or 'seg.png' ([a-z0-9_.-], not starting with '__' or '.')"
            )
        if field.endswith("."):
            raise ValueError(f"sample {key!r}: field name {field!r} must not end with '.'")
        value = sample[field]
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise ValueError(
                f"sample {key!r}: field {field!r} must be bytes, got {type(value).__name__} "
                "(encode it first, e.g. str.encode())"
            )
        data = bytes(value)
        chunks.append(member_header(f"{key}.{field}", len(data)))
        chunks.append(data)
        if len(data) % BLOCK:
            chunks.append(bytes(BLOCK - len(data) % BLOCK))
    return chunks


def padded(size: int) -> int:
    """``size`` rounded up to whole tar blocks: the space member data takes in an archive."""
    return -(-size // BLOCK) * BLOCK


def member_header(name: str, size: int, *, mode: int = 0o644, mtime: int = 0) -> bytes:
    """A deterministic ustar header for a regular file ``name`` of ``size`` bytes.

    The one tar header writer of koochak.data: shards use the defaults (every member alike),
    collection packs pass each file's permission bits and mtime in seconds. uid/gid are 0 and
    there are no user or group names, so the bytes depend on these arguments alone.
    """
    raw = name.encode("utf-8")
    prefix = b""
    if len(raw) > 100:
        # ustar stores long names as prefix + "/" + name: split at a slash where both parts fit.
        cuts = [i for i in range(1, min(len(raw) - 1, 156)) if raw[i] == 0x2F and len(raw) - i - 1 <= 100]
        if not cuts:
            raise ValueError(
                f"tar member name {name!r} is too long for a ustar header "
                "(at most 155 bytes before and 100 bytes after a '/' split)"
            )
        prefix, raw = raw[: cuts[0]], raw[cuts[0] + 1 :]
    if size > _MAX_SIZE:
        raise ValueError(f"tar member {name!r} is {size} bytes; a ustar member holds at most {_MAX_SIZE}")
    if not 0 <= mtime <= _MAX_SIZE or not 0 <= mode <= 0o7777:
        raise ValueError(f"tar member {name!r}: mtime {mtime} or mode {mode:#o} does not fit a ustar header")
    # Built as one join with the checksum summed arithmetically: headers are written for every
    # small file of an archive, and formatting a 512-byte bytearray field by field (then summing
    # it) cost several times more than the join.
    numbers = b"%07o\x00%s%s%011o\x00%011o\x00" % (mode, _ZERO_ID, _ZERO_ID, size, mtime)
    checksum = sum(raw) + sum(prefix) + sum(numbers) + _CONSTANT_SUM
    return b"".join(
        (
            raw.ljust(100, b"\x00"),
            numbers,
            b"%06o\x00 " % checksum,
            _AFTER_CHECKSUM,
            prefix.ljust(155, b"\x00"),
            _PADDING,
        )
    )


# ---------------------------------------------------------------------------------------------
# Reading


# name, size, chksum, typeflag, magic, prefix; the x-padding skips the fields we never read.
_HEADER = struct.Struct("100s24x12s12x8s1s100x6s2x64x16x155s12x")
_ZERO_BLOCK = bytes(BLOCK)
_REGULAR = (b"0", b"\x00", b"7")
_LINK_KINDS = {
    b"1": "hard link",
    b"2": "symbolic link",
    b"3": "character device",
    b"4": "block device",
    b"6": "FIFO",
}


def _where(source: str, pos: int) -> str:
    return f"{source}: tar header at byte {pos}"


def _field_str(raw: bytes) -> bytes:
    end = raw.find(b"\x00")
    return raw if end < 0 else raw[:end]


def _octal(raw: bytes, what: str, source: str, pos: int) -> int:
    if raw[:1] == b"\x80":
        # GNU base-256 (big-endian) for values that do not fit in octal.
        return int.from_bytes(raw[1:], "big")
    end = raw.find(b"\x00")
    text = (raw if end < 0 else raw[:end]).strip(b" ")
    if not text:
        return 0
    try:
        if not text.isdigit():  # int() alone would accept signs, '_' and '0o'
            raise ValueError(text)
        return int(text, 8)
    except ValueError:
        raise ValueError(
            f"{_where(source, pos)}: header field {what} is not an octal number: {raw!r}"
        ) from None


def _signed_checksum(header: bytes) -> int:
    # Some old writers summed signed bytes; accept that sum too, as tar readers do.
    rest = header[:148] + header[156:]
    return sum(rest) + 8 * 32 - 256 * sum(1 for b in rest if b > 127)


def _parse_pax(data: bytes, where: str) -> dict[str, str]:
    records: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos)
        if space < 0 or not data[pos:space].isdigit():
            raise ValueError(f"{where}: malformed pax header record at byte {pos}")
        length = int(data[pos:space])
        record = data[space + 1 : pos + length]
        if length <= space - pos or pos + length > len(data) or not record.endswith(b"\n"):
            raise ValueError(f"{where}: malformed pax header record at byte {pos}")
        name, eq, value = record[:-1].partition(b"=")
        if not eq:
            raise ValueError(f"{where}: pax header record without '=' at byte {pos}")
        try:
            records[name.decode("utf-8")] = value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{where}: pax header record is not UTF-8 at byte {pos}") from exc
        pos += length
    return records


def _decode_name(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where}: member name {raw!r} is not UTF-8") from exc


def _truncated(source: str, what: str, pos: int, want: int, got: int) -> NoReturn:
    raise ValueError(
        f"{source}: truncated tar archive: {what} at byte {pos} needs {want} bytes, {got} remain"
    )


def parse_members(
    data: memoryview, source: str, *, checksums: bool = True
) -> Iterator[tuple[str, memoryview]]:
    """Every regular-file member of the tar archive held whole in ``data``: (name, bytes).

    Each member's bytes are a slice of ``data`` (no copy), so they live as long as the caller
    keeps them and read as whatever ``data`` holds: hand in a read-only view of a buffer nobody
    writes again. ``data`` must be exactly the archive (its length is the object's size), so a
    header claiming more bytes than remain is a truncation error, never an allocation. Raises
    ValueError naming ``source`` and the member for anything malformed or unsafe.
    ``checksums=False`` skips the per-header checksums, for bytes whose SHA256 is checked
    anyway; bounds and names are always checked.
    """
    if data.ndim != 1 or data.itemsize != 1:
        data = data.cast("B")
    end = len(data)
    unpack = _HEADER.unpack_from
    pos = 0
    long_name: str | None = None
    pax: dict[str, str] = {}
    while True:
        if end - pos < BLOCK:
            raise ValueError(
                f"{source}: truncated tar archive: no end-of-archive marker (ends at byte {end})"
            )
        raw_name, raw_size, raw_sum, typeflag, magic, raw_prefix = unpack(data, pos)
        if not raw_name[0] and data[pos : pos + BLOCK] == _ZERO_BLOCK:
            # End of archive. Anything after it must be zero padding (tar record blocking).
            if bytes(data[pos + BLOCK :]).strip(b"\x00"):
                raise ValueError(
                    f"{source}: non-zero data after the end-of-archive marker at byte {pos}"
                )
            if long_name is not None or pax:
                raise ValueError(f"{_where(source, pos)}: archive ends after a long-name/pax header")
            return
        if checksums:
            header = bytes(data[pos : pos + BLOCK])
            stored = _octal(raw_sum, "chksum", source, pos)
            computed = sum(header) - sum(raw_sum) + 8 * 32
            if stored != computed and stored != _signed_checksum(header):
                raise ValueError(
                    f"{_where(source, pos)}: header checksum mismatch "
                    f"(stored {stored}, computed {computed})"
                )
        if magic not in (b"ustar\x00", b"ustar "):
            raise ValueError(f"{_where(source, pos)}: not a ustar/GNU tar header (magic {magic!r})")
        size = _octal(raw_size, "size", source, pos)
        if pax and typeflag in _REGULAR and "size" in pax:
            if not re.fullmatch(r"[0-9]+", pax["size"]):
                raise ValueError(f"{_where(source, pos)}: pax size {pax['size']!r} is not a number")
            size = int(pax["size"])
        header_pos = pos
        start = pos + BLOCK
        if size > end - start:
            _truncated(source, "member data", start, size, end - start)
        stop = start + size
        padding = -size % BLOCK
        if padding > end - stop:
            _truncated(source, "member padding", stop, padding, end - stop)
        pos = stop + padding
        member = data[start:stop]
        if long_name is None and not pax and typeflag in _REGULAR:
            # The common case, a regular file named by its own header, in as few steps as we can.
            name = _decode_name(_field_str(raw_name), source)
            if raw_prefix[0] and magic == b"ustar\x00":
                name = _decode_name(_field_str(raw_prefix), source) + "/" + name
            check_path(name, f"{source}: tar member name")
            yield name, member
            continue
        if typeflag == b"x":
            pax = _parse_pax(bytes(member), _where(source, header_pos))
            continue
        if typeflag == b"g":
            _parse_pax(bytes(member), _where(source, header_pos))  # validated; names nothing we use
            continue
        if typeflag == b"L":
            long_name = _decode_name(_field_str(bytes(member)), source)
            continue
        if typeflag == b"K":
            continue  # GNU long link name: only meaningful for links, which are refused below
        if long_name is not None:
            name = long_name
        elif "path" in pax:
            name = pax["path"]
        else:
            name = _decode_name(_field_str(raw_name), source)
            if magic == b"ustar\x00":
                prefix = _field_str(raw_prefix)
                if prefix:
                    name = _decode_name(prefix, source) + "/" + name
        long_name = None
        if pax:
            pax = {}
        if typeflag == b"5":
            continue  # directory entries carry no sample data
        if typeflag not in _REGULAR:
            kind = _LINK_KINDS.get(typeflag, f"type {typeflag!r}")
            raise ValueError(f"{source}: tar member {name!r} is a {kind}; shards hold regular files only")
        check_path(name, f"{source}: tar member name")
        yield name, member


def iter_samples(
    members: Iterable[tuple[str, Any]], source: str, *, copy: bool = False
) -> Iterator[dict[str, Any]]:
    """Group consecutive members sharing a key into samples, WebDataset style.

    Field values are the members' data as given (``copy=True``: each turned into ``bytes``).

    A key that reappears after another key, or an extension repeated within one sample, is a
    ValueError: WebDataset readers would silently split or overwrite such samples.
    """
    seen: set[str] = set()
    sample: dict[str, Any] | None = None
    for name, data in members:
        match = _MEMBER_RE.match(name)
        if match is None:
            raise ValueError(
                f"{source}: tar member {name!r} has no '<key>.<extension>' name, "
                "so it belongs to no sample"
            )
        key, ext = match.group(1), match.group(2).lower()
        if sample is None or key != sample["__key__"]:
            if sample is not None:
                yield sample
            if key in seen:
                raise ValueError(f"{source}: sample key {key!r} appears twice (members are not contiguous)")
            seen.add(key)
            sample = {"__key__": key}
        if ext in sample:
            raise ValueError(f"{source}: sample {key!r} has field {ext!r} twice")
        sample[ext] = bytes(data) if copy else data
    if sample is not None:
        yield sample


# A member name of the plain kind ShardWriter writes: ASCII key segments without dots, one
# extension, then the field's NUL padding. Such a name passes check_path and splits exactly as
# _MEMBER_RE splits it, so a shard made only of these needs neither check per member.
_PLAIN_MEMBER = re.compile(rb"((?:[A-Za-z0-9_\-]+/)*[A-Za-z0-9_\-]+)\.([A-Za-z0-9_.\-]+)(?:\x00|\Z)")


def parse_samples(
    data: memoryview, source: str, *, checksums: bool = True, copy: bool = False
) -> list[dict[str, Any]]:
    """``list(iter_samples(parse_members(data, source, checksums=checksums), source, copy=copy))``
    in one pass per member for the archives ShardWriter writes (plain ustar headers and names;
    ``checksums=False``, i.e. bytes whose SHA256 was checked): a few operations per record
    instead of two generators, two regular expressions and a path check. Anything else (another
    header kind, a long or unusual name, a malformed field, a repeated key) goes through the
    general parser, which accepts and refuses exactly as it always has."""
    if not checksums and data.ndim == 1 and data.itemsize == 1:
        samples = _plain_samples(data, copy)
        if samples is not None:
            return samples
    return list(iter_samples(parse_members(data, source, checksums=checksums), source, copy=copy))


def _plain_samples(data: memoryview, copy: bool) -> list[dict[str, Any]] | None:
    """The samples of an archive of plain members only, or None at the first thing that is not
    one (the caller then parses it the general way, errors included)."""
    unpack, match = _HEADER.unpack_from, _PLAIN_MEMBER.match
    end, pos = len(data), 0
    samples: list[dict[str, Any]] = []
    seen: set[str] = set()
    sample: dict[str, Any] = {}
    current = None
    while end - pos >= BLOCK:
        raw_name, raw_size, _, typeflag, magic, raw_prefix = unpack(data, pos)
        if not raw_name[0]:  # the end-of-archive marker, then nothing but zero padding
            if data[pos : pos + BLOCK] == _ZERO_BLOCK and not bytes(data[pos + BLOCK :]).strip(b"\x00"):
                return samples
            return None
        if magic != b"ustar\x00" or raw_prefix[0] or typeflag not in _REGULAR:
            return None
        named = match(raw_name)
        digits = raw_size[:11]
        if named is None or raw_size[11] or not digits.isdigit():
            return None
        try:
            size = int(digits, 8)
        except ValueError:  # an 8 or a 9
            return None
        start = pos + BLOCK
        stop = start + size
        pos = stop + (-size % BLOCK)
        if pos > end:
            return None
        key = named.group(1).decode("ascii")
        ext = named.group(2).decode("ascii").lower()
        if key != current:
            if key in seen:
                return None
            seen.add(key)
            current, sample = key, {"__key__": key}
            samples.append(sample)
        elif ext in sample:
            return None
        sample[ext] = bytes(data[start:stop]) if copy else data[start:stop]
    return None

