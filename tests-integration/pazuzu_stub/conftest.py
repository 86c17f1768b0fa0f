"""Fixtures for the tests that need Pazuzu's stand-in and the real local Slurm.

``local_slurm`` makes sure tools/local_slurm.sh's single-node Slurm is up (starting it when it
is installed but not running) and otherwise skips with the reason; under CI (``CI`` set to a
true value) a Slurm that cannot run fails the test instead, so CI never passes by skipping.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TOOL = ROOT / "tools" / "local_slurm.sh"
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # `import pazuzu` finds the stub


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def _node_state() -> str:
    try:
        out = subprocess.run(["sinfo", "-h", "-n", "localhost", "-o", "%t"],
                             capture_output=True, text=True, timeout=20)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"sinfo failed: {exc}"
    return out.stdout.strip() if out.returncode == 0 else f"sinfo failed: {out.stderr.strip()}"


def _usable(state: str) -> bool:
    return state.startswith(("idle", "mix", "alloc"))


def _slurm_problem() -> str | None:
    """None when the local Slurm runs, else why it cannot."""
    missing = [p for p in ("sbatch", "slurmctld", "slurmd", "munged") if shutil.which(p) is None]
    if missing:
        return (
            f"Slurm is not installed (missing {', '.join(missing)}); run tools/local_slurm.sh start"
        )
    if _usable(_node_state()):
        return None
    lock = Path(os.environ.get("TMPDIR", "/tmp"), "koochak-slurm.start.lock")
    with open(lock, "w") as handle:  # one starter at a time across xdist workers
        fcntl.flock(handle, fcntl.LOCK_EX)
        if not _usable(_node_state()):
            started = subprocess.run(
                [str(TOOL), "start"], capture_output=True, text=True, timeout=300
            )
            if started.returncode != 0:
                return f"tools/local_slurm.sh start failed: {(started.stderr or started.stdout).strip()}"
    state = _node_state()
    return None if _usable(state) else f"the local Slurm node is not usable: {state}"


@pytest.fixture(scope="session")
def local_slurm() -> None:
    problem = _slurm_problem()
    if problem is None:
        return
    if _in_ci():
        pytest.fail(f"CI requires the local Slurm (tools/local_slurm.sh): {problem}", pytrace=False)
    pytest.skip(problem)
