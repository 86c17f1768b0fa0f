"""The Store contract: what every backend promises, written before how any backend keeps it.

A Store holds immutable objects under relative POSIX keys (``koochak.storage.keys``). The
contract is deliberately narrow — get, open, put (create-only), stat, list, delete, local_path —
because object storage and its FUSE mounts cannot rename, append, overwrite or symlink
atomically. Everything durable that Koochak writes goes through it; conveniences (publication,
copies) are functions on top, never methods a backend must add.

``koochak.storage.testing.StoreConformance`` checks this contract: a backend subclasses it with
a ``store`` fixture. Import these names from ``koochak.storage.store`` or ``koochak.storage``;
this module imports nothing from Koochak, so it is the whole story for a backend's author.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import BinaryIO, Protocol, runtime_checkable

__all__ = ["ObjectInfo", "Store", "check_put_expectations"]


@dataclass(frozen=True)
class ObjectInfo:
    """What a store knows about one object: its key, size in bytes and modification time.

    ``sha256`` (64 lower-case hex digits) is set by ``put``, which hashes while it writes;
    ``stat`` and ``list`` leave it ``None`` rather than read the object again.
    """

    key: str
    size: int
    mtime_ns: int
    sha256: str | None = None


@runtime_checkable
class Store(Protocol):
    """A flat namespace of write-once objects under relative POSIX keys.

    Every method that takes a key refuses an invalid one (``validate_key``) with
    ``ValueError``. There is no rename, append, overwrite or symlink: object storage cannot
    provide them. ``location`` is a human-readable name for messages (a path or
    ``scheme://...``).
    """

    location: str

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """The bytes of ``[start, end)``; a missing key raises ``FileNotFoundError``.

        Slice semantics: clamped at the end of the object, negative offsets count from the end,
        ``start >= end`` gives ``b""``.
        """
        ...

    def open(self, key: str) -> BinaryIO:
        """A readable binary stream of the whole object; a missing key raises
        ``FileNotFoundError``."""
        ...

    def put(
        self,
        key: str,
        data: bytes | bytearray | memoryview | BinaryIO | Iterable[bytes],
        *,
        expected_size: int | None = None,
        expected_sha256: str | None = None,
    ) -> ObjectInfo:
        """Create ``key`` with ``data``, create-only; return its ObjectInfo with ``sha256``.

        An existing key raises ``FileExistsError`` and the existing object is untouched; of
        concurrent puts of one key exactly one wins. Returns only once the object is durable
        and reads back with the written size; nothing partial is ever visible under ``key``,
        whatever fails (the source, the disk, a kill). A mismatch with ``expected_size`` /
        ``expected_sha256`` raises ``ValueError`` and leaves nothing behind. ``data`` is a
        bytes-like object, a binary stream or an iterable of bytes; ``str`` is a ``TypeError``.
        """
        ...

    def stat(self, key: str) -> ObjectInfo:
        """Size and mtime of one object (``sha256`` None); a missing key, or a name that is
        not an object (a directory of objects), raises ``FileNotFoundError``."""
        ...

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with the string ``prefix``, sorted by key.

        Recursive and a plain string match (``"a/b"`` finds ``a/b/x`` and ``a/bc``); an unknown
        prefix gives ``[]``; publication temp files are never listed.
        """
        ...

    def delete(self, key: str) -> None:
        """Remove one object; a missing key raises ``FileNotFoundError``. The key may then be
        created anew."""
        ...

    def local_path(self, key: str) -> str | None:
        """An absolute filesystem path of the object when the store has one, else ``None``."""
        ...


def check_put_expectations(
    key: str, expected_size: int | None, expected_sha256: str | None
) -> str | None:
    """Check ``put``'s ``expected_size`` and ``expected_sha256`` before anything is written.

    Every backend calls this first, so a bad expectation is the same ``ValueError`` everywhere.
    Returns the expected digest lower-cased, or ``None`` when there is none.
    """
    if expected_size is not None and (
        isinstance(expected_size, bool) or not isinstance(expected_size, int) or expected_size < 0
    ):
        raise ValueError(
            f"put({key!r}): expected_size must be a non-negative int, got {expected_size!r}"
        )
    if expected_sha256 is None:
        return None
    digest = str(expected_sha256).lower()
    if len(digest) != 64 or digest.strip("0123456789abcdef"):
        raise ValueError(
            f"put({key!r}): expected_sha256 must be 64 hex digits, got {expected_sha256!r}"
        )
    return digest
