"""archive: scanning, planning, tar packs readable by tar, resume, and --delete-source."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import time

import pytest
from koochak.data.archive import archive_tree, plan_archive, read_groups, scan_source
from koochak.data.collection import load_collection
from koochak.data.verify import verify_collection
from koochak.storage.store import LocalStore


def _write(root, rel: str, size: int, seed: int = 0) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes((seed + i * 7) % 251 for i in range(size)))


@pytest.fixture
def tree(tmp_path):
    src = tmp_path / "src"
    for d in range(3):
        for f in range(4):
            _write(src, f"d{d}/f{f}.bin", 300 + 700 * f + d, seed=d * 10 + f)
    _write(src, "top.txt", 5)
    _write(src, "big/huge.bin", 40_000, seed=3)
    os.chmod(src / "d0" / "f1.bin", 0o600)
    return src


def test_archive_commits_a_collection_that_verifies(tree, tmp_path) -> None:
    dest = tmp_path / "dest"
    report = archive_tree(tree, dest, object_bytes=20_000, pack_bytes=8192)
    assert (report.files, report.objects) == (14, 1)
    assert report.packs > 1
    collection = load_collection(str(dest))
    by_path = collection.by_path()
    assert by_path["big/huge.bin"].object == "objects/big/huge.bin"
    assert by_path["d0/f1.bin"].mode == 0o600
    assert by_path["d0/f1.bin"].mtime_ns == os.stat(tree / "d0" / "f1.bin").st_mtime_ns
    assert collection.manifest.metadata["source"] == str(tree)
    assert verify_collection(dest, deep=True).ok
    assert {p.name for p in (dest / "records").iterdir()} == {
        f"pack-{i:06d}.json" for i in range(report.packs)
    }


def test_packs_are_plain_tar_files(tree, tmp_path) -> None:
    dest = tmp_path / "dest"
    archive_tree(tree, dest, object_bytes=20_000)
    out = tmp_path / "untarred"
    out.mkdir()
    for pack in sorted((dest / "packs").iterdir()):
        subprocess.run(["tar", "-xf", str(pack), "-C", str(out)], check=True)
    for entry in load_collection(str(dest)).entries:
        if entry.pack:
            assert (out / entry.path).read_bytes() == (tree / entry.path).read_bytes()


def test_groups_are_contiguous_in_one_pack_in_order(tmp_path) -> None:
    src = tmp_path / "src"
    for i in range(12):
        _write(src, f"x/{i:02d}.bin", 1000, seed=i)
    groups = tmp_path / "groups.csv"
    # g1 takes files out of path order; g2 has no order column values beyond the row order.
    groups.write_text("path,group,order\nx/05.bin,g1,2\nx/01.bin,g1,1\nx/09.bin,g1,3\n"
                      "x/02.bin,g2,1\nx/03.bin,g2,2\nmissing.bin,g3,1\n")
    dest = tmp_path / "dest"
    report = archive_tree(src, dest, groups=groups, pack_bytes=6 * 1536, object_bytes=1 << 20)
    assert report.unmatched_group_rows == 1
    entries = load_collection(str(dest)).entries
    g1 = [e for e in entries if e.group == "g1"]
    assert [e.path for e in g1] == ["x/01.bin", "x/05.bin", "x/09.bin"]
    assert len({e.pack for e in g1}) == 1
    offsets = [e.offset for e in g1]
    assert offsets == sorted(offsets) and offsets[-1] - offsets[0] == 2 * 1536
    assert {e.group for e in entries if e.path == "x/00.bin"} == {"x"}  # unlisted: by directory


def test_group_larger_than_a_pack_spills(tmp_path) -> None:
    src = tmp_path / "src"
    for i in range(10):
        _write(src, f"g/{i}.bin", 1000, seed=i)
    files, _ = scan_source(src)
    plan = plan_archive(files, pack_bytes=4 * 1536 + 1024, object_bytes=1 << 20)
    assert [len(p.members) for p in plan.packs] == [4, 4, 2]
    assert all(p.size <= 4 * 1536 + 1024 for p in plan.packs)


def test_plan_is_deterministic_and_objects_by_size(tree) -> None:
    files, _ = scan_source(tree)
    one = plan_archive(files, object_bytes=2000)
    two = plan_archive(list(reversed(files)), object_bytes=2000)
    assert one == two
    assert all(o.file.size >= 2000 for o in one.objects)
    everything = plan_archive(files, object_bytes=1 << 30, layout="objects")
    assert not everything.packs and len(everything.objects) == len(files)


def test_layout_objects_stores_every_file_as_is_and_round_trips(tree, tmp_path) -> None:
    dest = tmp_path / "dest"
    report = archive_tree(tree, dest, layout="objects", object_bytes=1 << 30)
    assert report.packs == 0 and report.objects == report.files == 14
    for entry in load_collection(dest).entries:
        assert entry.pack is None and entry.object == f"objects/{entry.path}"
        assert (dest / entry.object).read_bytes() == (tree / entry.path).read_bytes()
    assert verify_collection(dest, deep=True).ok


def test_object_bytes_default_comes_from_the_targets_profile(tree, tmp_path) -> None:
    from koochak.storage.profile import StoreProfile, min_object_bytes

    # request_seconds * bandwidth = 8 KiB: files at least that large become objects. (Without
    # a profile the conservative default puts the threshold far above this tree's 40 KB file.)
    profile = StoreProfile(request_seconds=0.001, stream_bytes_per_second=8.192e6, concurrency=2,
                           range_reads_scale=False, part_bytes=8 << 20, listing_cheap=True)
    assert min_object_bytes(profile) == 8192
    report = archive_tree(tree, LocalStore(tmp_path / "dest", profile=profile))
    collection = load_collection(tmp_path / "dest")
    assert [e.path for e in collection.entries if e.object] == ["big/huge.bin"]
    assert report.objects == 1 and collection.manifest.metadata["object_bytes"] == 8192
    assert archive_tree(tree, tmp_path / "plain", dry_run=True).objects == 0


def test_paths_that_are_not_store_keys_are_packed(tmp_path) -> None:
    src = tmp_path / "src"
    _write(src, "what?.bin", 5000)
    dest = tmp_path / "dest"
    archive_tree(src, dest, object_bytes=100)
    (entry,) = load_collection(str(dest)).entries
    assert entry.pack is not None
    with pytest.raises(ValueError, match="cannot be stored as an object"):
        archive_tree(src, tmp_path / "d2", layout="objects")


def test_filters_prune_skip_and_count(tree, tmp_path) -> None:
    os.symlink("top.txt", tree / "link.txt")
    old = time.time_ns() - 10 * 3600 * 10**9
    for path in tree.rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.utime(path, ns=(old, old))
    _write(tree, "d1/fresh.bin", 10)
    with pytest.raises(ValueError, match="symlink"):
        scan_source(tree)
    files, skipped = scan_source(
        tree, exclude=["d0"], include=["*.bin"], skip_symlinks=True, min_age_hours=1
    )
    paths = {f.path for f in files}
    assert not any(p.startswith("d0/") for p in paths)
    assert "top.txt" not in paths and "d1/fresh.bin" not in paths
    assert skipped == {"excluded": 1, "not_included": 1, "symlinks": 1, "too_new": 1}


def test_include_a_directory_keeps_its_tree_and_a_glob_keeping_nothing_fails(tree) -> None:
    files, skipped = scan_source(tree, include=["d1"])
    assert [f.path for f in files] == [f"d1/f{i}.bin" for i in range(4)]
    assert skipped["not_included"] == 10
    with pytest.raises(ValueError, match=r"--include 'd9' selects no file to archive"):
        scan_source(tree, include=["d1", "d9"])


def test_special_files_are_refused_unless_excluded(tree) -> None:
    os.mkfifo(tree / "pipe")
    with pytest.raises(ValueError, match="special file"):
        scan_source(tree)
    files, skipped = scan_source(tree, exclude=["pipe"])
    assert skipped["excluded"] == 1 and len(files) == 14


def test_files_from_takes_exactly_the_listed_paths(tree, tmp_path) -> None:
    os.symlink(tree / "d1", tree / "linked")
    listed = tmp_path / "list.txt"
    listed.write_text("d0/f0.bin\n./big/huge.bin\n\n")
    report = archive_tree(tree, tmp_path / "dest", files_from=listed)
    assert report.files == 2
    for bad, message in (("linked/f0.bin", "not a plain directory"), ("nope", "does not exist"),
                         ("nodir/x.bin", "nodir does not exist"),
                         ("../x", "segment"), ("d0", "directory"), ("d0/f0.bin\nd0/f0.bin", "twice")):
        listed.write_text(bad + "\n")
        # Errors name the list file and its line, so a long list is easy to fix.
        with pytest.raises(ValueError, match=f"--files-from {listed} line [12]: .*{message}"):
            archive_tree(tree, tmp_path / "dest2", files_from=listed, dry_run=True)


def test_groups_table_and_file_list_from_a_spreadsheet(tree, tmp_path) -> None:
    # A byte-order mark and CRLF line ends, as spreadsheets and Windows editors save them.
    table = tmp_path / "g.csv"
    table.write_bytes("path,group,order\r\nd0/f1.bin,g,2\r\nd0/f0.bin,g,1\r\n".encode("utf-8-sig"))
    assert read_groups(table) == {"d0/f1.bin": ("g", 2), "d0/f0.bin": ("g", 1)}
    listed = tmp_path / "list.txt"
    listed.write_bytes("d0/f0.bin\r\nbig/huge.bin\r\n".encode("utf-8-sig"))
    assert archive_tree(tree, tmp_path / "dest", files_from=listed, dry_run=True).files == 2


def test_groups_table_errors_name_the_line(tmp_path) -> None:
    table = tmp_path / "g.csv"
    table.write_text("a.bin,g\na.bin,h\n")
    with pytest.raises(ValueError, match="line 2"):
        read_groups(table)
    table.write_text("a.bin,g,first\n")
    with pytest.raises(ValueError, match="order"):
        read_groups(table)
    table.write_text("../a.bin,g\n")
    with pytest.raises(ValueError, match="line 1"):
        read_groups(table)


def test_dry_run_writes_nothing(tree, tmp_path) -> None:
    dest = tmp_path / "dest"
    report = archive_tree(tree, dest, dry_run=True, object_bytes=20_000)
    assert not dest.exists()
    assert report.dry_run and report.files == 14 and report.objects == 1
    assert report.requests["pull_gets"] < report.requests["pull_gets_unpacked"]


def test_rerun_after_commit_writes_nothing_and_changed_source_is_refused(tree, tmp_path) -> None:
    dest = tmp_path / "dest"
    archive_tree(tree, dest, object_bytes=20_000)
    before = {p: p.stat().st_mtime_ns for p in dest.rglob("*")}
    again = archive_tree(tree, dest, object_bytes=20_000)
    assert again.already_committed
    assert {p: p.stat().st_mtime_ns for p in dest.rglob("*")} == before
    _write(tree, "d2/new.bin", 10)
    with pytest.raises(ValueError, match="different files"):
        archive_tree(tree, dest, object_bytes=20_000)


def _uncommit(dest) -> None:
    """Make a finished archive look like one killed before its commit point."""
    (dest / "manifest.json").unlink()
    (dest / "files.jsonl.gz").unlink()


def test_resume_reuses_packs_by_record_and_by_content(tree, tmp_path) -> None:
    dest = tmp_path / "dest"
    first = archive_tree(tree, dest, object_bytes=20_000, pack_bytes=8192)
    _uncommit(dest)
    (dest / "records" / "pack-000001.json").unlink()  # killed between a pack and its record
    (dest / "packs" / "pack-000002.tar").unlink()  # killed before this pack
    (dest / "records" / "pack-000002.json").unlink()
    again = archive_tree(tree, dest, object_bytes=20_000, pack_bytes=8192)
    assert again.packs_reused == first.packs - 1
    assert again.objects_reused == 1
    assert verify_collection(dest, deep=True).ok


def test_leftover_pack_that_does_not_match_is_refused(tree, tmp_path) -> None:
    dest = tmp_path / "dest"
    archive_tree(tree, dest, object_bytes=20_000, pack_bytes=8192)
    _uncommit(dest)
    (dest / "records" / "pack-000000.json").unlink()
    pack = dest / "packs" / "pack-000000.tar"
    data = bytearray(pack.read_bytes())
    pack.chmod(0o644)
    data[0:1] = b"Z"  # a different member name in the first header
    pack.unlink()
    pack.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="left over"):
        archive_tree(tree, dest, object_bytes=20_000, pack_bytes=8192)


def test_leftover_record_for_a_changed_source_is_refused(tree, tmp_path) -> None:
    dest = tmp_path / "dest"
    archive_tree(tree, dest, object_bytes=20_000, pack_bytes=8192)
    _uncommit(dest)
    os.utime(tree / "d0" / "f0.bin", ns=(1, 1))
    with pytest.raises(ValueError, match="left over"):
        archive_tree(tree, dest, object_bytes=20_000, pack_bytes=8192)


def test_leftover_object_with_other_content_is_refused(tree, tmp_path) -> None:
    dest = tmp_path / "dest"
    archive_tree(tree, dest, object_bytes=20_000)
    _uncommit(dest)
    stat = os.stat(tree / "big" / "huge.bin")
    _write(tree, "big/huge.bin", 40_000, seed=99)  # same size, other bytes
    os.utime(tree / "big" / "huge.bin", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(ValueError, match="objects/big/huge.bin"):
        archive_tree(tree, dest, object_bytes=20_000)


def test_delete_source_moves_unchanged_files_and_keeps_changed_ones(tree, tmp_path) -> None:
    dest = tmp_path / "dest"
    total = sum(p.stat().st_size for p in tree.rglob("*") if p.is_file())
    seen = 0

    def touch_when_all_read(n: int) -> None:
        nonlocal seen
        seen += n
        if seen == total:  # every byte is archived; the file changes before deletion
            os.utime(tree / "d1" / "f2.bin", ns=(1, 1))

    report = archive_tree(tree, dest, object_bytes=20_000, delete_source=True,
                     progress=touch_when_all_read)
    assert report.verified is True
    assert report.kept_changed == ["d1/f2.bin"]
    assert report.deleted == 13
    assert [p.relative_to(tree).as_posix() for p in tree.rglob("*")] == ["d1", "d1/f2.bin"]
    assert verify_collection(dest, deep=True).ok


def test_delete_source_deletes_nothing_when_verify_fails(tree, tmp_path) -> None:
    dest = tmp_path / "dest"
    archive_tree(tree, dest, object_bytes=20_000)
    obj = dest / "objects" / "big" / "huge.bin"
    data = bytearray(obj.read_bytes())
    data[100] ^= 1
    obj.unlink()
    obj.write_bytes(bytes(data))
    report = archive_tree(tree, dest, object_bytes=20_000, delete_source=True)
    assert report.verified is False and report.deleted == 0
    assert any("huge.bin" in p for p in report.problems)
    assert (tree / "big" / "huge.bin").exists()


def test_files_table_lists_every_file_once(tree, tmp_path) -> None:
    dest = tmp_path / "dest"
    archive_tree(tree, dest, object_bytes=20_000)
    lines = gzip.decompress((dest / "files.jsonl.gz").read_bytes()).decode().splitlines()
    paths = [json.loads(line)["path"] for line in lines]
    assert sorted(paths) == sorted(
        p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file()
    )


def test_archive_into_a_store_object(tree, tmp_path) -> None:
    store = LocalStore(tmp_path / "dest", publish="exclusive")
    report = archive_tree(tree, store, object_bytes=20_000)
    assert report.dest == store.location
    assert verify_collection(store, deep=True).ok


def test_members_straddling_stream_buffers_stay_exact(tree, tmp_path, monkeypatch) -> None:
    import koochak.data.archive as archive_module

    monkeypatch.setattr(archive_module, "_STREAM_BUFFER", 1536)  # every member straddles
    dest = tmp_path / "dest"
    archive_tree(tree, dest, object_bytes=1 << 20)
    assert verify_collection(dest, deep=True).ok
    out = tmp_path / "untarred"
    out.mkdir()
    for pack in sorted((dest / "packs").iterdir()):
        subprocess.run(["tar", "-xf", str(pack), "-C", str(out)], check=True)
    for path in tree.rglob("*"):
        if path.is_file():
            assert (out / path.relative_to(tree)).read_bytes() == path.read_bytes()


def test_malformed_pack_record_is_refused(tree, tmp_path) -> None:
    dest = tmp_path / "dest"
    archive_tree(tree, dest, object_bytes=20_000, pack_bytes=8192)
    _uncommit(dest)
    record = dest / "records" / "pack-000000.json"
    doc = json.loads(record.read_text())
    doc["members"][0]["sha256"] = "not-a-digest"
    record.unlink()
    record.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="not a SHA256"):
        archive_tree(tree, dest, object_bytes=20_000, pack_bytes=8192)


def test_source_changing_mid_pack_fails_and_leaves_no_pack(tmp_path) -> None:
    src = tmp_path / "src"
    for i in range(6):
        _write(src, f"f{i}.bin", 3000, seed=i)
    dest = tmp_path / "dest"

    def change_last_file(n: int) -> None:
        os.utime(src / "f5.bin", ns=(1, 1))

    with pytest.raises(ValueError, match="f5.bin changed since it was scanned"):
        archive_tree(src, dest, object_bytes=1 << 20, streams=1, progress=change_last_file)
    assert not (dest / "packs" / "pack-000000.tar").exists()
    assert not (dest / "manifest.json").exists()
    # The rerun plans with the new mtime and completes.
    assert archive_tree(src, dest, object_bytes=1 << 20).files == 6
    assert verify_collection(dest, deep=True).ok


def test_dest_that_is_a_file_is_refused(tree, tmp_path) -> None:
    (tmp_path / "afile").write_text("keep")
    with pytest.raises(ValueError, match="is a file; expected a directory"):
        archive_tree(tree, tmp_path / "afile")
    assert (tmp_path / "afile").read_text() == "keep"


def test_dest_inside_src_is_refused(tree) -> None:
    with pytest.raises(ValueError, match="inside SRC"):
        archive_tree(tree, tree / "coll")
    assert not (tree / "coll").exists()


@pytest.mark.parametrize("fault", [("write", 1), ("write", 3), ("fsync", 2), ("write", 6)])
def test_storage_faults_fail_the_archive_and_a_rerun_completes(tree, tmp_path, fault) -> None:
    from koochak.storage.testing import Fault, FaultyStore

    op, nth = fault
    dest = tmp_path / "dest"
    faulty = FaultyStore(dest, [Fault(op, nth=nth)])
    with pytest.raises(OSError):
        archive_tree(tree, faulty, object_bytes=20_000, pack_bytes=8192, streams=1)
    assert not (dest / "manifest.json").exists()
    archive_tree(tree, dest, object_bytes=20_000, pack_bytes=8192)
    assert verify_collection(dest, deep=True).ok
