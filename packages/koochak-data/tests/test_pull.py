"""pull: merged range reads, exact restore, skips, and safety against hostile manifests and DESTs."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from koochak.data.archive import archive_tree
from koochak.data.collection import FileEntry, load_collection
from koochak.data.pull import merge_ranges, pull_collection

SHA = "00" * 32


def _write(root, rel: str, size: int, seed: int = 0) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes((seed + i * 13) % 251 for i in range(size)))


@pytest.fixture
def collection(tmp_path):
    src = tmp_path / "src"
    for d in range(3):
        for f in range(5):
            _write(src, f"d{d}/f{f}.txt", 100 + 900 * f, seed=d + f)
    _write(src, "objects/huge.bin", 50_000, seed=7)
    os.chmod(src / "d1" / "f3.txt", 0o751)
    os.utime(src / "d2" / "f4.txt", ns=(5, 1_234_567_890_123_456_789))
    dest = tmp_path / "coll"
    archive_tree(src, dest, object_bytes=20_000, pack_bytes=16_384)
    return src, dest


def _same_tree(a, b) -> None:
    files_a = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    assert files_a == files_b
    for rel in files_a:
        sa, sb = os.stat(a / rel), os.stat(b / rel)
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
        assert sa.st_mtime_ns == sb.st_mtime_ns, rel
        assert sa.st_mode == sb.st_mode, rel


def test_pull_restores_bytes_mode_and_exact_mtime(collection, tmp_path) -> None:
    src, coll = collection
    out = tmp_path / "out"
    report = pull_collection(coll, out)
    assert report.written == 16 and report.present == 0
    _same_tree(src, out)
    packs = len(load_collection(str(coll)).manifest.packs)
    assert report.requests == 2 + packs + 1  # manifest, table, one range per pack, one object
    assert not [p for p in out.rglob(".koochak-pull-*")]


def test_rerun_skips_present_files_and_refuses_differing_ones(collection, tmp_path) -> None:
    src, coll = collection
    out = tmp_path / "out"
    pull_collection(coll, out)
    again = pull_collection(coll, out)
    assert (again.written, again.present) == (0, 16)
    (out / "d0" / "f0.txt").unlink()
    (out / "d0" / "f1.txt").write_bytes(b"mine")
    with pytest.raises(ValueError, match="--overwrite"):
        pull_collection(coll, out)
    assert not (out / "d0" / "f0.txt").exists()  # refused before writing anything
    fixed = pull_collection(coll, out, overwrite=True)
    assert fixed.written == 2
    _same_tree(src, out)


def test_include_selects_files(collection, tmp_path) -> None:
    _, coll = collection
    out = tmp_path / "out"
    report = pull_collection(coll, out, include=["d1/*", "*.bin"])
    assert sorted(report.paths) == [f"d1/f{i}.txt" for i in range(5)] + ["objects/huge.bin"]
    assert not (out / "d0").exists()


def test_include_that_matches_nothing_is_an_error(collection, tmp_path) -> None:
    _, coll = collection
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"--include 'd1/\*\.bin' matches no file"):
        pull_collection(coll, out, include=["d1/*", "d1/*.bin"])
    assert not any(out.rglob("*.txt"))


def test_dest_that_is_a_file_is_refused(collection, tmp_path) -> None:
    _, coll = collection
    (tmp_path / "afile").write_text("keep me")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        pull_collection(coll, tmp_path / "afile")
    assert (tmp_path / "afile").read_text() == "keep me"


def test_merge_ranges_joins_neighbours_within_gap_and_cap() -> None:
    def entry(offset: int, size: int) -> FileEntry:
        return FileEntry(f"f{offset}", size, SHA, 0o644, 0, "g", "packs/pack-000000.tar", offset)

    entries = [entry(512, 100), entry(1536, 100), entry(10_240, 100), entry(11_264, 5000)]
    merged = merge_ranges(entries, gap_bytes=1024, max_range_bytes=1 << 20)
    assert [(s, e, len(m)) for s, e, m in merged] == [(512, 1636, 2), (10_240, 16_264, 2)]
    capped = merge_ranges(entries, gap_bytes=1 << 20, max_range_bytes=2000)
    assert [len(m) for _, _, m in capped] == [2, 1, 1]


def test_symlinks_under_dest_are_never_followed(collection, tmp_path) -> None:
    _, coll = collection
    outside = tmp_path / "outside"
    outside.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(outside, out / "d0")
    with pytest.raises(ValueError, match="symlink"):
        pull_collection(coll, out)
    assert list(outside.iterdir()) == []
    os.unlink(out / "d0")
    (out / "d1").mkdir(exist_ok=True)
    os.symlink(outside / "target.txt", out / "d1" / "f0.txt")
    with pytest.raises(ValueError, match="symlink"):
        pull_collection(coll, out)
    assert list(outside.iterdir()) == []
    assert os.path.islink(out / "d1" / "f0.txt")


def _rewrite_table(coll, edit) -> None:
    """Hand-craft a manifest: edit the file table's entries and re-seal its digest."""
    lines = [json.loads(x) for x in gzip.decompress((coll / "files.jsonl.gz").read_bytes()).splitlines()]
    edit(lines)
    table = gzip.compress("".join(json.dumps(x) + "\n" for x in lines).encode())
    manifest = json.loads((coll / "manifest.json").read_text())
    manifest["files_table"].update(size=len(table), sha256=hashlib.sha256(table).hexdigest())
    for path in ("files.jsonl.gz", "manifest.json"):
        (coll / path).unlink()
    (coll / "files.jsonl.gz").write_bytes(table)
    (coll / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("bad", ["../escape.txt", "/tmp/abs.txt", "d0/../../escape.txt"])
def test_traversal_paths_in_the_manifest_write_nothing(collection, tmp_path, bad) -> None:
    _, coll = collection
    _rewrite_table(coll, lambda lines: lines[0].update(path=bad))
    out = tmp_path / "deep" / "out"
    with pytest.raises(ValueError, match="path"):
        pull_collection(coll, out)
    assert not (tmp_path / "deep").exists()
    assert not (tmp_path / "escape.txt").exists()


def test_tar_member_names_are_ignored(tmp_path) -> None:
    """A pack whose tar headers name '../evil' still restores only the manifest's paths."""
    coll = tmp_path / "coll"
    (coll / "packs").mkdir(parents=True)
    payload = b"hello"
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("../evil.txt")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    pack = buffer.getvalue()
    (coll / "packs" / "pack-000000.tar").write_bytes(pack)
    entry = {"path": "good.txt", "size": 5, "sha256": hashlib.sha256(payload).hexdigest(),
             "mode": 0o644, "mtime_ns": 7, "group": ".", "pack": "packs/pack-000000.tar",
             "offset": pack.index(payload)}
    table = gzip.compress((json.dumps(entry) + "\n").encode())
    (coll / "files.jsonl.gz").write_bytes(table)
    manifest = {
        "version": 1, "kind": "koochak.collection", "created": "x", "files": 1, "bytes": 5,
        "objects": 0, "metadata": {},
        "packs": [{"key": "packs/pack-000000.tar", "size": len(pack),
                   "sha256": hashlib.sha256(pack).hexdigest(), "files": 1}],
        "files_table": {"key": "files.jsonl.gz", "size": len(table),
                        "sha256": hashlib.sha256(table).hexdigest()},
    }
    (coll / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "a" / "out"
    pull_collection(coll, out)
    assert [p.name for p in out.iterdir()] == ["good.txt"]
    assert not (tmp_path / "a" / "evil.txt").exists()


def test_corrupt_bytes_are_never_written_under_a_final_name(collection, tmp_path) -> None:
    _, coll = collection
    entry = next(e for e in load_collection(str(coll)).entries if e.path == "d0/f2.txt")
    pack = coll / entry.pack
    data = bytearray(pack.read_bytes())
    data[entry.offset + 3] ^= 0xFF
    pack.unlink()
    pack.write_bytes(bytes(data))
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=rf"1 file\(s\) failed .* First: d0/f2.txt \(in {entry.pack}\): got .* not written"):
        pull_collection(coll, out, streams=1)
    assert not (out / "d0" / "f2.txt").exists()
    assert not list(out.rglob(".koochak-pull-*"))
    # Every other file came back intact: one damaged file does not cost the rest.
    restored = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    everything = sorted(e.path for e in load_collection(str(coll)).entries)
    assert restored == [p for p in everything if p != "d0/f2.txt"]
    src, _ = collection
    assert all((out / p).read_bytes() == (src / p).read_bytes() for p in restored)


def test_truncated_pack_is_reported(collection, tmp_path) -> None:
    _, coll = collection
    pack = coll / "packs" / "pack-000000.tar"
    data = pack.read_bytes()
    pack.unlink()
    pack.write_bytes(data[:1000])
    with pytest.raises(ValueError, match="shorter"):
        pull_collection(coll, tmp_path / "out")


def test_leftover_temp_file_from_a_killed_pull_is_left_alone(collection, tmp_path) -> None:
    # pull removes only what it created itself: a hidden file it did not make may be user data.
    src, coll = collection
    out = tmp_path / "out"
    pull_collection(coll, out)
    target = out / "d0" / "f0.txt"
    target.unlink()
    temp = ".koochak-pull-" + hashlib.sha256(b"f0.txt").hexdigest()[:20] + ".tmp"
    (out / "d0" / temp).write_bytes(b"half")
    report = pull_collection(coll, out)
    assert report.written == 1
    assert (out / "d0" / temp).read_bytes() == b"half"
    (out / "d0" / temp).unlink()
    _same_tree(src, out)


_hostile_paths = st.one_of(
    st.sampled_from(["../x", "/abs", "a/../../x", "..", ".", "a//b", "a/./b", "d0", "d0/f0.txt/x",
                     "ok.txt", "d1/new.txt", "sub/dir/f.txt", ".koochak-pull-x.tmp", "a\x00b"]),
    st.text(alphabet="./ab", min_size=1, max_size=8),
)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(index=st.integers(0, 15), path=_hostile_paths, offset_delta=st.sampled_from([0, 0, 512, -512, 10**9]),
       size_delta=st.sampled_from([0, 0, 1, -1, -(10**6)]))
def test_fuzzed_manifests_only_fail_cleanly_and_never_escape(
    collection, index: int, path: str, offset_delta: int, size_delta: int
) -> None:
    _, coll = collection
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch) / "coll"
        shutil.copytree(coll, work)

        def edit(lines: list[dict]) -> None:
            entry = lines[index % len(lines)]
            entry["path"] = path
            entry["size"] = entry["size"] + size_delta
            if "offset" in entry:
                entry["offset"] = entry["offset"] + offset_delta

        _rewrite_table(work, edit)
        out = Path(scratch) / "box" / "out"
        try:
            pull_collection(work, out, streams=2)
        except ValueError:
            pass
        # Nothing outside DEST, and nothing but regular files and directories inside it.
        assert sorted(p.name for p in (Path(scratch)).iterdir()) in (["coll"], ["box", "coll"])
        if (Path(scratch) / "box").exists():
            assert [p.name for p in (Path(scratch) / "box").iterdir()] == ["out"]
            for p in out.rglob("*"):
                assert not p.is_symlink() and (p.is_file() or p.is_dir())


