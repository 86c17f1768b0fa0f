"""The one retention rule (``checkpoint.retention``), as a pure function of names."""

from __future__ import annotations

import pytest
from koochak.loop.checkpoint.retention import BestCheckpoints, judge, to_drop


def names(*steps: int) -> list[str]:
    return [f"step{s:09d}.pt" for s in steps]


NEWEST_FIRST = names(5, 4, 3, 2, 1)


def test_keep_last_k_drops_the_older_ones_newest_first():
    assert to_drop(NEWEST_FIRST, keep_last_k=2) == names(3, 2, 1)


def test_none_keeps_every_checkpoint():
    assert to_drop(NEWEST_FIRST, keep_last_k=None) == []


@pytest.mark.parametrize("keep", [0, 1])
def test_the_newest_committed_is_never_dropped(keep):
    assert names(5) not in [to_drop(NEWEST_FIRST, keep_last_k=keep)]
    assert "step000000005.pt" not in to_drop(NEWEST_FIRST, keep_last_k=keep, durable=set())
    assert "step000000005.pt" not in to_drop(
        NEWEST_FIRST, keep_last_k=keep, durable=set(), prune_unreplicated=True
    )


def test_the_best_and_what_is_being_copied_are_spared():
    verdict = judge(NEWEST_FIRST, keep_last_k=1, best=names(2), in_flight=names(3))
    assert verdict.drop == names(4, 1)
    assert verdict.held == []


def test_a_first_tier_holds_what_no_durable_tier_has_yet():
    verdict = judge(NEWEST_FIRST, keep_last_k=1, durable=set(names(4, 2)))
    assert verdict.drop == names(4, 2)
    assert verdict.held == names(3, 1)


def test_prune_unreplicated_drops_them_anyway_but_never_the_newest():
    verdict = judge(NEWEST_FIRST, keep_last_k=1, durable=set(), prune_unreplicated=True)
    assert verdict.drop == names(4, 3, 2, 1)
    assert verdict.held == []


def test_a_negative_keep_is_refused():
    with pytest.raises(ValueError, match="keep_last_k"):
        judge(NEWEST_FIRST, keep_last_k=-1)


def test_best_checkpoints_rank_by_the_metric_ties_to_the_newer_and_skip_missing():
    best = BestCheckpoints(2, "eval_loss", "min")
    for step, loss in ((1, 0.5), (2, 0.3), (3, 0.3), (4, float("nan")), (5, None)):
        best.note(names(step)[0], {"eval_loss": loss})
    assert best.best(None, names(5, 4, 3, 2, 1)) == set(names(3, 2))
    assert BestCheckpoints(1, "eval_loss", "max").best(None, []) == set()
    maximum = BestCheckpoints(1, "acc", "max")
    maximum.note(names(1)[0], {"acc": 0.1})
    maximum.note(names(2)[0], {"acc": 0.9})
    assert maximum.best(None, names(2, 1)) == set(names(2))
