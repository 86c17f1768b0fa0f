"""Data that resumes exactly or says it does not: the loop's one line about shuffling
DataLoaders, a DataLoader whose iteration leaves the global RNG alone, the elastic stream as a
DataLoader batch_sampler, per-sample generators and the lanes of an elastic epoch."""

from __future__ import annotations

import itertools

import pytest
import torch
from koochak.loop.batch import cycle
from koochak.loop.elastic import (
    ElasticBatches,
    SampleKey,
    elastic_sampler,
    find_elastic,
    lane_offset,
)
from koochak.loop.resumable import keep_rng_on_iter, resume_note
from koochak.loop.seed import sample_generator
from torch.utils.data import DataLoader, DistributedSampler

DATA = list(range(12))


@pytest.mark.parametrize(
    "make",
    [
        lambda: DataLoader(DATA, batch_size=3, shuffle=True),
        lambda: DataLoader(DATA, sampler=DistributedSampler(DATA, num_replicas=2, rank=0)),
        lambda: itertools.cycle(DataLoader(DATA, batch_size=3, shuffle=True)),
        lambda: itertools.cycle(DataLoader(DATA, batch_size=3)),
        lambda: cycle(DataLoader(DATA, batch_size=3, shuffle=True)),
    ],
    ids=["shuffle", "distributed", "itertools-cycle", "itertools-cycle-sequential", "cycle"],
)
def test_a_dataloader_that_resumes_on_other_batches_is_named(make):
    note = resume_note(make())
    assert note is not None and "other batches" in note and "ElasticBatches" in note


@pytest.mark.parametrize(
    "make",
    [
        lambda: DataLoader(DATA, batch_size=3),
        lambda: DataLoader(ElasticBatches(DATA, global_batch=3), batch_size=None),
        lambda: DataLoader(DATA, batch_sampler=elastic_sampler(len(DATA), global_batch=3)),
        lambda: iter(DATA),
        lambda: itertools.cycle(DATA),
    ],
    ids=["sequential", "elastic", "elastic-sampler", "iterator", "cycle-of-a-list"],
)
def test_data_that_is_not_known_to_reshuffle_gets_no_note(make):
    assert resume_note(make()) is None


def test_the_loop_prints_the_note_once_at_start(tmp_path, capsys):
    from koochak.loop import training_loop

    data = [torch.tensor([float(i)]) for i in range(8)]
    training_loop(
        model=torch.nn.Linear(1, 1),
        dataset=cycle(DataLoader(data, batch_size=2, shuffle=True)),
        step_fn=lambda model, batch, ctx: {"loss": model(batch).pow(2).mean()},
        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        train_cfg={
            "max_steps": 6,
            "device": "cpu",
            "out_dir": str(tmp_path),
            "progress_bar": False,
            "log_every": 100,
        },
    )
    out = capsys.readouterr().out
    assert out.count("koochak: the dataset is a cycle over a shuffling DataLoader") == 1


def test_starting_a_dataloader_leaves_the_global_rng_alone():
    loader = DataLoader(DATA, batch_size=3)
    torch.manual_seed(5)
    untouched = torch.rand(1)
    torch.manual_seed(5)
    iter(loader)
    assert not torch.equal(torch.rand(1), untouched)  # a plain iter draws the base seed
    torch.manual_seed(5)
    iter(keep_rng_on_iter(loader))
    assert torch.equal(torch.rand(1), untouched)


def test_the_elastic_sampler_feeds_workers_the_stream_and_the_loop_keeps_its_cursor(tmp_path):
    from koochak.loop import training_loop
    from koochak.loop.checkpoint import resolve_auto_resume

    values = torch.arange(20, dtype=torch.float32).unsqueeze(1)
    sampler = elastic_sampler(20, global_batch=4, seed=3)
    loader = DataLoader(values, batch_sampler=sampler, num_workers=2)
    assert find_elastic(loader) is sampler
    expected = list(itertools.islice(iter(elastic_sampler(20, global_batch=4, seed=3)), 7))
    assert [b.squeeze(1).int().tolist() for b in itertools.islice(iter(loader), 7)] == expected

    seen: list[int] = []

    def step_fn(model, batch, ctx):
        seen.extend(batch.squeeze(1).int().tolist())
        return {"loss": model(batch).pow(2).mean()}

    def run(max_steps):
        training_loop(
            model=torch.nn.Linear(1, 1),
            dataset=DataLoader(values, batch_sampler=elastic_sampler(20, global_batch=4, seed=3)),
            step_fn=step_fn,
            optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
            train_cfg={
                "max_steps": max_steps,
                "device": "cpu",
                "out_dir": str(tmp_path),
                "progress_bar": False,
                "log_every": 100,
            },
            resume="auto",
        )

    run(3)
    run(7)
    assert resolve_auto_resume(tmp_path).checkpoint["data"]["cursor"] == 28
    assert seen == sum(expected, [])