def test_include_a_directory_selects_its_tree(collection, tmp_path) -> None:
    _, coll = collection
    report = pull_collection(coll, tmp_path / "out", include=["d2"])
    assert sorted(report.paths) == [f"d2/f{i}.txt" for i in range(5)]


def test_corrupt_read_from_the_store_is_caught_and_a_rerun_completes(collection, tmp_path) -> None:
    from koochak.storage.testing import Fault, FaultyStore

    src, coll = collection
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="SHA256"):
        pull_collection(FaultyStore(coll, [Fault("read", nth=3, mode="corrupt")]), out, streams=1)
    pull_collection(coll, out)
    _same_tree(src, out)


@pytest.mark.parametrize("unnamed_files", [True, False])
def test_both_ways_of_naming_a_file_restore_the_same_tree(
    collection, tmp_path, monkeypatch, unnamed_files
):
    # Unnamed O_TMPFILEs linked in once whole where the kernel has them, hidden temp names
    # renamed into place elsewhere: the result is the same tree, and no temp name stays.
    import koochak.data.pull as pull_module

    if not unnamed_files:
        monkeypatch.setattr(pull_module, "_LINK_VIA", str(tmp_path / "no-proc"))
    src, coll = collection
    out = tmp_path / "out"
    pull_collection(coll, out)
    _same_tree(src, out)
    assert not [p for p in out.rglob(".koochak-pull-*")]
    pull_collection(coll, out, overwrite=True)  # everything present: nothing rewritten
    (out / "d0" / "f1.txt").write_bytes(b"changed")
    assert pull_collection(coll, out, overwrite=True).written == 1
    _same_tree(src, out)


