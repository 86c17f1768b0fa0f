"""How a state's tensor bytes are cut into parts, and how many parts ``auto`` means.

The tensors' bytes, in the order the state lists them, are laid end to end and cut into ``P``
runs of equal length (within one byte). A tensor that crosses a cut is split there, so one big
tensor may span several parts and every part is written and hashed in the same time.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from koochak.loop.checkpoint.parts_index import Extent

# A store stream faster than this is limited by hashing on one core (SHA256 runs at about
# 1-2 GB/s per core), so more parts than cores do not help; a slower one (object storage)
# is limited by the stream, and parts up to the store's concurrency do.
_CPU_BOUND_STREAM = 500e6


@dataclass(frozen=True)
class PartsPlan:
    """Where each tensor's bytes go: ``extents[i]`` are tensor ``i``'s runs, in order."""

    part_sizes: tuple[int, ...]
    extents: tuple[tuple[Extent, ...], ...]


def plan_parts(sizes: Sequence[int], parts: int) -> PartsPlan:
    """Cut tensors of ``sizes`` bytes into ``parts`` parts balanced by bytes.

    Every part gets ``total // parts`` or one more byte; fewer parts only when there are fewer
    bytes than parts (never an empty part, except the one part of an empty state).
    """
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts={parts!r}; expected an int >= 1")
    total = sum(sizes)
    count = max(1, min(parts, total))
    bounds = [total * k // count for k in range(count + 1)]
    extents: list[tuple[Extent, ...]] = []
    part, cursor = 0, 0
    for size in sizes:
        if size < 0:
            raise ValueError(f"tensor size {size} is negative")
        runs = []
        left = size
        while left:
            while cursor >= bounds[part + 1]:
                part += 1
            length = min(left, bounds[part + 1] - cursor)
            runs.append(Extent(part, cursor - bounds[part], length))
            cursor += length
            left -= length
        extents.append(tuple(runs))
    sizes_out = tuple(bounds[k + 1] - bounds[k] for k in range(count))
    return PartsPlan(sizes_out, tuple(extents))


def resolve_parts(parts: int | str, total_bytes: int, store: object) -> int:
    """The number of parts to write: ``parts`` itself, or what ``"auto"`` means for this store.

    ``auto``: as many parts as the store runs streams well in parallel (its profile's
    ``concurrency``), no more than this process's cores when one stream of the store is fast
    enough that hashing is the limit, and no part smaller than the profile's ``part_bytes``.
    1 means the single-file layout.
    """
    if parts == "auto":
        from koochak.storage.profile import profile_of

        profile = profile_of(store)
        streams = profile.concurrency
        if profile.stream_bytes_per_second >= _CPU_BOUND_STREAM:
            streams = min(streams, _cores())
        by_size = max(1, total_bytes // profile.part_bytes)
        return max(1, min(streams, by_size))
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(
            f"checkpoint parts={parts!r}; expected an int >= 1 (1 = one file) or 'auto'"
        )
    return parts


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
