"""A bandwidth budget for background replication: a token bucket the copy draws bytes from.

Replication shares the machine with the training thread. On a small, busy host the copy's
threads (reads, SHA256, writes) take cores and the interpreter lock the training step is waiting
for, so a copy at full speed slows every step it overlaps. ``BandwidthBudget`` paces a copy to
``train.checkpoint_replication_bandwidth_mb_s``: ``copy_objects`` reports each chunk it hands to
the target (its ``progress`` callback), and the budget sleeps that thread once the copy runs
ahead of its rate. A sleeping copy costs nothing; the price is lag, which the replicator logs and
publishes as before (``behind_s``, MB/s of each copy).

The arithmetic is pure (``delay_for`` with an injected clock), so it is tested without time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

# Bytes the bucket holds when full: a copy may move this much at once before pacing starts, so
# small checkpoints (and the manifest) are not slowed at all.
DEFAULT_BURST_BYTES = 16 << 20


class BandwidthBudget:
    """At most ``bytes_per_second`` on average, with bursts of up to ``burst_bytes``.

    ``take(n)`` after ``n`` bytes moved: sleeps as long as needed to stay within the rate.
    Thread-safe; shared by every stream of one copy (they split the rate between them).
    """

    def __init__(
        self,
        bytes_per_second: float,
        *,
        burst_bytes: int = DEFAULT_BURST_BYTES,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if isinstance(bytes_per_second, bool) or not bytes_per_second > 0:
            raise ValueError(
                f"BandwidthBudget: bytes_per_second must be > 0, got {bytes_per_second!r}"
            )
        if burst_bytes < 0:
            raise ValueError(f"BandwidthBudget: burst_bytes must be >= 0, got {burst_bytes!r}")
        self.rate = float(bytes_per_second)
        self.burst = float(burst_bytes)
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._tokens = self.burst
        self._last = clock()
        self.waited_s = 0.0  # total time the copy was held back (for the log)

    def delay_for(self, nbytes: int) -> float:
        """Spend ``nbytes`` tokens; return the seconds to wait before moving on (0: none).

        Tokens refill at ``rate`` up to ``burst``; a debt (negative balance) is paid by waiting
        debt / rate, and the next call sees the refill of that wait.
        """
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= max(0, nbytes)
            delay = -self._tokens / self.rate if self._tokens < 0 else 0.0
            self.waited_s += delay
            return delay

    def take(self, nbytes: int) -> None:
        """Account for ``nbytes`` just moved, sleeping as long as the budget says."""
        delay = self.delay_for(nbytes)
        if delay > 0:
            self._sleep(delay)


def bandwidth_budget(mb_per_s: float | None) -> BandwidthBudget | None:
    """The budget for ``train.checkpoint_replication_bandwidth_mb_s`` (None: unlimited)."""
    if mb_per_s is None:
        return None
    return BandwidthBudget(mb_per_s * 1e6)
