"""Reads from S3: byte ranges fetched in parallel, and a stream that resumes where it broke.

``read_range`` asks for the first ``part_bytes`` of the range in one GET; the answer's
``Content-Range`` tells the object's size, and what is left of the range is fetched as
``part_bytes`` ranges, ``concurrency`` at a time, each pinned to the first answer's ETag
(``If-Match``) so an object replaced meanwhile fails instead of mixing two objects' bytes. A
small object costs one request; so does any range when the store's profile says ranges of one
object do not add up (``range_reads_scale: false``). Every GET is retried (backoff with jitter) on throttling, 5xx
and broken connections.

``ObjectStream`` (what ``S3Store.open`` returns) reads one GET's body; if the connection breaks
mid-body it re-opens at the byte it reached, pinned to the same ETag.
"""

from __future__ import annotations

import errno
import io
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import botocore.exceptions as bce
from koochak.s3.errors import is_precondition_failed, is_transient, status_of, translate
from koochak.s3.retry import RetryPolicy

__all__ = ["Reader", "read_range", "ObjectStream"]

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


@dataclass(frozen=True)
class Reader:
    client: Any
    bucket: str
    object_key: str
    where: str
    part_bytes: int
    concurrency: int
    parallel: bool  # whether ranges of one object are worth fetching at once
    retry: RetryPolicy


def _get(r: Reader, begin: int, end: int | None, etag: str | None) -> tuple[bytes, int, str]:
    """(bytes of [begin, end), object size, ETag); end None = to the end of the object."""
    extra: dict[str, Any] = {"Range": f"bytes={begin}-{'' if end is None else end - 1}"}
    if etag is not None:
        extra["IfMatch"] = etag

    def call() -> tuple[bytes, int, str]:
        answer = r.client.get_object(Bucket=r.bucket, Key=r.object_key, **extra)
        body = answer["Body"]
        try:
            data = body.read()
        finally:
            body.close()
        return data, _size_of(answer, begin, len(data)), answer.get("ETag", "")

    try:
        return r.retry.run(f"get {r.where}", call)
    except bce.ClientError as exc:
        if status_of(exc) == 416:  # the range starts at or past the end: nothing to read
            return b"", begin, etag or ""
        if etag is not None and is_precondition_failed(exc):
            raise OSError(
                errno.EIO, "the object was replaced while it was being read", r.where
            ) from None
        raise translate(exc, r.where) from None
    except bce.BotoCoreError as exc:
        raise translate(exc, r.where) from None


def _size_of(answer: dict[str, Any], begin: int, got: int) -> int:
    match = _CONTENT_RANGE.fullmatch(str(answer.get("ContentRange", "")))
    if match and match.group(3) != "*":
        return int(match.group(3))
    return begin + got  # no Content-Range: the server sent the whole object


def read_range(r: Reader, begin: int, end: int | None) -> bytes:
    """Bytes ``[begin, end)`` of the object (``end`` None = to its end), clamped at its end.

    Where ranges of one object do not add up (the profile's ``range_reads_scale`` is false, as
    on a server that reads the whole object for every range) the range is one GET.
    """
    if not r.parallel:
        return _get(r, begin, end, None)[0]
    first_end = begin + r.part_bytes if end is None else min(end, begin + r.part_bytes)
    first, size, etag = _get(r, begin, first_end, None)
    stop = size if end is None else min(end, size)
    if begin + len(first) >= stop:
        return first[: max(0, stop - begin)]
    starts = range(begin + len(first), stop, r.part_bytes)
    if len(starts) == 1:
        rest = [_get(r, s, min(s + r.part_bytes, stop), etag)[0] for s in starts]
    else:
        with ThreadPoolExecutor(
            max_workers=min(r.concurrency, len(starts)), thread_name_prefix="koochak-s3-range"
        ) as pool:
            futures = [pool.submit(_get, r, s, min(s + r.part_bytes, stop), etag) for s in starts]
            rest = [future.result()[0] for future in futures]
    data = b"".join([first, *rest])
    if len(data) != stop - begin:
        raise OSError(
            errno.EIO,
            f"read {len(data)} bytes of range [{begin}, {stop}), expected {stop - begin}",
            r.where,
        )
    return data


class ObjectStream(io.RawIOBase):
    """A readable, seekable stream over one object; a broken body re-opens where it stopped."""

    def __init__(self, r: Reader) -> None:
        super().__init__()
        self._r = r
        self._pos = 0
        self._body: Any = None
        self._size = 0
        self._etag: str | None = None
        self._open_at(0)  # a missing key fails here, in open(), not on the first read

    def _open_at(self, pos: int) -> None:
        extra: dict[str, Any] = {}
        if pos:
            extra["Range"] = f"bytes={pos}-"
        if self._etag is not None:
            extra["IfMatch"] = self._etag

        def call() -> dict[str, Any]:
            return self._r.client.get_object(Bucket=self._r.bucket, Key=self._r.object_key, **extra)

        try:
            answer = self._r.retry.run(f"open {self._r.where}", call)
        except bce.ClientError as exc:
            if status_of(exc) == 416:
                self._body, self._pos = None, pos
                return
            raise translate(exc, self._r.where) from None
        except bce.BotoCoreError as exc:
            raise translate(exc, self._r.where) from None
        if self._etag is None:
            self._etag = answer.get("ETag")
            self._size = int(answer.get("ContentLength", 0))
        self._body, self._pos = answer["Body"], pos

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        target = base + offset
        if target < 0:
            raise ValueError(f"negative seek position {target}")
        if target != self._pos:
            self._drop_body()
            self._pos = target
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if not len(view) or self._pos >= self._size:
            return 0
        for attempt in range(self._r.retry.attempts):
            if self._body is None:
                self._open_at(self._pos)
                if self._body is None:
                    return 0
            try:
                data = self._body.read(len(view))
            except Exception as exc:
                if not is_transient(exc) or attempt == self._r.retry.attempts - 1:
                    raise translate(exc, self._r.where) from None
                self._drop_body()  # resume at self._pos with a new ranged GET
                self._r.retry.sleep(self._r.retry.delay(attempt))
                continue
            if not data and self._pos < self._size:
                self._drop_body()  # the connection ended early: resume
                continue
            view[: len(data)] = data
            self._pos += len(data)
            return len(data)
        raise OSError(errno.EIO, "the object stream kept breaking", self._r.where)

    def _drop_body(self) -> None:
        if self._body is not None:
            try:
                self._body.close()
            except Exception:
                pass
            self._body = None

    def close(self) -> None:
        self._drop_body()
        super().close()
