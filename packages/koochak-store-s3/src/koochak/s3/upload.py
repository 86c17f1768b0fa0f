"""Create-only puts to S3: one conditional PutObject, or parallel parts and a conditional commit.

The payload is cut into parts of ``part_bytes``. If it fits in one part it goes up as a single
``PutObject`` with ``If-None-Match: *``. Otherwise a multipart upload starts, up to
``concurrency`` parts are uploaded at once while the next ones are read, and
``CompleteMultipartUpload`` with ``If-None-Match: *`` commits the object. Every request carries
``x-amz-checksum-sha256`` of its body, which the server verifies; the SHA256 of the whole object
is computed in order as the parts are read, checked against ``expected_sha256`` *before* the
commit, and stored with the object (metadata ``koochak-sha256``) together with a random token
naming this put (``koochak-writer``).

The commit is sent once. When its answer is lost (a broken connection, a timeout, a 5xx), the
object is read back: if it carries this put's token and digest, the put won; if another object
is there, the put lost (``FileExistsError``); if nothing is there, the commit is sent again. A
failed or abandoned put aborts its multipart upload, so no part lingers (a killed process leaves
an incomplete upload, which is never visible; ``S3Store.abort_stale_uploads`` removes them).
"""

from __future__ import annotations

import base64
import errno
import hashlib
import logging
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import botocore.exceptions as bce
from koochak.s3.errors import (
    describe,
    is_conflict,
    is_missing,
    is_precondition_failed,
    is_transient,
    translate,
)
from koochak.s3.retry import RetryPolicy
from koochak.storage.store import ObjectInfo

__all__ = ["Upload", "put_object", "payload_parts", "SHA256_META", "WRITER_META"]

_log = logging.getLogger(__name__)

SHA256_META = "koochak-sha256"
WRITER_META = "koochak-writer"
# How often an unanswered commit is re-sent after reading back found nothing there.
_COMMIT_ATTEMPTS = 4


@dataclass(frozen=True)
class Upload:
    """Where one put goes and how: the client, the object, the part size and the retries."""

    client: Any
    bucket: str
    object_key: str
    key: str  # the store key, for the returned ObjectInfo
    where: str  # s3://bucket/object_key, for messages
    part_bytes: int
    concurrency: int
    retry: RetryPolicy
    check_absent: bool = False  # HEAD before writing (servers that ignore If-None-Match)
    verify_commit: bool = False  # read a single put back after its commit (non-atomic servers)


def payload_parts(data: object, part_bytes: int) -> Iterator[bytes | memoryview]:
    """``data`` (bytes-like, a binary stream, or an iterable of bytes) as parts of exactly
    ``part_bytes`` bytes, the last one shorter (an empty payload is one empty part).

    Buffers handed to put whole are cut into views without copying (their owner is blocked in
    put). Streams are read part by part; blocks from an iterable are copied into the part being
    filled, since a producer may refill one buffer for its next block.
    """
    if isinstance(data, str):
        raise TypeError(
            "put() data must be bytes, a binary stream or an iterable of bytes, not str"
        )
    if isinstance(data, (bytes, bytearray, memoryview)):
        view = memoryview(data).cast("B")
        if not len(view):
            yield b""
        for offset in range(0, len(view), part_bytes):
            yield view[offset : offset + part_bytes]
        return
    read = getattr(data, "read", None)
    if callable(read):
        yield from _stream_parts(read, part_bytes)
        return
    try:
        blocks = iter(data)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(
            f"put() data must be bytes, a binary stream or an iterable of bytes, "
            f"got {type(data).__name__}"
        ) from None
    part = bytearray()
    sent = False
    for block in blocks:
        if not isinstance(block, (bytes, bytearray, memoryview)):
            raise TypeError(f"put() iterable yielded {type(block).__name__}; expected bytes")
        view = memoryview(block).cast("B")
        while len(view):
            take = min(part_bytes - len(part), len(view))
            part += view[:take]
            view = view[take:]
            if len(part) == part_bytes:
                yield bytes(part)
                sent = True
                part = bytearray()
    if part or not sent:
        yield bytes(part)


