"""What S3's answers mean for a Store: missing, exists, conflict, transient, or a real error.

botocore reports an HTTP error as ``ClientError`` (with the S3 error code and status) and a
broken connection or timeout as one of its ``BotoCoreError`` subclasses. These helpers sort them,
and ``translate`` turns the rest into the Python exceptions the Store contract promises, naming
the store and key. No message here ever includes a credential: every text taken from an
exception goes through ``scrub`` (``koochak.storage.redact.redact_text``: URL user info,
signature parameters, the credential variables' values, and the credentials each client resolved
from the AWS configuration files, remembered by ``remember_credentials``).
"""

from __future__ import annotations

import errno
import http.client
import threading

import botocore.exceptions as bce
from koochak.storage.redact import redact_text

__all__ = [
    "ConditionalWritesIgnored",
    "status_of",
    "code_of",
    "is_missing",
    "is_precondition_failed",
    "is_conflict",
    "is_transient",
    "translate",
    "scrub",
    "describe",
    "remember_credentials",
]

# Throttling and server-side trouble: the request did not take effect (or, for a commit, may
# have): safe to retry for reads and idempotent steps.
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
    }
)
_TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})
_TRANSPORT = (
    bce.HTTPClientError,  # connection closed, read/connect timeouts, proxy errors
    bce.EndpointConnectionError,
    bce.ResponseStreamingError,
    bce.IncompleteReadError,
    http.client.HTTPException,
    ConnectionError,
    TimeoutError,
)


class ConditionalWritesIgnored(OSError):
    """The S3 server accepted a second create-only write of one key: it ignores If-None-Match.

    Create-only puts cannot be guaranteed there, so the store refuses them, unless the store was
    declared ``single_writer`` (only one process ever writes under its prefix).
    """

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOTSUP, message)

    def __str__(self) -> str:
        return str(self.strerror)


# Credentials the process's clients resolved (from ~/.aws/credentials, a profile, a role): their
# values are masked like the environment's. Grows with the client cache, one entry per value.
_RESOLVED: set[tuple[str, str]] = set()
_RESOLVED_LOCK = threading.Lock()


def remember_credentials(access_key: str | None, secret_key: str | None, token: str | None) -> None:
    """Mask these credential values (a client's resolved credentials) in every ``scrub``."""
    with _RESOLVED_LOCK:
        for name, value in (("AWS_ACCESS_KEY_ID", access_key),
                            ("AWS_SECRET_ACCESS_KEY", secret_key),
                            ("AWS_SESSION_TOKEN", token)):  # fmt: skip
            if value:
                _RESOLVED.add((name, value))


def scrub(text: str) -> str:
    """``text`` with no URL password, signature or known credential value left in it."""
    with _RESOLVED_LOCK:
        known = sorted(_RESOLVED)
    return redact_text(text, known)


def describe(exc: BaseException) -> str:
    """``Type: message`` of ``exc``, scrubbed, for log lines."""
    text = str(exc)
    return scrub(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)


def status_of(exc: BaseException) -> int | None:
    if isinstance(exc, bce.ClientError):
        return exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return None


def code_of(exc: BaseException) -> str:
    if isinstance(exc, bce.ClientError):
        return str(exc.response.get("Error", {}).get("Code", ""))
    return ""


def is_missing(exc: BaseException) -> bool:
    return code_of(exc) in ("NoSuchKey", "NotFound", "404") or (
        status_of(exc) == 404 and code_of(exc) not in ("NoSuchBucket", "NoSuchUpload")
    )


def is_precondition_failed(exc: BaseException) -> bool:
    return status_of(exc) == 412 or code_of(exc) == "PreconditionFailed"


def is_conflict(exc: BaseException) -> bool:
    return status_of(exc) == 409 or code_of(exc) == "ConditionalRequestConflict"


def is_transient(exc: BaseException) -> bool:
    """A throttle, a 5xx or a broken connection: worth retrying where retrying is safe."""
    if isinstance(exc, bce.ClientError):
        return code_of(exc) in _TRANSIENT_CODES or status_of(exc) in _TRANSIENT_STATUS
    return isinstance(exc, _TRANSPORT)


def translate(exc: BaseException, where: str) -> BaseException:
    """The Store-contract exception for a failed request on ``where`` (``s3://bucket/key``)."""
    if is_missing(exc):
        return FileNotFoundError(errno.ENOENT, "no such object", where)
    code = code_of(exc)
    if code == "NoSuchBucket":
        return FileNotFoundError(errno.ENOENT, "the bucket does not exist", where)
    if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch") or status_of(
        exc
    ) in (401, 403):
        return PermissionError(
            errno.EACCES,
            f"S3 refused access ({code or status_of(exc)}); check the credentials in the "
            "environment or the AWS configuration",
            where,
        )
    if isinstance(exc, bce.ClientError):
        return OSError(
            errno.EIO, scrub(f"S3 error {code or status_of(exc)}: {_message(exc)}"), where
        )
    return OSError(errno.EIO, f"S3 request failed: {describe(exc)}", where)


def _message(exc: bce.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Message", "")) or str(exc)
