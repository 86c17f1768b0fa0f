"""Credentials out of what Koochak writes: URL passwords and store clients' credential values.

A store client's foreign text (an SDK's exception message, a server's error text, a URL it
could not reach) can quote an endpoint with ``user:password@`` in it, a presigned URL's
signature, or a credential value it was given. Text that Koochak writes — an error message, a
log line, a ``repr``, a probe report, an event or preflight record — goes through
`redact_text` first:

* user info in any URL (``scheme://user:password@host``) becomes ``scheme://***@host``;
* the values of presigned-URL and signature parameters (``X-Amz-Credential``,
  ``X-Amz-Signature``, ``X-Amz-Security-Token``, ``Signature``, ``Credential=`` of an
  Authorization header) become ``***``;
* the value of each credential variable in `CREDENTIAL_VARIABLES` that the environment sets,
  and each value the caller adds (credentials a client resolved from its own configuration
  files), becomes ``[masked NAME]``, also in its JSON-escaped and percent-encoded forms.
  Values shorter than `MIN_SECRET_CHARS` are left alone: no real credential is that short, and
  masking a test placeholder such as ``test`` would garble ordinary words.

`koochak.events.secrets` masks a run's *named* secrets (the execution profile's list, handed
down by the runner); this module masks the credentials every store client reads by convention,
for the packages that may import only ``koochak.storage`` (a store plugin such as
``koochak.s3``). Standard library only.
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit, urlunsplit

__all__ = ["CREDENTIAL_VARIABLES", "MIN_SECRET_CHARS", "redact_text", "redact_url", "has_user_info"]

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


def has_user_info(url: str) -> bool:
    """Whether ``url`` carries a user or password (``scheme://user:password@host``)."""
    try:
        parts = urlsplit(url)
        return bool(parts.username or parts.password) or "@" in parts.netloc
    except ValueError:
        return bool(_USER_INFO.search(url))


def redact_url(url: str) -> str:
    """``url`` with its user info replaced by ``***`` and its query and fragment dropped."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc.rpartition("@")[2]
        if "@" in parts.netloc:
            netloc = f"***@{netloc}"
        return urlunsplit((parts.scheme, netloc, parts.path, "", ""))
    except ValueError:
        return redact_text(url)


def redact_text(
    text: str, secrets: Mapping[str, str] | Iterable[tuple[str, str]] | None = None
) -> str:
    """``text`` without URL user info, signature parameters, or credential values (see the
    module docstring); ``secrets`` adds ``{name: value}`` (or ``(name, value)`` pairs, for
    several values of one name) to the environment's."""
    if not text:
        return text
    text = _SIGNED.sub(r"\1***", _USER_INFO.sub(r"\1***@", text))
    pairs = [(name, os.environ.get(name, "")) for name in CREDENTIAL_VARIABLES]
    pairs += list(secrets.items() if isinstance(secrets, Mapping) else secrets or ())
    forms: dict[str, str] = {}
    for name, value in pairs:
        if isinstance(value, str) and len(value) >= MIN_SECRET_CHARS:
            for form in (value, urllib.parse.quote(value, safe=""), json.dumps(value)[1:-1]):
                forms.setdefault(form, name)
    if forms:
        pattern = "|".join(re.escape(form) for form in sorted(forms, key=len, reverse=True))
        text = re.sub(pattern, lambda m: f"[masked {forms[m.group(0)]}]", text)
    return text
