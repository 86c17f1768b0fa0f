"""Required files on flaky mounts: settling errors are waited out, everything else is not."""

from __future__ import annotations

import errno
import os

import pytest
from koochak.jobs.preflight import PreflightError
from koochak.jobs.requirements import interpreter_flags, wait_for_file


class FlakyMount:
    """Opens fail with ``errors`` in turn, then the real file opens."""

    def __init__(self, errors):
        self.errors = list(errors)
        self.calls = 0

    def __call__(self, path):
        self.calls += 1
        if self.errors:
            code = self.errors.pop(0)
            raise OSError(code, os.strerror(code), path)
        return os.open(path, os.O_RDONLY)


class Clock:
    def __init__(self):
        self.now = 0.0
        self.slept = []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds


def test_a_file_that_appears_after_a_few_eio_and_etime_is_waited_for(tmp_path):
    path = tmp_path / "shard.bin"
    path.write_bytes(b"data")
    mount = FlakyMount([errno.EIO, errno.EIO, errno.ETIME, errno.ENOTCONN])
    clock = Clock()
    wait_for_file(str(path), 900, opener=mount, clock=clock, sleep=clock.sleep)
    assert mount.calls == 5
    assert clock.slept == sorted(clock.slept)  # backing off


def test_settling_errors_past_the_deadline_fail_naming_the_file(tmp_path):
    path = tmp_path / "shard.bin"
    clock = Clock()
    mount = FlakyMount([errno.EIO] * 10_000)
    with pytest.raises(PreflightError, match="after 30 s.*shard.bin") as info:
        wait_for_file(str(path), 30, opener=mount, clock=clock, sleep=clock.sleep)
    assert info.value.check == "requirements.files"
    assert clock.now == pytest.approx(30, abs=5.1)


def test_other_errors_are_not_retried(tmp_path):
    mount = FlakyMount([errno.EACCES])
    with pytest.raises(PreflightError, match="unavailable: .*x.bin"):
        wait_for_file(str(tmp_path / "x.bin"), 900, opener=mount)
    assert mount.calls == 1
    with pytest.raises(PreflightError, match="not a regular file"):
        wait_for_file(str(tmp_path), 900)


def test_interpreter_flags_are_the_leading_options_only():
    assert interpreter_flags(["/py", "-I", "-u", "-m", "pkg", "-I"]) == ["-I", "-u"]
    assert interpreter_flags(["/py", "script.py", "-I"]) == []
