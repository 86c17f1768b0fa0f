"""Where an S3 store lives and how it talks to it: one frozen record, built from a URL or options.

``s3://bucket/some/prefix`` names a bucket and a key prefix; the endpoint, region and credentials
come from the standard AWS configuration (``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``,
``AWS_REGION``, ``~/.aws/config``, ...). A stores-file entry with ``backend: s3`` hands its
``options`` mapping here instead. Neither ever holds a credential: boto3 finds those itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from koochak.storage.profile import parse_size
from koochak.storage.redact import has_user_info, redact_url
from koochak.storage.store import validate_key

__all__ = ["S3Config", "MIN_PART_BYTES", "OPTION_KEYS", "config_from_path", "config_from_options"]

# S3 refuses parts below 5 MiB except the last one.
MIN_PART_BYTES = 5 << 20
MAX_PARTS = 10_000

OPTION_KEYS = (
    "bucket",
    "prefix",
    "endpoint",
    "region",
    "path_style",
    "single_writer",
    "verify_commit",
    "part_size",
    "concurrency",
)


@dataclass(frozen=True)
class S3Config:
    """One S3 store's settings.

    bucket:         the bucket
    prefix:         key prefix inside it ("" or ending in "/"); store keys live below it
    endpoint:       the S3 endpoint URL, None for the AWS configuration's default
    region:         the signing region, None for the AWS configuration's default
    path_style:     address the bucket in the path (most self-hosted servers) rather than the
                    host name; None leaves it to the AWS configuration
    single_writer:  only one process ever writes under this prefix, so a server that ignores
                    ``If-None-Match`` may still be used (create-only then rests on that promise)
    verify_commit:  read every single-request put back after its commit and require this put's
                    token there, for servers whose conditional PutObject is not atomic under
                    races (moto); multipart commits are always read back
    part_bytes:     multipart part size, and the range size of parallel reads
    concurrency:    parts uploaded / ranges read at once, per object
    """

    bucket: str
    prefix: str = ""
    endpoint: str | None = None
    region: str | None = None
    path_style: bool | None = None
    single_writer: bool = False
    verify_commit: bool = False
    part_bytes: int = 16 << 20
    concurrency: int = 8

    def __post_init__(self) -> None:
        if not isinstance(self.bucket, str) or not _valid_bucket(self.bucket):
            raise ValueError(
                f"S3 bucket {self.bucket!r} is not a bucket name (3-63 characters: lower-case "
                "letters, digits, '.', '-', '_')"
            )
        prefix = self.prefix.strip("/") if isinstance(self.prefix, str) else self.prefix
        if not isinstance(prefix, str):
            raise ValueError(f"S3 prefix {self.prefix!r} must be a string such as 'runs/exp0'")
        if prefix:
            try:
                validate_key(prefix)
            except ValueError as exc:
                raise ValueError(f"S3 prefix {self.prefix!r}: {exc}") from None
        object.__setattr__(self, "prefix", f"{prefix}/" if prefix else "")
        if self.endpoint is not None:
            object.__setattr__(self, "endpoint", _check_endpoint(self.endpoint))
        if self.region is not None and (not isinstance(self.region, str) or not self.region):
            raise ValueError(f"S3 region {self.region!r} must be a non-empty string or null")
        for name in ("path_style", "single_writer", "verify_commit"):
            value = getattr(self, name)
            if not (isinstance(value, bool) or (name == "path_style" and value is None)):
                raise ValueError(f"S3 {name}={value!r}; expected true or false")
        part = self.part_bytes
        if isinstance(part, bool) or not isinstance(part, int) or part < MIN_PART_BYTES:
            raise ValueError(
                f"S3 part_size={part!r}; expected at least 5 MiB (S3's smallest multipart part)"
            )
        conc = self.concurrency
        if isinstance(conc, bool) or not isinstance(conc, int) or conc < 1:
            raise ValueError(f"S3 concurrency={conc!r}; expected an int >= 1")

    @property
    def location(self) -> str:
        """``s3://bucket/prefix`` (never the endpoint's user or password)."""
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    def under(self, path: str) -> S3Config:
        """The same settings with ``path`` appended to the prefix."""
        path = path.strip("/")
        if not path:
            return self
        validate_key(path)
        return replace(self, prefix=self.prefix + path)


def config_from_path(path: str) -> S3Config:
    """``bucket/some/prefix`` (the text after ``s3://``) -> an S3Config with AWS defaults."""
    bucket, _, prefix = path.strip("/").partition("/")
    if not bucket:
        raise ValueError(f"s3://{path}: expected s3://<bucket>/<prefix>")
    return S3Config(bucket=bucket, prefix=prefix)


def config_from_options(path: str, options: Mapping[str, Any]) -> S3Config:
    """A stores-file entry's ``options`` (see OPTION_KEYS) with ``path`` below its prefix."""
    if not isinstance(options, Mapping):
        raise ValueError(f"S3 options must be a mapping of {', '.join(OPTION_KEYS)}")
    unknown = sorted(set(options) - set(OPTION_KEYS))
    if unknown:
        raise ValueError(
            f"unknown S3 option {', '.join(map(str, unknown))}; expected some of "
            f"{', '.join(OPTION_KEYS)}"
        )
    if "bucket" not in options:
        raise ValueError("S3 options need 'bucket'")
    values: dict[str, Any] = {k: v for k, v in options.items() if k != "part_size"}
    if "part_size" in options:
        try:
            values["part_bytes"] = parse_size(options["part_size"])
        except ValueError as exc:
            raise ValueError(f"S3 part_size: {exc}") from None
    return S3Config(**values).under(path)


def _valid_bucket(name: str) -> bool:
    allowed = set("abcdefghijklmnopqrstuvwxyz0123456789.-_")
    return 3 <= len(name) <= 63 and set(name) <= allowed and name[0].isalnum()


def _check_endpoint(endpoint: object) -> str:
    if not isinstance(endpoint, str):
        raise ValueError(f"S3 endpoint {endpoint!r} must be a URL such as https://s3.example.org")
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"S3 endpoint {public_endpoint(endpoint)!r} must be an http(s) URL such as "
            "https://s3.example.org"
        )
    if has_user_info(endpoint):
        raise ValueError(
            f"S3 endpoint {redact_url(endpoint)!r} carries a user or password; credentials "
            "come from the environment or the AWS configuration, never from the endpoint"
        )
    return endpoint.rstrip("/")


def public_endpoint(endpoint: str | None) -> str:
    """The endpoint with any user:password@ removed, safe for messages and logs."""
    if not endpoint:
        return "the AWS default endpoint"
    try:
        parts = urlsplit(endpoint)
        netloc = parts.hostname or ""
        if parts.port:
            netloc += f":{parts.port}"
        return urlunsplit((parts.scheme, netloc, parts.path, "", ""))
    except ValueError:
        return "<unparsable endpoint>"
