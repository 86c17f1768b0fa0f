"""One strict JSON reader for every document koochak.data reads (index, manifest, file table,
pack records): duplicate fields, NaN/Infinity and runaway nesting are ValueErrors naming the
document, never a silent last-one-wins or a RecursionError."""

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


def loads_strict(data: bytes | str, where: str) -> Any:
    """Parse ``data`` (UTF-8 bytes or str) as strict JSON; ValueError naming ``where``."""
    try:
        if isinstance(data, (bytes, bytearray, memoryview)):
            data = bytes(data).decode("utf-8")
        return _DECODER.decode(data)
    except RecursionError:
        raise ValueError(f"{where}: JSON nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{where}: not valid JSON ({exc})") from None
