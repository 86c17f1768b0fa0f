"""koochak.data.

Names are imported on first use (PEP 562), so the ``koochak-data`` command and ``import
koochak.data.pull`` load only what they run: a pull never imports the archiver, shards or packed
streaming. ``from koochak.data import X`` works for every name of ``__all__``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from koochak.storage.lazy_exports import lazy_exports

_EXPORTS = {
    "ArchiveReport": "archive",
    "archive_tree": "archive",
    "Collection": "collection",
    "FileEntry": "collection",
    "load_collection": "collection",
    "Group": "packed",
    "GroupStream": "packed",
    "PackCache": "packed",
    "PackedGroups": "packed",
    "PackUnit": "packed",
    "combine_plans": "packed",
    "assign_shards": "planning",
    "plan_shards": "planning",
    "worker_coordinates": "planning",
    "PullReport": "pull",
    "pull_collection": "pull",
    "ShardEntry": "shards",
    "ShardIndex": "shards",
    "ShardWriter": "shards",
    "describe_shard": "shards",
    "load_index": "shards",
    "read_shard": "shards",
    "read_shards": "shards",
    "write_index": "shards",
    "VerifyReport": "verify",
    "verify_collection": "verify",
}

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

if TYPE_CHECKING:
    from koochak.data.archive import ArchiveReport, archive_tree
    from koochak.data.collection import Collection, FileEntry, load_collection
    from koochak.data.packed import (
        Group,
        GroupStream,
        PackCache,
        PackedGroups,
        PackUnit,
        combine_plans,
    )
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


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
