"""The one write-once stager: the same function stages locally and, shipped as source, remotely.

(Its no-op, refusal and race behaviour is tested through both callers in test_backends.py and
test_manifest.py; here what only the merged writer promises.)"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys

import pytest
from koochak.jobs.staging import stage_write_once, staging_program
from koochak.storage.keys import TEMP_PREFIX
from koochak.storage.store import LocalStore


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_the_shipped_program_needs_nothing_but_the_standard_library(tmp_path):
    # -S: no site-packages, so no koochak at all; the program must still stage.
    probe = subprocess.run([sys.executable, "-I", "-S", "-c", "import koochak.jobs"])
    assert probe.returncode != 0
    target = tmp_path / "launch.json"
    argv = [sys.executable, "-I", "-S", "-c", staging_program(), str(target), _digest(b"m")]
    done = subprocess.run(argv, input=b"m", capture_output=True, check=True)
    assert done.stdout == b"written\n"
    assert target.read_bytes() == b"m" and stat.S_IMODE(target.stat().st_mode) == 0o444
    again = subprocess.run(argv, input=b"m", capture_output=True, check=True)
    assert again.stdout == b"unchanged\n"
    refused = subprocess.run(argv[:-1] + [_digest(b"n")], input=b"n", capture_output=True)
    assert refused.returncode == 1
    assert b"FileExistsError: " in refused.stderr
    assert b"refusing to replace different artifact" in refused.stderr


def test_a_crashed_stagers_temp_is_hidden_from_a_store_over_the_same_directory(
    tmp_path, monkeypatch
):
    def crash(*args, **kwargs):
        raise OSError("the node died here")

    monkeypatch.setattr(os, "link", crash)
    monkeypatch.setattr(os, "unlink", lambda path: None)  # ... before it could clean up
    with pytest.raises(OSError, match="the node died here"):
        stage_write_once(str(tmp_path / "config.yaml"), b"x", _digest(b"x"))
    monkeypatch.undo()
    (leftover,) = os.listdir(tmp_path)
    assert leftover.startswith(TEMP_PREFIX)
    assert LocalStore(tmp_path).list() == []


def test_a_fifo_in_the_way_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "launch.json"
    os.mkfifo(fifo)
    with pytest.raises(FileExistsError, match="refusing to stage over a non-regular file"):
        stage_write_once(str(fifo), b"x", _digest(b"x"))


def test_a_directory_in_the_way_is_refused(tmp_path):
    (tmp_path / "launch.json").mkdir()
    with pytest.raises(FileExistsError, match="refusing to stage over a non-regular file"):
        stage_write_once(str(tmp_path / "launch.json"), b"x", _digest(b"x"))


def test_different_bytes_of_the_same_size_are_refused_naming_both_digests(tmp_path):
    target = tmp_path / "config.yaml"
    stage_write_once(str(target), b"one", _digest(b"one"))
    with pytest.raises(FileExistsError) as caught:
        stage_write_once(str(target), b"two", _digest(b"two"))
    assert _digest(b"one") in str(caught.value) and _digest(b"two") in str(caught.value)
    assert target.read_bytes() == b"one"
