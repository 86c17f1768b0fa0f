"""Old names that still import, with a DeprecationWarning that names the new one."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

# Kept for one minor version after the rename (they went in 0.3), then removed.
REMOVED_IN = "koochak-jobs 0.4"


def moved(old: str, new: str) -> Any:
    """Warn that ``old`` (dotted) is deprecated and return what ``new`` (dotted) names.

    Called from a module ``__getattr__``, so the warning points at the line that used ``old``.
    """
    module, _, name = new.rpartition(".")
    warnings.warn(
        f"{old} is deprecated; use {new} (it is the same object). {old} will be removed in "
        f"{REMOVED_IN}.",
        DeprecationWarning,
        stacklevel=3,
    )
    return getattr(importlib.import_module(module), name)
