"""ShardRecords: a shard dataset indexable record by record, and an epoch order by whole shards."""

from __future__ import annotations

import pickle

import pytest
from koochak.data.records import ShardRecords
from koochak.data.shards import ShardWriter
from koochak.storage.store import LocalStore


@pytest.fixture
def store(tmp_path):
    store = LocalStore(str(tmp_path))
    with ShardWriter(store, "ds", target_bytes=4096) as writer:
        for i in range(40):
            writer.write({"__key__": f"r{i:03d}", "txt": f"record {i}".encode() * 40})
    return store


def test_records_are_indexed_in_index_order_across_shards(store):
    records = ShardRecords(store, "ds")
    assert len(records.index.shards) > 3
    assert len(records) == 40
    assert [r["__key__"] for r in records[::13]] == ["r000", "r013", "r026", "r039"]
    assert records[-1]["__key__"] == "r039"
    with pytest.raises(IndexError, match="record 40 out of range: the dataset holds 40"):
        records[40]


def test_a_shard_is_read_once_while_its_records_are_walked(store, monkeypatch):
    import koochak.data.records as module

    reads = []
    real = module.read_shard
    monkeypatch.setattr(
        module, "read_shard", lambda *a, **k: reads.append(a[2].key) or real(*a, **k)
    )
    records = ShardRecords(store, "ds", cached_shards=1)
    [records[i] for i in range(len(records))]
    assert len(reads) == len(records.index.shards)


def test_shard_order_shuffles_shards_per_epoch_and_keeps_each_shard_together(store):
    records = ShardRecords(store, "ds")
    order = records.shard_order(seed=1)
    first, second = list(order(0)), list(order(1))
    assert sorted(first) == sorted(second) == list(range(40))
    assert first != second
    shard_of = {}
    for shard, start in zip(records.index.shards, records._starts):
        shard_of.update({start + j: shard.key for j in range(shard.records)})
    runs = [shard_of[i] for i in first]
    changes = sum(a != b for a, b in zip(runs, runs[1:]))
    assert changes == len(records.index.shards) - 1  # one contiguous run per shard
    assert list(records.shard_order(seed=1)(0)) == first


def test_a_pickled_copy_starts_with_an_empty_cache(store):
    records = ShardRecords(store, "ds")
    records[0]
    assert records._cache
    clone = pickle.loads(pickle.dumps(records))
    assert not clone._cache and clone[5]["__key__"] == "r005"
