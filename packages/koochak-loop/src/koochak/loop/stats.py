"""Small running statistics for logging: windowed means, throughput and scalar EMAs.

Each `update` takes a number; passing a CUDA tensor calls `float()` on it, which synchronises with
the device, so feed these from values already on the host (e.g. at log boundaries).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable

__all__ = ["EMA", "SmoothedMeter", "Throughput"]


def _finite_or_raise(value: float, what: str) -> float:
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{what}: got NaN")
    return value


class SmoothedMeter:
    """Track a scalar over a sliding window (`avg`, `median`) and over all time (`global_avg`).

    `update(value, n)` records `value` as the mean of `n` items (e.g. a batch mean loss with
    `n=batch_size`); window statistics treat each update as one point.
    """

    def __init__(self, window: int = 20) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"SmoothedMeter window must be an int >= 1, got {window!r}")
        self._window: deque[float] = deque(maxlen=window)
        self.total = 0.0
        self.count = 0
        self.value = math.nan

    def update(self, value: float, n: int = 1) -> None:
        if n < 1:
            raise ValueError(f"SmoothedMeter.update n must be >= 1, got {n}")
        value = float(value)
        self._window.append(value)
        self.value = value
        self.total += value * n
        self.count += n

    @property
    def avg(self) -> float:
        """Mean of the values in the window (NaN before the first update)."""
        return sum(self._window) / len(self._window) if self._window else math.nan

    @property
    def median(self) -> float:
        return statistics.median(self._window) if self._window else math.nan

    @property
    def global_avg(self) -> float:
        """Item-weighted mean of every value since creation or `reset`."""
        return self.total / self.count if self.count else math.nan

    def reset(self) -> None:
        self._window.clear()
        self.total = 0.0
        self.count = 0
        self.value = math.nan


class Throughput:
    """Items per second between `reset()` and now, e.g. samples/s across the steps of a log window.

    `clock` is injectable so tests and callers can use a fake or a device-synchronised clock.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._start = clock()
        self.items = 0

    def update(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"Throughput.update n must be >= 0, got {n}")
        self.items += n

    @property
    def elapsed(self) -> float:
        return self._clock() - self._start

    @property
    def rate(self) -> float:
        """Items per second so far (NaN while no time has passed)."""
        elapsed = self.elapsed
        return self.items / elapsed if elapsed > 0 else math.nan

    def reset(self) -> float:
        """Restart the window; return the rate of the window that just ended."""
        rate = self.rate
        self._start = self._clock()
        self.items = 0
        return rate


class EMA:
    """Exponential moving average of a scalar with Adam-style bias correction.

    `value` after the first update equals that update, instead of being pulled towards zero.
    """

    def __init__(self, decay: float = 0.9) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay!r}")
        self.decay = decay
        self._biased = 0.0
        self.count = 0

    def update(self, value: float) -> float:
        value = _finite_or_raise(value, "EMA.update value")
        self._biased = self.decay * self._biased + (1.0 - self.decay) * value
        self.count += 1
        return self.value

    @property
    def value(self) -> float:
        if self.count == 0:
            return math.nan
        return self._biased / (1.0 - self.decay**self.count)

    def state_dict(self) -> dict[str, float | int]:
        return {"decay": self.decay, "biased": self._biased, "count": self.count}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        if set(state) != {"decay", "biased", "count"}:
            raise ValueError(f"EMA state keys {sorted(state)} != ['biased', 'count', 'decay']")
        self.decay = float(state["decay"])
        self._biased = float(state["biased"])
        self.count = int(state["count"])