def _stream_parts(read: Callable[[int], object], part_bytes: int) -> Iterator[bytes]:
    pending = bytearray()
    sent = False
    while True:
        block = read(part_bytes - len(pending))
        if block is None:
            raise TypeError("put() stream returned None; pass a blocking binary stream")
        if isinstance(block, str):
            raise TypeError("put() stream is in text mode; open it with 'rb'")
        if not isinstance(block, (bytes, bytearray, memoryview)):
            raise TypeError(f"put() stream read returned {type(block).__name__}; expected bytes")
        if not block:
            break
        if not pending and isinstance(block, bytes) and len(block) == part_bytes:
            yield block  # a whole part in one read (files): no copy
            sent = True
            continue
        pending += block  # short reads (pipes, sockets) add up without quadratic copying
        if len(pending) >= part_bytes:
            yield bytes(pending)
            sent = True
            pending = bytearray()
    if pending or not sent:
        yield bytes(pending)


def put_object(
    up: Upload,
    data: object,
    expected_size: int | None,
    expected_sha256: str | None,
    mtime_ns: Callable[[Any], int],
) -> ObjectInfo:
    """Create ``up.object_key`` from ``data``; see the module docstring for the guarantees."""
    parts = payload_parts(data, up.part_bytes)
    try:
        first = next(parts)
        second = next(parts, None)
        if up.check_absent:
            _refuse_existing(up)
        if second is None:
            return _single(up, first, expected_size, expected_sha256, mtime_ns)
        return _multipart(up, first, second, parts, expected_size, expected_sha256, mtime_ns)
    finally:
        close = getattr(parts, "close", None)
        if close is not None:
            close()


def _single(up, body, expected_size, expected_sha256, mtime_ns) -> ObjectInfo:
    digest = hashlib.sha256(body).digest()
    hexdigest = digest.hex()
    _check_result(up, len(body), hexdigest, expected_size, expected_sha256)
    token = uuid.uuid4().hex
    payload = bytes(body)
    checksum = _b64(digest)

    def send() -> dict[str, Any]:
        return up.client.put_object(
            Bucket=up.bucket,
            Key=up.object_key,
            Body=payload,
            IfNoneMatch="*",
            ChecksumSHA256=checksum,
            Metadata={SHA256_META: hexdigest, WRITER_META: token},
        )

    answer = commit(up, send, token, checksum)
    _check_server_checksum(up, answer, checksum, hexdigest, token)
    if up.verify_commit:
        _check_still_ours(up, token)
    return ObjectInfo(up.key, len(payload), mtime_ns(answer), hexdigest)


def _multipart(up, first, second, rest, expected_size, expected_sha256, mtime_ns) -> ObjectInfo:
    token = uuid.uuid4().hex
    whole = hashlib.sha256()
    size = 0
    created = up.retry.run(
        f"start upload of {up.where}",
        lambda: up.client.create_multipart_upload(
            Bucket=up.bucket,
            Key=up.object_key,
            ChecksumAlgorithm="SHA256",
            Metadata={WRITER_META: token},
        ),
    )
    upload_id = created["UploadId"]
    committed = False
    pool = ThreadPoolExecutor(max_workers=up.concurrency, thread_name_prefix="koochak-s3-part")
    in_flight: deque[Future[dict[str, Any]]] = deque()
    done: list[dict[str, Any]] = []
    try:
        for number, part in enumerate(_chain(first, second, rest), start=1):
            # The whole-object digest is taken in order on this thread (hashlib releases the
            # GIL) while the pool sends earlier parts, each hashing its own body for S3.
            whole.update(part)
            size += len(part)
            if expected_size is not None and size > expected_size:
                raise ValueError(
                    f"put({up.key!r}): data is longer than expected_size={expected_size}"
                )
            if number > 10_000:
                raise ValueError(
                    f"put({up.key!r}): more than 10000 parts of {up.part_bytes} bytes; use a "
                    "larger part_size for objects this large"
                )
            body = bytes(part) if not isinstance(part, bytes) else part
            while len(in_flight) >= up.concurrency:
                done.append(in_flight.popleft().result())
            in_flight.append(pool.submit(_upload_part, up, upload_id, number, body))
        while in_flight:
            done.append(in_flight.popleft().result())
        hexdigest = whole.hexdigest()
        _check_result(up, size, hexdigest, expected_size, expected_sha256)
        composite = _composite([part["ChecksumSHA256"] for part in done])
        plan = {"Parts": done}

        def send() -> dict[str, Any]:
            return up.client.complete_multipart_upload(
                Bucket=up.bucket,
                Key=up.object_key,
                UploadId=upload_id,
                MultipartUpload=plan,
                IfNoneMatch="*",
            )

        answer = commit(up, send, token, composite)
        committed = True
    except BaseException:
        for future in in_flight:
            future.cancel()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        if not committed:
            _abort(up, upload_id)
    # S3 keeps a checksum of the part checksums for a multipart object, not the SHA256 of the
    # whole: that one was checked against expected_sha256 before the commit.
    _check_server_checksum(up, answer, composite, hexdigest, token)
    _check_still_ours(up, token)
    return ObjectInfo(up.key, size, mtime_ns(answer), hexdigest)


