"""S3Store: Koochak's Store contract on an S3 bucket, with create-only puts.

Keys are stored under the configured prefix. ``put`` is create-only through ``If-None-Match: *``
(see ``upload``), after checking once per endpoint that the server honours it (see
``conditional``); ``get`` fetches large ranges in parallel (see ``download``); ``list`` pages
through ``ListObjectsV2``; ``delete`` removes exactly the key it is given. Reads and idempotent
steps are retried with backoff and jitter; conditional commits never blindly.
"""

from __future__ import annotations

import io
import logging
import time
from datetime import datetime, timezone
from typing import Any, BinaryIO

import botocore.exceptions as bce
from koochak.s3.client import client_for, endpoint_of
from koochak.s3.conditional import honours_if_none_match
from koochak.s3.config import S3Config, public_endpoint
from koochak.s3.download import ObjectStream, Reader, read_range
from koochak.s3.errors import ConditionalWritesIgnored, is_missing, translate
from koochak.s3.retry import DEFAULT_RETRY, RetryPolicy
from koochak.s3.upload import Upload, put_object
from koochak.storage.profile import StoreProfile
from koochak.storage.store import (
    TEMP_PREFIX,
    ObjectInfo,
    StoreCapabilities,
    check_put_expectations,
    validate_key,
)

__all__ = ["S3Store", "S3_PROFILE"]

_log = logging.getLogger(__name__)

# What an S3 service costs, before koochak-probe measured it: a request costs tens of
# milliseconds, one stream carries ~100 MB/s, many parallel requests add up, listing is fine.
S3_PROFILE = StoreProfile(
    request_seconds=0.03,
    stream_bytes_per_second=100e6,
    concurrency=16,
    range_reads_scale=True,
    part_bytes=16 << 20,
    listing_cheap=True,
)


