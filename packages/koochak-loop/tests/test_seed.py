import random

import numpy as np
import pytest
import torch
from koochak.loop.seed import get_rng_state, make_worker_init_fn, set_all_seeds, set_rng_state
from torch.utils.data import DataLoader, Dataset


def _draw() -> tuple:
    return (
        random.random(),
        random.gauss(0.0, 1.0),
        float(np.random.rand()),
        float(np.random.randn()),
        torch.rand(3).tolist(),
    )


def test_set_all_seeds_makes_every_rng_repeat():
    set_all_seeds(123)
    first = _draw()
    set_all_seeds(123)
    assert _draw() == first
    set_all_seeds(124)
    assert _draw() != first


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "7", True])
def test_set_all_seeds_rejects_bad_seed(bad):
    with pytest.raises((TypeError, ValueError), match="seed"):
        set_all_seeds(bad)


def test_rng_state_round_trips_through_torch_save_weights_only(tmp_path):
    set_all_seeds(7)
    _draw()
    # A pending cached gaussian is part of both Python's and NumPy's state: capture one mid-pair.
    random.gauss(0.0, 1.0)
    np.random.randn()
    state = get_rng_state()
    expected = _draw()

    path = tmp_path / "rng.pt"
    torch.save({"rng": state}, path)
    loaded = torch.load(path, weights_only=True)["rng"]

    set_all_seeds(999)
    _draw()
    set_rng_state(loaded)
    assert _draw() == expected


def test_set_rng_state_rejects_unknown_version_and_keys():
    state = get_rng_state()
    with pytest.raises(ValueError, match="version"):
        set_rng_state({**state, "version": 99})
    with pytest.raises(ValueError, match="extra"):
        set_rng_state({**state, "extra": 1})
    with pytest.raises(ValueError, match="missing"):
        set_rng_state({k: v for k, v in state.items() if k != "numpy"})


class _Draws(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple:
        return index, random.random(), float(np.random.rand()), float(torch.rand(()))


def _worker_draws(seed: int, rank: int) -> list:
    torch.manual_seed(0)  # the DataLoader's base seed comes from the main-process RNG
    loader = DataLoader(
        _Draws(), batch_size=None, num_workers=2, worker_init_fn=make_worker_init_fn(seed, rank)
    )
    return sorted(loader, key=lambda item: item[0])


def test_worker_init_fn_is_deterministic_and_rank_aware():
    first = _worker_draws(5, rank=0)
    assert _worker_draws(5, rank=0) == first
    other_rank = _worker_draws(5, rank=1)
    assert [row[1:] for row in other_rank] != [row[1:] for row in first]
    # Python and NumPy draws differ between the two workers (no copied global state).
    assert first[0][1] != first[1][1]
    assert first[0][2] != first[1][2]


def test_the_rng_note_reads_right_when_ranks_go_down_and_up(caplog):
    import logging

    from koochak.loop.checkpoint.restore import restore_rng
    from koochak.loop.seed import get_rng_state, rng_world_note

    assert rng_world_note(2, 2) is None
    fewer = rng_world_note(4, 2)
    assert fewer.startswith("checkpoint was written by 4 rank(s), resuming on 2: ranks 0-1: saved "
                            "RNG stream continued; the saved RNG state of ranks 2-3 is not used")  # fmt: skip
    assert "no saved" not in fewer and "seeded" not in fewer
    more = rng_world_note(1, 3)
    assert "rank 0: saved RNG stream continued; ranks 1-2: no saved RNG state, seeded" in more
    # Through the restore: a 2-rank checkpoint resumed on this one process says rank 1's is unused.
    state = get_rng_state()
    with caplog.at_level(logging.WARNING, logger="koochak.loop.checkpoint"):
        restore_rng({"rng_per_rank": [state, state], "world_size": 2})
    (record,) = [r for r in caplog.records if "resuming on 1" in r.getMessage()]
    assert "the saved RNG state of rank 1 is not used" in record.getMessage()
