"""What an S3 server guarantees, checked with real requests: koochak-probe's s3:// semantics.

``koochak-probe s3://bucket/prefix`` asks the store for these checks (``S3Store.probe_checks``)
before measuring it through the Store API. Each check writes under the probe's scratch prefix,
removes what it wrote, and answers True/False (None when it could not run):

conditional_create      a second PutObject with If-None-Match: * fails with 412
conditional_multipart   a second CompleteMultipartUpload with If-None-Match: * fails with 412
                        (completions one after another; racing ones are another matter)
checksum_verified       a body that does not match its x-amz-checksum-sha256 is refused
multipart_metadata      a multipart object keeps the metadata given when it was started
read_after_write        a GET right after a PUT returns the new object whole
list_after_write        a LIST right after a PUT shows the new object
"""

from __future__ import annotations

import base64
import hashlib
import time
import uuid
from collections.abc import Callable
from typing import Any

import botocore.exceptions as bce
from koochak.s3.errors import describe, is_precondition_failed

__all__ = ["semantics_checks"]


def semantics_checks(store: Any, prefix: str) -> list[dict[str, Any]]:
    """Rows ``{name, supported, detail, seconds}`` for ``store`` (an S3Store) under ``prefix``."""
    client, bucket = store._client, store.config.bucket
    base = f"{store.config.prefix}{prefix}semantics-{uuid.uuid4().hex[:8]}/"
    written: list[str] = []

    def key(name: str) -> str:
        written.append(base + name)
        return base + name

    checks = [
        ("conditional_create", lambda: _conditional_create(client, bucket, key("create"))),
        ("conditional_multipart", lambda: _conditional_multipart(client, bucket, key("mpu"))),
        ("checksum_verified", lambda: _checksum_verified(client, bucket, key("checksum"))),
        ("multipart_metadata", lambda: _multipart_metadata(client, bucket, key("meta"))),
        ("read_after_write", lambda: _read_after_write(client, bucket, key("raw"))),
        ("list_after_write", lambda: _list_after_write(client, bucket, key("law"))),
    ]
    rows = []
    try:
        for name, check in checks:
            rows.append(_row(name, check))
    finally:
        for written_key in written:
            try:
                client.delete_object(Bucket=bucket, Key=written_key)
            except Exception:
                pass  # visible leftovers are removed with the probe's scratch prefix
    return rows


def _row(name: str, check: Callable[[], tuple[bool, str]]) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        supported, detail = check()
    except Exception as exc:
        return {"name": name, "supported": None, "detail": f"could not check: {describe(exc)}"[:300],
                "seconds": None}  # fmt: skip
    return {"name": name, "supported": supported, "detail": detail,
            "seconds": time.perf_counter() - started}  # fmt: skip


def _conditional_create(client: Any, bucket: str, key: str) -> tuple[bool, str]:
    client.put_object(Bucket=bucket, Key=key, Body=b"first", IfNoneMatch="*")
    try:
        client.put_object(Bucket=bucket, Key=key, Body=b"second", IfNoneMatch="*")
    except bce.ClientError as exc:
        if is_precondition_failed(exc):
            return True, "a second If-None-Match: * PutObject failed with 412"
        raise
    return False, "a second If-None-Match: * PutObject overwrote the object (create-only unsafe)"


def _complete_one(client: Any, bucket: str, key: str, body: bytes, meta: dict | None = None):
    extra = {"Metadata": meta} if meta else {}
    upload = client.create_multipart_upload(Bucket=bucket, Key=key, **extra)["UploadId"]
    try:
        part = client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=body)
        return client.complete_multipart_upload(
            Bucket=bucket,
            Key=key,
            UploadId=upload,
            MultipartUpload={"Parts": [{"ETag": part["ETag"], "PartNumber": 1}]},
            IfNoneMatch="*",
        )
    except BaseException:
        try:
            client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload)
        except Exception:
            pass
        raise


def _conditional_multipart(client: Any, bucket: str, key: str) -> tuple[bool, str]:
    _complete_one(client, bucket, key, b"first")
    try:
        _complete_one(client, bucket, key, b"second")
    except bce.ClientError as exc:
        if is_precondition_failed(exc):
            return True, "a second If-None-Match: * CompleteMultipartUpload failed with 412"
        raise
    return False, "a second If-None-Match: * CompleteMultipartUpload overwrote the object"


def _checksum_verified(client: Any, bucket: str, key: str) -> tuple[bool, str]:
    wrong = base64.b64encode(hashlib.sha256(b"other bytes").digest()).decode()
    try:
        client.put_object(Bucket=bucket, Key=key, Body=b"these bytes", ChecksumSHA256=wrong)
    except bce.ClientError as exc:
        return (
            True,
            f"a body not matching x-amz-checksum-sha256 was refused ({exc.response.get('Error', {}).get('Code')})",
        )
    return False, (
        "a body not matching x-amz-checksum-sha256 was accepted: the server does not verify "
        "checksums (Koochak still hashes everything it writes and reads)"
    )


def _multipart_metadata(client: Any, bucket: str, key: str) -> tuple[bool, str]:
    _complete_one(client, bucket, key, b"x", meta={"koochak-check": "1"})
    meta = client.head_object(Bucket=bucket, Key=key).get("Metadata", {})
    if meta.get("koochak-check") == "1":
        return True, "metadata given at CreateMultipartUpload is kept"
    return False, "multipart objects lose their metadata (a racing completion cannot be detected)"


def _read_after_write(client: Any, bucket: str, key: str) -> tuple[bool, str]:
    body = uuid.uuid4().bytes * 64
    client.put_object(Bucket=bucket, Key=key, Body=body)
    got = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    if got == body:
        return True, "a GET right after the PUT returned the new object"
    return (
        False,
        f"a GET right after the PUT returned {len(got)} bytes, not the {len(body)} written",
    )


def _list_after_write(client: Any, bucket: str, key: str) -> tuple[bool, str]:
    client.put_object(Bucket=bucket, Key=key, Body=b"1")
    page = client.list_objects_v2(Bucket=bucket, Prefix=key)
    if any(item["Key"] == key for item in page.get("Contents", [])):
        return True, "a LIST right after the PUT showed the object"
    return False, "a LIST right after the PUT did not show the object yet"
