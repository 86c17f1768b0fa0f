"""Keep a run's secret values out of what the loop writes.

koochak-jobs' runner tells the workload which environment variables hold secrets
(``KOOCHAK_SECRET_NAMES``, names only). Foreign text the loop writes (an exception message in
koochak-train's one-line error, a warning quoting a hook's failure, a traceback under
``--debug``, a GPU health record) is masked with `koochak.events.secrets.mask_secrets`, the one
masking function koochak-jobs uses too; this module only wires it in. It masks, with no named
secrets as well, URL user info (``scheme://user:password@host``), signatures and the values of
the standard AWS credential variables; without koochak-events (an optional extra of the loop)
``koochak.storage.redact.redact_text``, which applies the same rules, does that. A run that
names secrets needs koochak-events (the runner that sets the variable has it); should it be
missing all the same, the text is withheld rather than written unmasked.
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


def _masker() -> Callable[[str], str]:
    """The masking function for this process: its named secrets and the credential rules."""
    named = bool(os.environ.get(_NAMES_VARIABLE, "").strip())
    try:
        from koochak.events.secrets import mask_secrets, secrets_from_environment
    except ImportError:
        if named:
            return lambda text: _WITHHELD
        from koochak.storage.redact import redact_text

        return redact_text
    secrets = secrets_from_environment() if named else {}
    return lambda text: mask_secrets(text, secrets)


def masking_active() -> bool:
    """Does this run name secrets? (What it writes is masked either way; a run that names them
    also keeps foreign tools, such as W&B's console capture, away from its raw output.)"""
    return bool(os.environ.get(_NAMES_VARIABLE, "").strip())


def mask_text(text: str) -> str:
    """``text`` with the run's named secrets and any credentials (see the module docstring)
    masked."""
    return _masker()(text)


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
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _MaskedStream(sys.stdout, mask), _MaskedStream(sys.stderr, mask)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
