"""Retries with exponential backoff and full jitter, for reads and idempotent steps only.

A GET, HEAD, LIST, DELETE, an UploadPart (re-sending a part number replaces it) or an abort may
be repeated after a throttle, a 5xx or a broken connection. A conditional commit (a create-only
PutObject or CompleteMultipartUpload) is never retried blindly: see ``upload.commit``.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from koochak.s3.errors import describe, is_transient

__all__ = ["RetryPolicy", "DEFAULT_RETRY"]

_T = TypeVar("_T")
_log = logging.getLogger(__name__)
# Its own stream: a retry inside a checkpoint upload must not draw from the user's ``random``
# (a resumed run would then see other numbers than an uninterrupted one).
_JITTER = random.Random()


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` tries in all; before try n+1 sleep a uniform random time in
    ``[0, min(max_seconds, base_seconds * 2**n))`` ("full jitter": many clients throttled at
    once spread out instead of retrying in lock step)."""

    attempts: int = 6
    base_seconds: float = 0.1
    max_seconds: float = 5.0
    sleep: Callable[[float], None] = field(default=time.sleep, compare=False, repr=False)
    uniform: Callable[[float, float], float] = field(
        default=_JITTER.uniform, compare=False, repr=False
    )

    def delay(self, retry: int) -> float:
        return self.uniform(0.0, min(self.max_seconds, self.base_seconds * (2**retry)))

    def run(self, what: str, call: Callable[[], _T]) -> _T:
        """``call()``, retried on transient failures; the last failure is raised."""
        for retry in range(self.attempts):
            try:
                return call()
            except Exception as exc:
                if not is_transient(exc) or retry == self.attempts - 1:
                    raise
                pause = self.delay(retry)
                _log.info("%s: %s; retry %d of %d in %.2f s", what, _short(exc), retry + 1,
                          self.attempts - 1, pause)  # fmt: skip
                self.sleep(pause)
        raise AssertionError("unreachable")  # pragma: no cover


def _short(exc: BaseException) -> str:
    # Scrubbed before it is cut: a cut through a credential would leave part of it unmasked.
    text = describe(exc)
    return (text.splitlines()[0] if text else "")[:200]


DEFAULT_RETRY = RetryPolicy()
