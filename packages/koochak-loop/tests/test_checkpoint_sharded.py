"""Sharded (FSDP) checkpoints in process, on a gloo group of one rank: the index every rank's
parts make, slab reads, selection that verifies every part, and a failed load that says which
part. The multi-rank cases (2 and 4 writers, resharding) run in test_fsdp.py."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time

import pytest
import torch
from koochak.loop import fsdp
from koochak.loop.checkpoint import build_checkpoint, checkpoint_name, load
from koochak.loop.checkpoint.index_fragments import is_head, parse_head, read_index
from koochak.loop.checkpoint.layouts.sharded import ShardedLoadError, save_sharded
from koochak.loop.checkpoint.resume import resume_checkpoint
from koochak.loop.checkpoint.sharded_read import Source, materialize, read_slabs
from koochak.loop.config import FsdpConfig
from koochak.storage.store import LocalStore
from torch import nn


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 7)

    def forward(self, x):
        return self.fc(x)


@pytest.fixture
def group(tmp_path):
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    yield
    torch.distributed.destroy_process_group()


def _sharded(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(Block(), nn.ReLU(), Block(), nn.BatchNorm1d(7))
    model[2].fc = nn.Linear(7, 7)
    fsdp.shard_model(model, FsdpConfig(shard_modules=["Block"]), torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    return model, opt


def _save(store, step, seed=0, reason="terminal"):
    model, opt = _sharded(seed)
    ckpt = build_checkpoint(step=step, next_step=step if reason != "periodic" else step + 1,
                            reason=reason, model=model, optimizer=opt)  # fmt: skip
    save_sharded(store, checkpoint_name(step), ckpt)
    return fsdp.full(ckpt)


def test_every_rank_writes_parts_and_the_index_says_where_every_shard_lies(group, tmp_path):
    store = LocalStore(str(tmp_path / "ckpt"))
    saved = _save(store, 5)
    name = checkpoint_name(5)
    assert is_head(store.get(name))  # version 2: a head naming each writer's fragment
    assert parse_head(store.get(name), name, name).fragments[0].key == f"{name}.part-00000-index"
    index = read_index(store, store.get(name), name, name)
    assert index.writers == 1
    assert [p.key for p in index.parts] == [f"{name}.part-00000-00000", f"{name}.part-00000-00001"]
    loaded = load(tmp_path / "ckpt" / name)  # one process reads it whole
    for key, value in saved["model"].items():
        assert torch.equal(loaded["model"][key], value), key
    doc = json.loads((tmp_path / "ckpt" / f"{name}.ready.json").read_text())
    assert doc["artifact_id"] == f"checkpoint/{name}"


def test_slab_reads_are_exact_rows_of_the_global_tensors(group, tmp_path):
    store = LocalStore(str(tmp_path))
    saved = _save(store, 1)
    name = checkpoint_name(1)
    source = Source(store, read_index(store, store.get(name), name, name), name)
    full = load(tmp_path / name)
    from koochak.loop.checkpoint.parts_tree import load_skeleton

    skeleton = load_skeleton(source.index.skeleton, name)
    number = skeleton["model"]["0.fc.weight"][1]
    for start, rows in ((0, 7), (0, 1), (3, 4), (6, 1), (2, 0)):
        (slab,) = read_slabs(source, [(number, start, rows)])
        assert torch.equal(slab, full["model"]["0.fc.weight"][start : start + rows])
    assert torch.equal(full["model"]["0.fc.weight"], saved["model"]["0.fc.weight"])


def test_a_checkpoint_with_a_damaged_part_is_passed_over_for_the_older_one(group, tmp_path, caplog):
    store = LocalStore(str(tmp_path))
    _save(store, 3, seed=1)
    _save(store, 6, seed=2)
    part = tmp_path / f"{checkpoint_name(6)}.part-00000-00001"
    data = bytearray(part.read_bytes())
    data[10] ^= 1
    part.chmod(0o644)
    part.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="koochak.loop.checkpoint"):
        found = resume_checkpoint("auto", tmp_path, sharded=True)
    assert found.path.endswith(checkpoint_name(3))
    assert f"part {part.name} has SHA256" in caplog.text


def test_the_chosen_checkpoint_loads_into_a_fresh_sharded_model(group, tmp_path):
    store = LocalStore(str(tmp_path))
    saved = _save(store, 4)
    found = resume_checkpoint("auto", tmp_path, sharded=True)
    model, opt = _sharded(seed=9)
    state = materialize(found.checkpoint, model, opt)
    model.load_state_dict(state["model"])
    for key, value in fsdp.full(model.state_dict()).items():
        assert torch.equal(value, saved["model"][key]), key


def test_selection_and_load_read_each_part_once(group, tmp_path, monkeypatch):
    store = LocalStore(str(tmp_path))
    saved = _save(store, 4)
    opened, stats, real_open, real_stat = [], [], LocalStore.open, LocalStore.stat
    monkeypatch.setattr(
        LocalStore, "open", lambda self, key: opened.append(key) or real_open(self, key)
    )
    monkeypatch.setattr(
        LocalStore, "stat", lambda self, key: stats.append(key) or real_stat(self, key)
    )
    found = resume_checkpoint("auto", tmp_path, sharded=True)
    model, opt = _sharded(seed=9)
    model.load_state_dict(materialize(found.checkpoint, model, opt)["model"])
    parts = [key for key in opened if ".part-" in key]
    assert sorted(parts) == sorted(set(parts)) and len(parts) == 2  # each read once, at selection
    assert not [key for key in stats if ".part-" in key]  # and none stat'ed
    for key, value in fsdp.full(model.state_dict()).items():
        assert torch.equal(value, saved["model"][key]), key


def test_a_part_gone_after_selection_is_restored_from_the_bytes_selection_verified(group, tmp_path):
    store = LocalStore(str(tmp_path))
    saved = _save(store, 4)
    found = resume_checkpoint("auto", tmp_path, sharded=True)
    gone = tmp_path / f"{checkpoint_name(4)}.part-00000-00001"
    gone.unlink()
    model, opt = _sharded(seed=9)
    model.load_state_dict(materialize(found.checkpoint, model, opt)["model"])
    for key, value in fsdp.full(model.state_dict()).items():
        assert torch.equal(value, saved["model"][key]), key
    # The verified bytes were handed over: a second load reads the store, and names the part.
    with pytest.raises(ShardedLoadError, match=f"rank 0: .*part {gone.name} is missing"):
        materialize(found.checkpoint, model, opt)


def test_a_failed_save_leaves_nothing_committed(group, tmp_path, monkeypatch):
    import koochak.loop.checkpoint.commit as commit

    store = LocalStore(str(tmp_path))
    monkeypatch.setattr(
        commit, "commit", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left"))
    )
    with pytest.raises(RuntimeError, match="step000000002.pt was not saved: OSError"):
        _save(store, 2)
    assert not list(tmp_path.glob("step*"))


class _Stalled:
    """A stream that delivers nothing until ``release`` is set (a hung mount)."""

    def __init__(self, release):
        self.release = release

    def readinto(self, buffer):
        self.release.wait()
        return 0

    def read(self, n=-1):
        self.release.wait()
        return b""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture
def stalled_part(monkeypatch):
    """Opening a key ending in ``.part-00000-00001`` gives a stream that stalls (0.2 s is late)."""
    import threading

    import koochak.loop.checkpoint.sharded_read as sharded_read

    release = threading.Event()
    stall = {"on": False}
    real_open = LocalStore.open

    def open_(self, key):
        if stall["on"] and key.endswith(".part-00000-00001"):
            return _Stalled(release)
        return real_open(self, key)

    monkeypatch.setattr(LocalStore, "open", open_)
    monkeypatch.setattr(sharded_read, "READ_STALL_SECONDS", 0.2)
    yield stall
    release.set()  # let the abandoned reader thread end


def test_a_stalled_part_fails_the_load_in_bounded_time_naming_it(group, tmp_path, stalled_part):
    store = LocalStore(str(tmp_path))
    _save(store, 4)
    found = resume_checkpoint("auto", tmp_path, sharded=True)
    model, opt = _sharded()
    materialize(found.checkpoint, model, opt)  # the selection's verified bytes, handed over
    stalled_part["on"] = True  # so this second load reads the part from the store
    part = f"{checkpoint_name(4)}.part-00000-00001"
    with pytest.raises(
        ShardedLoadError, match=f"rank 0: TimeoutError: .*part {part} made no progress"
    ):
        materialize(found.checkpoint, model, opt)


def test_a_stalled_part_fails_the_selection_instead_of_rolling_back(group, tmp_path, stalled_part):
    store = LocalStore(str(tmp_path))
    _save(store, 2)
    _save(store, 4)
    stalled_part["on"] = True
    part = f"{checkpoint_name(4)}.part-00000-00001"
    with pytest.raises(OSError, match=f"rank 0: TimeoutError: .*part {part} made no progress"):
        resume_checkpoint("auto", tmp_path, sharded=True)


def test_one_saver_class_answers_every_call_the_checkpointer_makes_in_every_layout(tmp_path):
    """Checkpointer drives one saver class whatever the layout or role: a rerun of a finished
    FSDP run reaches ``settle`` (its terminal checkpoint is already published), which must not
    be an AttributeError; no saver method is borrowed from another class."""
    import inspect

    from koochak.loop.checkpoint import saver as saver_module
    from koochak.loop.checkpoint.layouts import layout_for

    source = inspect.getsource(saver_module.Checkpointer)
    called = set(re.findall(r"self\.saver\.([a-z_]+)", source))
    assert called and called <= set(dir(saver_module.CheckpointSaver))
    assert not hasattr(saver_module, "ShardedSaver")
    for layout in (layout_for(sharded=True), layout_for(sharded=False, parts=2)):
        for role in ("coordinator", "follower"):
            saver = saver_module.CheckpointSaver(tmp_path, layout=layout, role=role)
            assert saver.settle(checkpoint_name(3), "terminal") is None
    follower = saver_module.CheckpointSaver(
        tmp_path, layout=layout_for(sharded=False), role="follower"
    )
    assert follower.save({"step": 3}) is None  # the whole layout: only the coordinator writes
    assert not any(tmp_path.iterdir())


def test_a_sharded_save_never_deletes_what_a_live_publisher_of_its_name_wrote(group, tmp_path):
    # The rule every layout keeps (issue 27, defect 1's class): rank 0 holds the name before it
    # clears anything under it, so another live publisher's parts survive and the save fails.
    from koochak.storage import artifact

    store = LocalStore(str(tmp_path))
    name = checkpoint_name(3)
    with artifact.claimed(store, name):  # a live publisher (this very process) holds the name
        store.put(f"{name}.part-00000-00000", b"the other publisher's bytes")
        with pytest.raises(RuntimeError, match=f"saving {name}: rank 0: FileExistsError"):
            _save(store, 3)
        assert store.get(f"{name}.part-00000-00000") == b"the other publisher's bytes"
    # It died without committing (its intent record stays, long past its deadline): the next
    # save takes the name over, and only then clears the leftover part under it.
    from koochak.storage import _publish_intent

    dead = dataclasses.replace(_publish_intent.ours(name), deadline=time.time() - 10 * 3600)
    store.put(name + _publish_intent.INTENT_SUFFIX, dead.to_bytes())
    _save(store, 3)
    assert artifact.read_manifest(store, name) is not None


def test_a_version_1_sharded_checkpoint_still_selects_and_loads(group, tmp_path, monkeypatch):
    import koochak.loop.checkpoint.layouts.sharded as sharded

    store = LocalStore(str(tmp_path))
    monkeypatch.setattr(sharded, "_regular", lambda leaves, world: None)  # the old writer
    saved = _save(store, 4)
    monkeypatch.undo()
    raw = store.get(checkpoint_name(4))
    assert json.loads(raw)["version"] == 1 and not is_head(raw)
    found = resume_checkpoint("auto", tmp_path, sharded=True)
    model, opt = _sharded(seed=9)
    model.load_state_dict(materialize(found.checkpoint, model, opt)["model"])
    for key, value in fsdp.full(model.state_dict()).items():
        assert torch.equal(value, saved["model"][key]), key
    assert torch.equal(load(tmp_path / checkpoint_name(4))["model"]["0.fc.weight"],
                       saved["model"]["0.fc.weight"])  # fmt: skip


def _four_writers(root):
    """A committed version-2 checkpoint of 4 writers, each holding 2 rows of one (8, 4) tensor
    and no tensor whole; (store, name, rows). Writer 0's part 0 is where a save keeps the
    tensors every rank restores whole, so every rank reads it."""
    from koochak.loop.checkpoint.index_fragments import (
        FragmentRef,
        encode_fragment,
        encode_head,
        fragment_key,
    )
    from koochak.loop.checkpoint.parts_index import part_key
    from koochak.loop.checkpoint.parts_tree import TENSOR_TAG, skeleton_bytes
    from koochak.loop.checkpoint.publication import publish

    store, name = LocalStore(str(root)), checkpoint_name(7)
    rows = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    refs = []
    for writer in range(4):
        raw = rows[2 * writer : 2 * writer + 2].numpy().tobytes()
        sha = store.put(part_key(name, writer, 0), raw).sha256
        fragment = encode_fragment(name, writer, [(part_key(name, writer, 0), len(raw), sha)],
                                   [], [(0, [(0, 0, len(raw))])])  # fmt: skip
        info = store.put(fragment_key(name, writer), fragment)
        refs.append(FragmentRef(fragment_key(name, writer), writer, len(fragment), info.sha256, 1))
    ckpt = build_checkpoint(step=7, next_step=8, model=torch.nn.Linear(4, 8, bias=False))
    skeleton = skeleton_bytes({**ckpt, "model": {"weight": (TENSOR_TAG, 0)}})
    publish(store, name, encode_head(name, 4, [("float32", (8, 4), "rows")], refs, skeleton))
    return store, name, rows


def test_a_rank_reads_the_head_and_only_the_fragments_and_parts_of_its_rows(tmp_path, monkeypatch):
    from koochak.loop.checkpoint.selection import open_candidate

    store, name, rows = _four_writers(tmp_path)
    opened, real_get, real_open = [], LocalStore.get, LocalStore.open
    monkeypatch.setattr(
        LocalStore, "get", lambda self, key, *a: opened.append(key) or real_get(self, key, *a)
    )
    monkeypatch.setattr(
        LocalStore, "open", lambda self, key: opened.append(key) or real_open(self, key)
    )
    _, ckpt = open_candidate(store, name, rank=1, world=2)  # rows 4..7: writers 2 and 3
    objects = {key.removeprefix(name) for key in opened if key.startswith(name + ".part")}
    assert objects == {".part-00000-index", ".part-00001-index", ".part-00002-index",
                       ".part-00003-index", ".part-00000-00000", ".part-00002-00000",
                       ".part-00003-00000"}  # fmt: skip
    assert ".part-00001-00000" not in objects  # its own fragment (its RNG state), not its part
    ref = ckpt["model"]["weight"]
    (slab,) = read_slabs(ref.source, [(ref.number, 4, 4)])
    assert torch.equal(slab, rows[4:])
    (whole,) = read_slabs(ref.source, [(ref.number, 0, 8)])  # beyond its fragments: all read
    assert torch.equal(whole, rows)
    assert load(store, name)["model"]["weight"].equal(rows)  # one process: every fragment


def _hsdp_writers(root, slabs_of_writer_3=()):
    """A committed version-2 checkpoint of HSDP on 2 x 2 ranks: writers 0 and 1 (the first
    replicate group) hold 4 rows each of one (8, 4) tensor, writers 2 and 3 a fragment and no
    part; the head says slab_writers 2. (store, name, rows)"""
    from koochak.loop.checkpoint.index_fragments import (
        FragmentRef,
        encode_fragment,
        encode_head,
        fragment_key,
    )
    from koochak.loop.checkpoint.parts_index import part_key
    from koochak.loop.checkpoint.parts_tree import TENSOR_TAG, skeleton_bytes
    from koochak.loop.checkpoint.publication import publish

    store, name = LocalStore(str(root)), checkpoint_name(7)
    rows = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    refs = []
    for writer in range(4):
        parts, slabs = [], list(slabs_of_writer_3) if writer == 3 else []
        if writer < 2:
            raw = rows[4 * writer : 4 * writer + 4].numpy().tobytes()
            sha = store.put(part_key(name, writer, 0), raw).sha256
            parts, slabs = [(part_key(name, writer, 0), len(raw), sha)], [(0, [(0, 0, len(raw))])]
        fragment = encode_fragment(name, writer, parts, [], slabs)
        info = store.put(fragment_key(name, writer), fragment)
        refs.append(FragmentRef(fragment_key(name, writer), writer, len(fragment), info.sha256,
                                len(parts)))  # fmt: skip
    ckpt = build_checkpoint(step=7, next_step=8, model=torch.nn.Linear(4, 8, bias=False))
    skeleton = skeleton_bytes({**ckpt, "model": {"weight": (TENSOR_TAG, 0)}})
    head = encode_head(name, 4, [("float32", (8, 4), "rows")], refs, skeleton, slab_writers=2)
    publish(store, name, head)
    return store, name, rows


def test_an_hsdp_head_splits_rows_over_its_slab_writers_only(tmp_path, monkeypatch):
    from koochak.loop.checkpoint.index_fragments import parse_head
    from koochak.loop.checkpoint.selection import open_candidate

    store, name, rows = _hsdp_writers(tmp_path)
    head = parse_head(store.get(name), name, name)
    assert (head.writers, head.slab_writers, head.row_writers) == (4, 2, 2)
    assert [ref.parts for ref in head.fragments] == [1, 1, 0, 0]
    assert load(store, name)["model"]["weight"].equal(rows)  # one process: every fragment
    opened, real_get, real_open = [], LocalStore.get, LocalStore.open
    monkeypatch.setattr(
        LocalStore, "get", lambda self, key, *a: opened.append(key) or real_get(self, key, *a)
    )
    monkeypatch.setattr(
        LocalStore, "open", lambda self, key: opened.append(key) or real_open(self, key)
    )
    # rank 3 of 2 x 2 holds the second half (shard position 1 of 2): writer 1's part
    _, ckpt = open_candidate(store, name, rank=3, world=4, shard_size=2)
    objects = {key.removeprefix(name) for key in opened if key.startswith(name + ".part")}
    assert objects == {".part-00000-index", ".part-00001-index", ".part-00003-index",
                       ".part-00000-00000", ".part-00001-00000"}  # fmt: skip
    ref = ckpt["model"]["weight"]
    (slab,) = read_slabs(ref.source, [(ref.number, 4, 4)])
    assert torch.equal(slab, rows[4:])


def test_an_hsdp_head_or_fragment_that_breaks_the_split_is_refused_naming_the_field(tmp_path):
    from koochak.loop.checkpoint.index_fragments import encode_head, parse_head
    from koochak.storage.artifact import InvalidArtifact

    store, name, _ = _hsdp_writers(tmp_path / "a", slabs_of_writer_3=[(0, [])])
    with pytest.raises(InvalidArtifact, match=r"00003-index: slabs\[0\]: writer 3 holds no rows"):
        load(store, name)
    head = parse_head(store.get(name), name, name)
    with pytest.raises(ValueError, match="field 'slab_writers' must be an int in 1..writers"):
        encode_head(name, 4, head.tensors, head.fragments, head.skeleton, slab_writers=5)


def test_a_sharded_checkpoint_is_not_pulled_back_even_by_one_process(tmp_path):
    # Resumed on one process from the replica, a sharded checkpoint is not copied back into
    # the first tier (a second S on top of the resume's S): the next save lands there.
    from koochak.loop.checkpoint.replication import ReplicaTier, Replicator

    replica, name, _ = _hsdp_writers(tmp_path / "replica")
    first = LocalStore(str(tmp_path / "first"))
    replicator = Replicator(first, [ReplicaTier(1, replica, None)], first_keep_last_k=None,
                            pull=name)  # fmt: skip
    replicator.before_publish(name + ".next")  # once the pull-back, if any, is done
    replicator.close()
    assert not (tmp_path / "first").exists() or not list((tmp_path / "first").iterdir())


def _two_writers(root, fragment_of):
    """A committed version-2 checkpoint of 2 writers, each holding 4 rows of one (8, 4)
    tensor in its part 0, writer 1 also an RNG state; ``fragment_of(writer, parts, rng)``
    returns the fragment bytes (``parts``: (key, size, sha256); ``rng``: writer 1's RNG state as
    ``torch.save`` bytes, and its part already put as part 1). (store, name, rows, state)"""
    import hashlib

    from koochak.loop.checkpoint.index_fragments import FragmentRef, encode_head, fragment_key
    from koochak.loop.checkpoint.parts_index import part_key
    from koochak.loop.checkpoint.parts_tree import TENSOR_TAG, skeleton_bytes
    from koochak.loop.checkpoint.publication import publish
    from koochak.loop.seed import get_rng_state

    store, name = LocalStore(str(root)), checkpoint_name(7)
    rows = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    state = get_rng_state()
    rng = skeleton_bytes(state)
    refs = []
    for writer in range(2):
        raw = rows[4 * writer : 4 * writer + 4].numpy().tobytes()
        parts = [
            (part_key(name, writer, 0), len(raw), store.put(part_key(name, writer, 0), raw).sha256)
        ]
        if writer == 1:
            store.put(part_key(name, 1, 1), rng)
        fragment = fragment_of(writer, parts, rng if writer == 1 else None)
        info = store.put(fragment_key(name, writer), fragment)
        count = len(json.loads(fragment)["parts"])
        refs.append(FragmentRef(fragment_key(name, writer), writer, len(fragment),
                                hashlib.sha256(fragment).hexdigest() or info.sha256, count))  # fmt: skip
    ckpt = build_checkpoint(step=7, next_step=8, model=nn.Linear(4, 8, bias=False), world_size=2)
    skeleton = skeleton_bytes({**ckpt, "model": {"weight": (TENSOR_TAG, 0)}})
    publish(store, name, encode_head(name, 2, [("float32", (8, 4), "rows")], refs, skeleton))
    return store, name, rows, state


def test_a_version_1_fragment_with_its_rng_state_in_base64_still_resumes(tmp_path):
    import base64

    from koochak.loop.checkpoint.selection import open_candidate

    def v1(writer, parts, rng):
        doc = {"format": "koochak-checkpoint-fragment", "version": 1, "name": checkpoint_name(7),
               "writer": writer, "parts": [{"key": k, "size": n, "sha256": s} for k, n, s in parts],
               "whole": [], "slabs": [{"tensor": 0, "extents": [{"part": 0, "offset": 0,
                                                                 "length": parts[0][1]}]}]}  # fmt: skip
        if rng is not None:
            doc["rng"] = base64.b64encode(rng).decode()
        return json.dumps(doc).encode()

    store, name, rows, state = _two_writers(tmp_path, v1)
    loaded = load(store, name)
    assert loaded["model"]["weight"].equal(rows)
    assert torch.equal(loaded["rng_per_rank"][1]["torch"], state["torch"])
    _, ckpt = open_candidate(store, name, rank=1, world=2)
    assert ckpt["rng_per_rank"][1]["python"] == state["python"]


def test_a_version_2_fragment_finds_packed_slabs_and_reads_its_rng_part(tmp_path):
    from koochak.loop.checkpoint.index_fragments import encode_fragment

    def v2(writer, parts, rng):
        if rng is not None:
            parts = [*parts, (f"{checkpoint_name(7)}.part-00001-00001", len(rng), _sha(rng))]
        raw = encode_fragment(checkpoint_name(7), writer, parts, [],
                              [(0, [(0, 0, parts[0][1])])], 1 if rng else None)  # fmt: skip
        doc = json.loads(raw)
        assert doc["packed"] == 0 and "slabs" not in doc and doc.get("rng") == (1 if rng else None)
        return raw

    store, name, rows, state = _two_writers(tmp_path, v2)
    loaded = load(store, name)
    assert loaded["model"]["weight"].equal(rows)
    assert torch.equal(loaded["rng_per_rank"][1]["numpy"]["key"], state["numpy"]["key"])


def _sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda doc: doc.update(version=3),
            r"00001-index: version=3; this Koochak reads version 1, 2",
        ),
        (
            lambda doc: doc.update(packed=2),
            r"00001-index: field 'packed' must be a part number in 0..1",
        ),
        (
            lambda doc: doc.update(rng=0),
            r"00001-index: field 'rng' must be the number of its last part",
        ),
        (
            lambda doc: doc.update(slabs=[]),
            r"00001-index: exactly one of fields 'packed' and 'slabs'",
        ),
        (
            lambda doc: doc["parts"][0].update(size=doc["parts"][0]["size"] + 4),
            r"00001-index: its parts from 0 on hold more bytes than its rows",
        ),
        (lambda doc: doc.update(extra=1), r"00001-index.*extra"),
    ],
)
def test_a_version_2_fragment_that_does_not_hold_is_refused_naming_the_field(
    tmp_path, change, message
):
    from koochak.loop.checkpoint.index_fragments import encode_fragment
    from koochak.storage.artifact import InvalidArtifact

    def damaged(writer, parts, rng):
        if rng is not None:
            parts = [*parts, (f"{checkpoint_name(7)}.part-00001-00001", len(rng), _sha(rng))]
        doc = json.loads(encode_fragment(checkpoint_name(7), writer, parts, [],
                                         [(0, [(0, 0, parts[0][1])])], 1 if rng else None))  # fmt: skip
        if writer == 1:
            change(doc)
        return json.dumps(doc).encode()

    store, name, _, _ = _two_writers(tmp_path, damaged)
    with pytest.raises(InvalidArtifact, match=message):
        load(store, name)
