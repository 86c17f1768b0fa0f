"""Fixtures for the tests on tools/local_cluster.sh's two-node Slurm (node1, node2 in namespaces).

``cluster_env`` makes sure the cluster runs (starting it, one xdist worker at a time, when it
is not) and returns where it is; where it cannot run the tests skip with the script's one-line
reason, except under CI (``CI`` set to a true value), where they fail. ``cluster_env`` points
this test's Slurm clients (sbatch, scontrol, the Pazuzu stand-in) at the cluster's slurm.conf
and boto3 at the cluster's S3 server, leaving the machine-wide single-node Slurm alone.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TOOL = ROOT / "tools" / "local_cluster.sh"
STUB = HERE.parent / "pazuzu_stub"
for path in (HERE, STUB):  # `import pazuzu` (the stand-in), slurm_jobs, cluster_jobs
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


@dataclass(frozen=True)
class LocalCluster:
    env: dict[str, str]  # every `export KEY='VALUE'` line of `local_cluster.sh env`

    @property
    def slurm_conf(self) -> str:
        return self.env["SLURM_CONF"]

    @property
    def nodes(self) -> list[str]:
        return self.env["KOOCHAK_CLUSTER_NODES"].split()

    @property
    def local(self) -> str:
        """The path every node sees its own node-local disk at (/local)."""
        return self.env["KOOCHAK_CLUSTER_LOCAL"]

    def nodelocal(self, node: str) -> Path:
        """Where the host sees ``node``'s node-local disk."""
        return Path(self.env["KOOCHAK_CLUSTER_NODELOCAL"], node)

    @property
    def s3_endpoint(self) -> str:
        return self.env["KOOCHAK_CLUSTER_S3_ENDPOINT"]

    @property
    def s3_bucket(self) -> str:
        return self.env["KOOCHAK_CLUSTER_S3_BUCKET"]

    @property
    def s3_env(self) -> dict[str, str]:
        creds = {k: v for k, v in self.env.items() if k.startswith("AWS_")}
        return {**creds, "AWS_ENDPOINT_URL_S3": self.s3_endpoint}

    def tool(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return _tool(*args, timeout=timeout)


def _tool(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(TOOL), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def _last_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = (done.stderr or done.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit {done.returncode}, no output"


def _cluster_problem() -> str | None:
    """None when the cluster runs (starting it if needed), else why it cannot."""
    if _tool("status", timeout=60).returncode == 0:
        return None
    lock = Path(os.environ.get("TMPDIR", "/tmp"), "koochak-cluster.start.lock")
    with open(lock, "w") as handle:  # one starter at a time across xdist workers
        fcntl.flock(handle, fcntl.LOCK_EX)
        if _tool("status", timeout=60).returncode != 0:
            started = _tool("start", timeout=600)
            if started.returncode != 0:
                return f"tools/local_cluster.sh start failed: {_last_line(started)}"
    return None


def ensure_cluster() -> LocalCluster:
    """The running cluster (restarting a node a test lost), or skip/fail with the reason."""
    problem = _cluster_problem()
    if problem is not None:
        if _in_ci():
            pytest.fail(f"CI requires the two-node cluster: {problem}", pytrace=False)
        pytest.skip(problem)
    return LocalCluster(parse_env(_tool("env", timeout=60).stdout))


def parse_env(text: str) -> dict[str, str]:
    """The variables of ``local_cluster.sh env``'s ``export KEY='VALUE'`` lines (shell-quoted)."""
    env = {}
    for line in text.splitlines():
        words = shlex.split(line)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            key, value = words[1].split("=", 1)
            env[key] = value
    return env


def _cluster_lock(mode: int):
    """Tests share the nodes (LOCK_SH); a test that loses a node has them alone (LOCK_EX), so
    no other xdist worker's job is on node2 when it dies."""
    lock = Path(os.environ.get("TMPDIR", "/tmp"), "koochak-cluster.tests.lock")
    handle = open(lock, "w")  # noqa: SIM115 (closed by the fixture that holds the lock)
    fcntl.flock(handle, mode)
    return handle


def _exported(cluster: LocalCluster, monkeypatch) -> LocalCluster:
    monkeypatch.setenv("SLURM_CONF", cluster.slurm_conf)
    for name, value in cluster.s3_env.items():
        monkeypatch.setenv(name, value)
    return cluster


@pytest.fixture
def cluster_env(monkeypatch):
    """The cluster, with SLURM_CONF and the S3 settings exported for this test."""
    with _cluster_lock(fcntl.LOCK_SH):
        yield _exported(ensure_cluster(), monkeypatch)


@pytest.fixture
def cluster_alone(monkeypatch):
    """``cluster_env`` with no other test on the cluster meanwhile; restores lost nodes after."""
    with _cluster_lock(fcntl.LOCK_EX):
        yield _exported(ensure_cluster(), monkeypatch)
        ensure_cluster()
