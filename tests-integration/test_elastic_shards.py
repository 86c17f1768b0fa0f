"""Elastic data over a real shard dataset: ElasticBatches (koochak-loop) streams the records of
ShardRecords (koochak-data) by whole shards, and a stream cut on 4 ranks and resumed on 2 or 1
consumes every record of the epoch exactly once."""

from __future__ import annotations

import itertools

import pytest
from koochak.data.records import ShardRecords
from koochak.data.shards import ShardWriter
from koochak.loop.elastic import ElasticBatches
from koochak.storage.store import LocalStore


def _keys(records):
    return [r["__key__"] for r in records]


@pytest.mark.parametrize("resumed_on", [1, 2, 4])
def test_a_shard_stream_resumed_on_another_world_size_reads_each_record_once(tmp_path, resumed_on):
    store = LocalStore(str(tmp_path))
    with ShardWriter(store, "ds", target_bytes=4096) as writer:
        for i in range(48):
            writer.write({"__key__": f"r{i:03d}", "txt": f"record {i}".encode() * 40})
    records = ShardRecords(store, "ds")

    def stream(rank, world, state=None):
        data = ElasticBatches(records, global_batch=8, order=records.shard_order(seed=4),
                              collate=_keys, rank=rank, world_size=world)  # fmt: skip
        if state is not None:
            data.load_state(state)
        return data

    before = [stream(r, 4) for r in range(4)]
    seen = [
        k
        for parts in zip(*(itertools.islice(iter(d), 3) for d in before))
        for p in parts
        for k in p
    ]
    state = before[0].state_after(3)
    assert state["order"] == "shard_order(seed=4)"
    after = [stream(r, resumed_on, state) for r in range(resumed_on)]
    seen += [
        k for parts in zip(*(itertools.islice(iter(d), 3) for d in after)) for p in parts for k in p
    ]
    assert sorted(seen) == [f"r{i:03d}" for i in range(48)]  # the whole epoch, once