def test_keys_name_each_record_and_its_epoch_whatever_the_rank():
    def keys(world):
        parts = [list(itertools.islice(iter(ElasticBatches(
            DATA, global_batch=4, collate=list, keys=True, rank=r, world_size=world)), 5))
            for r in range(world)]  # fmt: skip
        return [pair for step in zip(*parts) for part in step for pair in part]

    one = keys(1)
    assert one == keys(2) == keys(4)
    assert [key.epoch for key, _ in one] == [0] * 12 + [1] * 8
    assert all(isinstance(key, SampleKey) and key.index == record for key, record in one)
    assert sorted(key.index for key, _ in one[:12]) == DATA


def test_a_sample_generator_depends_on_seed_epoch_and_sample_only():
    def draw(*args):
        return torch.rand(4, generator=sample_generator(*args))

    torch.manual_seed(0)
    first = draw(1, 2, 3)
    torch.manual_seed(99)  # the global RNG plays no part
    assert torch.equal(draw(1, 2, 3), first)
    others = [draw(2, 2, 3), draw(1, 3, 3), draw(1, 2, 4)]
    assert not any(torch.equal(first, other) for other in others)
    with pytest.raises(ValueError, match="sample_generator: epoch must be an int >= 0, got -1"):
        sample_generator(1, -1, 3)


@pytest.mark.parametrize("size", [1, 5, 37, 100, 257])
@pytest.mark.parametrize(("lanes", "batch"), [(1, 4), (2, 6), (4, 8), (8, 64)])
def test_lanes_are_a_bijection_of_the_epoch_and_one_lane_changes_nothing(size, lanes, batch):
    for phase in {0, 1, batch // 2, batch - 1}:
        placed = [lane_offset(o, size, lanes, batch, phase) for o in range(size)]
        assert sorted(placed) == list(range(size))
        if lanes == 1:
            assert placed == list(range(size))


def test_each_rank_walks_its_own_lanes():
    data = ElasticBatches(list(range(64)), global_batch=8, shuffle=False, collate=list,
                          lanes=4, rank=1, world_size=2)  # fmt: skip
    got = sorted(sum(itertools.islice(iter(data), 8), []))
    assert got == list(range(32, 64))  # lanes 2 and 3: the epoch's second half
    with pytest.raises(ValueError, match="lanes=3 does not divide global_batch=8"):
        ElasticBatches(list(range(64)), global_batch=8, lanes=3)


@pytest.mark.parametrize(("size", "world"), [(1000, 4), (997, 2), (1003, 4), (1003, 2)])
def test_every_epoch_of_an_uneven_size_keeps_each_rank_on_its_own_lanes(size, world):
    """Epochs that do not start a global batch still deal each rank its lanes (the layout
    follows the batch slots), with each record once per epoch."""
    batch, lanes = 24, 4
    data = ElasticBatches(list(range(size)), global_batch=batch, shuffle=False, lanes=lanes)
    local, share = batch // world, size / world
    for epoch in range(4):
        positions = range(epoch * size, (epoch + 1) * size)
        placed = [data.record_at(p) for p in positions]
        assert sorted(placed) == list(range(size))
        owner = [(p % batch) // local for p in positions]
        strays = [
            (o, r) for o, r in zip(owner, placed) if not -batch <= r - o * share < share + batch
        ]
        assert strays == [], epoch


def test_a_laned_stream_refuses_another_global_batch():
    saved = ElasticBatches(DATA, global_batch=4, lanes=2).state_after(2)
    with pytest.raises(ValueError, match="field 'data.global_batch' is 4 but this stream has 8"):
        ElasticBatches(DATA, global_batch=8, lanes=2).load_state(saved)
