"""Store keys and the names reserved while publishing: the lowest layer of ``koochak.storage``.

``store`` (the Store protocol and LocalStore), ``stores_file`` and ``fsutil`` all build on these,
so this module imports nothing from Koochak.
"""

from __future__ import annotations

import re

__all__ = ["PUBLISH_MODES", "TEMP_PREFIX", "validate_key"]

# How a LocalStore makes a put visible: hard link from a temp name, or O_EXCL on the key itself.
PUBLISH_MODES = ("link", "exclusive")

# Hidden names used while publishing; a key can never name one, and list() never shows one.
TEMP_PREFIX = ".koochak-tmp-"

_BAD_KEY_CHARS = re.compile(r"[?#\x00\\]")


def validate_key(key: str) -> str:
    """Return ``key`` unchanged if it is a valid store key, else raise ``ValueError``.

    A key is a relative POSIX path: no leading ``/``, no empty, ``.`` or ``..`` segments, no
    ``?``, ``#``, backslash or NUL (they mean something else in URIs and on other systems), and
    no segment starting with the publication temp prefix.
    """
    if not isinstance(key, str):
        raise TypeError(f"store key must be a str, got {type(key).__name__}: {key!r}")
    if not key:
        raise ValueError("store key is empty; expected a relative path such as 'dir/name.bin'")
    if key.startswith("/"):
        raise ValueError(f"store key {key!r} is absolute; expected a relative path")
    bad = _BAD_KEY_CHARS.search(key)
    if bad:
        raise ValueError(
            f"store key {key!r} contains {bad.group()!r}; '?', '#', backslash and NUL are not allowed"
        )
    for segment in key.split("/"):
        if segment in ("", ".", ".."):
            raise ValueError(
                f"store key {key!r} has an empty, '.' or '..' segment; expected 'a/b/c' form"
            )
        if segment.startswith(TEMP_PREFIX):
            raise ValueError(f"store key {key!r} uses the reserved prefix {TEMP_PREFIX!r}")
    return key


def _validate_prefix(prefix: str) -> str:
    """A list prefix may be empty or end inside a segment; it still may not escape the root."""
    if not isinstance(prefix, str):
        raise TypeError(f"list prefix must be a str, got {type(prefix).__name__}")
    if not prefix:
        return prefix
    head, _, tail = prefix.rpartition("/")
    if head:
        validate_key(head)
    if tail in (".", ".."):
        raise ValueError(
            f"list prefix {prefix!r} ends in {tail!r}; expected a relative path prefix"
        )
    if prefix.startswith("/") or _BAD_KEY_CHARS.search(tail):
        raise ValueError(f"list prefix {prefix!r} is not a relative key prefix")
    return prefix
