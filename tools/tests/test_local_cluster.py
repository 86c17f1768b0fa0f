"""tools/local_cluster.sh's command line without touching the running cluster (the cluster
itself is exercised by tests-integration/cluster), and the settings of tools/local_s3.sh it
uses for its private S3 instance on the bridge."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1]


def _run(tool: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(TOOLS / tool), *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=60)  # fmt: skip


def test_unknown_command_prints_usage_and_exits_64(tmp_path):
    done = _run("local_cluster.sh", "restart", KOOCHAK_CLUSTER_DIR=str(tmp_path))
    assert done.returncode == 64
    assert "install|start|stop|status|env|exec NODE CMD...|kill-node NODE" in done.stderr


def test_an_unknown_node_is_one_line_naming_the_nodes(tmp_path):
    for command in ("exec", "kill-node"):
        done = _run("local_cluster.sh", command, "node3", "true", KOOCHAK_CLUSTER_DIR=str(tmp_path))
        assert done.returncode == 1
        assert done.stderr == "local_cluster: no node 'node3': one of node1 node2\n"


def test_status_of_a_cluster_that_never_started_says_stopped_and_fails(tmp_path):
    done = _run("local_cluster.sh", "status", KOOCHAK_CLUSTER_DIR=str(tmp_path))
    assert done.returncode == 1
    for line in ("munged: stopped", "slurmctld: stopped", "node1: slurmd stopped",
                 "node2: slurmd stopped", "s3: stopped", f"SLURM_CONF={tmp_path}/slurm.conf"):
        assert line in done.stdout.splitlines(), done.stdout  # fmt: skip


def _evaluated(out: str, cwd: Path) -> dict[str, str]:
    """What ``eval "$(local_cluster.sh env)"`` leaves exported in a real bash run in ``cwd``."""
    done = subprocess.run(["bash", "-c", 'eval "$1" && env -0', "bash", out], capture_output=True,
                          text=True, env={"PATH": os.environ["PATH"]}, cwd=cwd,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0 and done.stderr == "", done.stderr
    return dict(item.split("=", 1) for item in done.stdout.split("\0") if "=" in item)


def test_env_selects_the_cluster_and_its_s3_on_the_bridge(tmp_path):
    out = _run("local_cluster.sh", "env", KOOCHAK_CLUSTER_DIR=str(tmp_path)).stdout
    assert all(line.startswith("export ") for line in out.splitlines()), out
    env = _evaluated(out, tmp_path)
    assert env["SLURM_CONF"] == f"{tmp_path}/slurm.conf"
    assert env["KOOCHAK_CLUSTER_NODES"] == "node1 node2"
    assert env["KOOCHAK_CLUSTER_LOCAL"] == "/local"
    assert env["KOOCHAK_CLUSTER_S3_ENDPOINT"] == "http://10.231.77.1:5310"
    assert env["AWS_ACCESS_KEY_ID"] == "test"


def test_env_is_safe_to_eval_with_spaces_and_quotes_in_the_directory(tmp_path):
    odd = tmp_path / "a dir's $(touch pwned) name"
    out = _run("local_cluster.sh", "env", KOOCHAK_CLUSTER_DIR=str(odd)).stdout
    env = _evaluated(out, tmp_path)
    assert env["KOOCHAK_CLUSTER_DIR"] == str(odd)
    assert env["SLURM_CONF"] == f"{odd}/slurm.conf"
    assert env["KOOCHAK_CLUSTER_NODES"] == "node1 node2"
    assert not (tmp_path / "pwned").exists()  # the old unquoted lines ran `touch pwned` here


def test_local_s3_binds_where_told_and_can_leave_the_mounts_out(tmp_path):
    private = {"KOOCHAK_S3_DIR": str(tmp_path), "KOOCHAK_S3_HOST": "10.231.77.1",
               "KOOCHAK_S3_PORT": "5399", "KOOCHAK_S3_MOUNTS": "0"}  # fmt: skip
    env = dict(line.split("=", 1) for line in _run("local_s3.sh", "env", **private).stdout.split())
    assert env["KOOCHAK_S3_ENDPOINT"] == "http://10.231.77.1:5399"
    status = _run("local_s3.sh", "status", **private)
    assert status.returncode == 1 and "moto: stopped" in status.stdout
    assert "s3fs" not in status.stdout and "rclone mount" not in status.stdout
    default = dict(
        line.split("=", 1)
        for line in _run("local_s3.sh", "env", KOOCHAK_S3_DIR=str(tmp_path)).stdout.split()
    )
    assert default["KOOCHAK_S3_ENDPOINT"] == "http://127.0.0.1:5300"  # unchanged by default
