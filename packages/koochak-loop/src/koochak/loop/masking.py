"""Keep a run's secret values out of what the loop writes.

koochak-jobs' runner tells the workload which environment variables hold secrets
(``KOOCHAK_SECRET_NAMES``, names only). Foreign text the loop writes (an exception message in
koochak-train's one-line error, a warning quoting a hook's failure, a traceback under
``--debug``, a GPU health record) is masked with `koochak.events.secrets.mask_secrets`, the one
masking function koochak-jobs uses too; this module only wires it in. koochak-events is an
optional extra of the loop, but the runner that sets the variable needs it, so it is there
whenever there is something to mask. Should it be missing all the same, the text is withheld
rather than written unmasked.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, TextIO

__all__ = ["mask_text", "masked_output", "masking_active"]

# koochak.events.secrets.SECRET_NAMES_VARIABLE, named here so that a loop without
# koochak-events still knows when it must not write foreign text.
_NAMES_VARIABLE = "KOOCHAK_SECRET_NAMES"
_WITHHELD = (
    "[text withheld: this run names secrets, and koochak-events, which masks them, is not "
    "installed: pip install 'koochak-loop[events]']"
)


def _masker() -> Callable[[str], str] | None:
    """The masking function for this process's secrets; None when the run names none."""
    if not os.environ.get(_NAMES_VARIABLE, "").strip():
        return None
    try:
        from koochak.events.secrets import mask_secrets, secrets_from_environment
    except ImportError:
        return lambda text: _WITHHELD
    secrets = secrets_from_environment()
    if not secrets:
        return None
    return lambda text: mask_secrets(text, secrets)


def masking_active() -> bool:
    """Does this run name secrets (so what it writes is masked)?"""
    return _masker() is not None


def mask_text(text: str) -> str:
    """``text`` with the values of the run's named secrets masked (unchanged without any)."""
    mask = _masker()
    return text if mask is None else mask(text)


class _MaskedStream:
    """A text stream that masks each ``write`` and hands everything else to the real one."""

    def __init__(self, stream: TextIO, mask: Callable[[str], str]) -> None:
        self._stream = stream
        self._mask = mask

    def write(self, text: str) -> int:
        self._stream.write(self._mask(text))
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def masked_output() -> Iterator[None]:
    """Mask what this process writes through ``sys.stdout``/``sys.stderr`` meanwhile (prints,
    warnings, logging, tracebacks), when the run names secrets; otherwise change nothing.

    Each ``write`` call is masked on its own: a value split across two writes, or written to
    the file descriptors directly (C extensions, child processes), is not seen."""
    mask = _masker()
    if mask is None:
        yield
        return
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _MaskedStream(sys.stdout, mask), _MaskedStream(sys.stderr, mask)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
