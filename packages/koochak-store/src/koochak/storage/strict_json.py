"""One strict JSON reader for every document Koochak reads back (ready manifests, shard indexes,
collection manifests and file tables, launch manifests, event envelopes): duplicate fields,
NaN/Infinity and runaway nesting are ValueErrors naming the document, never a silent
last-one-wins or a RecursionError. ``require_version`` checks a format's version field as an
exact ``int`` (``true`` and ``1.0`` compare equal to 1 in Python and are refused here)."""

from __future__ import annotations

import json
from typing import Any


def _no_duplicate_fields(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):  # the common case costs one comparison
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                raise ValueError(f"field {name!r} appears twice")
            seen.add(name)
    return result


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


# One decoder for every call: json.loads with hooks would build a new one each time, which
# costs as much as decoding a file-table line.
_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicate_fields, parse_constant=_no_constant)


def loads_strict(data: bytes | bytearray | memoryview | str, where: str) -> Any:
    """Parse ``data`` (UTF-8 bytes or str) as strict JSON; ValueError naming ``where``."""
    try:
        if isinstance(data, (bytes, bytearray, memoryview)):
            data = bytes(data).decode("utf-8")
        return _DECODER.decode(data)
    except RecursionError:
        raise ValueError(f"{where}: JSON nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{where}: not valid JSON ({exc})") from None


def is_exact_int(value: Any) -> bool:
    """True for an ``int`` that is not a ``bool`` (JSON ``1``, never ``true`` or ``1.0``)."""
    return type(value) is int


def require_version(
    doc: Any, where: str, supported: int | tuple[int, ...], field: str = "version"
) -> int:
    """Return ``doc[field]`` if it is an exact int among ``supported``; else a ValueError that
    names ``where``, the field, what was found and what this Koochak reads."""
    versions = (supported,) if isinstance(supported, int) else tuple(supported)
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(doc).__name__}")
    if field not in doc:
        raise ValueError(f"{where}: field {field!r} is missing")
    value = doc[field]
    if not is_exact_int(value):
        raise ValueError(
            f"{where}: field {field!r} must be the integer {versions[-1]}, got {value!r} "
            f"({type(value).__name__})"
        )
    if value not in versions:
        readable = ", ".join(str(v) for v in versions)
        raise ValueError(f"{where}: {field}={value}; this Koochak reads version {readable}")
    return value


def check_fields(
    doc: Any,
    where: str,
    required: frozenset[str] | set[str],
    optional: frozenset[str] | set[str] = frozenset(),
    *,
    prefix: str = "",
    error: type[Exception] = ValueError,
) -> dict[str, Any]:
    """Return ``doc`` if it is a JSON object holding every ``required`` field and nothing beyond
    ``required | optional``; else ``error`` naming ``where`` and the first unknown (then
    missing) field, spelled ``prefix + name`` (``"runner.python"``). The common case costs two
    set comparisons, so a reader may call it once per line of a large table."""
    if not isinstance(doc, dict):
        raise error(f"{where}: expected a JSON object, got {type(doc).__name__}")
    fields = doc.keys()
    if required <= fields and (fields - required) <= optional:
        return doc
    unknown = sorted(set(fields) - set(required) - set(optional), key=str)
    if unknown:
        expected = ", ".join(sorted(set(required) | set(optional)))
        raise error(f"{where}: unknown field '{prefix}{unknown[0]}' (expected {expected})")
    missing = sorted(set(required) - set(fields))
    raise error(f"{where}: missing field '{prefix}{missing[0]}'")
