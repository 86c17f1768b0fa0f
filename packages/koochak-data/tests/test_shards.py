"""ShardWriter, index.json, read_shard, describe_shard and write_index against a real LocalStore."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from koochak.data import shards as sh
from koochak.data.shards import (
    ShardEntry,
    ShardWriter,
    describe_shard,
    load_index,
    parse_index,
    read_shard,
    read_shards,
    write_index,
)
from koochak.storage.store import LocalStore

PREFIX = "datasets/foo"


@pytest.fixture()
def store(tmp_path) -> LocalStore:
    return LocalStore(tmp_path / "store", fsync=False)


def _samples(n: int, size: int = 300) -> list[dict]:
    return [
        {"__key__": f"r/{i:05d}", "cls": str(i % 7).encode(), "bin": bytes([i % 251]) * (size + i)}
        for i in range(n)
    ]


def _build(store, samples, prefix=PREFIX, target=4096, metadata=None):
    with ShardWriter(store, prefix, target_bytes=target, metadata=metadata) as writer:
        for sample in samples:
            writer.write(sample)
    return writer.close()


def _read_all(store, index) -> list[dict]:
    return [s for shard in index.shards for s in read_shard(store, index, shard)]


def test_build_then_read_every_record_in_order(store) -> None:
    samples = _samples(40)
    index = _build(store, samples, metadata={"source": "unit", "classes": 7})
    assert len(index.shards) > 3
    assert index.records == 40
    assert index.metadata == {"source": "unit", "classes": 7}
    assert [s.key for s in index.shards] == [f"shard-{i:06d}.tar" for i in range(len(index.shards))]
    assert all(s.size <= 4096 for s in index.shards)
    assert _read_all(store, index) == samples
    assert load_index(store, PREFIX) == index


def test_index_is_written_last_and_its_hash_is_the_version(store) -> None:
    index = _build(store, _samples(10))
    raw = store.get(f"{PREFIX}/index.json")
    assert index.version == hashlib.sha256(raw).hexdigest()
    document = json.loads(raw)
    assert document["kind"] == "koochak.shards" and document["version"] == 1
    assert document["format"] == "tar"
    for entry, listed in zip(index.shards, document["shards"]):
        assert listed == {"key": entry.key, "size": entry.size, "sha256": entry.sha256, "records": entry.records}
        assert store.stat(f"{PREFIX}/{entry.key}").size == entry.size


def test_index_digests_are_the_shard_bytes_even_from_a_store_that_reports_none(tmp_path) -> None:
    import dataclasses

    class Quiet(LocalStore):
        def put(self, key, data, **kwargs):  # type: ignore[override]
            return dataclasses.replace(super().put(key, data, **kwargs), sha256=None)

    for store in (LocalStore(tmp_path / "a"), Quiet(tmp_path / "b")):
        index = _build(store, _samples(30))
        for shard in index.shards:
            data = Path(store.local_path(index.key_of(shard))).read_bytes()
            assert shard.sha256 == hashlib.sha256(data).hexdigest() and shard.size == len(data)


def test_same_records_give_the_same_dataset_version(tmp_path) -> None:
    a = _build(LocalStore(tmp_path / "a", fsync=False), _samples(25))
    b = _build(LocalStore(tmp_path / "b", fsync=False), _samples(25))
    assert a.version == b.version
    assert (tmp_path / "a" / PREFIX / "shard-000001.tar").read_bytes() == (
        tmp_path / "b" / PREFIX / "shard-000001.tar"
    ).read_bytes()


def test_interrupted_build_commits_nothing_and_rerun_reuses_shards(store) -> None:
    samples = _samples(30)
    with pytest.raises(RuntimeError, match="boom"), ShardWriter(store, PREFIX, target_bytes=4096) as writer:
        for i, sample in enumerate(samples):
            if i == 20:
                raise RuntimeError("boom")
            writer.write(sample)
    published = [info.key for info in store.list(PREFIX)]
    assert published and f"{PREFIX}/index.json" not in published
    with pytest.raises(FileNotFoundError):
        load_index(store, PREFIX)

    with ShardWriter(store, PREFIX, target_bytes=4096) as rerun:
        for sample in samples:
            rerun.write(sample)
    assert rerun.shards_reused == len(published)
    assert _read_all(store, rerun.close()) == samples


_KILLABLE_BUILD = """
import sys, time
from koochak.data.shards import ShardWriter
from koochak.storage.store import LocalStore

