"""Elastic data: one global stream of records, cut into global batches, each rank's slice of
every global batch; the cursor in the checkpoint makes a resume on any world size exact."""

from __future__ import annotations

import itertools

import pytest
import torch
from koochak.loop.elastic import ElasticBatches, check_elastic_state, epoch_permutation


def _ids(batch) -> list[int]:
    return batch.tolist() if isinstance(batch, torch.Tensor) else list(batch)


def _take(data: ElasticBatches, n: int) -> list[list[int]]:
    return [_ids(b) for b in itertools.islice(iter(data), n)]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 100, 1000])
def test_epoch_permutation_is_a_bijection_that_changes_with_epoch_and_seed(size):
    orders = {
        (seed, epoch): [epoch_permutation(i, size, seed, epoch) for i in range(size)]
        for seed in (0, 1)
        for epoch in (0, 1)
    }
    for order in orders.values():
        assert sorted(order) == list(range(size))
    if size >= 64:
        assert len({tuple(o) for o in orders.values()}) == 4


def test_epoch_permutation_is_fixed_forever():
    # Integer arithmetic only: a resume on another machine or torch version meets the same order.
    # These are pinned: changing the function would silently reorder every saved run's data.
    assert [epoch_permutation(i, 8, 0, 0) for i in range(8)] == [1, 0, 3, 4, 6, 7, 5, 2]
    assert [epoch_permutation(i, 10, 3, 1) for i in range(10)] == [5, 0, 7, 2, 8, 3, 4, 1, 6, 9]


def test_ranks_take_their_slice_of_every_global_batch():
    records = list(range(20))
    whole = _take(ElasticBatches(records, global_batch=4, seed=1, collate=list), 8)
    for world in (2, 4):
        parts = [_take(ElasticBatches(records, global_batch=4, seed=1, collate=list,
                                      rank=r, world_size=world), 8) for r in range(world)]  # fmt: skip
        for step in range(8):
            assert sum((p[step] for p in parts), []) == whole[step]


def test_epochs_follow_each_other_and_each_holds_every_record_once():
    records = list(range(10))
    stream = sum(_take(ElasticBatches(records, global_batch=4, seed=5, collate=list), 10), [])
    assert len(stream) == 40
    for epoch in range(4):
        assert sorted(stream[epoch * 10 : (epoch + 1) * 10]) == records
    assert stream[:10] != stream[10:20]  # a new order every epoch


@pytest.mark.parametrize(("before", "after"), [(1, 2), (4, 1), (2, 4), (2, 2)])
def test_a_resume_on_another_world_size_continues_at_the_next_record(before, after):
    records = list(range(30))
    uninterrupted = sum(_take(ElasticBatches(records, global_batch=4, collate=list), 12), [])
    first = [ElasticBatches(records, global_batch=4, collate=list, rank=r, world_size=before)
             for r in range(before)]  # fmt: skip
    seen = [sum(zip(*(_take(d, 5) for d in first)), ()) for _ in [0]][0]
    state = first[0].state_after(5)
    assert state["cursor"] == 20
    second = []
    for r in range(after):
        data = ElasticBatches(records, global_batch=4, collate=list, rank=r, world_size=after)
        data.load_state(state)
        second.append(_take(data, 7))
    resumed = [x for step in zip(*second) for part in step for x in part]
    assert [x for part in seen for x in part] + resumed == uninterrupted


def test_a_changed_global_batch_still_consumes_each_record_once_and_warns():
    records = list(range(12))
    data = ElasticBatches(records, global_batch=4, collate=list, shuffle=False)
    head = sum(_take(data, 2), [])
    state = data.state_after(2)
    bigger = ElasticBatches(records, global_batch=6, collate=list, shuffle=False)
    with pytest.warns(UserWarning, match="global_batch=4 and resumes with 6"):
        bigger.load_state(state)
    assert head + sum(_take(bigger, 1), []) == list(range(12)) + [0, 1]  # next epoch follows


@pytest.mark.parametrize(("key", "value"), [("records", 13), ("seed", 9), ("order", "sequential")])
def test_a_cursor_from_another_stream_is_refused(key, value):
    data = ElasticBatches(list(range(12)), global_batch=4)
    state = {**data.state_after(1), key: value}
    with pytest.raises(ValueError, match=f"data.{key}"):
        data.load_state(state, "ckpt.pt")


@pytest.mark.parametrize(
    "state",
    [
        {"version": 2},
        {"version": True, "cursor": 0, "global_batch": 1, "records": 1, "seed": 0, "order": "x"},
        {"version": 1, "cursor": -1, "global_batch": 1, "records": 1, "seed": 0, "order": "x"},
        {
            "version": 1,
            "cursor": 0,
            "global_batch": 1,
            "records": 1,
            "seed": 0,
            "order": "x",
            "z": 1,
        },
        {"version": 1, "cursor": 0, "global_batch": 1.0, "records": 1, "seed": 0, "order": "x"},
    ],
)
def test_a_malformed_cursor_is_refused_naming_the_field(state):
    with pytest.raises(ValueError, match="ckpt.pt: field 'data"):
        check_elastic_state(state, "ckpt.pt")


def test_a_global_batch_that_does_not_split_over_the_ranks_is_refused():
    with pytest.raises(ValueError, match="global_batch=6 does not split evenly over 4 ranks"):
        next(iter(ElasticBatches(list(range(10)), global_batch=6, rank=0, world_size=4)))


def test_dataloader_workers_hand_back_the_batches_in_stream_order():
    records = [torch.tensor(i) for i in range(24)]
    data = ElasticBatches(records, global_batch=4, seed=2)
    loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=2)
    got = [b.tolist() for b in itertools.islice(iter(loader), 9)]
    assert got == _take(ElasticBatches(records, global_batch=4, seed=2), 9)


def test_a_custom_order_per_epoch():
    data = ElasticBatches(list(range(6)), global_batch=3, collate=list,
                          order=lambda epoch: list(range(6))[::-1] if epoch % 2 else list(range(6)))  # fmt: skip
    assert _take(data, 4) == [[0, 1, 2], [3, 4, 5], [5, 4, 3], [2, 1, 0]]


def test_the_loop_stores_the_cursor_and_resumes_from_it(tmp_path):
    from koochak.loop import training_loop
    from koochak.loop.checkpoint import resolve_auto_resume

    records = [{"id": i, "x": torch.tensor([float(i)])} for i in range(10)]
    seen: list[int] = []

    def step_fn(model, batch, ctx):
        seen.extend(batch["id"].tolist())
        return {"loss": model(batch["x"]).pow(2).mean()}

    def run(max_steps):
        model = torch.nn.Linear(1, 1)
        return training_loop(
            model=model, dataset=ElasticBatches(records, global_batch=3, seed=1),
            step_fn=step_fn, optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
            train_cfg={"max_steps": max_steps, "grad_accum": 2, "device": "cpu",
                       "out_dir": str(tmp_path), "progress_bar": False, "log_every": 100},
            resume="auto",
        )  # fmt: skip

    first = run(2)
    assert first["data"]["cursor"] == 2 * 2 * 3
    run(4)
    assert resolve_auto_resume(tmp_path).checkpoint["data"]["cursor"] == 24
    stream = ElasticBatches(records, global_batch=3, seed=1, collate=lambda r: [x["id"] for x in r])
    assert seen == sum(_take(stream, 8), [])