def _check_still_ours(up: Upload, token: str) -> None:
    """Read back a committed object: it must carry this put's token.

    On a server whose conditional writes are atomic (AWS S3, MinIO, R2, ...) it always does.
    moto checks ``If-None-Match`` and then writes, without a lock, so racing commits can all be
    accepted and the last one's bytes stay: every writer but that one then finds another token
    here and reports ``FileExistsError`` instead of success. Done for every multipart commit
    (one request next to a large upload) and, with ``verify_commit``, for single puts too. A
    commit that lands after this read-back is not seen; readers' digest checks against an
    artifact's manifest are the last line.
    """
    head = _read_back(up)
    if head is None:
        raise OSError(errno.EIO, "the object vanished right after its commit", up.where)
    found = head.get("Metadata", {}).get(WRITER_META)
    if found is None:
        # The server keeps no metadata of multipart uploads (rclone serve s3): nothing to check.
        return
    if found != token:
        raise FileExistsError(
            errno.EEXIST, "object already exists (another writer's upload completed)", up.where
        )


def _chain(first, second, rest) -> Iterator[bytes | memoryview]:
    yield first
    yield second
    yield from rest


def _upload_part(up: Upload, upload_id: str, number: int, body: bytes) -> dict[str, Any]:
    checksum = _b64(hashlib.sha256(body).digest())

    def send() -> dict[str, Any]:
        return up.client.upload_part(
            Bucket=up.bucket,
            Key=up.object_key,
            UploadId=upload_id,
            PartNumber=number,
            Body=body,
            ChecksumAlgorithm="SHA256",
            ChecksumSHA256=checksum,
        )

    # Re-sending a part number replaces that part: an idempotent step, retried.
    try:
        answer = up.retry.run(f"part {number} of {up.where}", send)
    except bce.ClientError as exc:
        raise translate(exc, up.where) from None
    got = answer.get("ChecksumSHA256")
    if got is not None and got != checksum:
        raise OSError(
            errno.EIO,
            f"S3 stored part {number} with SHA256 {got}, sent {checksum}: the bytes were changed "
            "in transit",
            up.where,
        )
    return {"ETag": answer["ETag"], "PartNumber": number, "ChecksumSHA256": checksum}


