"""pull never destroys or misreports data (issue 9, defects 1-3, and two pulls into one DEST):
temp names never collide with restored files, an mtime the filesystem cannot hold is refused
naming the file (and reruns agree), a FIFO pack or object fails at once instead of hanging, and
a second pull into a DEST that another pull is writing fails with a plain one-line message."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from koochak.data.archive import archive_tree
from koochak.data.cli import main
from koochak.data.pull import pull_collection

LOCK_NAME = ".koochak-pull.lock"  # koochak.data.pull.LOCK_NAME, spelled out as documented


def _old_temp_name(name: str) -> str:
    """The temp name pull used to give ``name``'s file (and unlink if something held it)."""
    return ".koochak-pull-" + hashlib.sha256(name.encode()).hexdigest()[:20] + ".tmp"


def _rewrite_table(coll: Path, edit) -> None:
    lines = [
        json.loads(x) for x in gzip.decompress((coll / "files.jsonl.gz").read_bytes()).splitlines()
    ]
    edit(lines)
    table = gzip.compress("".join(json.dumps(x) + "\n" for x in lines).encode())
    manifest = json.loads((coll / "manifest.json").read_text())
    manifest["files_table"].update(size=len(table), sha256=hashlib.sha256(table).hexdigest())
    for path in ("files.jsonl.gz", "manifest.json"):
        (coll / path).unlink()
    (coll / "files.jsonl.gz").write_bytes(table)
    (coll / "manifest.json").write_text(json.dumps(manifest))


def _archive(tmp_path, files: dict[str, bytes], **kwargs) -> Path:
    src = tmp_path / "src"
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    coll = tmp_path / "coll"
    archive_tree(src, coll, **kwargs)
    return coll


def _no_hang(call, seconds: float = 60.0):
    outcome: list[BaseException | None] = []

    def run():
        try:
            call()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, "pull is blocked (it opened a FIFO without O_NONBLOCK)"
    return outcome[0]


def test_a_file_named_like_a_siblings_temp_file_is_restored_and_counted(tmp_path):
    files = {"d/a.txt": b"alpha", f"d/{_old_temp_name('a.txt')}": b"user data, not a temp file"}
    coll = _archive(tmp_path, files)
    out = tmp_path / "out"
    report = pull_collection(coll, out)
    assert report.written == 2 and sorted(report.paths) == sorted(files)
    for rel, data in files.items():
        assert (out / rel).read_bytes() == data
    assert sorted(os.listdir(out / "d")) == sorted(Path(rel).name for rel in files)


def test_a_user_file_in_dest_with_a_temp_like_name_is_never_touched(tmp_path):
    coll = _archive(tmp_path, {"a.txt": b"alpha"})
    out = tmp_path / "out"
    out.mkdir()
    (out / _old_temp_name("a.txt")).write_bytes(b"mine")
    pull_collection(coll, out)
    assert (out / _old_temp_name("a.txt")).read_bytes() == b"mine"
    assert (out / "a.txt").read_bytes() == b"alpha"


YEAR_1800 = -5_364_662_400 * 10**9
YEAR_2500 = 16_725_225_600 * 10**9  # beyond what a signed 64-bit count of ns can hold


@pytest.mark.parametrize("mtime_ns", [YEAR_1800, YEAR_2500, 2**70], ids=["1800", "2500", "2**70"])
def test_an_mtime_the_filesystem_cannot_hold_is_refused_naming_the_file_and_reruns_agree(
    tmp_path, mtime_ns
):
    coll = _archive(tmp_path, {"a.txt": b"alpha", "b.txt": b"beta"})
    _rewrite_table(
        coll, lambda lines: [x.update(mtime_ns=mtime_ns) for x in lines if x["path"] == "a.txt"]
    )
    out = tmp_path / "out"

    def outcome():
        try:
            pull_collection(coll, out)
        except ValueError as exc:
            assert "\n" not in str(exc)
            return str(exc)
        return None

    first = outcome()
    if first is None:  # this filesystem holds the time: it must be restored exactly
        assert os.stat(out / "a.txt").st_mtime_ns == mtime_ns
    else:
        assert f"{out / 'a.txt'}: mtime_ns={mtime_ns}" in first and "not written" in first
        assert not (out / "a.txt").exists()
    assert (out / "b.txt").read_bytes() == b"beta"  # the other files are restored either way
    second = outcome()
    assert (first is None) == (second is None)
    if first is not None:
        assert "1 file(s) could not be restored exactly" in second


@pytest.mark.parametrize("where", ["pack", "object"])
def test_a_fifo_in_place_of_a_pack_or_object_fails_at_once(tmp_path, where):
    coll = _archive(
        tmp_path, {"small.txt": b"s" * 100, "big.bin": b"b" * 50_000}, object_bytes=10_000
    )
    key = "packs/pack-000000.tar" if where == "pack" else "objects/big.bin"
    (coll / key).unlink()
    os.mkfifo(coll / key)
    error = _no_hang(lambda: pull_collection(coll, tmp_path / "out"))
    assert isinstance(error, FileNotFoundError) and key in str(error)


