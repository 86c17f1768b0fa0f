"""Scenario 2, evacuation on two nodes: `scancel --signal=USR1 --batch` reaches the batch shell
(srun), every node's launcher and every rank; every rank on both nodes saves its share of one
terminal checkpoint and exits 75, so does the job, and Slurm requeues it (RequeueExit=75 in the
cluster's slurm.conf). The second attempt resumes from that checkpoint and ends bit-identical to
an uninterrupted run at the same world size (the same weights, the same records at every step)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

STEPS = 20


def test_usr1_evacuates_both_nodes_slurm_requeues_and_the_rerun_is_bit_identical(
    cluster_env, tmp_path
):
    import torch
    from cluster_jobs import (
        ended,
        logs,
        model_state,
        prepare,
        resources,
        sample_log,
        scancel,
        submit,
        wait_for,
    )
    from cluster_user import CONFIG
    from slurm_jobs import exit_code, wait_for_path

    config = CONFIG.replace("max_steps: 12", f"max_steps: {STEPS}")
    evacuated = prepare(tmp_path, "evacuated", config, STEP_SLEEP="1")
    straight = prepare(tmp_path, "straight", config)
    first, reference = submit(evacuated, resources()), submit(straight, resources())
    wait_for_path(Path(evacuated.run_dir) / "started", timeout=300, job_id=first.job_id)
    scancel("--signal=USR1", "--batch", first.job_id)
    requeued = wait_for(first.job_id, lambda f: int(f.get("Restarts", "0")) >= 1 or ended(f),
                        300, "the requeue")  # fmt: skip
    assert int(requeued.get("Restarts", "0")) == 1, (requeued, logs(first))
    # The first attempt exited 75 on every node and Slurm put the job back in the queue.
    assert (requeued["JobState"], requeued["ExitCode"]) == ("PENDING", "75:0"), requeued
    # Slurm holds a requeued batch job back for about two minutes (its BeginTime); a test
    # need not wait that out, but a few seconds keep the new attempt's launch credential clear
    # of the old attempt's revocation on the nodes.
    subprocess.run(["scontrol", "update", f"JobId={first.job_id}", "StartTime=now+10"],
                   check=False)  # fmt: skip
    fields = wait_for(first.job_id, ended, 300, "the second attempt's end")
    assert (fields["JobState"], exit_code(fields)) == ("COMPLETED", 0), logs(first)
    fields = wait_for(reference.job_id, ended, 300, "the end")
    assert (fields["JobState"], exit_code(fields)) == ("COMPLETED", 0), logs(reference)

    seen = sample_log(Path(evacuated.run_dir))
    attempts = sorted({s.attempt for s in seen})
    assert attempts == [f"{first.job_id}.0", f"{first.job_id}.1"], attempts
    before = [s for s in seen if s.attempt.endswith(".0")]
    after = [s for s in seen if s.attempt.endswith(".1")]
    # Every rank of both nodes evacuated at the same step; the rerun continued at the next one.
    assert {s.host for s in before} == {s.host for s in after} == {"node1", "node2"}
    stopped = max(s.step for s in before)
    assert all(max(s.step for s in before if s.rank == r) == stopped for r in (0, 1))
    assert 0 < stopped < STEPS - 1, "the evacuation came too late to prove a resume"
    assert min(s.step for s in after) == stopped + 1
    # The rerun is the uninterrupted run: the same records at each step on each rank...
    by_step = lambda entries: sorted((s.step, s.rank, s.ids) for s in entries)  # noqa: E731
    assert by_step(after + [s for s in before if s.step <= stopped]) == by_step(
        sample_log(Path(straight.run_dir))
    )
    # ... and the same weights, bit for bit.
    name = f"step{STEPS:09d}.pt"
    resumed = model_state(str(Path(evacuated.run_dir) / name))
    uninterrupted = model_state(str(Path(straight.run_dir) / name))
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)