def commit(
    up: Upload, send: Callable[[], dict[str, Any]], token: str, checksum: str
) -> dict[str, Any]:
    """Send a conditional commit once; resolve a lost answer by reading back, never by guessing.

    412: the key exists (``FileExistsError``) unless a read-back shows this put's own token,
    which happens when an earlier, unanswered attempt of this same put won ("ours" means the
    object carries this put's token and, where the server reports one, this put's checksum:
    ``checksum``, the SHA256 of a single put or the checksum of part checksums). 409 (a concurrent
    conditional write or delete of the key), a 5xx or a broken connection: read back; this put's
    object means success, another object means ``FileExistsError``, nothing means the commit did
    not happen and is sent again (at most ``_COMMIT_ATTEMPTS`` times in all).
    """
    for attempt in range(1, _COMMIT_ATTEMPTS + 1):
        try:
            return send()
        except Exception as exc:
            if is_precondition_failed(exc):
                if attempt == 1:
                    raise FileExistsError(errno.EEXIST, "object already exists", up.where) from None
            elif not (is_conflict(exc) or is_transient(exc)):
                raise _translated(exc, up.where) from None
            _log.info("commit of %s: %s; reading back to see whether it happened", up.where,
                      type(exc).__name__)  # fmt: skip
            head = _read_back(up)
            if head is not None:
                ours = head.get("Metadata", {}).get(WRITER_META) == token and _comparable_match(
                    head.get("ChecksumSHA256"), checksum
                )
                if ours:
                    return head
                raise FileExistsError(errno.EEXIST, "object already exists", up.where) from None
            if attempt == _COMMIT_ATTEMPTS:
                raise OSError(
                    errno.EIO,
                    f"commit failed {attempt} times and nothing was published "
                    f"(last: {type(exc).__name__}); the put can be retried",
                    up.where,
                ) from None
            up.retry.sleep(up.retry.delay(attempt - 1))
    raise AssertionError("unreachable")  # pragma: no cover


def _translated(exc: BaseException, where: str) -> BaseException:
    if isinstance(exc, (bce.ClientError, bce.BotoCoreError)):
        return translate(exc, where)
    return exc


def _read_back(up: Upload) -> dict[str, Any] | None:
    try:
        return up.retry.run(
            f"read back {up.where}",
            lambda: up.client.head_object(
                Bucket=up.bucket, Key=up.object_key, ChecksumMode="ENABLED"
            ),
        )
    except bce.ClientError as exc:
        if is_missing(exc):
            return None
        raise translate(exc, up.where) from None


def _refuse_existing(up: Upload) -> None:
    """Servers that ignore If-None-Match, declared single-writer: at least refuse what is there."""
    if _read_back(up) is not None:
        raise FileExistsError(errno.EEXIST, "object already exists", up.where)


def _abort(up: Upload, upload_id: str) -> None:
    try:
        up.retry.run(
            f"abort upload of {up.where}",
            lambda: up.client.abort_multipart_upload(
                Bucket=up.bucket, Key=up.object_key, UploadId=upload_id
            ),
        )
    except Exception as exc:  # invisible either way; the put's own error is what matters
        _log.warning("could not abort the multipart upload of %s: %s", up.where, describe(exc))


def _check_result(up, size, hexdigest, expected_size, expected_sha256) -> None:
    if expected_size is not None and size != expected_size:
        raise ValueError(f"put({up.key!r}): got {size} bytes, expected_size={expected_size}")
    if expected_sha256 is not None and hexdigest != expected_sha256:
        raise ValueError(
            f"put({up.key!r}): SHA256 {hexdigest} does not match expected_sha256={expected_sha256}"
        )


def _check_server_checksum(up, answer, sent, hexdigest, token) -> None:
    """The server's checksum of what it stored must be the one computed here."""
    got = answer.get("ChecksumSHA256")
    if _comparable_match(got, sent):
        return
    _remove_ours(up, token)
    raise OSError(
        errno.EIO,
        f"S3 reports SHA256 {got} for the object, expected {sent} (SHA256 {hexdigest}); the "
        "object was removed",
        up.where,
    )


def _comparable_match(stored: str | None, ours: str) -> bool:
    """False only when the server reports a checksum of the same kind that differs."""
    if stored is None or stored == ours:
        return True
    # A server may report a full-object checksum for a multipart upload (or the reverse):
    # a different kind, not comparable; the writer token decides then.
    return ("-" in stored) != ("-" in ours)


def _remove_ours(up: Upload, token: str) -> None:
    try:
        head = _read_back(up)
        if head is not None and head.get("Metadata", {}).get(WRITER_META) == token:
            up.client.delete_object(Bucket=up.bucket, Key=up.object_key)
    except Exception as exc:
        _log.warning("could not remove %s after a checksum mismatch: %s", up.where, describe(exc))


def _composite(part_checksums: list[str]) -> str:
    """S3's checksum of a multipart object: SHA256 of the parts' raw digests, then -N."""
    joined = b"".join(base64.b64decode(c) for c in part_checksums)
    return f"{_b64(hashlib.sha256(joined).digest())}-{len(part_checksums)}"


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode("ascii")
