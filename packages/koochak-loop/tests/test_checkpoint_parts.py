"""Checkpoint parts: the planner, the index, parallel writes and verified reads, damaged parts."""

from __future__ import annotations

import base64
import errno
import hashlib
import io
import json
import os
import pickle
import threading
from collections import OrderedDict

import pytest
import torch
from koochak.loop.checkpoint.layouts import layout_of
from koochak.loop.checkpoint.layouts.parts import PARTS
from koochak.loop.checkpoint.parts_index import (
    PARTS_FORMAT,
    Extent,
    Part,
    PartsIndex,
    Shard,
    TensorEntry,
    encode_index,
    object_keys,
    parse_index,
    part_key,
)
from koochak.loop.checkpoint.parts_io import delete_parts, host_tensor, read_parts, write_parts
from koochak.loop.checkpoint.parts_plan import plan_parts, resolve_parts
from koochak.loop.checkpoint.parts_tree import (
    TENSOR_TAG,
    join_tensors,
    load_skeleton,
    skeleton_bytes,
    split_tensors,
)
from koochak.storage.profile import REMOTE_PROFILE, StoreProfile
from koochak.storage.store import LocalStore, ObjectInfo
from koochak.storage.testing import Fault, FaultyStore, visible_files

NAME = "step000000007.pt"


# -- the planner ---------------------------------------------------------------------------


def _covered(plan, sizes):
    """Each tensor's extents add up to its size; each part is filled exactly, in order."""
    for extents, size in zip(plan.extents, sizes):
        assert sum(e.length for e in extents) == size
    cursor = [0] * len(plan.part_sizes)
    for extents in plan.extents:
        for e in extents:
            assert e.offset == cursor[e.part]
            cursor[e.part] += e.length
    assert cursor == list(plan.part_sizes)


@pytest.mark.parametrize(
    "sizes, parts",
    [([100] * 64, 4), ([1 << 20] * 4, 2), ([7, 1, 0, 13, 1000], 3), ([5], 4), ([64] * 3, 4)],
)
def test_plan_balances_parts_within_one_byte(sizes, parts):
    plan = plan_parts(sizes, parts)
    _covered(plan, sizes)
    assert len(plan.part_sizes) == min(parts, sum(sizes))
    assert max(plan.part_sizes) - min(plan.part_sizes) <= 1


def test_plan_splits_one_big_tensor_across_every_part():
    plan = plan_parts([10, 1000, 10], 4)
    assert [e.part for e in plan.extents[1]] == [0, 1, 2, 3]
    assert plan.part_sizes == (255, 255, 255, 255)


def test_plan_of_fewer_bytes_than_parts_and_of_nothing():
    assert plan_parts([2], 8).part_sizes == (1, 1)
    empty = plan_parts([0, 0], 4)
    assert empty.part_sizes == (0,) and empty.extents == ((), ())


@pytest.mark.parametrize("parts", [0, -1, True, 2.0, "two"])
def test_plan_refuses_a_bad_part_count(parts):
    with pytest.raises(ValueError, match="parts="):
        plan_parts([1], parts)


def test_resolve_parts_keeps_an_int_and_refuses_nonsense(tmp_path):
    store = LocalStore(tmp_path)
    assert resolve_parts(3, 10, store) == 3
    for bad in (0, "many", 1.5, None):
        with pytest.raises(ValueError, match="expected an int >= 1 .* or 'auto'"):
            resolve_parts(bad, 10, store)


def test_auto_parts_follow_cores_streams_and_size(tmp_path, monkeypatch):
    import koochak.loop.checkpoint.parts_plan as plan_module

    monkeypatch.setattr(plan_module, "_cores", lambda: 2)
    local = LocalStore(tmp_path)  # LOCAL_PROFILE: 8 fast streams, 64 MiB parts
    assert resolve_parts("auto", 1 << 30, local) == 2  # hashing-bound: one part per core
    assert resolve_parts("auto", 100 << 20, local) == 1  # two parts would be under 64 MiB
    remote = LocalStore(tmp_path, profile=REMOTE_PROFILE)  # 16 slow streams
    assert resolve_parts("auto", 1 << 30, remote) == 16
    assert resolve_parts("auto", 200 << 20, remote) == 3
    tiny = StoreProfile(0.0, 2e9, 4, False, 1 << 20, True)
    monkeypatch.setattr(plan_module, "_cores", lambda: 16)
    assert resolve_parts("auto", 1 << 30, LocalStore(tmp_path, profile=tiny)) == 4


