"""StoreProfile: a store's measured performance, and the decisions that follow from it.

Transfers and archives size their work from a profile (how many streams, how large a part, which
files to pack), so the same code is fast on a parallel filesystem and on an object-storage mount.
Profiles are measured by ``koochak-probe`` and kept in the stores file.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from koochak.storage.protocol import capabilities_of

__all__ = [
    "StoreProfile",
    "LOCAL_PROFILE",
    "REMOTE_PROFILE",
    "profile_of",
    "min_object_bytes",
    "parse_size",
]


@dataclass(frozen=True)
class StoreProfile:
    """Measured performance of one store.

    request_seconds:          cost of one small request (open + first byte, stat, tiny get)
    stream_bytes_per_second:  cold read bandwidth of a single stream
    concurrency:              number of parallel streams worth running
    range_reads_scale:        whether parallel byte ranges of *one* object add up
    part_bytes:               byte-range size for parallel reads of large objects
    listing_cheap:            whether listing a prefix is fast enough to rely on
    """

    request_seconds: float
    stream_bytes_per_second: float
    concurrency: int
    range_reads_scale: bool
    part_bytes: int
    listing_cheap: bool

    def __post_init__(self) -> None:
        def number(name: str, positive: bool) -> None:
            value = getattr(self, name)
            ok = (
                not isinstance(value, bool)
                and isinstance(value, (int, float))
                and math.isfinite(value)
                and (value > 0 if positive else value >= 0)
            )
            if not ok:
                bound = "> 0" if positive else ">= 0"
                raise ValueError(f"StoreProfile.{name}={value!r}; expected a finite number {bound}")

        number("request_seconds", positive=False)
        number("stream_bytes_per_second", positive=True)
        for name in ("concurrency", "part_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"StoreProfile.{name}={value!r}; expected an int >= 1")
        for name in ("range_reads_scale", "listing_cheap"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"StoreProfile.{name}={getattr(self, name)!r}; expected true or false"
                )


# A local or parallel filesystem: cheap requests, listing is fine, one stream per file is enough.
LOCAL_PROFILE = StoreProfile(
    request_seconds=0.0005,
    stream_bytes_per_second=1e9,
    concurrency=8,
    range_reads_scale=False,
    part_bytes=64 << 20,
    listing_cheap=True,
)

# What we assume about a store nobody measured: object storage behind a mount, where a request
# can cost a second, each stream is slow, and only many parallel requests reach the bandwidth.
REMOTE_PROFILE = StoreProfile(
    request_seconds=0.5,
    stream_bytes_per_second=50e6,
    concurrency=16,
    range_reads_scale=True,
    part_bytes=64 << 20,
    listing_cheap=False,
)


def profile_of(store: object) -> StoreProfile:
    """The profile ``store`` declares (``capabilities_of(store).profile``), else a default.

    A store that declares no profile gets LOCAL_PROFILE when it publishes with hard links on a
    filesystem (a POSIX filesystem) and REMOTE_PROFILE otherwise: an object-storage mount
    (exclusive mode), or any store that declares nothing, gets the conservative one.
    """
    declared = capabilities_of(store)
    profile = declared.profile
    if isinstance(profile, StoreProfile):
        return profile
    if profile is not None:
        raise TypeError(
            f"{store!r} declares a profile of type {type(profile).__name__}; expected a "
            "StoreProfile"
        )
    if declared.publish == "link" and declared.root is not None:
        return LOCAL_PROFILE
    return REMOTE_PROFILE


def min_object_bytes(profile: StoreProfile) -> int:
    """Size below which a file should be packed with others rather than stored alone.

    At this size one request's fixed cost equals the time to stream the bytes, so a smaller
    object spends most of its time on overhead. Clamped to [4 KiB, part_bytes].
    """
    raw = profile.request_seconds * profile.stream_bytes_per_second
    return int(min(max(raw, 4096), profile.part_bytes))


_UNITS = {
    "": 1,
    "b": 1,
    # Bare letters follow dd, ls and df: binary multiples ("64M" is 64 MiB).
    "k": 1 << 10,
    "m": 1 << 20,
    "g": 1 << 30,
    "t": 1 << 40,
    "p": 1 << 50,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "pib": 1 << 50,
    # "kB", "MB", "GB" are SI: decimal multiples.
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*")


def parse_size(value: int | str) -> int:
    """Parse a byte count: an int, or a string such as ``"64M"``, ``"1.5GB"``, ``"16MiB"``.

    Bare ``K/M/G/T/P`` and ``KiB/MiB/...`` are binary (``64M`` = 64 * 2**20); ``kB/MB/GB/...`` are
    decimal (``1.5GB`` = 1.5e9). Fractions round to the nearest byte.
    """
    if isinstance(value, bool):
        raise ValueError(f"size {value!r} is a boolean; expected bytes such as 1048576 or '64M'")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size {value!r} is negative; expected a byte count >= 0")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if not isinstance(value, str):
        raise ValueError(
            f"size {value!r} is not a byte count; expected an int or a string like '64M'"
        )
    match = _SIZE.fullmatch(value)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(
            f"size {value!r} is not understood; expected an int or a number with a unit such as "
            "'512', '64M', '16MiB', '1.5GB'"
        )
    try:
        amount = Decimal(match.group(1)) * _UNITS[unit]
    except InvalidOperation:  # pragma: no cover - the regex admits only decimal numbers
        raise ValueError(f"size {value!r} is not a number") from None
    return int(amount.to_integral_value())