def test_a_filesystem_without_unnamed_files_falls_back_to_temp_names(
    collection, tmp_path, monkeypatch
):
    import errno as errno_module

    real_open = os.open

    def no_tmpfile(path, flags, *args, **kwargs):
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno_module.EOPNOTSUPP, "Operation not supported")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_tmpfile)
    src, coll = collection
    pull_collection(coll, tmp_path / "out")
    _same_tree(src, tmp_path / "out")


def test_modes_the_umask_would_strip_are_restored_exactly(tmp_path) -> None:
    src = tmp_path / "src"
    for name, mode in (("open.sh", 0o777), ("shared.txt", 0o666), ("private", 0o600)):
        _write(src, name, 300)
        os.chmod(src / name, mode)
    archive_tree(src, tmp_path / "coll")
    previous = os.umask(0o077)
    try:
        pull_collection(tmp_path / "coll", tmp_path / "out")
    finally:
        os.umask(previous)
    _same_tree(src, tmp_path / "out")


def test_merge_ranges_of_many_small_neighbours_is_one_range() -> None:
    entries = [
        FileEntry(f"f{i}", 100, SHA, 0o644, 0, "", pack="p", offset=512 + 1024 * i)
        for i in range(20_000)
    ]
    ((start, end, members),) = merge_ranges(entries, gap_bytes=1024, max_range_bytes=64 << 20)
    assert (start, end, len(members)) == (512, 512 + 1024 * 19_999 + 100, 20_000)


