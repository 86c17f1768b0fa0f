"""koochak.data."""

from koochak.data.archive import ArchiveReport, archive_tree
from koochak.data.collection import Collection, FileEntry, load_collection
from koochak.data.packed import Group, GroupStream, PackCache, PackedGroups, PackUnit, combine_plans
from koochak.data.planning import assign_shards, plan_shards, worker_coordinates
from koochak.data.pull import PullReport, pull_collection
from koochak.data.shards import (
    ShardEntry,
    ShardIndex,
    ShardWriter,
    describe_shard,
    load_index,
    read_shard,
    read_shards,
    write_index,
)
from koochak.data.verify import VerifyReport, verify_collection

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
    "read_shards",
    "worker_coordinates",
    "write_index",
    # collections and the koochak-data tool
    "ArchiveReport",
    "Collection",
    "FileEntry",
    "PullReport",
    "VerifyReport",
    "archive_tree",
    "load_collection",
    "pull_collection",
    "verify_collection",
    # packed group streaming
    "Group",
    "GroupStream",
    "PackCache",
    "PackUnit",
    "PackedGroups",
    "combine_plans",
]