# -- the tensor tree -----------------------------------------------------------------------


def test_split_and_join_keep_containers_metadata_and_tied_tensors():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    state = model.state_dict()
    tied = torch.arange(6.0)
    value = {"model": state, "pair": (tied, tied), "list": [1, "a", None], "n": 2.5}
    skeleton, tensors = split_tensors(value)
    assert len(tensors) == len(state) + 1  # the tied tensor is stored once
    back = join_tensors(load_skeleton(skeleton_bytes(skeleton), "x"), tensors, "x")
    assert isinstance(back["model"], OrderedDict)
    assert back["model"]._metadata == state._metadata
    assert back["pair"][0] is back["pair"][1]
    assert back["list"] == [1, "a", None] and back["n"] == 2.5


def test_split_refuses_what_parts_cannot_hold():
    with pytest.raises(ValueError, match="reserved for tensor references"):
        split_tensors({"x": (TENSOR_TAG, 0)})
    with pytest.raises(ValueError, match="meta tensor"):
        split_tensors({"x": torch.empty(2, device="meta")})
    with pytest.raises(ValueError, match="sparse"):
        split_tensors({"x": torch.eye(2).to_sparse()})


def test_join_refuses_references_the_index_cannot_back():
    with pytest.raises(ValueError, match="refers to tensor 3; the index has 1"):
        join_tensors({"a": (TENSOR_TAG, 3)}, [torch.zeros(1)], "ck")
    with pytest.raises(ValueError, match="lists tensor 1, which the skeleton never uses"):
        join_tensors({"a": (TENSOR_TAG, 0)}, [torch.zeros(1), torch.zeros(1)], "ck")


def test_a_skeleton_that_would_run_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with pytest.raises(ValueError, match="skeleton is not loadable weights-only"):
        load_skeleton(pickle.dumps(Evil(), protocol=2), "ck")
    assert not marker.exists()


# -- writing and reading -------------------------------------------------------------------


def _state():
    torch.manual_seed(0)
    return {
        "version": 1,
        "big": torch.randn(300, 257),
        "bf16": torch.randn(33, 7).to(torch.bfloat16),
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "strided": torch.arange(40, dtype=torch.int32).reshape(5, 8)[:, ::2],
        "nested": [{"w": torch.randn(1000)}, (torch.arange(3),)],
    }


def _write(store, state, parts, name=NAME, **kwargs):
    skeleton, tensors = split_tensors(state)
    index = write_parts(
        store, name, [host_tensor(t) for t in tensors], skeleton_bytes(skeleton), parts, **kwargs
    )
    raw = encode_index(index)
    store.put(name, raw)
    return raw


def _read(store, name=NAME, **kwargs):
    index = parse_index(store.get(name), f"{store.location}/{name}", name)
    tensors = read_parts(store, index, f"{store.location}/{name}", **kwargs)
    return join_tensors(load_skeleton(index.skeleton, name), tensors, name)


def _assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("publish", ["link", "exclusive"])
@pytest.mark.parametrize("parts", [1, 2, 4, 7])
def test_parts_round_trip_on_a_local_store(tmp_path, publish, parts):
    store = LocalStore(tmp_path, publish=publish)
    state = _state()
    raw = _write(store, state, parts)
    assert layout_of(raw) is PARTS  # an index, told from a file in one place
    _assert_same(state, _read(store))
    index = parse_index(raw, "x")
    assert len(index.parts) == parts
    assert visible_files(tmp_path) == sorted([NAME] + [p.key for p in index.parts])
    assert object_keys(index)[-2:] == [NAME, NAME + ".ready.json"]
    sizes = [p.size for p in index.parts]
    assert max(sizes) - min(sizes) <= 1