def test_a_pack_the_file_table_names_is_waited_for_not_skipped(collection, tmp_path) -> None:
    # Through a mount another client may see manifest.json and files.jsonl.gz before a pack.
    import threading

    from koochak.storage.store import LocalStore

    src, coll = collection
    pack = sorted((coll / "packs").iterdir())[0]
    hidden = tmp_path / "hidden-pack"
    pack.rename(hidden)
    threading.Timer(0.3, lambda: hidden.rename(pack)).start()
    pull_collection(LocalStore(coll, read_settle_seconds=5), tmp_path / "out")
    _same_tree(src, tmp_path / "out")


def test_ranges_from_a_store_of_cheap_requests_are_capped_at_16_mib(tmp_path) -> None:
    # A local store's request costs little: a 64 MiB range would be 64 MiB of fresh memory per
    # request, so ranges stop at 16 MiB there; an explicit max_range_bytes still decides.
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"f{i}.bin").write_bytes(bytes([i]) * (7 << 20))
    coll = tmp_path / "coll"
    archive_tree(src, coll, object_bytes=32 << 20, pack_bytes=64 << 20, show_progress=False)
    assert len(load_collection(str(coll)).manifest.packs) == 1
    report = pull_collection(coll, tmp_path / "out", show_progress=False)
    assert report.requests == 2 + 2  # manifest, table, then 14 MiB and 7 MiB
    _same_tree(src, tmp_path / "out")
    report = pull_collection(coll, tmp_path / "out2", max_range_bytes=64 << 20)
    assert report.requests == 2 + 1


def test_at_most_two_threads_write_fetched_ranges(collection, tmp_path, monkeypatch) -> None:
    import threading
    import time

    from koochak.data import pull as pull_module

    original = pull_module._DestTree.write
    lock, busy, most = threading.Lock(), [0], [0]

    def write(self, d, entry, data, fsync):
        if entry.pack is None:  # an object streams in and is written as it comes: not counted
            return original(self, d, entry, data, fsync)
        with lock:
            busy[0] += 1
            most[0] = max(most[0], busy[0])
        try:
            time.sleep(0.005)  # long enough for the other streams to arrive meanwhile
            return original(self, d, entry, data, fsync)
        finally:
            with lock:
                busy[0] -= 1

    monkeypatch.setattr(pull_module._DestTree, "write", write)
    src, coll = collection
    out = tmp_path / "out"
    report = pull_collection(coll, out, streams=6, gap_bytes=0, max_range_bytes=1)
    assert report.requests > 8  # many ranges, fetched by 6 streams
    assert most[0] == 2
    _same_tree(src, out)


def test_a_store_of_cheap_requests_gets_two_streams_by_default(collection, tmp_path, monkeypatch):
    # Ranges from a local filesystem come at memory speed: more streams would only hold more
    # buffers. A store whose requests are dear keeps its profile's concurrency.
    import dataclasses

    from koochak.data import pull as pull_module
    from koochak.storage import profile as profile_module

    seen = []
    real = pull_module.ThreadPoolExecutor
    monkeypatch.setattr(pull_module, "ThreadPoolExecutor",
                        lambda max_workers: seen.append(max_workers) or real(max_workers))  # fmt: skip
    src, coll = collection
    pull_collection(coll, tmp_path / "out")
    assert seen == [2]
    remote = dataclasses.replace(profile_module.REMOTE_PROFILE, concurrency=12)
    monkeypatch.setattr(profile_module, "profile_of", lambda store: remote)
    seen.clear()
    pull_collection(coll, tmp_path / "out2")
    assert seen == [12]
    _same_tree(src, tmp_path / "out2")