def test_a_second_pull_into_the_same_dest_fails_plainly_while_the_first_finishes(tmp_path):
    coll = _archive(tmp_path, {f"f{i}.bin": bytes([i]) * 3000 for i in range(6)}, object_bytes=1000)
    out = tmp_path / "out"
    started, release = threading.Event(), threading.Event()
    first: list[BaseException | None] = []

    def slow_progress(n: int) -> None:
        started.set()
        assert release.wait(120), "the test never released the first pull"

    def first_pull():
        try:
            pull_collection(coll, out, progress=slow_progress, streams=1)
            first.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            first.append(exc)

    thread = threading.Thread(target=first_pull)
    thread.start()
    try:
        assert started.wait(120)
        second = subprocess.run(
            [sys.executable, "-m", "koochak.data", "pull", str(coll), str(out)],
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        release.set()
        thread.join(120)
    assert second.returncode == 1
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and "another pull is writing into" in lines[0] and str(out) in lines[0]
    assert first == [None]
    assert not (out / LOCK_NAME).exists()  # released and removed when the first pull ended
    assert sorted(os.listdir(out)) == [f"f{i}.bin" for i in range(6)]
    again = subprocess.run(
        [sys.executable, "-m", "koochak.data", "pull", str(coll), str(out), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0 and json.loads(again.stdout)["present"] == 6


def test_a_foreign_file_where_the_lock_goes_is_refused_and_kept(tmp_path, capsys):
    coll = _archive(tmp_path, {"a.txt": b"alpha"})
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).write_bytes(b"my notes")
    assert main(["pull", str(coll), str(out)]) == 1
    err = capsys.readouterr().err
    assert "is not a koochak-data pull lock" in err and len(err.strip().splitlines()) == 1
    assert (out / LOCK_NAME).read_bytes() == b"my notes"
    assert not (out / "a.txt").exists()


def test_a_lock_left_by_a_killed_pull_is_taken_over_and_only_its_temp_files_go(tmp_path):
    coll = _archive(tmp_path, {"a.txt": b"alpha", "d/b.txt": b"beta"})
    out = tmp_path / "out"
    (out / "d").mkdir(parents=True)
    from koochak.data import _dest_lock
    from koochak.data import pull as pull_module

    assert pull_module.LOCK_NAME == LOCK_NAME
    killed = "ab" * 16
    (out / LOCK_NAME).write_bytes(_dest_lock._MAGIC + f"run {killed} pid 1\n".encode())
    theirs = out / "d" / f".koochak-pull-{killed}-{'c' * 32}.tmp"
    theirs.write_bytes(b"half a file from the killed pull")
    unknown = (
        out / "d" / f".koochak-pull-{'ef' * 16}-{'c' * 32}.tmp"
    )  # no lock line: not provably a pull's
    unknown.write_bytes(b"keep")
    report = pull_collection(coll, out)
    assert report.written == 2 and report.leftovers_removed == 1
    assert not theirs.exists() and unknown.read_bytes() == b"keep"
    assert sorted(os.listdir(out)) == ["a.txt", "d"]
    assert sorted(os.listdir(out / "d")) == sorted(["b.txt", unknown.name])


def test_a_collection_file_named_like_a_killed_pulls_temp_file_is_kept(tmp_path):
    killed = "ab" * 16
    name = f".koochak-pull-{killed}-{'c' * 32}.tmp"
    coll = _archive(tmp_path, {name: b"archived on purpose"})
    out = tmp_path / "out"
    pull_collection(coll, out)
    from koochak.data import _dest_lock

    (out / LOCK_NAME).write_bytes(_dest_lock._MAGIC + f"run {killed} pid 1\n".encode())
    assert pull_collection(coll, out).leftovers_removed == 0
    assert (out / name).read_bytes() == b"archived on purpose"


def test_a_dest_without_flock_still_pulls_and_cleans_up_nothing(tmp_path, monkeypatch, caplog):
    import errno
    import fcntl

    coll = _archive(tmp_path, {"a.txt": b"alpha"})
    out = tmp_path / "out"
    out.mkdir()
    from koochak.data import _dest_lock

    killed = "ab" * 16
    (out / LOCK_NAME).write_bytes(_dest_lock._MAGIC + f"run {killed} pid 1\n".encode())
    maybe_live = out / f".koochak-pull-{killed}-{'c' * 32}.tmp"
    maybe_live.write_bytes(b"without a lock nobody can tell this pull is dead")

    def no_flock(fd, operation):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    report = pull_collection(coll, out)
    assert report.written == 1 and report.leftovers_removed == 0
    assert maybe_live.exists() and "not serialized" in caplog.text


def test_new_directories_appear_only_whole_and_a_killed_pulls_staged_one_goes(tmp_path):
    """A directory DEST lacks is filled under a hidden name and renamed into place at the end:
    while the pull writes, no file of it is visible under its final path."""
    files = {f"d/sub/f{i}.bin": bytes([i]) * (100 + i) for i in range(6)}
    files["top.txt"] = b"top"
    coll = _archive(tmp_path, files)
    out = tmp_path / "out"
    out.mkdir()
    from koochak.data import _dest_lock

    killed = "ab" * 16
    (out / LOCK_NAME).write_bytes(_dest_lock._MAGIC + f"run {killed} pid 1\n".encode())
    staged = out / f".koochak-pull-{killed}-{'c' * 32}.tmp"  # a killed pull's staged directory
    (staged / "sub").mkdir(parents=True)
    (staged / "sub" / "f0.bin").write_bytes(b"half")
    seen = []

    def progress(_bytes):
        seen.append((out / "d").exists())

    report = pull_collection(coll, out, progress=progress, streams=1)
    assert report.written == 7 and report.leftovers_removed == 1
    assert len(seen) == 7 and not any(seen)  # d/ appears only once all its files are whole
    assert (out / "d").is_dir()
    assert not staged.exists()
    assert sorted(os.listdir(out)) == ["d", "top.txt"]
    for rel, data in files.items():
        assert (out / rel).read_bytes() == data
    assert not [p for p in out.rglob(".koochak-pull-*")]