class DictStore:
    """A Store in memory whose put reports no digest and whose streams have no readinto."""

    def __init__(self) -> None:
        self.location = "mem://test"
        self.objects: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def get(self, key, start=None, end=None):
        return self.objects[key][start:end]

    def open(self, key):
        data = self.objects[key]

        class Stream(io.RawIOBase):
            def __init__(self):
                self.inner = io.BytesIO(data)

            def read(self, n=-1):
                return self.inner.read(n)

        return Stream()

    def put(self, key, data, *, expected_size=None, expected_sha256=None):
        chunks = [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)
        blob = b"".join(bytes(c) for c in chunks)
        if expected_size is not None and len(blob) != expected_size:
            raise ValueError("size")
        with self.lock:
            if key in self.objects:
                raise FileExistsError(key)
            self.objects[key] = blob
        return ObjectInfo(key=key, size=len(blob), mtime_ns=0, sha256=None)

    def stat(self, key):
        if key not in self.objects:
            raise FileNotFoundError(key)
        return ObjectInfo(key=key, size=len(self.objects[key]), mtime_ns=0)

    def list(self, prefix=""):
        return [self.stat(k) for k in sorted(self.objects) if k.startswith(prefix)]

    def delete(self, key):
        del self.objects[key]

    def local_path(self, key):
        return None


def test_parts_work_on_any_store_through_the_protocol_only():
    store = DictStore()
    state = _state()
    _write(store, state, 3)
    _assert_same(state, _read(store))
    assert delete_parts(store, NAME) == [part_key(NAME, 0, n) for n in range(3)]
    assert list(store.objects) == [NAME]


class BarrierStore(LocalStore):
    """A LocalStore whose puts and opens of parts wait until ``count`` of them run at once."""

    def __init__(self, root, count):
        super().__init__(root)
        self.barrier = threading.Barrier(count, timeout=20)

    def put(self, key, data, **kwargs):
        if ".part-" in key:
            self.barrier.wait()  # BrokenBarrierError if the parts were written one by one
        return super().put(key, data, **kwargs)

    def open(self, key):
        if ".part-" in key:
            self.barrier.wait()
        return super().open(key)


def test_parts_are_written_and_read_concurrently(tmp_path):
    store = BarrierStore(tmp_path, 4)
    state = _state()
    _write(store, state, 4)
    _assert_same(state, _read(store))


def test_a_part_that_fails_to_write_leaves_no_part_behind(tmp_path):
    store = FaultyStore(tmp_path, [Fault("write", nth=2, errno=errno.ENOSPC)], fsync=True)
    with pytest.raises(OSError, match="No space left"):
        _write(store, _state(), 3, workers=1)
    assert visible_files(tmp_path) == []


# -- damaged parts -------------------------------------------------------------------------


def _damage(tmp_path, how):
    store = LocalStore(tmp_path)
    _write(store, _state(), 3)
    victim = tmp_path / part_key(NAME, 0, 1)
    data = victim.read_bytes()
    if how == "missing":
        victim.unlink()
    elif how == "truncated":
        victim.write_bytes(data[:-1])
    elif how == "extended":
        victim.write_bytes(data + b"\0")
    elif how == "bit flipped":
        victim.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif how == "swapped":
        other = tmp_path / part_key(NAME, 0, 2)
        victim.write_bytes(other.read_bytes())
    elif how == "emptied":
        victim.write_bytes(b"")
    elif how == "replaced by a directory":
        victim.unlink()
        victim.mkdir()
    return store


@pytest.mark.parametrize(
    "how, message",
    [
        ("truncated", "part-00000-00001 has \\d+ bytes; the index says"),
        ("extended", "part-00000-00001 has \\d+ bytes; the index says"),
        ("bit flipped", "part-00000-00001 has SHA256 [0-9a-f]{64}; the index says"),
        ("swapped", "part-00000-00001 has (SHA256|\\d+ bytes)"),
        ("emptied", "part-00000-00001 has 0 bytes"),
    ],
)
def test_a_damaged_part_is_refused_naming_it(tmp_path, how, message):
    store = _damage(tmp_path, how)
    with pytest.raises(ValueError, match=message):
        _read(store)


