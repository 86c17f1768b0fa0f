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

`recorded_config` is the config as a run records it (``<out_dir>/config.yaml``, every
checkpoint's ``config``, W&B's and TensorBoard's copies): every value a ``${oc.env:NAME}``
interpolation brought in is ``[masked NAME]`` in the key that interpolated it (and, 8 characters
or longer, wherever else it appears), and every string is masked as above (the named secrets,
credentials, URL user info). The run itself uses the unmasked config.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TextIO

__all__ = ["mask_text", "masked_output", "masking_active", "recorded_config"]

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


_ENV_REFERENCE = re.compile(r"\$\{oc\.env:\s*([A-Za-z_][A-Za-z0-9_]*)")
_MASK_EVERYWHERE_CHARS = 8  # shorter values ("1", "cpu") would garble unrelated strings


def _env_references(raw: Any, found: dict[str, str]) -> dict[str, str]:
    """``{NAME: value}`` of every ``${oc.env:NAME}`` in ``raw`` (unresolved) that is set."""
    if isinstance(raw, str):
        for name in _ENV_REFERENCE.findall(raw):
            if os.environ.get(name):
                found[name] = os.environ[name]
    elif isinstance(raw, Mapping):
        for value in raw.values():
            _env_references(value, found)
    elif isinstance(raw, (list, tuple)):
        for value in raw:
            _env_references(value, found)
    return found


def _replaced(text: str, values: Mapping[str, str]) -> str:
    for name, value in sorted(values.items(), key=lambda item: -len(item[1])):
        text = text.replace(value, f"[masked {name}]")
    return text


def recorded_config(resolved: Mapping[str, Any], raw: Mapping[str, Any]) -> dict[str, Any]:
    """``resolved`` (the plain resolved config) as the run may write it: what ``${oc.env:...}``
    brought in masked (``raw`` is the same config unresolved, e.g.
    ``OmegaConf.to_container(cfg, resolve=False)``), then every string `mask_text`-ed."""
    env = _env_references(raw, {})
    everywhere = {n: v for n, v in env.items() if len(v) >= _MASK_EVERYWHERE_CHARS}
    mask = _masker()

    def walk(value: Any, source: Any) -> Any:
        if isinstance(value, Mapping):
            get = source.get if isinstance(source, Mapping) else (lambda key: None)
            return {key: walk(item, get(key)) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            sources = list(source) if isinstance(source, (list, tuple)) else []
            sources += [None] * (len(value) - len(sources))
            return [walk(item, src) for item, src in zip(value, sources)]
        local = _env_references(source, {}) if isinstance(source, str) else {}
        if local and not isinstance(value, str):  # a number or flag read from the environment
            return _replaced(str(value), local) if str(value) else value
        if isinstance(value, str):
            return mask(_replaced(_replaced(value, local), everywhere))
        return value

    return walk(resolved, raw)


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
