"""tools/local_cluster.sh: two Slurm compute nodes in namespaces, each with its own hostname and
its own node-local disk at the same path, beside (not instead of) the single-node Slurm."""

from __future__ import annotations

import subprocess
import uuid

import pytest


def _run(*cmd: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{cmd}: {done.stderr}"
    return done.stdout


def test_both_nodes_are_idle_and_run_a_two_node_step(cluster_env):
    states = dict(line.split() for line in _run("sinfo", "-h", "-N", "-o", "%N %t").splitlines())
    # idle, or mix/alloc while another test's job runs there
    assert sorted(states) == ["node1", "node2"], states
    assert all(s.startswith(("idle", "mix", "alloc")) for s in states.values()), states
    assert sorted(_run("srun", "-N2", "--time=1", "hostname").split()) == ["node1", "node2"]


def test_each_node_sees_its_own_local_disk(cluster_env):
    name = f"probe-{uuid.uuid4().hex}"
    local = cluster_env.local
    out = _run("srun", "-N2", "--time=1", "bash", "-c",
               f'hostname > {local}/{name}; echo "$(hostname) $(cat {local}/{name}) $(ls {local} | grep -c {name})"')  # fmt: skip
    assert sorted(out.splitlines()) == ["node1 node1 1", "node2 node2 1"]
    for node in ("node1", "node2"):  # the host sees each disk in the node's directory
        path = cluster_env.nodelocal(node) / name
        assert path.read_text() == f"{node}\n"
        path.unlink()


def test_the_nodes_reach_each_other_and_the_s3_server_on_the_bridge(cluster_env):
    import urllib.request

    assert urllib.request.urlopen(cluster_env.s3_endpoint, timeout=10).status == 200
    probe = (f"import urllib.request, socket; print(socket.gethostbyname('node1'), "
             f"urllib.request.urlopen('{cluster_env.s3_endpoint}', timeout=10).status)")  # fmt: skip
    out = _run("srun", "-N1", "-w", "node2", "--time=1", "python3", "-c", probe)
    assert out.split() == ["10.231.77.11", "200"]


def test_the_single_node_slurm_is_left_alone(cluster_env, monkeypatch):
    assert "koochak-cluster" in _run("scontrol", "show", "config")
    monkeypatch.delenv("SLURM_CONF")
    done = subprocess.run(["sinfo", "-h", "-o", "%N"], capture_output=True, text=True, timeout=60)
    assert "node1" not in done.stdout  # /etc/slurm/slurm.conf still names its own cluster


@pytest.mark.slow
def test_start_repairs_what_a_killed_run_left(cluster_alone):
    """The daemons SIGKILLed (pid files, namespaces, veths, the bridge and the munge socket left
    behind): `start` brings both nodes back to a working two-node step."""
    import os
    import signal
    from pathlib import Path

    state = Path(cluster_alone.env["KOOCHAK_CLUSTER_DIR"])
    for pidfile in ("slurmctld.pid", "munge/munged.pid", "slurmd-node1.pid"):
        os.kill(int((state / pidfile).read_text()), signal.SIGKILL)
    assert cluster_alone.tool("status").returncode == 1
    started = cluster_alone.tool("start", timeout=300)
    assert started.returncode == 0, started.stderr
    assert cluster_alone.tool("status").returncode == 0
    assert sorted(_run("srun", "-N2", "--time=1", "hostname").split()) == ["node1", "node2"]