class S3Store:
    """A Store on ``s3://bucket/prefix`` (see ``S3Config`` for the settings).

    ``profile`` (a StoreProfile) sizes copies and reads above the store; without one the store
    uses ``S3_PROFILE`` with the config's part size. ``client`` replaces the boto3 client (tests);
    ``retry`` the retry policy of reads and idempotent steps.
    """

    def __init__(
        self,
        config: S3Config,
        *,
        profile: StoreProfile | None = None,
        client: Any = None,
        retry: RetryPolicy = DEFAULT_RETRY,
    ) -> None:
        if not isinstance(config, S3Config):
            raise TypeError(f"S3Store needs an S3Config, got {type(config).__name__}")
        if profile is not None and not isinstance(profile, StoreProfile):
            raise TypeError(f"S3Store profile must be a StoreProfile, got {type(profile).__name__}")
        self.config = config
        self.location = config.location
        self.profile = profile or _default_profile(config)
        self.retry = retry
        self._client = client if client is not None else client_for(config)

    def __repr__(self) -> str:
        return f"S3Store({self.location!r}, endpoint={self.endpoint!r})"

    def __getstate__(self) -> dict[str, Any]:
        # A boto3 client does not pickle (DataLoader workers, spawned processes): the copy
        # builds its own from the same settings; credentials come from its own environment.
        state = dict(self.__dict__)
        state["_client"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._client = client_for(self.config)

    @property
    def endpoint(self) -> str:
        """The endpoint URL in use, without any user or password."""
        return public_endpoint(endpoint_of(self._client))

    def child(self, prefix: str) -> S3Store:
        """The same store rooted at ``prefix`` below this one."""
        validate_key(prefix)
        return S3Store(
            self.config.under(prefix), profile=self.profile, client=self._client, retry=self.retry
        )

    def local_path(self, key: str) -> str | None:
        validate_key(key)
        return None

    def capabilities(self) -> StoreCapabilities:
        """No filesystem (create-only by conditional writes), its profile, its own probe checks,
        ``list_shallow`` (``ListObjectsV2``'s ``Delimiter``)."""
        return StoreCapabilities(profile=self.profile, probe_checks=True, list_shallow=True)

    def _where(self, key: str) -> str:
        return f"s3://{self.config.bucket}/{self.config.prefix}{key}"

    def _object(self, key: str) -> str:
        return self.config.prefix + validate_key(key)

    # -- reads -------------------------------------------------------------------------------

    def _reader(self, key: str) -> Reader:
        return Reader(
            client=self._client,
            bucket=self.config.bucket,
            object_key=self._object(key),
            where=self._where(key),
            part_bytes=self.profile.part_bytes,
            concurrency=self.config.concurrency,
            parallel=self.profile.range_reads_scale,
            retry=self.retry,
        )

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        reader = self._reader(key)
        for name, value in (("start", start), ("end", end)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"get({key!r}): {name} must be an int or None, got {value!r}")
        if (start is not None and start < 0) or (end is not None and end < 0):
            size = self.stat(key).size
            begin, stop, _ = slice(start, end).indices(size)
            return read_range(reader, begin, stop, size) if stop > begin else b""
        begin = start or 0
        if end is not None and end <= begin:
            self.stat(key)  # a missing key still raises
            return b""
        return read_range(reader, begin, end)

    def open(self, key: str) -> BinaryIO:
        stream = ObjectStream(self._reader(key))
        return io.BufferedReader(stream, buffer_size=1 << 20)  # type: ignore[return-value]

    def stat(self, key: str) -> ObjectInfo:
        obj = self._object(key)
        answer = self._head(obj, self._where(key))
        return ObjectInfo(key=key, size=int(answer["ContentLength"]), mtime_ns=_mtime_ns(answer))

    def _head(self, obj: str, where: str) -> dict[str, Any]:
        try:
            return self.retry.run(
                f"stat {where}",
                lambda: self._client.head_object(Bucket=self.config.bucket, Key=obj),
            )
        except (bce.ClientError, bce.BotoCoreError) as exc:
            raise translate(exc, where) from None

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        return self._list(prefix, None)

    def list_shallow(self, prefix: str, delimiter: str) -> list[ObjectInfo]:
        """``list(prefix)`` less every key with ``delimiter`` after ``prefix``: S3 groups those
        into common prefixes (``Delimiter``), one entry per group, which are dropped here."""
        if not delimiter:
            raise ValueError("list_shallow: delimiter must be a non-empty string")
        return self._list(prefix, delimiter)

    def _list(self, prefix: str, delimiter: str | None) -> list[ObjectInfo]:
        _check_prefix(prefix)
        base = self.config.prefix
        found: list[ObjectInfo] = []
        token: str | None = None
        while True:
            request: dict[str, Any] = {"Bucket": self.config.bucket, "Prefix": base + prefix}
            if delimiter is not None:
                request["Delimiter"] = delimiter
            if token:
                request["ContinuationToken"] = token
            try:
                page = self.retry.run(
                    f"list {self.location}/{prefix}",
                    lambda request=request: self._client.list_objects_v2(**request),
                )
            except (bce.ClientError, bce.BotoCoreError) as exc:
                raise translate(exc, f"{self.location}/{prefix}") from None
            for item in page.get("Contents", []):
                key = item["Key"][len(base) :]
                if _is_object_key(key):
                    found.append(
                        ObjectInfo(
                            key=key, size=int(item["Size"]), mtime_ns=_ns(item["LastModified"])
                        )
                    )
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                break
        found.sort(key=lambda info: info.key)
        return found

    # -- writes ------------------------------------------------------------------------------

    def put(
        self,
        key: str,
        data: Any,
        *,
        expected_size: int | None = None,
        expected_sha256: str | None = None,
    ) -> ObjectInfo:
        obj = self._object(key)
        want_sha = check_put_expectations(key, expected_size, expected_sha256)
        if isinstance(data, str):
            raise TypeError(
                "put() data must be bytes, a binary stream or an iterable of bytes, not str"
            )
        upload = Upload(
            client=self._client,
            bucket=self.config.bucket,
            object_key=obj,
            key=key,
            where=self._where(key),
            part_bytes=self.config.part_bytes,
            concurrency=self.config.concurrency,
            retry=self.retry,
            check_absent=not self._trusts_conditional_writes(),
            verify_commit=self.config.verify_commit,
        )
        return put_object(upload, data, expected_size, want_sha, _mtime_ns)

    def _trusts_conditional_writes(self) -> bool:
        """True when the server honours If-None-Match; False only for a single-writer store."""
        endpoint = endpoint_of(self._client)
        try:
            honoured = honours_if_none_match(
                self._client, endpoint, self.config.bucket, self.config.prefix, self.retry
            )
        except (bce.ClientError, bce.BotoCoreError) as exc:
            raise translate(exc, self.location) from None
        if honoured:
            return True
        if self.config.single_writer:
            return False
        raise ConditionalWritesIgnored(
            f"{self.location}: the S3 server at {public_endpoint(endpoint)} ignores "
            "If-None-Match: * (a second create-only write of a probe key succeeded), so it "
            "cannot refuse a second writer of a key and create-only puts are refused. If only "
            "one process ever writes under this prefix, declare it: single_writer: true in the "
            "stores-file entry's options"
        )

    def delete(self, key: str) -> None:
        obj = self._object(key)
        where = self._where(key)
        self._head(obj, where)  # FileNotFoundError for a missing key, as the contract says
        try:
            self.retry.run(
                f"delete {where}",
                lambda: self._client.delete_object(Bucket=self.config.bucket, Key=obj),
            )
        except (bce.ClientError, bce.BotoCoreError) as exc:
            raise translate(exc, where) from None

    def probe_checks(self, prefix: str) -> list[dict[str, Any]]:
        """What this server guarantees, checked under ``prefix`` (koochak-probe calls this).

        Rows of ``{name, supported, detail, seconds}``: conditional create and multipart
        commit, checksum verification, metadata on multipart objects, read- and
        list-after-write. See ``koochak.s3.probe``.
        """
        from koochak.s3.probe import semantics_checks

        return semantics_checks(self, prefix)

    def abort_stale_uploads(self, older_than_seconds: float = 86400.0) -> list[str]:
        """Abort incomplete multipart uploads under the prefix started more than
        ``older_than_seconds`` ago; return their keys.

        A killed writer leaves its multipart upload open: never visible, but its parts are
        stored (and billed) until aborted. A bucket lifecycle rule (AbortIncompleteMultipartUpload)
        does the same server-side. Live uploads are younger than any sensible threshold.
        """
        if isinstance(older_than_seconds, bool) or not isinstance(older_than_seconds, (int, float)):
            raise ValueError(f"older_than_seconds={older_than_seconds!r}; expected a number")
        cutoff = time.time() - older_than_seconds
        aborted: list[str] = []
        request: dict[str, Any] = {"Bucket": self.config.bucket, "Prefix": self.config.prefix}
        while True:
            page = self.retry.run(
                f"list uploads under {self.location}",
                lambda request=dict(request): self._client.list_multipart_uploads(**request),
            )
            for upload in page.get("Uploads", []):
                if upload["Initiated"].timestamp() >= cutoff:
                    continue
                try:
                    self.retry.run(
                        f"abort upload of {upload['Key']}",
                        lambda u=upload: self._client.abort_multipart_upload(
                            Bucket=self.config.bucket, Key=u["Key"], UploadId=u["UploadId"]
                        ),
                    )
                except bce.ClientError as exc:
                    if not is_missing(exc) and "NoSuchUpload" not in str(exc):
                        raise translate(exc, self.location) from None
                aborted.append(upload["Key"][len(self.config.prefix) :])
            if not page.get("IsTruncated"):
                break
            request["KeyMarker"] = page.get("NextKeyMarker")
            request["UploadIdMarker"] = page.get("NextUploadIdMarker")
        return sorted(aborted)


def _default_profile(config: S3Config) -> StoreProfile:
    from dataclasses import replace

    return replace(S3_PROFILE, part_bytes=config.part_bytes, concurrency=max(config.concurrency, 1))


def _is_object_key(key: str) -> bool:
    """Directory markers (``dir/``), temp names and keys a Store cannot name are not objects."""
    if not key or key.endswith("/"):
        return False
    try:
        validate_key(key)
    except ValueError:
        return False
    return not any(part.startswith(TEMP_PREFIX) for part in key.split("/"))


def _check_prefix(prefix: str) -> None:
    if not isinstance(prefix, str):
        raise TypeError(f"list prefix must be a str, got {type(prefix).__name__}")
    if not prefix:
        return
    head, _, tail = prefix.rpartition("/")
    if head:
        validate_key(head)
    if prefix.startswith("/") or tail in (".", "..") or any(c in tail for c in "?#\\\x00"):
        raise ValueError(f"list prefix {prefix!r} is not a relative key prefix")


def _ns(moment: datetime) -> int:
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return int(moment.timestamp() * 1_000_000) * 1000


def _mtime_ns(answer: dict[str, Any]) -> int:
    moment = answer.get("LastModified")
    if isinstance(moment, datetime):
        return _ns(moment)
    return time.time_ns()  # PutObject answers carry no date: the commit just happened
