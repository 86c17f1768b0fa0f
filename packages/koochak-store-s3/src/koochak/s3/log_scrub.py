"""Credentials out of the SDK's own log records, for a user who turns DEBUG logging on.

At DEBUG, botocore logs every request it sends with its headers (the ``Authorization`` header
names the access key and carries the request's signature) and its signer logs each signature
on a line of its own. Nothing of that reaches a log unless the process enables DEBUG for those
loggers, but a user chasing a failing upload does exactly that, and then pastes the log into an
issue. `install` puts one filter on every logger of the SDK and its HTTP stack (``botocore``,
``boto3``, ``s3transfer``, ``urllib3``) that rewrites each record's message through
`errors.scrub` (URL user info, signature parameters, the credential values the clients resolved)
and blanks the signer's signature lines. A filter runs only for records whose level is enabled,
so with DEBUG off it costs nothing.

`install` is called each time a client is made (idempotent), after the SDK has created its
module loggers, so loggers the SDK makes later are covered from the next client on.
"""

from __future__ import annotations

import logging
import re

from koochak.s3.errors import scrub

_FAMILIES = ("botocore", "boto3", "s3transfer", "urllib3")
# botocore's signer: "Signature:\n<64 hex digits>" (and the string it signed, which holds no
# secret but is of no use to anyone reading a log).
_SIGNATURE_LINE = re.compile(r"(?m)^(Signature:\s*)[0-9a-fA-F]{16,}")


class ScrubFilter(logging.Filter):
    """Rewrites a record's message with no credential in it; never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a record whose arguments do not format: leave it to the handler
            return True
        clean = scrub(_SIGNATURE_LINE.sub(r"\1***", message))
        if clean != message:
            record.msg, record.args = clean, None
        return True


_FILTER = ScrubFilter()


def install() -> None:
    """Put the filter on every existing logger of the SDK's families (once each)."""
    manager = logging.Logger.manager
    names = [name for name in list(manager.loggerDict) if name.split(".", 1)[0] in _FAMILIES]
    for name in {*names, *_FAMILIES}:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
