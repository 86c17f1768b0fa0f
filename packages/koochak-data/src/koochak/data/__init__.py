"""koochak.data."""

from koochak.data.planning import assign_shards, plan_shards, worker_coordinates
from koochak.data.shards import (
    ShardEntry,
    ShardIndex,
    ShardWriter,
    describe_shard,
    load_index,
    read_shard,
    write_index,
)

__all__ = [
    # shards and planning (ShardDataset: koochak.data.shards.ShardDataset, imports torch)
    "ShardEntry",
    "ShardIndex",
    "ShardWriter",
    "assign_shards",
    "describe_shard",
    "load_index",
    "plan_shards",
    "read_shard",
    "worker_coordinates",
    "write_index",
]
