"""Masking the values of a run's named secrets in text that is about to be written.

An execution profile names secrets (``secrets: [TRACKING_TOKEN]``); koochak-jobs' runner reads
their values on the node and hands them to the workload. Foreign output (a compiler's stderr, a
package's import error, an exception message, a coordinator's rejection reason) can echo such a
value, and what Koochak writes (``preflight.json``, a stderr line, an event payload, a log line)
must not. The runner masks with the values it holds and tells the workload which names are
secret through `SECRET_NAMES_VARIABLE` (names only, never values); the loop and these event
hooks read that variable with `secrets_from_environment`.

This module lives in koochak-events because it is the one layer both koochak-jobs and
koochak-loop may import, and it is standard library only.

What is masked, for each non-empty value: the value itself and the forms foreign text tends to
quote it in (JSON-escaped, ASCII or not, twice JSON-escaped, Python ``repr``-escaped and
percent-encoded), longest first, in one pass, each replaced by ``[masked NAME]``. Mask before
truncating: a cut through a value would leave part of it unmasked.

Beyond the named secrets, always (with no names too), what any library's error text can carry:

* the values of the standard credential variables `CREDENTIAL_VARIABLES` (``AWS_ACCESS_KEY_ID``,
  ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_SECURITY_TOKEN``) that the environment
  sets, as ``[masked NAME]`` in the same forms, when at least `MIN_SECRET_CHARS` long (no real
  credential is shorter; a test placeholder such as ``test`` would garble ordinary words);
* user info in any URL (``scheme://user:password@host`` becomes ``scheme://***@host``);
* the values of presigned-URL and signature parameters (``X-Amz-Signature=``, ``Signature=``,
  ``Credential=`` ...), as ``***``.

These are the rules of ``koochak.storage.redact.redact_text`` (which koochak-events may not
import); a test in koochak-loop holds the two to the same answers.
"""

from __future__ import annotations

import functools
import json
import os
import re
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "CREDENTIAL_VARIABLES",
    "MIN_SECRET_CHARS",
    "SECRET_NAMES_VARIABLE",
    "mask_secrets",
    "mask_strings",
    "secret_names_value",
    "secrets_from_environment",
]

SECRET_NAMES_VARIABLE = "KOOCHAK_SECRET_NAMES"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
CREDENTIAL_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
)
MIN_SECRET_CHARS = 8
# Greedy up to the last "@" before the path: a password may itself hold an unescaped "@".
_USER_INFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^\s/?#'\"<>]*@")
_SIGNED = re.compile(
    r"(?i)((?:X-Amz-(?:Credential|Signature|Security-Token)|Signature|Credential)=)"
    r"[^&\s'\",;]+"
)


def secret_names_value(names: Iterable[str]) -> str:
    """The value of `SECRET_NAMES_VARIABLE` for ``names`` (comma-separated)."""
    return ",".join(names)


def secrets_from_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{name: value}`` for each name `SECRET_NAMES_VARIABLE` lists and ``env`` (default
    ``os.environ``) sets; ``{}`` when the variable is unset. Malformed names are ignored."""
    env = os.environ if env is None else env
    names = env.get(SECRET_NAMES_VARIABLE, "")
    found = {}
    for name in names.split(","):
        name = name.strip()
        if _NAME.fullmatch(name) and env.get(name):
            found[name] = env[name]
    return found


def mask_secrets(text: str, secrets: Mapping[str, str]) -> str:
    """``text`` with every form of every secret value replaced by ``[masked NAME]``, and the
    environment's credential values, URL user info and signatures masked too (with no
    ``secrets`` as well; see the module docstring)."""
    if not text:
        return text
    if "://" in text:  # the order of redact_text: URLs and signatures, then values
        text = _USER_INFO.sub(r"\1***@", text)
    if "=" in text:
        text = _SIGNED.sub(r"\1***", text)
    found = {name: os.environ.get(name, "") for name in CREDENTIAL_VARIABLES}
    items = {n: v for n, v in found.items() if len(v) >= MIN_SECRET_CHARS}
    items.update(secrets or {})  # a named secret keeps its own name
    if items:
        pattern, names = _compiled(tuple(sorted(items.items())))
        if pattern is not None:
            text = pattern.sub(lambda m: f"[masked {names[m.group(0)]}]", text)
    return text


def mask_strings(value: Any, secrets: Mapping[str, str]) -> Any:
    """A copy of a JSON-like ``value`` with `mask_secrets` applied to every string in it (keys
    included); other values unchanged. Mask the data, then encode it: a secret is then never
    split or escaped by the encoder."""
    if isinstance(value, str):
        return mask_secrets(value, secrets)
    if isinstance(value, Mapping):
        return {mask_strings(k, secrets): mask_strings(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [mask_strings(v, secrets) for v in value]
    return value


def _forms(value: str) -> set[str]:
    once = json.dumps(value)[1:-1]
    return {
        value,
        once,
        json.dumps(value, ensure_ascii=False)[1:-1],
        json.dumps(once)[1:-1],
        repr(value)[1:-1],
        urllib.parse.quote(value, safe=""),
        urllib.parse.quote_plus(value, safe=""),
    }


@functools.lru_cache(maxsize=8)
def _compiled(items: tuple[tuple[str, str], ...]) -> tuple[re.Pattern[str] | None, dict[str, str]]:
    names: dict[str, str] = {}
    for name, value in items:
        if not isinstance(value, str) or not value:
            continue  # nothing to leak, and an empty pattern would match everywhere
        for form in _forms(value):
            names.setdefault(form, name)
    if not names:
        return None, names
    # Longest first: a value that contains another secret's value is masked whole.
    alternatives = sorted(names, key=len, reverse=True)
    return re.compile("|".join(re.escape(form) for form in alternatives)), names
