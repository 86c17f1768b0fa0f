"""Deprecated alias of checkpoint selection's old module; kept for one minor version.

Import from ``koochak.loop.checkpoint`` (``load``, ``latest``, ``best``,
``highest_valid_published``, ``resolve_auto_resume``); the module behind them is
``koochak.loop.checkpoint.resume``.
"""

import warnings

from koochak.loop.checkpoint.resume import (
    best,
    highest_valid_published,
    latest,
    load,
    resolve_auto_resume,
)

__all__ = ["best", "highest_valid_published", "latest", "load", "resolve_auto_resume"]

warnings.warn(
    "koochak.loop.resume is deprecated and will be removed in the next minor version; "
    "import load, latest, best, highest_valid_published and resolve_auto_resume from "
    "koochak.loop.checkpoint",
    DeprecationWarning,
    stacklevel=2,
)
