import pytest
from koochak.loop.sharding import shard_dataset, shard_iterable_dataset, shard_map_dataset
from torch.utils.data import DataLoader, IterableDataset


class _Stream(IterableDataset):
    """A re-iterable stream with no length, like a reader over shard files."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def test_map_shards_are_disjoint_and_cover_everything():
    data = list(range(10))
    shards = [list(shard_map_dataset(data, rank, 3)) for rank in range(3)]
    assert shards == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]


def test_map_drop_remainder_gives_equal_lengths():
    shards = [shard_map_dataset(list(range(10)), rank, 3, drop_remainder=True) for rank in range(3)]
    assert [len(s) for s in shards] == [3, 3, 3]


def test_iterable_sharding_with_real_dataloader_workers_sees_every_item_once():
    world_size, n = 2, 101
    seen = []
    for rank in range(world_size):
        sharded = shard_dataset(_Stream(n), rank, world_size, mode="iterable")
        loader = DataLoader(sharded, batch_size=None, num_workers=2)
        seen.extend(int(x) for x in loader)
    assert sorted(seen) == list(range(n))


def test_iterable_sharding_without_workers_and_for_plain_lists():
    assert list(shard_iterable_dataset([10, 11, 12, 13, 14], 1, 2)) == [11, 13]


def test_map_mode_works_with_a_real_dataloader():
    sharded = shard_dataset(list(range(7)), 1, 2, mode="map")
    loader = DataLoader(sharded, batch_size=2, num_workers=0)
    assert [b.tolist() for b in loader] == [[1, 3], [5]]


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        ((list(range(3)), 2, 2), {}, ValueError, "rank must be in"),
        ((list(range(3)), 0, 0), {}, ValueError, "world_size must be >= 1"),
        ((list(range(3)), 0, 1), {"mode": "random"}, ValueError, "mode must be one of"),
        ((_Stream(3), 0, 1), {"mode": "map"}, TypeError, "use mode='iterable'"),
        ((list(range(3)), 0, 1), {"mode": "iterable", "drop_remainder": True}, TypeError, "no options"),
    ],
)
def test_bad_arguments_are_named(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        shard_dataset(*args, **kwargs)