store = LocalStore(sys.argv[1])
with ShardWriter(store, "killed", target_bytes=4096) as writer:
    for i in range(60):
        writer.write({"__key__": f"r/{i:05d}", "bin": bytes([i]) * (300 + i)})
        if i == 30:
            print("halfway", flush=True)
            time.sleep(60)  # killed here
"""


@pytest.mark.slow
def test_build_killed_with_sigkill_commits_nothing_and_a_rerun_completes(store) -> None:
    import signal

    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLABLE_BUILD, str(store.root)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "halfway\n"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    left = [info.key for info in store.list("killed")]
    assert left and "killed/index.json" not in left
    with pytest.raises(FileNotFoundError):
        load_index(store, "killed")
    samples = [{"__key__": f"r/{i:05d}", "bin": bytes([i]) * (300 + i)} for i in range(60)]
    with ShardWriter(store, "killed", target_bytes=4096) as writer:
        for sample in samples:
            writer.write(sample)
    assert writer.shards_reused == len(left)
    assert list(read_shards(store, load_index(store, "killed"))) == samples


def test_rerun_with_different_records_is_refused(store) -> None:
    with pytest.raises(RuntimeError), ShardWriter(store, PREFIX, target_bytes=4096) as writer:
        for sample in _samples(20):
            writer.write(sample)
        raise RuntimeError("interrupted")
    changed = _samples(20)
    changed[0]["cls"] = b"changed"
    with pytest.raises(FileExistsError, match=r"shard-000000.tar already exists with different content"):
        _build(store, changed)
    writer = ShardWriter(store, PREFIX, target_bytes=4096)
    with pytest.raises(FileExistsError):
        for sample in changed:
            writer.write(sample)
    with pytest.raises(ValueError, match="is closed"):
        writer.write(changed[-1])
    assert not any(i.key.endswith("index.json") for i in store.list(PREFIX))


def test_committed_dataset_is_immutable_but_identical_rerun_is_fine(store) -> None:
    first = _build(store, _samples(12))
    assert _build(store, _samples(12)).version == first.version
    with pytest.raises(FileExistsError):
        _build(store, _samples(13))
    assert load_index(store, PREFIX) == first


def test_writer_refuses_bad_input_and_empty_datasets(store) -> None:
    with pytest.raises(ValueError, match="metadata must be JSON"):
        ShardWriter(store, PREFIX, metadata={"x": object()})
    with pytest.raises(ValueError, match="format must be one of"):
        ShardWriter(store, PREFIX, format="zip")
    with pytest.raises(ValueError, match="'..'"):
        ShardWriter(store, "datasets/../x")
    writer = ShardWriter(store, PREFIX, target_bytes="1MiB")
    writer.write({"__key__": "a", "cls": b"1"})
    with pytest.raises(ValueError, match="already written to this shard"):
        writer.write({"__key__": "a", "cls": b"2"})
    with pytest.raises(ValueError, match="no shards; nothing committed"):
        ShardWriter(store, "empty").close()


def test_big_sample_gets_its_own_shard(store) -> None:
    samples = [{"__key__": "small", "bin": b"x"}, {"__key__": "big", "bin": bytes(10000)}]
    index = _build(store, samples, target=2048)
    assert [s.records for s in index.shards] == [1, 1]
    assert _read_all(store, index) == samples


def test_describe_and_write_index_cover_pre_existing_files(store) -> None:
    built = _build(store, _samples(15), prefix="built")
    for entry in built.shards:
        store.put(f"copied/part/{entry.key}", store.get(f"built/{entry.key}"))
    described = describe_shard(store, "copied/part/shard-000000.tar")
    assert described == ShardEntry("copied/part/shard-000000.tar", *[
        getattr(built.shards[0], f) for f in ("size", "sha256", "records")
    ])
    index = write_index(store, "copied", [f"part/{e.key}" for e in built.shards], metadata={"m": 1})
    assert [e.sha256 for e in index.shards] == [e.sha256 for e in built.shards]
    assert _read_all(store, load_index(store, "copied")) == _samples(15)
    with pytest.raises(ValueError, match="listed twice"):
        write_index(store, "again", ["a.tar", "a.tar"])


def test_webdataset_reads_a_dataset_written_by_shard_writer(store) -> None:
    import webdataset as wds

    samples = _samples(25)
    index = _build(store, samples)
    urls = [store.local_path(index.key_of(shard)) for shard in index.shards]
    got = list(wds.WebDataset(urls, shardshuffle=False))
    assert [g["__key__"] for g in got] == [s["__key__"] for s in samples]
    assert all(g["bin"] == s["bin"] and g["cls"] == s["cls"] for g, s in zip(got, samples))


def test_shards_written_by_webdataset_can_be_indexed_and_read(store) -> None:
    import webdataset as wds

    root = Path(store.root) / "wds"
    root.mkdir(parents=True)
    expected = []
    for part in range(2):
        with wds.TarWriter(str(root / f"part-{part}.tar")) as sink:
            for i in range(5):
                sample = {"__key__": f"p{part}/s{i}", "txt": f"hello {part} {i}", "cls": i}
                sink.write(sample)
                expected.append({"__key__": f"p{part}/s{i}", "cls": str(i).encode(),
                                 "txt": f"hello {part} {i}".encode()})
    index = write_index(store, "wds", ["part-0.tar", "part-1.tar"])
    assert [e.records for e in index.shards] == [5, 5]
    assert list(read_shards(store, load_index(store, "wds"))) == expected


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs the tar program")
def test_shards_made_with_tar_can_be_indexed_and_read(store, tmp_path) -> None:
    src = tmp_path / "src"
    (src / "train").mkdir(parents=True)
    for i in range(3):
        (src / "train" / f"{i:03d}.cls").write_bytes(str(i).encode())
        (src / "train" / f"{i:03d}.input.npy").write_bytes(bytes([i]) * 700)
    members = sorted(str(p.relative_to(src)) for p in (src / "train").iterdir())  # keys contiguous
    target = Path(store.root) / "tarred" / "shard-0.tar"
    target.parent.mkdir(parents=True)
    subprocess.run(
        ["tar", "-cf", str(target), "--no-recursion", "-C", str(src), "train", *members], check=True
    )
    index = write_index(store, "tarred", ["shard-0.tar"])
    got = list(read_shards(store, index))
    assert [s["__key__"] for s in got] == ["train/000", "train/001", "train/002"]
    assert got[2] == {"__key__": "train/002", "cls": b"2", "input.npy": bytes([2]) * 700}


def test_header_claiming_a_huge_member_is_a_clean_error(store) -> None:
    from koochak.data import _tar

    header = bytearray(_tar.member_header("a.bin", 0))
    header[124:136] = b"\x80" + (2**80).to_bytes(11, "big")  # GNU base-256 size
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\x00 " % sum(header)
    store.put("hostile/shard.tar", bytes(header) + bytes(4096))
    with pytest.raises(ValueError, match="truncated tar archive"):
        describe_shard(store, "hostile/shard.tar")
    with pytest.raises(ValueError, match="truncated tar archive"):
        write_index(store, "hostile", ["shard.tar"])
    assert not any(i.key.endswith("index.json") for i in store.list("hostile"))


def test_shard_dataset_pickles_for_spawned_workers(store) -> None:
    import pickle

    _build(store, _samples(12))
    dataset = sh.ShardDataset(store, PREFIX, rank=1, world_size=2, epoch=4, seed=3)
    clone = pickle.loads(pickle.dumps(dataset))
    assert type(clone) is type(dataset)
    assert [s["__key__"] for s in clone] == [s["__key__"] for s in dataset]


def test_prefix_must_be_relative(store) -> None:
    with pytest.raises(ValueError, match="absolute"):
        load_index(store, "/datasets/foo")
    _build(store, _samples(3))
    assert load_index(store, PREFIX + "/").prefix == PREFIX


def _tamper_shard(store, index, mutate) -> None:
    path = Path(store.local_path(index.key_of(index.shards[1])))
    data = bytearray(path.read_bytes())
    mutate(data)
    path.chmod(0o644)  # the store publishes read-only objects; this test plays the attacker
    path.write_bytes(data)


def test_tampered_shard_fails_naming_the_field_and_yields_nothing(store) -> None:
    index = _build(store, _samples(20))
    shard = index.shards[1]

    def flip(data):
        data[600] ^= 0xFF

    _tamper_shard(store, index, flip)
    with pytest.raises(ValueError, match=r"shard-000001.tar: sha256 mismatch"):
        read_shard(store, index, shard)
    # Without verification the shard is still parsed strictly and sized, just not hashed.
    assert len(list(read_shard(store, index, shard, verify=False))) == shard.records

    _tamper_shard(store, index, lambda data: data.extend(bytes(512)))
    with pytest.raises(ValueError, match="size mismatch: index says .* shard is longer"):
        read_shard(store, index, shard)
    _tamper_shard(store, index, lambda data: data.__delitem__(slice(-1024, None)))
    with pytest.raises(ValueError, match="size mismatch"):
        read_shard(store, index, shard)


def test_index_with_wrong_record_count_is_caught_before_any_sample(store) -> None:
    index = _build(store, _samples(10))
    lying = parse_index(
        sh._index_bytes("tar", {}, [ShardEntry(e.key, e.size, e.sha256, e.records + 1) for e in index.shards]),
        prefix=PREFIX,
    )
    with pytest.raises(ValueError, match="records mismatch: index says"):
        read_shard(store, lying, lying.shards[0])
    with pytest.raises(ValueError, match="not listed in the index"):
        read_shard(store, index, "shard-999999.tar")


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_read_shards_yields_everything_in_order(store, prefetch) -> None:
    samples = _samples(40)
    index = _build(store, samples)
    assert list(read_shards(store, index, prefetch=prefetch)) == samples
    subset = [index.shards[2].key, index.shards[0]]
    assert list(read_shards(store, index, subset, prefetch=prefetch)) == (
        list(read_shard(store, index, index.shards[2])) + list(read_shard(store, index, index.shards[0]))
    )


def test_read_shards_stops_at_a_bad_shard_without_its_samples(store) -> None:
    index = _build(store, _samples(30))

    def flip(data):
        data[700] ^= 0x01

    _tamper_shard(store, index, flip)  # shards[1]
    got: list[dict] = []
    with pytest.raises(ValueError, match="shard-000001.tar: sha256 mismatch"):
        for sample in read_shards(store, index, prefetch=2):
            got.append(sample)
    assert got == list(read_shard(store, index, index.shards[0]))
    with pytest.raises(ValueError, match="prefetch must be"):
        list(read_shards(store, index, prefetch=-1))


def _good_document() -> dict:
    return {
        "kind": "koochak.shards",
        "version": 1,
        "format": "tar",
        "metadata": {},
        "shards": [{"key": "shard-000000.tar", "size": 2048, "sha256": "0" * 64, "records": 1}],
    }


def _with(path: str, value, delete: bool = False) -> bytes:
    document = _good_document()
    target = document
    parts = path.split(".")
    for part in parts[:-1]:
        target = target[int(part)] if part.isdigit() else target[part]
    if delete:
        del target[parts[-1]]
    else:
        target[parts[-1]] = value
    return json.dumps(document).encode()


@pytest.mark.parametrize(
    "data, message",
    [
        (_with("kind", "koochak.other"), "field 'kind'"),
        (_with("version", 2), "version=2; this Koochak reads version 1"),
        (_with("version", True), "field 'version'"),
        (_with("format", "zip"), "field 'format'"),
        (_with("extra", 1), "unknown field 'extra'"),
        (_with("metadata", None, delete=True), "missing field 'metadata'"),
        (_with("metadata", []), "field 'metadata'"),
        (_with("shards", []), "field 'shards'"),
        (_with("shards.0.key", "../escape.tar"), r"shards\[0\].key"),
        (_with("shards.0.key", "/abs.tar"), r"shards\[0\].key"),
        (_with("shards.0.key", "index.json"), r"shards\[0\].key must not name the index"),
        (_with("shards.0.key", 7), r"shards\[0\].key must be a string"),
        (_with("shards.0.size", -1), r"shards\[0\].size must be a non-negative integer"),
        (_with("shards.0.size", 1.5), r"shards\[0\].size"),
        (_with("shards.0.records", -3), r"shards\[0\].records"),
        (_with("shards.0.sha256", "ABC"), r"shards\[0\].sha256"),
        (_with("shards.0.owner", "x"), r"shards\[0\]: unknown field 'owner'"),
        (_with("shards.0.size", None, delete=True), r"shards\[0\]: missing field 'size'"),
        (b'{"kind": "koochak.shards", "kind": "koochak.shards"}', "appears twice"),
        (b"[1, 2]", "expected a JSON object"),
        (b"\xff\xfe", "not valid JSON"),
        (b'{"version": NaN}', "not valid JSON"),
    ],
)
def test_hostile_index_is_rejected_naming_the_field(data, message) -> None:
    with pytest.raises(ValueError, match=message):
        parse_index(data, source="ds/index.json")


def test_duplicate_shard_keys_are_rejected() -> None:
    document = _good_document()
    document["shards"].append(dict(document["shards"][0]))
    with pytest.raises(ValueError, match=r"shards\[1\].key 'shard-000000.tar' is listed twice"):
        parse_index(json.dumps(document).encode())


def test_tampered_index_on_disk_is_rejected(store) -> None:
    _build(store, _samples(5))
    path = Path(store.local_path(f"{PREFIX}/index.json"))
    document = json.loads(path.read_text())
    document["shards"][0]["size"] = -5
    path.chmod(0o644)
    path.write_text(json.dumps(document))
    with pytest.raises(ValueError, match=r"datasets/foo/index.json: shards\[0\].size"):
        load_index(store, PREFIX)


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5000) | st.text(max_size=12),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.binary(max_size=300), _json.map(lambda d: json.dumps(d).encode())))
def test_fuzz_parse_index_only_raises_value_error(data) -> None:
    try:
        parse_index(data)
    except ValueError:
        pass


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["kind", "version", "format", "metadata", "shards", "key", "size", "sha256", "records"]),
    _json,
)
def test_fuzz_one_field_of_a_good_index_only_raises_value_error(field, value) -> None:
    document = _good_document()
    target = document["shards"][0] if field in ("key", "size", "sha256", "records") else document
    target[field] = value
    try:
        index = parse_index(json.dumps(document).encode())
    except ValueError:
        return
    assert index.shards[0].size >= 0 and index.shards[0].records >= 0


def test_import_koochak_data_does_not_import_torch() -> None:
    code = (
        "import sys, koochak.data, koochak.data.shards, koochak.data.planning\n"
        "koochak.data.worker_coordinates(rank=0, world_size=1)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------
# Zero-copy reads: what the buffer guarantees


class _SwappingStore(LocalStore):
    """A LocalStore whose shard reads see the file replaced by ``replacement`` at a chosen
    moment: after the first piece was read, or once the whole shard has been read."""

    def __init__(self, root, replacement: bytes, when: str) -> None:
        super().__init__(root, fsync=False)
        self.replacement, self.when = replacement, when

    def open(self, key):
        buffered = super().open(key)
        inner = buffered.raw  # unbuffered: each read sees the file as it is now
        path = Path(self.local_path(key))
        store = self

        class Stream(io.RawIOBase):
            calls = 0

            def readable(self) -> bool:
                return True

            def readinto(self, view) -> int:
                view = memoryview(view)[:700]  # several small reads per shard
                n = inner.readinto(view)
                Stream.calls += 1
                if (store.when == "first" and Stream.calls == 1) or (store.when == "end" and not n):
                    path.chmod(0o644)
                    with open(path, "r+b") as f:  # in place: the open descriptor sees it
                        f.write(store.replacement)
                return n

            def close(self) -> None:
                buffered.close()
                super().close()

        return Stream()


def _same_size_variants(tmp_path):
    """Two one-shard datasets of identical size and layout but different bytes."""
    a = [{"__key__": f"k{i}", "bin": bytes([1]) * (500 + i)} for i in range(6)]
    b = [{"__key__": f"k{i}", "bin": bytes([2]) * (500 + i)} for i in range(6)]
    plain = LocalStore(tmp_path / "s", fsync=False)
    index_a = _build(plain, a, prefix="a", target=1 << 20)
    index_b = _build(plain, b, prefix="b", target=1 << 20)
    bytes_b = Path(plain.local_path(index_b.key_of(index_b.shards[0]))).read_bytes()
    assert index_a.shards[0].size == len(bytes_b)
    return a, index_a, bytes_b


def test_shard_changed_while_being_read_never_delivers_a_sample(tmp_path) -> None:
    a, index_a, bytes_b = _same_size_variants(tmp_path)
    store = _SwappingStore(tmp_path / "s", bytes_b, when="first")
    with pytest.raises(ValueError, match="sha256 mismatch"):
        read_shard(store, index_a, index_a.shards[0])
    with pytest.raises(ValueError, match="sha256 mismatch"):
        list(read_shards(store, index_a, prefetch=2))


def test_shard_changed_after_its_hash_gives_exactly_the_hashed_bytes(tmp_path) -> None:
    # The samples are cut from the buffer that was hashed, never from a second read.
    a, index_a, bytes_b = _same_size_variants(tmp_path)
    store = _SwappingStore(tmp_path / "s", bytes_b, when="end")
    assert list(read_shard(store, index_a, index_a.shards[0])) == a
    assert Path(store.local_path(index_a.key_of(index_a.shards[0]))).read_bytes() == bytes_b


@pytest.mark.parametrize("prefetch", [None, 0, 2])  # None: read_shard, shard after shard
def test_zero_copy_samples_stay_valid_after_later_shards_are_read(store, prefetch) -> None:
    samples = _samples(40)
    index = _build(store, samples)
    held = []
    if prefetch is None:
        stream = (s for shard in index.shards for s in read_shard(store, index, shard))
    else:
        stream = read_shards(store, index, prefetch=prefetch)
    for i, sample in enumerate(stream):
        assert isinstance(sample["bin"], memoryview) and sample["bin"].readonly
        if i < 3:
            held.append(sample["bin"])  # only one field of the first shard's samples is kept
        with pytest.raises(TypeError):
            sample["bin"][0] = 0  # read-only: one caller cannot change what another sees
    # Every later shard has been read (into reused buffers where possible) since.
    assert [bytes(v) for v in held] == [s["bin"] for s in samples[:3]]
    copies = list(read_shards(store, index, prefetch=prefetch or 0, copy=True))
    assert copies == samples and all(type(s["bin"]) is bytes for s in copies)
    assert [bytes(v) for v in held] == [s["bin"] for s in samples[:3]]


def test_shard_buffers_are_reused_only_once_no_sample_points_into_them() -> None:
    buffers = sh._Buffers(2)
    first = buffers.take(100)
    view = memoryview(first)[10:20].toreadonly()
    buffers.give(first)
    second = buffers.take(100)
    assert second is not first  # a sample still holds the first
    del view
    buffers.give(second)
    assert buffers.take(80) in (first, second)  # reused, whichever fits


def test_shards_hashed_piece_by_piece_on_the_helper_thread(store, monkeypatch) -> None:
    # Test shards are small: shrink the pieces so the threaded, many-piece path runs.
    monkeypatch.setattr(sh, "_FIRST_PIECE", 512)
    monkeypatch.setattr(sh, "_READ_PIECE", 2048)
    samples = _samples(30, size=3000)
    index = _build(store, samples, target=20000)
    assert all(s.size > 4 * 2048 for s in index.shards)
    assert _read_all(store, index) == samples
    assert list(read_shards(store, index, prefetch=2)) == samples
    for shard in index.shards:
        assert describe_shard(store, index.key_of(shard)).sha256 == shard.sha256

    def flip(data):
        data[-3000] ^= 0x01  # in the last piece

    _tamper_shard(store, index, flip)
    with pytest.raises(ValueError, match="shard-000001.tar: sha256 mismatch"):
        read_shard(store, index, index.shards[1])


def test_shard_dataset_hands_out_picklable_bytes_unless_asked_for_views(store) -> None:
    import pickle

    samples = _samples(6)
    _build(store, samples)

    def by_key(found):
        return sorted(found, key=lambda s: s["__key__"])  # the plan shuffles shard order

    got = by_key(sh.ShardDataset(store, PREFIX))  # DataLoader workers pickle what they yield
    assert got == samples and all(type(s["bin"]) is bytes for s in got)
    assert pickle.loads(pickle.dumps(got)) == samples
    views = by_key(sh.ShardDataset(store, PREFIX, copy=False))
    assert views == samples and all(isinstance(s["bin"], memoryview) for s in views)
