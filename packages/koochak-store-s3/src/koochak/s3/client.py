"""The boto3 client an S3 store uses, configured so that Koochak decides what is retried.

botocore would otherwise retry any failed request, a conditional commit included, which turns a
lost response into a false "already exists". Its own retries are off (one attempt per call), its
automatic CRC32 checksums are off (puts send their SHA256 instead) and the connection pool fits
the store's concurrency. An endpoint URL carrying a user or password is refused, wherever it came
from (``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``, a profile's ``endpoint_url``; a stores-file
``endpoint`` is refused earlier, by ``config``), with the URL shown redacted; the credentials the
client resolved are remembered so that every message scrubs them (``errors.scrub``). Bodies are not signed a second time: each carries its SHA256 in
``x-amz-checksum-sha256``, which the server verifies (botocore skips body signing over https
anyway; over plain http it would hash every byte once more). Clients are thread-safe and cost tens of milliseconds to build, so one
is kept per distinct setting for the life of the process.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from koochak.s3 import log_scrub
from koochak.s3.config import S3Config
from koochak.s3.errors import remember_credentials, scrub
from koochak.storage.redact import has_user_info, redact_url

__all__ = ["client_for", "endpoint_of"]

_CLIENTS: dict[tuple[Any, ...], Any] = {}
_ENVIRONMENT = (
    "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_DEFAULT_PROFILE",
    "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
)  # fmt: skip
_LOCK = threading.Lock()


def client_for(config: S3Config) -> Any:
    """A boto3 S3 client for ``config``'s endpoint, region and addressing style (shared)."""
    pool = max(10, 4 * config.concurrency + 4)  # several puts/gets of one store at once
    # What boto3 reads from the environment is part of the key: a process that changes it
    # (a test, a tool switching profiles) gets a client for the new settings.
    key = (config.endpoint, config.region, config.path_style, pool,
           *(os.environ.get(name) for name in _ENVIRONMENT))  # fmt: skip
    with _LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            client = _CLIENTS[key] = _make_client(config, pool)
    return client


def _make_client(config: S3Config, pool: int) -> Any:
    import boto3
    from botocore.config import Config

    # Each body carries x-amz-checksum-sha256, which the server verifies; signing the payload as
    # well would hash every byte a third time (botocore does it over plain http).
    s3: dict[str, Any] = {"payload_signing_enabled": False}
    if config.path_style is not None:
        s3["addressing_style"] = "path" if config.path_style else "virtual"
    settings = Config(
        retries={"total_max_attempts": 1, "mode": "standard"},
        max_pool_connections=pool,
        s3=s3,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        connect_timeout=10,
        read_timeout=60,
        tcp_keepalive=True,
    )
    # A session of its own: boto3's default session is shared mutable state of the process.
    session = boto3.session.Session()
    try:
        client = session.client(
            "s3", endpoint_url=config.endpoint, region_name=config.region, config=settings
        )
    except Exception as exc:
        if scrub(str(exc)) == str(exc):
            raise
        raise ValueError(f"S3 client for {config.location}: {scrub(str(exc))}") from None
    _refuse_user_info(str(client.meta.endpoint_url))
    credentials = session.get_credentials()
    if credentials is not None:
        frozen = credentials.get_frozen_credentials()
        remember_credentials(frozen.access_key, frozen.secret_key, frozen.token)
    # botocore adds the header in a handler of "before-call.s3"; ours runs after it.
    client.meta.events.register_last("before-call.s3", _no_expect_for_small_bodies)
    log_scrub.install()  # the SDK's DEBUG records (request headers, signatures) scrubbed too
    return client


def _refuse_user_info(endpoint: str) -> None:
    if not has_user_info(endpoint):
        return
    source = next(
        (name for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
         if has_user_info(os.environ.get(name, ""))),
        "the AWS configuration's endpoint_url (profile "
        f"{os.environ.get('AWS_PROFILE') or 'default'})",
    )  # fmt: skip
    raise ValueError(
        f"S3 endpoint {redact_url(endpoint)!r} (from {source}) carries a user or password; "
        "credentials come from the environment or the AWS configuration, never from the "
        "endpoint URL"
    )


# botocore sends every PutObject body with "Expect: 100-continue" and waits for the server's
# go-ahead before sending it: one more round trip per put. Worth it for a large body (a 412 for
# an existing key then costs no upload), not for a small one, where it is most of the latency.
_EXPECT_MIN_BYTES = 1 << 20


def _no_expect_for_small_bodies(params: dict[str, Any], model: Any = None, **_: Any) -> None:
    from botocore.utils import determine_content_length

    if getattr(model, "name", None) != "PutObject":
        return
    size = determine_content_length(params.get("body"))
    if size is not None and size < _EXPECT_MIN_BYTES:
        params.get("headers", {}).pop("Expect", None)


def endpoint_of(client: Any) -> str:
    """The endpoint URL the client talks to (resolved from the AWS configuration if unset)."""
    return str(client.meta.endpoint_url)
