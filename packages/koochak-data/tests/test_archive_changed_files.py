"""A source file rewritten while archive reads it never commits torn (issue 9, defect 4).

The rewrite keeps the size and restores the old mtime, as a careful writer (rsync -t, touch -r)
would: only ctime (and, for a replacement, the inode) tells that the file changed, like tar's
"file changed as we read it".
"""

from __future__ import annotations

import os

import pytest
from koochak.data.archive import archive_tree
from koochak.data.collection import load_collection
from koochak.data.verify import verify_collection

SIZE = 6 << 20  # more than one 4 MiB pack buffer, so the file is read in several pieces


def _rewrite_keeping_size_and_mtime(path, fill: int) -> None:
    before = os.stat(path)
    with open(path, "r+b") as handle:
        handle.write(bytes([fill]) * before.st_size)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def _source(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(b"\x01" * SIZE)
    (src / "small.txt").write_bytes(b"small")
    return src


def test_a_packed_file_rewritten_mid_read_fails_and_the_rerun_commits_the_new_bytes(
    tmp_path, monkeypatch
):
    src = _source(tmp_path)
    target = os.stat(src / "big.bin").st_ino
    real_readv = os.readv
    rewritten = []

    def readv_then_rewrite(fd, buffers):
        got = real_readv(fd, buffers)
        if not rewritten and os.fstat(fd).st_ino == target:
            rewritten.append(True)  # the first piece is old bytes, the rest would be new
            _rewrite_keeping_size_and_mtime(src / "big.bin", 2)
        return got

    monkeypatch.setattr(os, "readv", readv_then_rewrite)
    dest = tmp_path / "dest"
    with pytest.raises(ValueError, match="big.bin: file changed as we read it"):
        archive_tree(src, dest, pack_bytes=64 << 20, object_bytes=1 << 30, streams=1)
    assert rewritten
    assert not (dest / "manifest.json").exists()
    monkeypatch.setattr(os, "readv", real_readv)

    archive_tree(src, dest, pack_bytes=64 << 20, object_bytes=1 << 30, streams=1)
    assert verify_collection(dest, deep=True).ok
    entry = load_collection(dest).by_path()["big.bin"]
    assert entry.pack is not None
    with open(dest / entry.pack, "rb") as pack:
        pack.seek(entry.offset)
        assert pack.read(entry.size) == b"\x02" * SIZE


def test_an_object_rewritten_during_the_copy_fails_and_the_rerun_commits_the_new_bytes(tmp_path):
    src = _source(tmp_path)
    dest = tmp_path / "dest"
    calls = []

    def rewrite_once(n: int) -> None:
        if not calls:
            calls.append(n)
            _rewrite_keeping_size_and_mtime(src / "big.bin", 3)

    with pytest.raises(ValueError, match="big.bin: file changed as we read it"):
        archive_tree(src, dest, object_bytes=1 << 20, streams=1, progress=rewrite_once)
    assert calls and not (dest / "manifest.json").exists()

    archive_tree(src, dest, object_bytes=1 << 20, streams=1)  # no leftover object is in the way
    assert verify_collection(dest, deep=True).ok
    entry = load_collection(dest).by_path()["big.bin"]
    assert entry.object is not None
    assert (dest / entry.object).read_bytes() == b"\x03" * SIZE


def test_a_file_replaced_by_rename_mid_read_is_refused(tmp_path, monkeypatch):
    src = _source(tmp_path)
    target = os.stat(src / "big.bin").st_ino
    real_readv = os.readv
    replaced = []

    def readv_then_replace(fd, buffers):
        got = real_readv(fd, buffers)
        if not replaced and os.fstat(fd).st_ino == target:
            replaced.append(True)
            before = os.stat(src / "big.bin")
            (src / "new.bin").write_bytes(b"\x04" * SIZE)
            os.utime(src / "new.bin", ns=(before.st_atime_ns, before.st_mtime_ns))
            os.replace(src / "new.bin", src / "big.bin")  # same size and mtime, new inode
        return got

    monkeypatch.setattr(os, "readv", readv_then_replace)
    dest = tmp_path / "dest"
    with pytest.raises(ValueError, match="big.bin: file changed as we read it"):
        archive_tree(src, dest, pack_bytes=64 << 20, object_bytes=1 << 30, streams=1)
    assert replaced and not (dest / "manifest.json").exists()
