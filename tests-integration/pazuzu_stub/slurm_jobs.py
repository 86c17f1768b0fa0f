"""Helpers for tests that watch real Slurm jobs (importable: conftest puts this folder on sys.path)."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

_FIELD = re.compile(r"(\w+)=(\S*)")


def job_fields(job_id: str) -> dict[str, str]:
    """`scontrol show job -o` as a dict (the job stays known for MinJobAge after it ends)."""
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=True
    )
    return dict(_FIELD.findall(out.stdout))


TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
}


def wait_for_job(job_id: str, timeout: float = 180.0) -> dict[str, str]:
    """Poll until the job is terminal; its fields (JobState, ExitCode 'code:signal', ...)."""
    deadline = time.monotonic() + timeout
    while True:
        fields = job_fields(job_id)
        if fields.get("JobState") in TERMINAL:
            return fields
        if time.monotonic() > deadline:
            raise AssertionError(
                f"Slurm job {job_id} still {fields.get('JobState')} after {timeout} s"
            )
        time.sleep(0.2)


def exit_code(fields: dict[str, str]) -> int:
    """The job's exit status from ExitCode=<code>:<signal>."""
    return int(fields["ExitCode"].split(":")[0])


def wait_for_path(path: Path, timeout: float = 120.0, job_id: str | None = None) -> None:
    """Poll until ``path`` exists; fail early when ``job_id`` ended without making it."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if (
            job_id is not None
            and job_fields(job_id).get("JobState") in TERMINAL
            and not path.exists()
        ):
            raise AssertionError(
                f"Slurm job {job_id} ended ({job_fields(job_id).get('JobState')}) before {path} appeared"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout} s")
        time.sleep(0.1)
