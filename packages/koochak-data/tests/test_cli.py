"""The koochak-data command: summaries, --json, exit codes, one-line errors, and SIGKILL reruns."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from koochak.data.cli import main


def _write(root: Path, rel: str, size: int, seed: int = 0) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(random.Random(seed).randbytes(size))


@pytest.fixture
def src(tmp_path) -> Path:
    root = tmp_path / "src"
    for i in range(20):
        _write(root, f"part{i % 3}/file{i:03d}.dat", 200 + 97 * i, seed=i)
    _write(root, "large/model.bin", 30_000, seed=99)
    return root


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_archive_verify_ls_pull_round_trip(src, tmp_path, capsys) -> None:
    dest, out = str(tmp_path / "coll"), str(tmp_path / "out")
    code, text, _ = _run(capsys, "archive", str(src), dest, "--object-bytes", "20K")
    assert code == 0 and "committed" in text and "21 (" in text and "0 reused" in text
    code, text, _ = _run(capsys, "archive", str(src), dest, "--object-bytes", "20K")
    assert code == 0 and "already committed" in text and "reused" not in text
    code, text, _ = _run(capsys, "verify", dest, "--deep", "--json")
    report = json.loads(text)
    assert code == 0 and report["ok"] and report["deep"] and report["files"] == 21
    code, text, _ = _run(capsys, "ls", dest, "--include", "part1/*")
    assert text.split() == sorted(f"part1/file{i:03d}.dat" for i in range(1, 20, 3))
    code, text, _ = _run(capsys, "ls", dest, "--long", "--include", "*.bin")
    assert "objects/large/model.bin" in text and text.startswith("0644")
    code, text, _ = _run(capsys, "pull", dest, out, "--json")
    assert code == 0 and json.loads(text)["written"] == 21
    assert (Path(out) / "large/model.bin").read_bytes() == (src / "large/model.bin").read_bytes()


def test_dry_run_reports_and_writes_nothing(src, tmp_path, capsys) -> None:
    dest = tmp_path / "coll"
    code, text, _ = _run(capsys, "archive", str(src), str(dest), "--dry-run", "--json",
                         "--pack-bytes", "8K", "--object-bytes", "20K")
    report = json.loads(text)
    assert code == 0 and report["dry_run"] and report["files"] == 21 and report["objects"] == 1
    assert report["packs"] > 1 and report["requests"]["target_puts"] > report["packs"]
    assert not dest.exists()
    groups = tmp_path / "groups.csv"
    groups.write_text("path,group\npart0/file000.dat,g\npart0/typo.dat,g\n")
    code, text, _ = _run(capsys, "archive", str(src), str(dest), "--dry-run", "--groups", str(groups))
    assert code == 0 and "dry run (nothing written)" in text and "reused" not in text
    assert "skipped           none" in text and "puts to write it" in text
    assert "1 row(s) of --groups name no archived file" in text and "part0/typo.dat" in text


def test_verify_exits_1_on_problems(src, tmp_path, capsys) -> None:
    dest = tmp_path / "coll"
    assert _run(capsys, "archive", str(src), str(dest), "--object-bytes", "20K")[0] == 0
    pack = dest / "packs" / "pack-000000.tar"
    data = bytearray(pack.read_bytes())
    data[700] ^= 1
    pack.unlink()
    pack.write_bytes(bytes(data))
    code, text, _ = _run(capsys, "verify", str(dest))
    assert code == 0  # sizes still match
    code, text, _ = _run(capsys, "verify", str(dest), "--deep")
    assert code == 1 and "SHA256 differs" in text
    (dest / "objects" / "large" / "model.bin").unlink()
    code, text, _ = _run(capsys, "verify", str(dest), "--json")
    assert code == 1 and json.loads(text)["problems"][0]["message"] == "missing"


def test_errors_are_one_line_without_traceback(tmp_path, capsys) -> None:
    code, out, err = _run(capsys, "verify", str(tmp_path / "nothing"))
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("koochak-data verify: error:")
    link_src = tmp_path / "s"
    link_src.mkdir()
    os.symlink("/etc/hostname", link_src / "l")
    code, _, err = _run(capsys, "archive", str(link_src), str(tmp_path / "d"))
    assert code == 1 and "--skip-symlinks" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exc:
        main(["archive", str(link_src), str(tmp_path / "d"), "--pack-bytes", "lots"])
    assert exc.value.code == 2


def test_delete_source_cli(src, tmp_path, capsys) -> None:
    dest = tmp_path / "coll"
    code, text, _ = _run(capsys, "archive", str(src), str(dest), "--delete-source", "--dry-run")
    assert code == 0 and "a dry run deletes nothing" in text and "FAILED" not in text
    assert len([p for p in src.rglob("*") if p.is_file()]) == 21 and not dest.exists()
    code, text, _ = _run(capsys, "archive", str(src), str(dest), "--delete-source")
    assert code == 0
    assert "sources deleted  21" in text and "deep verify      ok" in text
    assert not any(p.is_file() for p in src.rglob("*"))
    code, _, _ = _run(capsys, "verify", str(dest), "--deep")
    assert code == 0


@pytest.mark.slow
def test_console_script_and_module_entry_point(src, tmp_path) -> None:
    exe = Path(sys.executable).with_name("koochak-data")
    dest = tmp_path / "coll"
    done = subprocess.run([str(exe), "archive", str(src), str(dest), "--json"],
                          capture_output=True, text=True, check=True)
    assert json.loads(done.stdout)["files"] == 21 and done.stderr == ""  # no bar off a TTY
    listed = subprocess.run([sys.executable, "-m", "koochak.data", "ls", str(dest)],
                            capture_output=True, text=True, check=True)
    assert len(listed.stdout.split()) == 21
    bad = subprocess.run([sys.executable, "-m", "koochak.data", "pull", str(tmp_path / "no"),
                          str(tmp_path / "o")], capture_output=True, text=True)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr


# ------------------------------------------------------------------------- kill -9 and rerun


def _big_tree(root: Path) -> None:
    for i in range(600):
        _write(root, f"g{i % 7}/f{i:04d}.bin", 1000 + (i * 37) % 9000, seed=i)
    for i in range(3):
        _write(root, f"large/obj{i}.bin", 3_000_000, seed=1000 + i)


def _cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "koochak.data", *argv]


def _seconds(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True)
    return time.perf_counter() - start


def _kill_at_random_points(
    argv: list[str], seconds: float, seed: int, reset: Callable[[], None],
    after_kill: Callable[[], None] = lambda: None,
) -> int:
    """Start the command and SIGKILL it at random moments inside its run; returns the kills.

    ``seconds`` is how long one whole run took here, so kills land inside the work however
    fast or loaded the machine is. A run that finished before its kill is undone with
    ``reset`` and tried again with an earlier kill, until two kills have landed.
    """
    rng = random.Random(seed)
    kills = 0
    scale = 1.0
    for _ in range(12):
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(rng.uniform(0.3, 0.9) * seconds * scale)
        if proc.poll() is not None:
            _, err = proc.communicate()
            assert proc.returncode == 0, err.decode()
            reset()
            scale *= 0.7
            continue
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        after_kill()
        if kills == 2:
            break
    return kills


@pytest.mark.slow
def test_archive_killed_at_random_points_resumes_and_verifies(tmp_path) -> None:
    src, dest = tmp_path / "src", tmp_path / "coll"
    _big_tree(src)
    options = ["--pack-bytes", "64K", "--object-bytes", "1M", "--streams", "1"]
    seconds = _seconds(_cli("archive", str(src), str(tmp_path / "timing"), *options))
    argv = _cli("archive", str(src), str(dest), *options)
    kills = _kill_at_random_points(
        argv, seconds, seed=1, reset=lambda: shutil.rmtree(dest, ignore_errors=True)
    )
    assert kills >= 1
    subprocess.run(argv, check=True, capture_output=True)
    verified = subprocess.run(_cli("verify", str(dest), "--deep", "--json"),
                              capture_output=True, text=True)
    assert verified.returncode == 0, verified.stdout
    assert json.loads(verified.stdout)["files"] == 603


@pytest.mark.slow
def test_pull_killed_at_random_points_leaves_no_partial_file(tmp_path) -> None:
    src, dest, out = tmp_path / "src", tmp_path / "coll", tmp_path / "out"
    _big_tree(src)
    subprocess.run(_cli("archive", str(src), str(dest), "--pack-bytes", "256K",
                        "--object-bytes", "1M"), check=True, capture_output=True)
    argv = _cli("pull", str(dest), str(out), "--streams", "1")
    seconds = _seconds(_cli("pull", str(dest), str(tmp_path / "timing"), "--streams", "1"))

    def only_complete_files() -> None:
        for path in out.rglob("*"):
            rel = path.relative_to(out)
            # Temps, the lock, and a new directory still staged under its hidden name (its
            # files are named but the directory is not in place: the next pull removes it).
            if path.is_file() and not any(p.startswith(".koochak-pull") for p in rel.parts):
                assert path.read_bytes() == (src / rel).read_bytes(), rel

    kills = _kill_at_random_points(
        argv, seconds, seed=2, reset=lambda: shutil.rmtree(out, ignore_errors=True),
        after_kill=only_complete_files,
    )
    assert kills >= 1
    subprocess.run(argv, check=True, capture_output=True)
    for path in src.rglob("*"):
        if path.is_file():
            restored = out / path.relative_to(src)
            assert restored.read_bytes() == path.read_bytes()
            assert restored.stat().st_mtime_ns == path.stat().st_mtime_ns
    # The killed runs' temp files are gone (their tokens were in the lock file), and so is the lock.
    assert not list(out.rglob(".koochak-pull*"))


def test_scheme_dest_and_empty_tree(tmp_path, capsys) -> None:
    from koochak.storage.store import LocalStore, register_store

    register_store("clitest", lambda rest: LocalStore(tmp_path / "tier" / rest))
    empty = tmp_path / "empty"
    empty.mkdir()
    code, text, _ = _run(capsys, "archive", str(empty), "clitest://sets/none", "--json")
    assert code == 0 and json.loads(text)["files"] == 0
    assert (tmp_path / "tier" / "sets" / "none" / "manifest.json").exists()
    code, text, _ = _run(capsys, "ls", "clitest://sets/none")
    assert code == 0 and text == ""
    assert _run(capsys, "pull", "clitest://sets/none", str(tmp_path / "o"))[0] == 0


def test_progress_bar_can_be_forced(src, tmp_path, capsys) -> None:
    code, _, err = _run(capsys, "archive", str(src), str(tmp_path / "c"), "--progress")
    assert code == 0 and "archive" in err and "100%" in err
    code, _, err = _run(capsys, "verify", str(tmp_path / "c"), "--deep")
    assert code == 0 and err == ""  # not a terminal: quiet


def test_progress_bar_shows_on_a_terminal_by_default(src, tmp_path, monkeypatch) -> None:
    import io

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for argv in (["archive", str(src), str(tmp_path / "c")],
                 ["verify", str(tmp_path / "c"), "--deep"],
                 ["pull", str(tmp_path / "c"), str(tmp_path / "out")]):
        terminal = Terminal()
        monkeypatch.setattr(sys, "stderr", terminal)
        assert main(argv) == 0
        assert f"{argv[0]}:" in terminal.getvalue() and "100%" in terminal.getvalue(), argv


def test_no_command_ever_lists_storage(src, tmp_path, capsys) -> None:
    # Object-storage mounts make listing slow or forbid it: every command must work from the
    # manifest (and shards from index.json) alone.
    from koochak.data.shards import ShardWriter, load_index, read_shards
    from koochak.storage.store import LocalStore, register_store

    class NoListing(LocalStore):
        def list(self, prefix: str = ""):  # type: ignore[override]
            raise AssertionError(f"listed {prefix!r}")

    register_store("nolist", lambda rest: NoListing(tmp_path / "tier" / rest))
    dest = "nolist://sets/c"
    for argv in (["archive", str(src), dest, "--object-bytes", "20K"],
                 ["archive", str(src), dest, "--object-bytes", "20K"],  # rerun: committed
                 ["ls", dest, "--long"], ["verify", dest, "--deep"],
                 ["pull", dest, str(tmp_path / "out")], ["pull", dest, str(tmp_path / "out")]):
        code, _, err = _run(capsys, *argv)
        assert code == 0, (argv, err)
    store = NoListing(tmp_path / "tier" / "shards")
    with ShardWriter(store, "ds", target_bytes=2048) as writer:
        for i in range(10):
            writer.write({"__key__": f"k{i}", "bin": bytes(600)})
    assert len(list(read_shards(store, load_index(store, "ds")))) == 10
