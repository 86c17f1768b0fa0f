"""HSDP for real: 4 gloo ranks on CPU play 2 nodes of 2 (``train.fsdp.hsdp``, ``shard_size: 2``;
``KOOCHAK_NODE_INDEX`` is ``rank // 2``), each parameter ``Replicate()`` over the nodes and
``Shard(0)`` within one.

- training under HSDP ends at the weights of 1-D FSDP on the same 4 ranks, and the logged
  (clipped-by) gradient norm is the unsharded one, not the replicated copies counted twice;
- the checkpoint holds each slab once: only the first node's ranks write tensor parts, the
  other node's ranks a fragment with their RNG state; the head says ``slab_writers: 2``;
- with every node's first tier gone, the durable tier resumes bit-identically on 4 ranks
  under HSDP, exactly on 2 ranks of 1-D FSDP, and a 1-D checkpoint resumes under HSDP.
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
from test_fsdp import _final, _ids, _launch, _seen  # noqa: E402

NAME = f"step{world.SAVE_AT:09d}.pt"


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp_hsdp")
    _launch(out, 4, ["save", "hsdp", "hsdpcut4", "hsdpfrom4"])
    _launch(out, 2, ["hsdpcut4"])
    return out


def _grad_norms(out: Path, name: str) -> list[float]:
    logs = _seen(out, name)[0]["logs"]
    return [entry["grad_norm"] for entry in logs if "grad_norm" in entry]


def test_hsdp_trains_like_1d_fsdp_and_clips_by_the_unsharded_norm(out):
    for rank_log in _seen(out, "hsdp4"):
        assert rank_log["code"] == 0, rank_log
    hsdp, flat = _grad_norms(out, "hsdp4"), _grad_norms(out, "save4")
    assert len(hsdp) == len(flat) == world.MAX_STEPS
    for a, b in zip(hsdp, flat):
        assert abs(a - b) <= 1e-5 * max(1.0, b), (hsdp, flat)
    final, flat_final = _final(out, "hsdp4"), _final(out, "save4")
    for key in flat_final["model"]:
        assert torch.allclose(final["model"][key], flat_final["model"][key], atol=1e-5), key


def test_each_slab_is_written_once_by_the_first_replicate_group(out):
    from koochak.loop.checkpoint.index_fragments import parse_head

    durable, flat = out / "hsdp4" / "durable", out / "save4"
    head = parse_head((durable / NAME).read_bytes(), NAME, NAME)
    assert head.writers == 4 and head.slab_writers == 2
    # writer 0's RNG state is the checkpoint's own (in the head); the others' their last part
    assert [ref.parts for ref in head.fragments] == [2, 2, 1, 1]
    for writer in (2, 3):  # the second node's ranks: a fragment and their RNG part, no slab
        fragment = json.loads((durable / f"{NAME}.part-{writer:05d}-index").read_text())
        assert fragment["rng"] == 0 and len(fragment["parts"]) == 1 and fragment["packed"] == 0
        assert [p.name for p in (out / "hsdp4" / "node1").glob(f"{NAME}.part-{writer:05d}-0*")
                ] == [f"{NAME}.part-{writer:05d}-00000"]  # fmt: skip

    def tensor_bytes(directory: Path) -> int:  # every part but the writers' RNG parts
        total = 0
        for index in directory.glob(f"{NAME}.part-*-index"):
            fragment = json.loads(index.read_text())
            rng = fragment.get("rng")
            total += sum(p["size"] for i, p in enumerate(fragment["parts"]) if i != rng)
        return total

    # the same state as 1-D FSDP's on 4 ranks, stored once (not once per node)
    assert tensor_bytes(durable) == tensor_bytes(flat)


def test_from_the_durable_tier_hsdp_resumes_bit_identically_on_4_ranks(out):
    assert json.loads((out / "hsdpcut4to4.restore.json").read_text())["problems"] == []
    uninterrupted, resumed = _final(out, "hsdp4"), _final(out, "hsdpcut4to4")
    for part in ("model", "ema"):
        assert world.diff(uninterrupted[part], resumed[part], part) == []
    assert world.diff(uninterrupted["optimizer"]["state"], resumed["optimizer"]["state"],
                      "opt") == []  # fmt: skip
    after = range(world.SAVE_AT + 1, world.MAX_STEPS)
    assert _ids(out, "hsdpcut4to4", 4, after) == _ids(out, "hsdp4", 4, after)


def test_each_rank_selects_the_parts_of_its_own_shard_group_position(out):
    # rank r of 2 x 2 holds the rows of writer r % 2, so beside writer 0's part of the tensors
    # held whole it reads writer r % 2's slab parts and no other; the 1-D guess (slab r of 4)
    # would read none on rank 2 (then writer 0's at load) and both writers' on rank 1
    whole = f"{NAME}.part-00000-00000"
    for r in range(4):
        selected = json.loads((out / f"hsdpcut4to4.selected.{r}.json").read_text())
        slabs = {int(key.split(".part-")[1][:5]) for key in selected if key != whole}
        assert whole in selected and slabs == {r % 2}, (r, selected)


def test_an_hsdp_checkpoint_resumes_exactly_on_2_ranks_of_1d_fsdp(out):
    assert json.loads((out / "hsdpcut4to2.restore.json").read_text())["problems"] == []
    before = _ids(out, "hsdp4", 4, range(world.SAVE_AT + 1))
    after = _ids(out, "hsdpcut4to2", 2, range(world.SAVE_AT + 1, world.MAX_STEPS))
    assert not set(before) & set(after)
    assert sorted({**before, **after}) == list(range(world.MAX_STEPS * 2 * world.GLOBAL_BATCH))


def test_a_1d_checkpoint_resumes_exactly_under_hsdp(out):
    assert json.loads((out / "hsdpfrom4to4.restore.json").read_text())["problems"] == []
    for rank_log in _seen(out, "hsdpfrom4to4"):
        assert rank_log["code"] == 0, rank_log
