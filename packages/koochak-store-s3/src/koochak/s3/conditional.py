"""Does this S3 server honour ``If-None-Match: *``? Asked once per endpoint, then remembered.

Create-only puts rest entirely on the server refusing a second conditional write of one key
(412). Some S3-compatible servers and gateways ignore the header and silently overwrite, which
would make every "create-only" put a last-writer-wins put. So before the first conditional write
to an endpoint the store writes a hidden probe key twice with ``If-None-Match: *``: the second
write must fail with 412. The answer is cached per endpoint for the life of the process.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any

import botocore.exceptions as bce
from koochak.s3.errors import describe, is_precondition_failed
from koochak.s3.retry import RetryPolicy
from koochak.storage.store import TEMP_PREFIX

__all__ = ["honours_if_none_match", "forget_answers"]

_log = logging.getLogger(__name__)
_ANSWERS: dict[str, bool] = {}
_LOCK = threading.Lock()


def honours_if_none_match(
    client: Any, endpoint: str, bucket: str, prefix: str, retry: RetryPolicy
) -> bool:
    """True when ``endpoint`` refuses a second ``If-None-Match: *`` PutObject (cached)."""
    with _LOCK:  # one probe per endpoint, also when many threads put at once
        answer = _ANSWERS.get(endpoint)
        if answer is None:
            answer = _ANSWERS[endpoint] = _probe(client, bucket, prefix, retry)
    return answer


def forget_answers() -> None:
    """Drop the cached answers (tests; a server that was reconfigured)."""
    with _LOCK:
        _ANSWERS.clear()


def _probe(client: Any, bucket: str, prefix: str, retry: RetryPolicy) -> bool:
    # A hidden name (the temp prefix is never listed) inside the store's own prefix, where the
    # store's credentials may write.
    key = f"{prefix}{TEMP_PREFIX}conditional-check-{uuid.uuid4().hex}"

    def put(body: bytes) -> None:
        client.put_object(Bucket=bucket, Key=key, Body=body, IfNoneMatch="*")

    try:
        retry.run("conditional-write check", lambda: put(b"first"))
        try:
            put(b"second")
        except bce.ClientError as exc:
            if is_precondition_failed(exc):
                return True
            raise
        _log.warning("S3 server for bucket %s ignored If-None-Match: * (a second create-only "
                     "PutObject of %s succeeded)", bucket, key)  # fmt: skip
        return False
    finally:
        try:
            retry.run("conditional-write check cleanup",
                      lambda: client.delete_object(Bucket=bucket, Key=key))  # fmt: skip
        except Exception as exc:  # hidden and never listed; the answer stands
            _log.warning("could not remove the conditional-write probe key %s: %s", key, describe(exc))
