"""The Store contract: what every backend promises, written before how any backend keeps it.

A Store holds immutable objects under relative POSIX keys (``koochak.storage.keys``). The
contract is deliberately narrow — get, open, put (create-only), stat, list, delete, local_path —
because object storage and its FUSE mounts cannot rename, append, overwrite or symlink
atomically. Everything durable that Koochak writes goes through it; conveniences (publication,
copies) are functions on top, never methods a backend must add.

Abilities beyond the seven methods are *declared*, never guessed: a store may offer
``capabilities() -> StoreCapabilities`` (what it can do beyond the contract, and how it would like
to be treated), and every caller asks ``capabilities_of(store)``. A store that declares nothing
gets ``StoreCapabilities()``, the safe defaults (no filesystem root, no batch put, no
self-checks, a remote profile, no read settling).

``koochak.storage.testing.StoreConformance`` checks this contract, and that a store does what it
declares: a backend subclasses it with a ``store`` fixture. Import these names from
``koochak.storage.store`` or ``koochak.storage``; this module imports nothing from Koochak at
all, so it is the whole story for a backend's author.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol, runtime_checkable

__all__ = [
    "ObjectInfo",
    "PUBLISH_DECLARATIONS",
    "Store",
    "StoreCapabilities",
    "capabilities_of",
    "check_put_expectations",
    "list_shallow",
]

# What ``StoreCapabilities.publish`` may say: how a put makes its object appear.
PUBLISH_DECLARATIONS = ("link", "exclusive", None)


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


@dataclass(frozen=True)
class StoreCapabilities:
    """What a store can do beyond the Store contract, declared by the store itself.

    ``publish``              how a put makes its object appear on a filesystem: ``"link"`` (a
                             no-replace hard link: POSIX filesystems; create-only holds between
                             all clients), ``"exclusive"`` (a rename under a directory lock:
                             object-storage mounts; create-only holds between this host's
                             writers only), or ``None`` (not a filesystem: the backend's own
                             create-only put, e.g. S3's conditional write).
    ``root``                 the absolute directory that holds the objects (``local_path(key)`` is
                             ``root/key``), or ``None`` when there is none.
    ``read_settle_seconds``  how long readers should wait for an object that a manifest names to
                             become visible (0: it is visible at once).
    ``put_many``             the store has ``put_many([(key, data, expected_size,
                             expected_sha256), ...]) -> list[ObjectInfo]``, a create-only batch put.
    ``profile``              the store's StoreProfile (its costs), or ``None`` for the default
                             (``koochak.storage.profile.profile_of`` decides).
    ``probe_checks``         the store has ``probe_checks(prefix) -> list[dict]``, rows of
                             ``name``, ``supported``, ``detail``, ``seconds`` that koochak-probe
                             reports.
    ``list_shallow``         the store has ``list_shallow(prefix, delimiter) -> list[ObjectInfo]``:
                             what ``list(prefix)`` gives less every key with ``delimiter`` after
                             ``prefix``, found without enumerating those (S3's ``Delimiter``; a
                             directory entry's name, no stat). Callers use the function
                             ``list_shallow(store, ...)``, which filters ``list`` for a store
                             that does not declare it.

    The defaults are safe for a store that says nothing about itself.
    """

    publish: str | None = None
    root: str | None = None
    read_settle_seconds: float = 0.0
    put_many: bool = False
    profile: Any = None  # a koochak.storage.profile.StoreProfile (not imported: see above)
    probe_checks: bool = False
    list_shallow: bool = False

    def __post_init__(self) -> None:
        if self.publish not in PUBLISH_DECLARATIONS:
            raise ValueError(
                f"StoreCapabilities publish={self.publish!r}; expected one of "
                f"{PUBLISH_DECLARATIONS}"
            )
        root = self.root
        if root is not None and (not isinstance(root, str) or not root.startswith("/")):
            raise ValueError(f"StoreCapabilities root={root!r}; expected an absolute path or None")
        value = self.read_settle_seconds
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(
                f"StoreCapabilities read_settle_seconds={value!r}; expected a number >= 0"
            )
        for name in ("put_many", "probe_checks", "list_shallow"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"StoreCapabilities {name}={getattr(self, name)!r}; expected a bool"
                )


_DEFAULTS = StoreCapabilities()


def capabilities_of(store: Any) -> StoreCapabilities:
    """What ``store`` declares it can do (``store.capabilities()``), or the safe defaults.

    The one place that looks at a store for more than the contract: callers ask this, never
    ``getattr`` or ``isinstance`` of a backend class. A ``capabilities`` that returns anything
    other than a StoreCapabilities is a TypeError naming the store.
    """
    declare = getattr(store, "capabilities", None)
    if declare is None:
        return _DEFAULTS
    declared = declare() if callable(declare) else declare
    if not isinstance(declared, StoreCapabilities):
        raise TypeError(
            f"{type(store).__name__}.capabilities() returned {type(declared).__name__}; "
            "expected a koochak.storage.protocol.StoreCapabilities"
        )
    return declared


def exists(store: Any, key: str) -> bool:
    """Whether ``store`` holds ``key`` now (one ``stat``); other errors propagate."""
    try:
        store.stat(key)
    except FileNotFoundError:
        return False
    return True


def list_shallow(store: Any, prefix: str, delimiter: str) -> list[ObjectInfo]:
    """The objects of ``store`` whose key starts with ``prefix`` and has no ``delimiter`` after
    it, sorted by key: e.g. a tier's checkpoints and their manifests without any of their parts
    (``delimiter`` ``".part-"``). The store's own ``list_shallow`` where it declares one (it
    never enumerates what it leaves out), else ``list(prefix)`` filtered."""
    if not delimiter:
        raise ValueError("list_shallow: delimiter must be a non-empty string")
    if capabilities_of(store).list_shallow:
        return store.list_shallow(prefix, delimiter)
    return [info for info in store.list(prefix) if delimiter not in info.key[len(prefix) :]]
