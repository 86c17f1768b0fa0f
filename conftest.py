"""Fixtures every test folder may use: the real object storage of tools/local_s3.sh.

``local_s3`` makes sure the loopback S3 servers and the two FUSE mounts of tools/local_s3.sh are
up (starting them once, whichever xdist worker gets there first) and returns where they are.
Where they cannot run the tests that use it skip with the reason, except under CI (``CI`` set to
a true value), where they fail: CI never passes by skipping a real counterpart.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
S3_TOOL = ROOT / "tools" / "local_s3.sh"


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


@dataclass(frozen=True)
class LocalS3:
    """Where tools/local_s3.sh's servers and mounts are (see the script's header)."""

    endpoint: str  # moto: honours If-None-Match
    nocond_endpoint: str  # rclone serve s3: ignores If-None-Match
    mount_bucket: str  # the bucket both mounts show
    native_bucket: str  # a bucket for native S3 stores
    nocond_bucket: str
    s3fs_mount: Path
    rclone_mount: Path
    rclone: Path  # the rclone binary (for `rclone copy` baselines)
    rclone_config: Path  # its config, with the remote `moto:`
    env: dict[str, str]  # every KEY=VALUE line of `local_s3.sh env`, credentials included

    @property
    def credentials(self) -> dict[str, str]:
        """The AWS_* variables a client of these servers needs."""
        return {k: v for k, v in self.env.items() if k.startswith("AWS_")}


def _tool(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(S3_TOOL), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def _s3_problem() -> str | None:
    """None when the servers and mounts run (starting them if needed), else why they cannot."""
    if _tool("status", timeout=30).returncode == 0:
        return None
    lock = Path(os.environ.get("TMPDIR", "/tmp"), "koochak-s3.start.lock")
    with open(lock, "w") as handle:  # one starter at a time across xdist workers
        fcntl.flock(handle, fcntl.LOCK_EX)
        if _tool("status", timeout=30).returncode != 0:
            started = _tool("start", timeout=600)
            if started.returncode != 0:
                why = (started.stderr or started.stdout).strip().splitlines()
                return f"tools/local_s3.sh start failed: {why[-1] if why else 'no output'}"
    return None


@pytest.fixture(scope="session")
def local_s3() -> LocalS3:
    problem = _s3_problem()
    if problem is not None:
        if _in_ci():
            pytest.fail(f"CI requires tools/local_s3.sh: {problem}", pytrace=False)
        pytest.skip(problem)
    lines = _tool("env", timeout=30).stdout.splitlines()
    env = dict(line.split("=", 1) for line in lines if "=" in line)
    return LocalS3(
        endpoint=env["KOOCHAK_S3_ENDPOINT"],
        nocond_endpoint=env["KOOCHAK_S3_NOCOND_ENDPOINT"],
        mount_bucket=env["KOOCHAK_S3_MOUNT_BUCKET"],
        native_bucket=env["KOOCHAK_S3_NATIVE_BUCKET"],
        nocond_bucket=env["KOOCHAK_S3_NOCOND_BUCKET"],
        s3fs_mount=Path(env["KOOCHAK_S3FS_MOUNT"]),
        rclone_mount=Path(env["KOOCHAK_RCLONE_MOUNT"]),
        rclone=Path(env["KOOCHAK_S3_RCLONE"]),
        rclone_config=Path(env["KOOCHAK_S3_RCLONE_CONFIG"]),
        env=env,
    )
