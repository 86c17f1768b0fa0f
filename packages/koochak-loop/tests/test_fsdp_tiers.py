"""FSDP on checkpoint tiers, for real: 2 gloo ranks on CPU play 2 nodes (``KOOCHAK_NODE_INDEX``
is the rank), the first tier is node-local (``train.checkpoint_dir: .../node{node}``) and a
directory every rank reaches is the durable tier behind it.

- each node's directory holds its own ranks' parts, the coordinator's also the index and the
  manifest; the durable tier holds every committed checkpoint whole, committed there only
  once every rank's parts were verified;
- a first tier every rank shares (async saves) replicates each sharded checkpoint whole;
- with every first-tier directory gone, the checkpoint resumes from the durable tier on 2
  ranks (bit-identical to the uninterrupted run) and on 1 process (every sample exactly once,
  the same weights to float tolerance).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import fsdp_world as world  # noqa: E402
from test_fsdp import _final, _ids, _launch  # noqa: E402


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp_tiers")
    _launch(out, 2, ["tiers", "tierscut2", "tiersshared"])
    _launch(out, 1, ["tierscut2"])
    return out


def _manifests(directory: Path) -> list[str]:
    return sorted(p.name[: -len(".ready.json")] for p in directory.glob("*.ready.json"))


def test_both_tiers_hold_every_committed_checkpoint_each_node_its_own_parts(out):
    from koochak.loop.checkpoint import checkpoint_name
    from koochak.loop.checkpoint.publication import checkpoint_objects

    run = out / "tiers2"
    steps = [checkpoint_name(world.SAVE_AT), checkpoint_name(world.MAX_STEPS)]
    assert _manifests(run / "node0") == steps
    assert _manifests(run / "durable") == steps
    assert not list((run / "node1").glob("*.ready.json"))  # the coordinator's node commits
    for name in steps:
        objects = checkpoint_objects(run / "durable", name)
        parts = [key for key in objects if ".part-" in key]
        assert {key.split(".part-")[1][:5] for key in parts} == {"00000", "00001"}
        for key in objects:  # whole in the durable tier
            assert (run / "durable" / key).is_file(), key
        # rank 1 copied its own parts into the durable tier and left its receipt there
        assert (run / "durable" / f"{name}.part-00001-receipt").is_file()
        for key in parts:  # each node holds its own ranks' parts, and no other's
            node = int(key.split(".part-")[1][:5])
            assert (run / f"node{node}" / key).is_file(), key
            assert not (run / f"node{1 - node}" / key).exists(), key
    for rank_log in (
        json.loads((out / "tiers2.seen.0.json").read_text()),
        json.loads((out / "tiers2.seen.1.json").read_text()),
    ):
        assert rank_log["code"] == 0, rank_log


def test_with_the_first_tier_gone_2_ranks_resume_from_the_durable_tier_bit_identically(out):
    uninterrupted, resumed = _final(out, "tiers2"), _final(out, "tierscut2to2")
    for part in ("model", "ema"):
        assert world.diff(uninterrupted[part], resumed[part], part) == []
    assert (
        world.diff(uninterrupted["optimizer"]["state"], resumed["optimizer"]["state"], "opt") == []
    )
    assert uninterrupted["data"] == resumed["data"]
    after = range(world.SAVE_AT + 1, world.MAX_STEPS)
    assert _ids(out, "tierscut2to2", 2, after) == _ids(out, "tiers2", 2, after)


def test_with_the_first_tier_gone_1_process_resumes_from_the_durable_tier(out):
    before = _ids(out, "tiers2", 2, range(world.SAVE_AT + 1))
    after = _ids(out, "tierscut2to1", 1, range(world.SAVE_AT + 1, world.MAX_STEPS))
    assert not set(before) & set(after)
    assert sorted({**before, **after}) == list(range(world.MAX_STEPS * 2 * world.GLOBAL_BATCH))
    final, resumed = _final(out, "tiers2")["model"], _final(out, "tierscut2to1")["model"]
    for key in final:
        assert torch.allclose(final[key], resumed[key], atol=1e-5, rtol=0), key


def test_a_shared_first_tier_replicates_async_sharded_saves_whole(out):
    from koochak.loop.checkpoint import checkpoint_name, load

    steps = [checkpoint_name(world.SAVE_AT), checkpoint_name(world.MAX_STEPS)]
    assert _manifests(out / "tiersshared2") == _manifests(out / "tiersshared2.d") == steps
    for name in steps:  # rank 1 replicated its own parts (a receipt), rank 0 none of them
        assert (out / "tiersshared2.d" / f"{name}.part-00001-receipt").is_file()
    durable = load(out / "tiersshared2.d" / steps[0])
    first = load(out / "tiersshared2" / steps[0])
    assert world.diff(first["model"], durable["model"], "model") == []
    assert world.diff(_final(out, "tiersshared2")["model"], _final(out, "tiers2")["model"],
                      "final") == []  # the same run whatever its tiers  # fmt: skip
