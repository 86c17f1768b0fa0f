"""Scenario 4, a rank hung on node2 (its step_fn blocks forever from step 3): the job ends well
before its time limit, on every node, with the reason in its log. The bound is the collective
timeout of the gloo group (rank 0 on node1 gives up waiting for node2 in the gradient
all-reduce; KOOCHAK_COLLECTIVE_TIMEOUT_S, torch's default is 30 minutes) plus srun's --wait. In
practice node2's launcher loses the rendezvous store with node1's launcher and stops its hung
rank within seconds; srun kills whatever is left KOOCHAK_NODES_WAIT_S after node1's launcher
ended (60 s by default)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

COLLECTIVE_TIMEOUT_S = 20
WAIT_S = 15


def _processes_of(run_dir: str) -> list[int]:
    """Live processes whose command line names this run (its runner's manifest)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path("/proc", entry, "cmdline").read_bytes()
        except OSError:
            continue
        if run_dir.encode() in cmdline:
            pids.append(int(entry))
    return pids


def test_a_hung_rank_ends_the_job_on_every_node_within_the_bound(
    cluster_env, tmp_path, monkeypatch
):
    from cluster_jobs import ended, logs, prepare, resources, submit, wait_for
    from cluster_user import CONFIG
    from slurm_jobs import exit_code, wait_for_path

    monkeypatch.setenv("KOOCHAK_NODES_WAIT_S", str(WAIT_S))  # sbatch exports it to the job
    run = prepare(tmp_path, "hung", CONFIG, HANG_ON="node2", HANG_AT="3",
                  KOOCHAK_COLLECTIVE_TIMEOUT_S=str(COLLECTIVE_TIMEOUT_S))  # fmt: skip
    handle = submit(run, resources())  # a 10-minute time limit
    wait_for_path(Path(run.run_dir) / "hung-node2", timeout=300, job_id=handle.job_id)
    # Ended long before the time limit: the collective timeout, then srun's wait, then teardown.
    fields = wait_for(handle.job_id, ended, COLLECTIVE_TIMEOUT_S + WAIT_S + 120, "the end")
    err = Path(handle.stderr_path).read_text()
    assert fields["JobState"] == "FAILED" and exit_code(fields) != 0, logs(handle)
    assert "node1" in err and "node2" in err, err[-4000:]
    # node1: rank 0 gave up on the collective, said so, and its launcher exited with its code.
    assert "koochak-train: training failed" in err and "python -m koochak.loop.launch: rank 0 exited 1" in err, err[-4000:]
    # node2: its launcher (or srun, at the latest KOOCHAK_NODES_WAIT_S later) ended the hung rank.
    assert "srun: error: node2: task 1: " in err, err[-4000:]
    assert _processes_of(run.run_dir) == []  # nothing of the run is left on either node
