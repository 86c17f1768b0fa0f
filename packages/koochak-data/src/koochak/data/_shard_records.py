"""The records of a dataset's ``index.json``: ShardEntry and ShardIndex.

Their own module, below both ``shards`` (which reads and writes the index) and ``planning``
(which deals the entries to workers), so neither of those imports the other back.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ShardEntry", "ShardIndex"]


@dataclass(frozen=True)
class ShardEntry:
    """One shard as listed in a dataset's ``index.json``."""

    key: str  # relative to the prefix holding index.json (describe_shard: the store key)
    size: int  # bytes
    sha256: str  # lower-case hex SHA256 of the whole shard
    records: int  # samples in the shard


@dataclass(frozen=True)
class ShardIndex:
    """A loaded, validated ``index.json``. ``version`` is the SHA256 of the index bytes."""

    prefix: str  # store prefix holding index.json and the shards ("" for the store root)
    format: str
    metadata: dict[str, Any] = field(compare=False)  # treat as read-only
    shards: tuple[ShardEntry, ...]
    version: str

    @property
    def records(self) -> int:
        return sum(shard.records for shard in self.shards)

    @property
    def size(self) -> int:
        return sum(shard.size for shard in self.shards)

    @functools.cached_property
    def entries_by_key(self) -> dict[str, ShardEntry]:
        return {shard.key: shard for shard in self.shards}

    def key_of(self, shard: ShardEntry | str) -> str:
        """The store key of ``shard`` (an entry of this index, or its relative key)."""
        name = shard.key if isinstance(shard, ShardEntry) else shard
        return _join(self.prefix, name)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name
