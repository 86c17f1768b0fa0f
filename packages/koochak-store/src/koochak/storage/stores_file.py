"""The stores file: scheme names mapped to LocalStore roots and settings (work in progress)."""

from __future__ import annotations

from koochak.storage.store import Store


def open_from_stores_file(scheme: str, path: str, location: str) -> Store:
    raise ValueError(
        f"open_store({location!r}): no store is registered for scheme {scheme!r} "
        "(register_store, a 'koochak.stores' entry point or the stores file)"
    )
