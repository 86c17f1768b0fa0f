"""ElasticBatches' seeded shuffle within a window, and UnpackedRecords (several records per
sample): exactly once per epoch and exact resume on another world size are kept."""

from __future__ import annotations

import itertools

import pytest
from koochak.loop.elastic import ElasticBatches, UnpackedRecords


def _take(data: ElasticBatches, n: int) -> list[list[int]]:
    return [list(b) for b in itertools.islice(iter(data), n)]


def _stream(records, world: int, rank: int, state=None, **settings) -> ElasticBatches:
    data = ElasticBatches(records, global_batch=8, collate=list, rank=rank, world_size=world,
                          **settings)  # fmt: skip
    if state is not None:
        data.load_state(state)
    return data


def _run(records, world: int, batches: int, state=None, **settings) -> list[int]:
    """The global stream of ``batches`` global batches read on ``world`` ranks."""
    parts = [_take(_stream(records, world, r, state, **settings), batches) for r in range(world)]
    return [x for step in zip(*parts) for part in step for x in part]


def test_a_window_shuffle_mixes_within_windows_only_and_keeps_each_record_once():
    records = list(range(103))  # the last window of 10 is 3 long
    data = ElasticBatches(records, global_batch=8, collate=list, shuffle=False, shuffle_window=10)
    for epoch in range(2):
        order = [data.record_at(epoch * 103 + p) for p in range(103)]
        assert sorted(order) == records
        for first in range(0, 103, 10):
            assert sorted(order[first : first + 10]) == list(range(first, min(first + 10, 103)))
        assert order != records  # shuffled
        if epoch == 0:
            first_epoch = order
    assert order != first_epoch  # a new shuffle every epoch


def test_same_seed_same_order_another_seed_another():
    records = list(range(64))
    one = _run(records, 1, 16, seed=3, shuffle=False, shuffle_window=16)
    assert one == _run(records, 1, 16, seed=3, shuffle=False, shuffle_window=16)
    assert one != _run(records, 1, 16, seed=4, shuffle=False, shuffle_window=16)


@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 1), (1, 4)])
def test_a_windowed_stream_resumed_on_another_world_size_is_exact(before, after):
    records = list(range(60))
    settings = {"seed": 7, "shuffle": False, "shuffle_window": 12}
    uninterrupted = _run(records, 1, 15, **settings)  # two epochs
    head = _run(records, before, 5, **settings)
    state = _stream(records, before, 0, **settings).state_after(5)
    tail = _run(records, after, 10, state, **settings)
    assert head + tail == uninterrupted
    assert sorted(uninterrupted[:60]) == records  # every sample id once in the epoch


def test_a_resume_with_another_window_is_refused():
    records = list(range(40))
    state = _stream(records, 1, 0, shuffle_window=8).state_after(2)
    assert state["order"] == "shuffle+window8"
    with pytest.raises(ValueError, match="data.order"):
        _stream(records, 1, 0, state, shuffle_window=4)
    with pytest.raises(ValueError, match="shuffle_window"):
        ElasticBatches(records, global_batch=8, shuffle_window=-1)


def _packed(n: int, per: int) -> list[list[int]]:
    return [list(range(s, min(s + per, n))) for s in range(0, n, per)]


def test_unpacked_records_are_addressed_one_by_one_and_checked():
    samples = _packed(50, 8)  # 7 samples, the last holds 2
    calls = []
    records = UnpackedRecords(samples, 8, lambda s: calls.append(1) or s, total=50)
    assert len(records) == 50 and [records[i] for i in range(50)] == list(range(50))
    assert records[-1] == 49 and len(calls) == 7  # each sample unpacked once
    with pytest.raises(ValueError, match="total"):
        UnpackedRecords(samples, 8, list, total=60)
    broken = UnpackedRecords([[1, 2], [3]], 2, list)  # says 4 records, the last sample has 1
    with pytest.raises(ValueError, match="sample 1 unpacks to 1 records, expected 2"):
        broken[3]


@pytest.mark.parametrize(("before", "after"), [(4, 1), (2, 4)])
def test_packed_records_in_a_sample_order_resume_exactly_on_another_world_size(before, after):
    samples = _packed(70, 8)  # 9 samples, the last holds 6

    def order(epoch: int) -> list[int]:  # a per-epoch order of the samples
        return sorted(range(len(samples)), key=lambda s: (s * 7 + epoch * 3) % len(samples))

    records = UnpackedRecords(samples, 8, list, total=70)
    settings = {"order": records.expand(order), "shuffle_window": 16, "seed": 1}
    uninterrupted = _run(records, 1, 18, **settings)  # 144 records: two epochs and a bit
    for epoch in range(2):
        assert sorted(uninterrupted[epoch * 70 : (epoch + 1) * 70]) == list(range(70))
    head = _run(records, before, 6, **settings)
    state = _stream(records, before, 0, **settings).state_after(6)
    assert state["cursor"] == 48  # records, not samples: the resume lands inside a sample
    assert head + _run(records, after, 12, state, **settings) == uninterrupted