@pytest.mark.parametrize("how", ["missing", "replaced by a directory"])
def test_a_missing_part_is_late_not_damaged(tmp_path, how):
    """The index names the part, so it existed: missing here is another client not seeing it
    yet (a mount), an error naming the index once read_settle_seconds pass, never "damaged"."""
    _damage(tmp_path, how)
    store = LocalStore(tmp_path, read_settle_seconds=0.2)
    with pytest.raises(FileNotFoundError, match=f"{NAME} names it") as missing:
        _read(store)
    assert not isinstance(missing.value, ValueError)
    assert missing.value.filename.endswith(part_key(NAME, 0, 1))


def test_a_part_that_shows_up_within_read_settle_seconds_is_read(tmp_path):
    import threading

    store = LocalStore(tmp_path, read_settle_seconds=30)
    state = _state()
    _write(store, state, 3)
    victim = tmp_path / part_key(NAME, 0, 1)
    data = victim.read_bytes()
    victim.unlink()
    later = threading.Timer(0.3, victim.write_bytes, args=(data,))
    later.start()
    try:
        _assert_same(_read(store), state)
    finally:
        later.join()


def test_a_part_that_changes_after_its_size_was_checked_is_refused(tmp_path):
    """Sizes are checked first; a part that then reads short or long still fails its read."""
    store = LocalStore(tmp_path)
    _write(store, _state(), 2)
    index = parse_index(store.get(NAME), "ck", NAME)
    victim = tmp_path / index.parts[0].key

    class Shrinking(LocalStore):
        def open(self, key):
            if key == index.parts[0].key:
                victim.write_bytes(victim.read_bytes()[:-10])
            return super().open(key)

    with pytest.raises(ValueError, match="ends after \\d+ bytes"):
        read_parts(Shrinking(tmp_path), index, "ck")


def test_an_eio_reading_a_part_propagates(tmp_path):
    good = LocalStore(tmp_path)
    _write(good, _state(), 2)
    store = FaultyStore(tmp_path, [Fault("read", nth=1, errno=errno.EIO, times=100)])

    class Unbuffered(FaultyStore):
        def open(self, key):  # reads through the faulty pread, like get()
            return io.BytesIO(self.inner.get(key))

    unbuffered = Unbuffered(tmp_path, store.faults)
    with pytest.raises(OSError) as caught:
        _read(unbuffered)
    assert not isinstance(caught.value, ValueError) and caught.value.errno == errno.EIO


# -- the index -----------------------------------------------------------------------------


def _doc(tmp_path):
    store = LocalStore(tmp_path)
    return json.loads(_write(store, _state(), 3))


def _encoded(doc):
    return json.dumps(doc).encode()


