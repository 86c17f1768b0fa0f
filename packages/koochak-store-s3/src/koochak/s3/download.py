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

Every answer is checked against its request, because HTTP lets a server or proxy ignore
``Range``: a ``206`` must carry a ``Content-Range`` whose first byte, last byte and total match
the request and the object's known size (else ``OSError`` naming both windows); a body shorter
than its ``Content-Range`` is retried like a broken connection. A ``200`` (the whole object) to
a ranged request is sliced when the object is at most ``part_bytes`` long (one part: the
memory a read already budgets for one request) and refused otherwise, without reading its
body, with ``RangeIgnored``. (``rclone serve s3`` answers ranged GETs with 200 and a correct
``Content-Range``: an answer that carries one is checked as the partial answer it is.)
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

__all__ = ["Reader", "read_range", "ObjectStream", "RangeIgnored"]

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class RangeIgnored(OSError):
    """A ranged GET was answered ``200`` with the whole object, too large to take and slice."""

    def __init__(self, where: str, asked: str, size: int, bound: int) -> None:
        super().__init__(
            errno.EIO,
            f"the S3 server ignored Range ({asked}): it answered 200 with the whole "
            f"{size}-byte object, more than the {bound} bytes (part_size) a read takes whole",
            where,
        )


@dataclass(frozen=True)
class Reader:
    client: Any
    bucket: str
    object_key: str
    where: str
    part_bytes: int  # also the largest whole-object answer taken for a ranged request
    concurrency: int
    parallel: bool  # whether ranges of one object are worth fetching at once
    retry: RetryPolicy


def _is_whole(answer: dict[str, Any]) -> bool:
    """A 200 without Content-Range: the whole object. (rclone serve s3 1.75 answers a ranged GET
    with 200 and a right Content-Range: that is a partial answer, checked as a 206 is.)"""
    status = answer.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status == 200 and not answer.get("ContentRange")


def _content_range(answer: dict[str, Any], where: str, asked: str) -> tuple[int, int, int]:
    """(first, last, total) of a 206 answer's Content-Range; OSError when it has none."""
    match = _CONTENT_RANGE.fullmatch(str(answer.get("ContentRange", "")).strip())
    if not match or match.group(3) == "*":
        raise OSError(
            errno.EIO,
            f"the S3 server answered {asked} without a usable Content-Range "
            f"({answer.get('ContentRange')!r})",
            where,
        )
    first, last, total = int(match.group(1)), int(match.group(2)), int(match.group(3))
    return first, last, total


def _check_window(
    where: str, asked: str, got: tuple[int, int, int], begin: int, end: int | None,
    size: int | None,
) -> None:  # fmt: skip
    """The 206 window ``got`` must be what ``[begin, end)`` asked for, of an object of ``size``."""
    first, last, total = got
    want_last = (total if end is None else min(end, total)) - 1
    if first != begin or last != want_last or (size is not None and total != size):
        known = "" if size is None else f" of a {size}-byte object"
        raise OSError(
            errno.EIO,
            f"the S3 server answered bytes {first}-{last}/{total} to {asked}{known}: "
            "a wrong window, refused",
            where,
        )


def _short(got: int, want: int) -> bce.IncompleteReadError:
    # Retried like a connection that broke mid-body (is_transient knows this type).
    return bce.IncompleteReadError(actual_bytes=got, expected_bytes=want)


def _get(
    r: Reader, begin: int, end: int | None, etag: str | None, size: int | None = None
) -> tuple[bytes, int, str]:
    """(bytes of [begin, end), object size, ETag); end None = to the end of the object.

    ``size``, when known (a stat, or the first range's answer), must be the answer's total.
    """
    asked = f"bytes={begin}-{'' if end is None else end - 1}"
    extra: dict[str, Any] = {"Range": asked}
    if etag is not None:
        extra["IfMatch"] = etag

    def call() -> tuple[bytes, int, str]:
        answer = r.client.get_object(Bucket=r.bucket, Key=r.object_key, **extra)
        body = answer["Body"]
        try:
            if _is_whole(answer):  # the whole object: the server ignored Range
                return _whole(r, answer, body, begin, end, size, asked)
            data = body.read()
        finally:
            body.close()
        got = _content_range(answer, r.where, asked)
        _check_window(r.where, asked, got, begin, end, size)
        if len(data) != got[1] - got[0] + 1:
            raise _short(len(data), got[1] - got[0] + 1)
        return data, got[2], answer.get("ETag", "")

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


