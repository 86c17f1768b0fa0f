"""Deprecated alias of the loop's old saving module; kept for one minor version.

The code is in ``koochak.loop.checkpoint.saver`` (``capture_checkpoint``, ``CheckpointSaver``),
``.restore`` (``restore_rng``) and ``.resume`` (``resume_checkpoint``, which now returns a
``ResumePoint(path, checkpoint)`` or None; the function here keeps the old
``(checkpoint, path)`` order).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

from koochak.loop.checkpoint.restore import restore_rng
from koochak.loop.checkpoint.resume import RESUME_MODES
from koochak.loop.checkpoint.resume import resume_checkpoint as _resume_checkpoint
from koochak.loop.checkpoint.saver import CheckpointSaver, capture_checkpoint
from koochak.storage.store import Store

__all__ = [
    "RESUME_MODES",
    "CheckpointSaver",
    "capture_checkpoint",
    "restore_rng",
    "resume_checkpoint",
]


def resume_checkpoint(
    resume: str | None,
    location: str | os.PathLike[str] | Store | None,
    checkpoint_dict: Mapping[str, Any] | None = None,
    auto_resume_path: str | None = None,
) -> tuple[dict[str, Any] | None, str | None]:
    """``(checkpoint, path)``, or ``(None, None)`` to start fresh (the old order)."""
    found = _resume_checkpoint(resume, location, checkpoint_dict, auto_resume_path)
    return (None, None) if found is None else (found.checkpoint, found.path)


warnings.warn(
    "koochak.loop.checkpoint_saver is deprecated and will be removed in the next minor version; "
    "its code is in koochak.loop.checkpoint.saver, .restore and .resume",
    DeprecationWarning,
    stacklevel=2,
)