def test_index_bytes_are_deterministic_and_parse_back(tmp_path):
    raw = _write(LocalStore(tmp_path / "a"), _state(), 3)
    again = _write(LocalStore(tmp_path / "b"), _state(), 3)
    assert raw == again and raw.endswith(b"\n")
    doc = json.loads(raw)
    assert doc["format"] == PARTS_FORMAT and doc["version"] == 1 and doc["writers"] == 1


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(format="zip"), "field 'format'"),
        (lambda d: d.update(version=3), "version=3; this Koochak reads version 1"),
        (lambda d: d.update(version=2), "a version-2 index .a head naming per-writer fragments"),
        (lambda d: d.update(version=True), "must be the integer 1"),
        (lambda d: d.update(extra=1), "unknown field 'extra'"),
        (lambda d: d.pop("skeleton"), "missing field 'skeleton'"),
        (lambda d: d.update(name="step000000008.pt"), "was read as 'step000000007.pt'"),
        (lambda d: d.update(writers=0), "'writers' must be an int >= 1"),
        (lambda d: d.update(parts=[]), "'parts' must be a non-empty list"),
        (lambda d: d["parts"][1].update(key="other.bin"), "parts\\[1\\].key is 'other.bin'"),
        (lambda d: d["parts"][1].update(key=part_key(NAME, 0, 2)), "parts\\[1\\].key"),
        (lambda d: d["parts"][0].update(writer=1), "parts\\[0\\].writer is 1"),
        (lambda d: d["parts"][0].update(sha256="ABC"), "sha256 must be 64 lower-case hex"),
        (lambda d: d["parts"][0].update(size=-1), "size must be an int >= 0"),
        (lambda d: d["parts"][0].update(size=1.0), "size must be an int >= 0"),
        (lambda d: d["parts"][0].update(size=d["parts"][0]["size"] + 1), "cover \\d+ bytes"),
        (lambda d: d["parts"][0].update(extra=1), "unknown field 'extra'"),
        (lambda d: d["tensors"][0].update(dtype="object"), "dtype is 'object'"),
        (lambda d: d["tensors"][0].update(dtype="float64"), "extents hold \\d+ bytes"),
        (lambda d: d["tensors"][0].update(shape=[300, -1]), "shape\\[1\\] must be an int"),
        (lambda d: d["tensors"][0].update(shards=[]), "shards must be a non-empty list"),
        (lambda d: d["tensors"][0]["shards"][0].update(offsets=[1, 0]), "spans \\[1, 301\\)"),
        (lambda d: d["tensors"][0]["shards"][0].update(offsets=[0]), "need 2 entries"),
        (lambda d: d["tensors"][0]["shards"][0]["extents"][0].update(part=9), "lists 3 parts"),
        (lambda d: d["tensors"][0]["shards"][0]["extents"][0].update(length=0), "length must"),
        (lambda d: d["tensors"][0]["shards"][0]["extents"][0].update(offset=1), "overlap|gap"),
        (lambda d: d.update(skeleton="not base64!"), "'skeleton' is not valid base64"),
        (lambda d: d.update(skeleton=5), "'skeleton' must be a base64 string"),
    ],
)
def test_index_faults_are_refused_naming_the_field(tmp_path, edit, message):
    doc = _doc(tmp_path)
    edit(doc)
    with pytest.raises(ValueError, match=message):
        parse_index(_encoded(doc), "ck.pt", NAME)


def test_index_refuses_duplicate_fields_and_nan():
    with pytest.raises(ValueError, match="appears twice"):
        parse_index(b'{"format": 1, "format": 2}', "ck")
    with pytest.raises(ValueError, match="NaN is not valid JSON"):
        parse_index(b'{"format": NaN}', "ck")


def test_extents_that_overlap_inside_a_part_are_refused(tmp_path):
    doc = _doc(tmp_path)
    first = doc["tensors"][1]["shards"][0]["extents"][0]
    second = doc["tensors"][2]["shards"][0]["extents"][0]
    second["offset"] = first["offset"]  # two tensors claim the same bytes
    with pytest.raises(ValueError, match="overlap|gap"):
        parse_index(_encoded(doc), "ck")


# -- several writers and sharded tensors (the layout FSDP will write) -----------------------


def _put_raw(store, key, data):
    return Part(key, int(key[-11:-6]), len(data), store.put(key, data).sha256)


