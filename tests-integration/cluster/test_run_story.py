"""The story of a run that lost a node (issue 39): a two-node DDP job, its first tier on each
node's own disk and an S3 replica, loses node2 (every process SIGKILLed, its disk deleted); the
same prepared run is resubmitted on one node and resumes from the replica; retention
(keep_last_k: 2) has pruned the first attempt's checkpoints by the end. The report, rendered here
on the submitting host, must name the lost node, the resume step and tier, and show every commit
and replication the run history recorded, pruned or not: the test reads the picture itself (the
figure's labelled artists and the HTML), not only the gathered data.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CONFIG = """\
train: {{max_steps: {steps}, ckpt_every: 3, keep_last_k: 2, log_every: 1, device: cpu,
        progress_bar: false, ddp: true, warn_unsharded: false, evacuation_enabled: true,
        checkpoint_dir: "{local}/{tag}/{{node}}", checkpoint_replication_retry_s: 1,
        checkpoint_replicas: [s3://{bucket}/{tag}]}}
optim: {{optimizer: {{name: sgd, lr: 0.05}}}}
logging: {{stdout: false}}
entry: {{model: "cluster_user:make_model", dataset: "cluster_user:dataset",
        step: "cluster_user:step_fn"}}
"""


def _committed(store) -> list[int]:
    from koochak.storage.artifact import published_candidates

    return sorted(n for n, _ in published_candidates(store, r"step(\d{9})\.pt"))


def _node_lost(node: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        state = subprocess.run(["sinfo", "-h", "-n", node, "-o", "%t"], capture_output=True,
                               text=True, timeout=30).stdout.strip()  # fmt: skip
        if state.startswith("down") or state.endswith("*"):
            return state
        assert time.monotonic() < deadline, f"{node} still '{state}' after {timeout} s"
        time.sleep(0.5)


def test_the_report_tells_a_lost_node_and_the_resume_after_pruning(cluster_alone, tmp_path):
    from cluster_jobs import ended, logs, prepare, resources, scancel, submit, wait_for
    from koochak.loop import report, report_cli
    from koochak.loop.run_history import read_history
    from koochak.storage import open_store
    from slurm_jobs import exit_code, job_fields

    steps, tag = 20, f"story-{uuid.uuid4().hex}"
    config = CONFIG.format(steps=steps, local=cluster_alone.local, tag=tag,
                           bucket=cluster_alone.s3_bucket)  # fmt: skip
    run = prepare(tmp_path, "story", config, STEP_SLEEP="1", **cluster_alone.s3_env)
    replica = open_store(f"s3://{cluster_alone.s3_bucket}/{tag}")
    first = submit(run, resources(nodes=2))
    wait_for(first.job_id, lambda f: ended(f) or len(_committed(replica)) >= 2, 300,
             "two checkpoints in the replica")  # fmt: skip
    assert not ended(job_fields(first.job_id)), logs(first)

    lost = cluster_alone.tool("kill-node", "node2")
    assert lost.returncode == 0, lost.stderr
    _node_lost("node2", 360)
    fields = wait_for(first.job_id, lambda f: ended(f) or f.get("JobState") == "PENDING", 180,
                      "the end or a requeue")  # fmt: skip
    requeued = not ended(fields)
    if requeued:  # NODE_FAIL requeued it; it would wait for two nodes: cancel it
        scancel(first.job_id)
        wait_for(first.job_id, ended, 60, "the cancellation")
    started = cluster_alone.tool("start", timeout=300)  # node2 returns, its disk empty
    assert started.returncode == 0, started.stderr
    again = submit(run, resources(nodes=1, constraint="node2"), distributed=True)
    fields = wait_for(again.job_id, ended, 300, "the end")
    assert (fields["JobState"], exit_code(fields)) == ("COMPLETED", 0), logs(again)

    # -- what the history recorded (the data behind the picture)
    run_dir = Path(run.run_dir)
    history = read_history(run_dir)
    starts = [r for r in history if r["event"] == "start"]
    assert [s["attempt"] for s in starts] == [1, 2], history
    assert sorted(starts[0]["hosts"]) == ["node1", "node2"] and starts[0]["world_size"] == 2
    lost_ranks = starts[0]["hosts"]["node2"]
    previous = starts[1]["previous"]
    assert previous["end"] == "node_lost", previous
    assert previous["failure"].startswith(f"node2 lost: rank {lost_ranks[0]} never ended")
    assert ("requeued by Slurm" in previous["failure"]) == requeued, (previous, requeued)
    (chosen,) = [r for r in history if r["event"] == "resume"]
    assert chosen["tier"] == 1 and chosen["step"] >= 5, chosen
    commits = {(r["tier"], r["step"]) for r in history if r["event"] == "commit"}
    replicated = {r["step"] for r in history if r["event"] == "replicate"
                  and r["status"] == "committed" and r["tier"] == 1}  # fmt: skip
    assert (1, chosen["step"]) in commits and chosen["step"] in replicated
    assert _committed(replica) == [17, 20]  # retention pruned everything attempt 1 committed

    # -- the report, rendered here (the submitting host), after the pruning
    data = report.gather_run(run_dir)
    fig = report.build_figure(data)
    loss_ax, ckpt_ax = fig.axes[0], fig.axes[2]
    texts = {t.get_gid(): t.get_text() for ax in fig.axes for t in ax.texts if t.get_gid()}
    assert texts["attempt-ending-1"].startswith("attempt 1: node2 lost: rank"), texts
    assert "node2 lost" in texts["restart-label-2"]
    assert texts["resumed-label-2"] == f"attempt 2 resumed here (tier 1, step {chosen['step']})"
    lines = {line.get_gid(): line for line in ckpt_ax.get_lines() if line.get_gid()}
    star = lines["resumed-from-2"]
    assert list(star.get_ydata()) == [1]
    tier1 = data.tiers[1]
    assert set(tier1.pruned) >= {s for (t, s) in commits if t == 1 and s < chosen["step"]}
    hollow = lines["pruned-tier1"]
    assert len(hollow.get_xdata()) == len(tier1.pruned) and set(hollow.get_ydata()) == {1}
    for tier, step in commits:  # every commit the history holds is labelled on the timeline
        assert f"commit-label-tier{tier}-{step}" in texts, (tier, step)
    assert "lag-tier1" in lines and loss_ax.get_lines()
    import matplotlib.pyplot as plt

    plt.close(fig)
    assert report_cli.main([str(run_dir), "--out", str(tmp_path / "story")]) == 0
    page = (tmp_path / "story.html").read_text()
    assert "node2 lost" in page and f"resumed from step {chosen['step']} in tier 1" in page
    for step in sorted(replicated):
        assert f"step {step} replicated to tier 1" in page
    assert "(pruned since)" in page
    keep = Path("/tmp/koochak-story-report")  # for a person to look at the picture
    keep.mkdir(exist_ok=True)
    shutil.copy(tmp_path / "story.png", keep / "story.png")
    shutil.copy(tmp_path / "story.html", keep / "story.html")