def _whole(
    r: Reader, answer: dict[str, Any], body: Any, begin: int, end: int | None,
    size: int | None, asked: str,
) -> tuple[bytes, int, str]:  # fmt: skip
    """A 200 answer to ``asked``: sliced when the whole object is small enough, else refused."""
    length = int(answer.get("ContentLength", -1))
    exact = begin == 0 and (end is None or (length >= 0 and end >= length))
    if not exact and not 0 <= length <= r.part_bytes:
        raise RangeIgnored(r.where, asked, length, r.part_bytes)
    data = body.read()
    if length >= 0 and len(data) != length:
        raise _short(len(data), length)
    if size is not None and len(data) < size:
        raise _short(len(data), size)
    if size is not None and len(data) != size:
        raise OSError(
            errno.EIO,
            f"the S3 server answered {asked} with a whole object of {len(data)} bytes, "
            f"not the {size} bytes it has",
            r.where,
        )
    return data[begin:end], len(data), answer.get("ETag", "")


def read_range(r: Reader, begin: int, end: int | None, size: int | None = None) -> bytes:
    """Bytes ``[begin, end)`` of the object (``end`` None = to its end), clamped at its end.

    ``size`` is the object's size when the caller knows it (from a stat): every answer must
    agree. Where ranges of one object do not add up (the profile's ``range_reads_scale`` is
    false, as on a server that reads the whole object for every range) the range is one GET.
    """
    if not r.parallel:
        return _get(r, begin, end, None, size)[0]
    first_end = begin + r.part_bytes if end is None else min(end, begin + r.part_bytes)
    first, size, etag = _get(r, begin, first_end, None, size)
    stop = size if end is None else min(end, size)
    if begin + len(first) >= stop:
        return first[: max(0, stop - begin)]
    starts = range(begin + len(first), stop, r.part_bytes)
    if len(starts) == 1:
        rest = [_get(r, s, min(s + r.part_bytes, stop), etag, size)[0] for s in starts]
    else:
        with ThreadPoolExecutor(
            max_workers=min(r.concurrency, len(starts)), thread_name_prefix="koochak-s3-range"
        ) as pool:
            futures = [
                pool.submit(_get, r, s, min(s + r.part_bytes, stop), etag, size) for s in starts
            ]
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

        first_open = self._etag is None

        def call() -> tuple[dict[str, Any], Any]:
            answer = self._r.client.get_object(Bucket=self._r.bucket, Key=self._r.object_key, **extra)
            return answer, self._checked_body(answer, pos, first_open)

        try:
            answer, body = self._r.retry.run(f"open {self._r.where}", call)
        except bce.ClientError as exc:
            if status_of(exc) == 416:
                self._body, self._pos = None, pos
                return
            raise translate(exc, self._r.where) from None
        except bce.BotoCoreError as exc:
            raise translate(exc, self._r.where) from None
        if first_open:
            self._etag = answer.get("ETag")
            self._size = int(answer.get("ContentLength", 0))
        self._body, self._pos = body, pos

    def _checked_body(self, answer: dict[str, Any], pos: int, first_open: bool) -> Any:
        """The body of ``answer`` to a GET from ``pos``, once it is known to start there."""
        r, body = self._r, answer["Body"]
        asked = f"bytes={pos}-"
        if _is_whole(answer):
            length = int(answer.get("ContentLength", -1))
            if not first_open and length != self._size:
                body.close()
                raise OSError(
                    errno.EIO,
                    f"the object is now {length} bytes, not the {self._size} it was when opened",
                    r.where,
                )
            if not pos:
                return body
            # The server ignored Range: take the whole object when it is small, skip to pos.
            if length > r.part_bytes:
                body.close()
                raise RangeIgnored(r.where, asked, length, r.part_bytes)
            try:
                data = body.read()
            finally:
                body.close()
            if len(data) != length:
                raise _short(len(data), length)
            return io.BytesIO(data[pos:])
        try:
            got = _content_range(answer, r.where, asked)
            _check_window(r.where, asked, got, pos, None, self._size)
        except OSError:
            body.close()
            raise
        return body

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