def test_an_index_from_two_writers_with_sharded_tensors_reads_back(tmp_path):
    store = LocalStore(tmp_path)
    rows = torch.arange(24, dtype=torch.float32).reshape(6, 4)  # dim-0 slabs, one per writer
    grid = torch.arange(16, dtype=torch.int64).reshape(4, 4)  # 2x2 boxes across two parts

    def raw(t):
        return t.contiguous().numpy().tobytes()

    w0 = raw(rows[:4]) + raw(grid[:2, :2]) + raw(grid[:2, 2:])
    w1 = raw(rows[4:]) + raw(grid[2:, :2]) + raw(grid[2:, 2:])
    parts = (_put_raw(store, part_key(NAME, 0, 0), w0), _put_raw(store, part_key(NAME, 1, 0), w1))
    r0, r1 = raw(rows[:4]), raw(rows[4:])
    q = len(raw(grid[:2, :2]))
    tensors = (
        TensorEntry(
            "float32",
            (6, 4),
            (
                Shard((4, 0), (2, 4), (Extent(1, 0, len(r1)),)),
                Shard((0, 0), (4, 4), (Extent(0, 0, len(r0)),)),
            ),
        ),
        TensorEntry(
            "int64",
            (4, 4),
            (
                Shard((0, 0), (2, 2), (Extent(0, len(r0), q),)),
                Shard((0, 2), (2, 2), (Extent(0, len(r0) + q, q),)),
                Shard((2, 0), (2, 2), (Extent(1, len(r1), q),)),
                Shard(
                    (2, 2),
                    (2, 2),
                    (Extent(1, len(r1) + q, q // 2), Extent(1, len(r1) + q + q // 2, q // 2)),
                ),
            ),
        ),
    )
    skeleton = skeleton_bytes({"rows": (TENSOR_TAG, 0), "grid": (TENSOR_TAG, 1)})
    index = PartsIndex(NAME, 2, parts, tensors, skeleton)
    store.put(NAME, encode_index(index))
    back = _read(store)
    assert torch.equal(back["rows"], rows) and torch.equal(back["grid"], grid)
    assert object_keys(index)[:2] == [part_key(NAME, 0, 0), part_key(NAME, 1, 0)]


def test_shards_that_overlap_or_leave_a_hole_are_refused():
    def index(shards, part_size):
        digest = hashlib.sha256(b"").hexdigest()
        return PartsIndex(
            NAME,
            1,
            (Part(part_key(NAME, 0, 0), 0, part_size, digest),),
            (TensorEntry("uint8", (4, 4), tuple(shards)),),
            b"",
        )

    def box(offsets, shape, start):
        return Shard(offsets, shape, (Extent(0, start, shape[0] * shape[1]),))

    overlap = [box((0, 0), (2, 4), 0), box((1, 0), (2, 4), 8)]
    with pytest.raises(ValueError, match="do not add up|overlap"):
        encode_index(index(overlap, 16))
    boxes = [box((0, 0), (2, 2), 0), box((1, 1), (2, 2), 4), box((2, 0), (2, 4), 8)]
    with pytest.raises(ValueError, match="overlap"):
        encode_index(index(boxes, 16))
    hole = [box((0, 0), (2, 4), 0)]
    with pytest.raises(ValueError, match="do not add up"):
        encode_index(index(hole, 8))


def test_an_index_never_lists_a_key_outside_its_checkpoint(tmp_path):
    """Pruning deletes what an index lists; a hostile index must not name another object."""
    doc = _doc(tmp_path)
    doc["parts"][0]["key"] = "step000000001.pt"
    with pytest.raises(ValueError, match="expected 'step000000007.pt.part-00000-00000'"):
        parse_index(_encoded(doc), "ck")


def test_skeleton_field_is_the_weights_only_payload(tmp_path):
    doc = _doc(tmp_path)
    skeleton = load_skeleton(base64.b64decode(doc["skeleton"]), "ck")
    assert skeleton["big"] == (TENSOR_TAG, 0) and skeleton["version"] == 1
    assert os.path.exists(tmp_path / NAME)


def test_one_process_reads_and_writes_many_parts_on_a_bounded_pool(tmp_path, monkeypatch):
    import concurrent.futures

    import koochak.loop.checkpoint.parts_io as parts_io
    import koochak.loop.checkpoint.verified_read as verified_read
    from koochak.loop.checkpoint import build_checkpoint, load, save

    pools = []

    class Recorded(concurrent.futures.ThreadPoolExecutor):
        def __init__(self, max_workers=None, **kwargs):
            pools.append(max_workers)
            super().__init__(max_workers=max_workers, **kwargs)

    monkeypatch.setattr(parts_io, "ThreadPoolExecutor", Recorded)
    monkeypatch.setattr(verified_read, "ThreadPoolExecutor", Recorded)
    model = torch.nn.Linear(64, 64)
    save(build_checkpoint(step=1, next_step=2, model=model), LocalStore(tmp_path), parts=40)
    assert len([n for n in os.listdir(tmp_path) if ".part-" in n]) == 40
    loaded = load(tmp_path / "step000000001.pt")
    assert torch.equal(loaded["model"]["weight"], model.weight.detach())
    assert pools and max(pools) <= parts_io.MAX_PART_THREADS < 40
