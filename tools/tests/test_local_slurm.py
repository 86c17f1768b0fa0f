"""tools/local_slurm.sh's command line, without starting a second cluster (the real cluster is
exercised by the Slurm tests in tests-integration/pazuzu_stub)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "local_slurm.sh"


def _tool(*args: str, state_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "KOOCHAK_SLURM_DIR": str(state_dir)}
    return subprocess.run([str(TOOL), *args], capture_output=True, text=True, env=env, timeout=60)


def test_unknown_command_prints_usage_and_exits_64(tmp_path):
    done = _tool("restart", state_dir=tmp_path)
    assert done.returncode == 64 and "usage:" in done.stderr and "start|stop|status" in done.stderr


def test_status_of_a_cluster_that_never_started_says_stopped_and_fails(tmp_path):
    done = _tool("status", state_dir=tmp_path)
    assert done.returncode == 1
    assert done.stdout.splitlines()[:3] == [
        "munged: stopped",
        "slurmctld: stopped",
        "slurmd: stopped",
    ]
    assert f"SLURM_CONF={tmp_path}/slurm.conf" in done.stdout


def test_stop_without_daemons_is_harmless(tmp_path):
    done = _tool("stop", state_dir=tmp_path)
    assert done.returncode == 0 and "stopped" in done.stderr
