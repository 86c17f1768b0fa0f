"""One strict JSON reader for every document koochak.data reads (index, manifest, file table,
pack records): duplicate fields, NaN/Infinity and runaway nesting are ValueErrors naming the
document, never a silent last-one-wins or a RecursionError."""

from __future__ import annotations

import json
from typing import Any


def _no_duplicate_fields(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for name, value in pairs:
        if name in result:
            raise ValueError(f"field {name!r} appears twice")
        result[name] = value
    return result


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def loads_strict(data: bytes | str, where: str) -> Any:
    """Parse ``data`` (UTF-8 bytes or str) as strict JSON; ValueError naming ``where``."""
    try:
        if isinstance(data, (bytes, bytearray, memoryview)):
            data = bytes(data).decode("utf-8")
        return json.loads(
            data, object_pairs_hook=_no_duplicate_fields, parse_constant=_no_constant
        )
    except RecursionError:
        raise ValueError(f"{where}: JSON nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{where}: not valid JSON ({exc})") from None
