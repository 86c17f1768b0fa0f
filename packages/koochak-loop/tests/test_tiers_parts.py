"""Tiered checkpoints in parts: every part and the index replicate, verified, committed last; the
replica prunes and replaces them, and resume over the tiers reads them back."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from koochak.loop.checkpoint import (
    build_checkpoint,
    checkpoint_objects,
    load,
    publish,
    resolve_auto_resume,
    save,
)
from koochak.loop.checkpoint.layouts import read_checkpoint
from koochak.loop.checkpoint.parts_index import (
    PART_INFIX,
    Extent,
    Part,
    PartsIndex,
    Shard,
    TensorEntry,
    encode_index,
    parse_index,
    part_key,
)
from koochak.loop.checkpoint.parts_tree import TENSOR_TAG, skeleton_bytes
from koochak.loop.checkpoint.tiers import checkpoint_copy_items, replicate_checkpoint
from koochak.loop.loop import training_loop
from koochak.storage import artifact
from koochak.storage.artifact import READY_SUFFIX, read_manifest
from koochak.storage.store import LocalStore


def _name(step):
    return f"step{step:09d}.pt"


def _ckpt(step, value=0.0):
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return build_checkpoint(step=step, next_step=step + 1, model=model)


def _parts(root, name):
    return sorted(n for n in os.listdir(root) if n.startswith(name + PART_INFIX))


def _committed(root):
    return sorted(p.name[: -len(READY_SUFFIX)] for p in root.glob(f"*{READY_SUFFIX}"))


class _Recording(LocalStore):
    """A LocalStore that records the keys it puts and deletes, in order."""

    def __init__(self, root, **kwargs):
        super().__init__(root, **kwargs)
        self.puts: list[str] = []
        self.deletes: list[str] = []

    def put(self, key, data, **expected):
        result = super().put(key, data, **expected)
        self.puts.append(key)
        return result

    def delete(self, key):
        self.deletes.append(key)
        return super().delete(key)


def test_a_checkpoint_in_parts_replicates_its_parts_then_its_index_then_the_manifest(tmp_path):
    first = LocalStore(tmp_path / "first")
    save(_ckpt(3, value=1.5), first, parts=3)
    name = _name(3)
    replica = _Recording(tmp_path / "replica")
    result = replicate_checkpoint(first, replica, name)
    objects = checkpoint_objects(first, name)  # issue 22's list: parts, index, manifest
    assert len(objects) == 5 and set(replica.puts) == set(objects)
    assert replica.puts[-2:] == [name, name + READY_SUFFIX]  # every part before the index
    assert checkpoint_objects(replica, name) == objects
    # The copy items are that list, less the manifest, each with the size and digest it must have.
    items = checkpoint_copy_items(first, name, read_manifest(first, name)[0])
    assert [item.key for item in items] == objects[:-1]
    assert all(item.sha256 and item.size for item in items)
    assert read_manifest(replica, name)[1] == read_manifest(first, name)[1]
    assert result.bytes_copied == sum(os.path.getsize(tmp_path / "first" / k) for k in objects)
    back = load(replica, name)
    assert all(bool((t == 1.5).all()) for t in back["model"].values())
    assert replicate_checkpoint(first, replica, name).bytes_copied == 0  # same commit: left alone


def test_a_damaged_part_is_refused_and_nothing_commits_in_the_replica(tmp_path):
    first = LocalStore(tmp_path / "first")
    save(_ckpt(2), first, parts=2)
    part = tmp_path / "first" / _parts(tmp_path / "first", _name(2))[1]
    os.chmod(part, 0o644)
    data = bytearray(part.read_bytes())
    data[0] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(ValueError):
        replicate_checkpoint(first, LocalStore(tmp_path / "replica"), _name(2))
    assert not (tmp_path / "replica" / (_name(2) + READY_SUFFIX)).exists()
    assert resolve_auto_resume(tmp_path / "replica") is None


def test_an_index_changed_since_its_commit_is_refused(tmp_path):
    first = LocalStore(tmp_path / "first")
    save(_ckpt(2), first, parts=2)
    index = tmp_path / "first" / _name(2)
    os.chmod(index, 0o644)
    index.write_bytes(index.read_bytes().replace(b'"writers":1', b'"writers":1 '))
    with pytest.raises(ValueError, match="does not match its ready manifest"):
        replicate_checkpoint(first, LocalStore(tmp_path / "replica"), _name(2))


def test_re_saving_a_step_in_parts_replaces_every_part_in_the_replica(tmp_path):
    first = LocalStore(tmp_path / "first")
    save(_ckpt(5, value=1.0), first, parts=3)
    replica = _Recording(tmp_path / "replica")
    replicate_checkpoint(first, replica, _name(5))
    assert len(_parts(tmp_path / "replica", _name(5))) == 3
    # A resumed run saves step 5 again, now in two parts (or in one file).
    save(_ckpt(5, value=2.0), first, parts=2)
    replica.deletes.clear()
    replicate_checkpoint(first, replica, _name(5))
    # The re-save rule: uncommit (manifest), then the index, then every old part; then replace.
    assert replica.deletes[:2] == [_name(5) + READY_SUFFIX, _name(5)]
    assert len(replica.deletes) == 2 + 3
    assert len(_parts(tmp_path / "replica", _name(5))) == 2
    assert read_manifest(replica, _name(5))[1] == read_manifest(first, _name(5))[1]
    assert all(bool((t == 2.0).all()) for t in load(replica, _name(5))["model"].values())
    save(_ckpt(5, value=3.0), first)  # back to one file: no part may stay behind
    replicate_checkpoint(first, replica, _name(5))
    assert _parts(tmp_path / "replica", _name(5)) == []
    assert all(bool((t == 3.0).all()) for t in load(replica, _name(5))["model"].values())


def test_leftover_parts_of_a_killed_copy_are_replaced(tmp_path):
    first = LocalStore(tmp_path / "first")
    save(_ckpt(4, value=1.0), first, parts=2)
    replica_root = tmp_path / "replica"
    replica_root.mkdir()
    for key in _parts(tmp_path / "first", _name(4)):  # half a copy, no index, no manifest
        (replica_root / key).write_bytes(b"half")
    (replica_root / f"{_name(4)}{PART_INFIX}00000-00007").write_bytes(b"from another layout")
    replicate_checkpoint(first, LocalStore(replica_root), _name(4))
    assert _parts(replica_root, _name(4)) == _parts(tmp_path / "first", _name(4))
    assert all(
        bool((t == 1.0).all()) for t in load(LocalStore(replica_root), _name(4))["model"].values()
    )


def test_a_damaged_part_in_the_first_tier_resumes_the_same_step_from_the_replica(tmp_path, caplog):
    first, replica = LocalStore(tmp_path / "first"), LocalStore(tmp_path / "replica")
    for step in (3, 5):
        save(_ckpt(step, value=step), first, parts=2)
        replicate_checkpoint(first, replica, _name(step))
    part = tmp_path / "first" / _parts(tmp_path / "first", _name(5))[0]
    os.chmod(part, 0o644)
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        path, ckpt = resolve_auto_resume([first, replica])
    assert ckpt["step"] == 5 and path == str(tmp_path / "replica" / _name(5))  # no step back
    assert all(bool((t == 5.0).all()) for t in ckpt["model"].values())


# ------------------------------------------------------------------ in the loop


def _batches(start: int, stop: int = 1000):
    for t in range(start, stop):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(t))
        yield x, x.sum(1, keepdim=True)


def _step(model, batch, ctx):
    x, y = batch
    return {"loss": torch.nn.functional.mse_loss(model(x), y)}


def _run(first, replicas, *, max_steps=6, train=None, start=0, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 1))
    train_cfg = {"max_steps": max_steps, "log_every": 100, "device": "cpu", "out_dir": str(first),
                 "ckpt_every": 1, "keep_last_k": None, "progress_bar": False,
                 "checkpoint_parts": 2, "checkpoint_replicas": replicas,
                 "checkpoint_replication_retry_s": 0}  # fmt: skip
    train_cfg.update(train or {})
    return training_loop(
        model=model, dataset=_batches(start), step_fn=_step,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05), train_cfg=train_cfg, **kwargs,
    )  # fmt: skip


def _objects_are_those_of_commits(root):
    committed = _committed(root)
    expected = sorted(key for name in committed for key in checkpoint_objects(root, name))
    present = sorted(p.name for p in root.iterdir() if p.name.startswith("step"))
    assert present == expected, root


@pytest.mark.parametrize("async_save", [False, True])
def test_a_run_in_parts_replicates_prunes_per_tier_and_resumes_from_the_replica(
    tmp_path, async_save
):
    first, durable = tmp_path / "node-local", tmp_path / "durable"
    straight = _run(tmp_path / "straight", [], max_steps=8, train={"checkpoint_parts": 1})
    _run(first, [{"location": str(durable), "keep_last_k": 3}], max_steps=4,
         train={"keep_last_k": 2, "checkpoint_async": async_save})  # fmt: skip
    # Saves: periodic 0, 1, 2, then the terminal 4 (after the last update, instead of a periodic).
    assert _committed(first) == [_name(2), _name(4)]
    assert _committed(durable) == [_name(1), _name(2), _name(4)]
    for root in (first, durable):
        _objects_are_those_of_commits(root)  # pruning removed every part of what it pruned
    for name in _committed(durable):
        assert len(_parts(durable, name)) == 2
        index = parse_index((durable / name).read_bytes(), name, name)
        assert [p.key for p in index.parts] == _parts(durable, name)
        assert (
            read_manifest(LocalStore(durable), name)[0].sha256
            == artifact.read_verified(LocalStore(durable), name)[0].sha256
        )
    shutil.rmtree(first)  # requeued onto another node: the node-local tier is gone
    resumed = _run(first, [{"location": str(durable), "keep_last_k": 3}], max_steps=8,
                   resume="auto", start=4, train={"ckpt_every": 0})  # fmt: skip
    assert torch.equal(straight["model"]["0.weight"], resumed["model"]["0.weight"])
    # The replica's checkpoint was pulled back into the first tier, parts and all.
    assert _name(4) in _committed(first) and len(_parts(first, _name(4))) == 2
    assert (
        read_manifest(LocalStore(first), _name(4))[1]
        == read_manifest(LocalStore(durable), _name(4))[1]
    )
    assert _name(8) in _committed(durable)
    _objects_are_those_of_commits(durable)


def _two_writers(tmp_path):
    """A committed checkpoint of two writers in ``tmp_path / "first"`` (the layout sharded
    saves write: each rank its own parts, one index names all); (store, name, parts, rows)."""
    first = LocalStore(tmp_path / "first")
    name = _name(7)
    rows = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    slabs = [rows[:4].numpy().tobytes(), rows[4:].numpy().tobytes()]
    parts = tuple(
        Part(
            part_key(name, writer, 0),
            writer,
            len(raw),
            first.put(part_key(name, writer, 0), raw).sha256,
        )
        for writer, raw in enumerate(slabs)
    )
    shards = (
        Shard((0, 0), (4, 4), (Extent(0, 0, len(slabs[0])),)),
        Shard((4, 0), (2, 4), (Extent(1, 0, len(slabs[1])),)),
    )
    tensors = (TensorEntry("float32", (6, 4), shards),)
    ckpt = build_checkpoint(step=7, next_step=8, model=torch.nn.Linear(4, 6, bias=False))
    skeleton = {**ckpt, "model": {"weight": (TENSOR_TAG, 0)}}
    index = PartsIndex(name, 2, parts, tensors, skeleton_bytes(skeleton))
    publish(first, name, encode_index(index))
    return first, name, parts, rows


def test_a_checkpoint_from_several_writers_replicates_without_special_cases(tmp_path):
    first, name, _, rows = _two_writers(tmp_path)
    replica = LocalStore(tmp_path / "replica")
    replicate_checkpoint(first, replica, name)
    assert checkpoint_objects(replica, name) == checkpoint_objects(first, name)
    assert _parts(tmp_path / "replica", name) == [part_key(name, 0, 0), part_key(name, 1, 0)]
    publication, data = artifact.read_verified(replica, name)
    back = read_checkpoint(replica, name, data, name)
    assert torch.equal(back["model"]["weight"], rows)
    assert torch.equal(load(replica, name)["model"]["weight"], rows)


class _Reads(LocalStore):
    """A LocalStore that records the keys it reads."""

    def __init__(self, root, **kwargs):
        super().__init__(root, **kwargs)
        self.reads: list[str] = []

    def get(self, key, start=None, end=None):
        self.reads.append(key)
        return super().get(key, start, end)

    def open(self, key):
        self.reads.append(key)
        return super().open(key)


def test_the_coordinator_commits_from_each_writers_receipt_never_reading_its_parts(tmp_path):
    from koochak.loop.checkpoint.part_receipt import put_receipt
    from koochak.loop.checkpoint.replication import FollowerReplicator, ReplicaTier

    first, name, parts, rows = _two_writers(tmp_path)
    replica = _Reads(tmp_path / "replica")
    with pytest.raises(TimeoutError, match="writer 1 \\(no receipt yet\\)"):
        replicate_checkpoint(first, replica, name, remote_writers={1}, wait_s=0.05)
    theirs = [(p.key, p.size, p.sha256) for p in parts if p.writer == 1]
    put_receipt(replica, name, 1, [(key, size, "0" * 64) for key, size, _ in theirs])
    with pytest.raises(TimeoutError, match="writer 1 \\(its receipt names other"):
        replicate_checkpoint(first, replica, name, remote_writers={1}, wait_s=0.05)
    assert _committed(tmp_path / "replica") == []
    # Writer 1 copies its own part, verified as it is written, and leaves its receipt.
    follower = FollowerReplicator(
        first, [ReplicaTier(1, replica, None)], rank=1, keep_last_k=None, prune=False
    )
    follower.submit(name, theirs)
    follower.settle()
    follower.close()
    replica.reads.clear()
    replicate_checkpoint(first, replica, name, remote_writers={1}, wait_s=5)
    assert _committed(tmp_path / "replica") == [name]
    assert part_key(name, 1, 0) not in replica.reads  # its receipt vouches for it
    assert torch.equal(load(replica, name)["model"]["weight"], rows)


@pytest.fixture
def one_rank_group(tmp_path):
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    yield
    torch.distributed.destroy_process_group()


def test_a_sharded_fsdp_checkpoint_replicates_and_reads_back_from_the_replica(
    one_rank_group, tmp_path
):
    from koochak.loop import fsdp
    from koochak.loop.checkpoint.layouts.sharded import save_sharded
    from koochak.loop.config import FsdpConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    fsdp.shard_model(model, FsdpConfig(shard_modules=["Linear"]), torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 5)).sum().backward()
    optimizer.step()
    ckpt = build_checkpoint(step=3, next_step=3, reason="terminal", model=model,
                            optimizer=optimizer)  # fmt: skip
    first, replica = LocalStore(tmp_path / "first"), LocalStore(tmp_path / "replica")
    save_sharded(first, _name(3), ckpt, parts=2)
    replicate_checkpoint(first, replica, _name(3))
    objects = checkpoint_objects(first, _name(3))
    assert len(objects) > 3  # several parts (unsharded tensors, then shards), index, manifest
    assert checkpoint_objects(replica, _name(3)) == objects
    assert read_manifest(replica, _name(3))[1] == read_manifest(first, _name(3))[1]
    back, original = load(replica, _name(3)), load(first, _name(3))
    assert back["model"].keys() == original["model"].keys()
    for key, value in original["model"].items():
        assert torch.equal(back["model"][key], value)
