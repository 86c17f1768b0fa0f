"""A package's public names imported on first use (PEP 562), for the koochak packages' ``__init__``.

A command that needs one module of a package (``koochak-data pull``, the launcher) should not pay
for importing every module the package re-exports. Each package lists its names and where they
live, and `lazy_exports` makes the module-level ``__getattr__`` and ``__dir__`` that import a
name's module when the name is first read and keep the value in the package's namespace (later
reads are plain attribute lookups). Standard library only, so every koochak package may use it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, homes: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose name ``n`` lives in module ``homes[n]``
    (relative to ``package``, or absolute when it starts with ``koochak.``); ``namespace`` is the
    package's ``globals()``."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = home if home.startswith("koochak.") else f"{package}.{home}"
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # resolved once
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(homes))

    return __getattr__, __dir__
