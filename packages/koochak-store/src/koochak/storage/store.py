"""Where a Store comes from (``open_store``, ``register_store``), and the Store API in one import.

``from koochak.storage.store import open_store, LocalStore, Store, ObjectInfo`` is the public
path (the spec's), so this module also re-exports the names that live in their own files:

* ``protocol.py``   the Store contract: ``Store`` and ``ObjectInfo``, contract first in each
                    docstring, and the declared optional abilities (``StoreCapabilities``,
                    ``capabilities_of``); checked for any backend by ``koochak.storage.testing``;
* ``local_store.py`` ``LocalStore`` (publish ``link`` / ``exclusive``) and ``SETTLING_ERRNOS``;
* ``keys.py``       ``validate_key``, ``TEMP_PREFIX``, ``PUBLISH_MODES``.

The contract lives apart from this module so that it imports nothing: ``open_store`` needs
LocalStore, LocalStore needs ObjectInfo, and keeping the three in one direction
(protocol <- local_store <- store) leaves the package without an import cycle.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from urllib.parse import unquote

from koochak.storage.keys import PUBLISH_MODES, TEMP_PREFIX, validate_key
from koochak.storage.local_store import SETTLING_ERRNOS, LocalStore, ObjectCollision
from koochak.storage.protocol import (
    ObjectInfo,
    Store,
    StoreCapabilities,
    capabilities_of,
    check_put_expectations,
    exists,
    list_shallow,
)

__all__ = [
    "ObjectInfo",
    "Store",
    "StoreCapabilities",
    "capabilities_of",
    "LocalStore",
    "ObjectCollision",
    "PUBLISH_MODES",
    "SETTLING_ERRNOS",
    "TEMP_PREFIX",
    "validate_key",
    "check_put_expectations",
    "exists",
    "list_shallow",
    "open_store",
    "register_store",
]


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*")
_FACTORIES: dict[str, Callable[[str], Store]] = {}
ENTRY_POINT_GROUP = "koochak.stores"


def register_store(scheme: str, factory: Callable[[str], Store]) -> None:
    """Make ``open_store("scheme://path")`` return ``factory(path)`` in this process.

    A registered factory wins over ``koochak.stores`` entry points and the stores file, and a
    second registration of a scheme replaces the first. ``scheme`` must look like a URI scheme
    (``ValueError``); ``file`` always means a LocalStore and cannot be registered.
    """
    if not isinstance(scheme, str) or not _SCHEME.fullmatch(scheme):
        raise ValueError(f"register_store: scheme {scheme!r} is not a URI scheme like 'archive'")
    if scheme.lower() == "file":
        raise ValueError("register_store: 'file' always means a LocalStore and cannot be replaced")
    if not callable(factory):
        raise TypeError(f"register_store({scheme!r}): factory must be callable, got {factory!r}")
    _FACTORIES[scheme.lower()] = factory


def _entry_point_factory(scheme: str) -> Callable[[str], Store] | None:
    from importlib.metadata import entry_points

    matches = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name.lower() == scheme]
    if not matches:
        return None
    if len({ep.value for ep in matches}) > 1:
        values = ", ".join(sorted(ep.value for ep in matches))
        raise ValueError(
            f"scheme {scheme!r} is claimed by several {ENTRY_POINT_GROUP!r} entry points: {values}"
        )
    try:
        factory = matches[0].load()
    except Exception as exc:  # a plugin that fails to import: name it, not a bare traceback
        raise ImportError(
            f"the {ENTRY_POINT_GROUP!r} entry point {matches[0].name!r} = {matches[0].value!r} "
            f"for scheme {scheme!r} failed to load: {type(exc).__name__}: {exc}"
        ) from exc
    if not callable(factory):
        raise TypeError(f"entry point {matches[0].value!r} for scheme {scheme!r} is not callable")
    return factory


def _file_uri_path(location: str) -> str:
    rest = location[len("file://") :]
    host, slash, path = rest.partition("/")
    if host not in ("", "localhost"):
        raise ValueError(
            f"open_store({location!r}): file:// URIs must name a local path, not host {host!r}"
        )
    return unquote(slash + path) or "/"


def open_store(location: str | os.PathLike[str] | Store) -> Store:
    """The Store a location names: a path, a ``scheme://path`` URI, or a Store itself.

    A Store is returned unchanged; plain paths and ``file://`` URIs become a LocalStore; any
    other ``scheme://path`` comes from, in order, a ``register_store`` factory, an installed
    ``koochak.stores`` entry point, or the stores file (which builds a LocalStore with that
    entry's settings). A factory that returns something other than a Store is a ``TypeError``.
    """
    if isinstance(location, os.PathLike):
        return LocalStore(os.fspath(location))
    if not isinstance(location, str):
        if isinstance(location, Store):
            return location
        raise TypeError(f"open_store: expected a path, URI or Store, got {type(location).__name__}")
    if not location:
        raise ValueError("open_store: location is empty; expected a path or scheme://path")
    scheme, sep, rest = location.partition("://")
    if not sep or not _SCHEME.fullmatch(scheme):
        return LocalStore(location)
    scheme = scheme.lower()
    if scheme == "file":
        return LocalStore(_file_uri_path(location))
    factory = _FACTORIES.get(scheme) or _entry_point_factory(scheme)
    if factory is not None:
        store = factory(rest)
        if not isinstance(store, Store):
            raise TypeError(
                f"open_store({location!r}): the factory for {scheme!r} returned "
                f"{type(store).__name__}, which does not implement the Store protocol"
            )
        return store
    from koochak.storage.stores_file import settings_for_scheme

    settings = settings_for_scheme(scheme, location)
    if settings.backend is not None:  # a plugin store configured in the stores file
        found = _FACTORIES.get(settings.backend) or _entry_point_factory(settings.backend)
        return settings.open_backend(rest, location, found)
    try:
        root = settings.root_for(rest)
    except ValueError as exc:
        raise ValueError(f"open_store({location!r}): {exc}") from None
    return LocalStore(
        root,
        publish=settings.publish,
        fsync=settings.fsync,
        verify_readback=settings.verify_readback,
        settle_seconds=settings.settle_seconds,
        read_settle_seconds=settings.read_settle_seconds,
        profile=settings.profile,
    )
