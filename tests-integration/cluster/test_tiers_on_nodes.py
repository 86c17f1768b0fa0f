"""Scenarios 1 and 3: the first checkpoint tier on each node's own disk (/local, the same path
on every node), an s3:// replica on the cluster's S3 server (moto on the bridge) as the durable
tier.

1. A 2-node run exits 0, every checkpoint it committed is committed in the replica (the same
   ready manifest), and each node's first tier holds only what its own ranks wrote.
2. A node lost: every process of node2 (slurmd, the job step, the ranks) SIGKILLed and its disk
   deleted. Slurm marks node2 down and the job fails (or is requeued, and is cancelled: it cannot
   run on one node). The same prepared run resubmitted on one node with one rank (the returned,
   empty node2) resumes from the durable tier, and the sample-id log shows every record of the
   run trained exactly once over the attempts.

The runs are FSDP with the first tier at /local/<run>/{node}; MODE = "ddp: true" runs the same
scenarios under DDP (rank 0 then writes whole checkpoints, the other node nothing).
"""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

MODE = "fsdp: {enabled: true}"  # DDP: "ddp: true" (rank 0 then writes whole checkpoints)


def _config(cluster, tag: str, steps: int) -> str:
    from cluster_user import CONFIG

    tiers = (f'checkpoint_dir: "{cluster.local}/{tag}/{{node}}", checkpoint_replication_retry_s: 1,\n'
             f"        checkpoint_replicas: [s3://{cluster.s3_bucket}/{tag}],\n        ")  # fmt: skip
    config = CONFIG.replace("max_steps: 12", f"max_steps: {steps}").replace("ddp: true", MODE)
    return config.replace("progress_bar: false,", f"progress_bar: false, {tiers}", 1)


def _profile_s3(cluster) -> dict[str, str]:
    return dict(cluster.s3_env)  # the ranks' clean environment reaches the same S3 server


def _committed(store) -> list[str]:
    from koochak.storage.artifact import published_candidates

    return sorted(name for _, name in published_candidates(store, r"step(\d{9})\.pt"))


def _first_tier(cluster, node: str, tag: str) -> Path:
    """The node's first tier as the host sees it: /local/<tag>/{node} on that node."""
    found = sorted((cluster.nodelocal(node) / tag).glob("*"))
    assert len(found) <= 1, found
    return found[0] if found else cluster.nodelocal(node) / tag / "none"


def _objects(path: Path) -> list[str]:
    return sorted(p.name for p in path.rglob("*") if p.is_file()) if path.exists() else []


def test_two_nodes_commit_every_checkpoint_in_the_replica(cluster_env, tmp_path):
    from cluster_jobs import ended, logs, prepare, resources, sample_log, submit, wait_for
    from koochak.storage import LocalStore, open_store
    from koochak.storage.artifact import read_manifest
    from slurm_jobs import exit_code

    tag = f"tiers-{uuid.uuid4().hex}"
    run = prepare(tmp_path, "tiers", _config(cluster_env, tag, 12), **_profile_s3(cluster_env))
    handle = submit(run, resources(nodes=2))
    fields = wait_for(handle.job_id, ended, 300, "the end")
    assert (fields["JobState"], exit_code(fields)) == ("COMPLETED", 0), logs(handle)

    replica = open_store(f"s3://{cluster_env.s3_bucket}/{tag}")
    seen = sample_log(Path(run.run_dir))
    ranks = {node: {s.rank for s in seen if s.host == node} for node in ("node1", "node2")}
    (lead,) = [node for node, r in ranks.items() if 0 in r]
    (other,) = [node for node in ranks if node != lead]
    first = LocalStore(_first_tier(cluster_env, lead, tag))
    expected = _committed(first)  # after every 3 updates, and the terminal one
    assert expected == [f"step{s:09d}.pt" for s in (2, 5, 8, 12)]
    assert _committed(replica) == expected
    for name in expected:  # the replica committed the first tier's very commit
        assert read_manifest(replica, name)[1] == read_manifest(first, name)[1]
    held = {node: _objects(_first_tier(cluster_env, node, tag)) for node in ranks}
    if "fsdp" in MODE:  # each node holds its own ranks' parts (rank 0's node: index, manifests)
        for node in ranks:
            writers = {int(n.split(".part-")[1][:5]) for n in held[node] if ".part-" in n}
            assert writers == ranks[node], (node, held[node])
        assert not [n for n in held[other] if n.endswith(".ready.json")], held[other]
        keys = replica_keys(replica)  # parts, and each writer's receipt for its own parts
        parts = {n for n in keys if ".part-" in n and not n.endswith("-receipt")}
        assert parts == {n for node in ranks for n in held[node] if ".part-" in n}
        assert any(n.endswith("-receipt") for n in keys), keys  # the commit trusted receipts
    else:  # DDP: rank 0 writes every checkpoint; the other node's rank writes nothing
        assert held[other] == []


def replica_keys(store) -> list[str]:
    return sorted(info.key for info in store.list())


def _wait_node_state(
    node: str, prefixes: tuple[str, ...], timeout: float, not_responding: bool = False
) -> str:
    import time

    deadline = time.monotonic() + timeout
    while True:
        out = subprocess.run(["sinfo", "-h", "-n", node, "-o", "%t"], capture_output=True,
                             text=True, timeout=30).stdout.strip()  # fmt: skip
        if out.startswith(prefixes) or (not_responding and out.endswith("*")):
            return out
        assert time.monotonic() < deadline, f"{node} still '{out}' after {timeout} s"
        time.sleep(0.5)


def test_a_lost_node_then_one_node_resumes_from_the_durable_tier(cluster_alone, tmp_path):
    from cluster_jobs import ended, logs, prepare, resources, sample_log, scancel, submit, wait_for
    from cluster_user import GLOBAL_BATCH
    from koochak.storage import open_store
    from slurm_jobs import exit_code, job_fields

    steps, tag = 20, f"lost-{uuid.uuid4().hex}"
    run = prepare(tmp_path, "lost", _config(cluster_alone, tag, steps), STEP_SLEEP="1",
                  **_profile_s3(cluster_alone))  # fmt: skip
    replica = open_store(f"s3://{cluster_alone.s3_bucket}/{tag}")
    first = submit(run, resources(nodes=2))
    wait_for(first.job_id, lambda f: ended(f) or len(_committed(replica)) >= 2, 300,
             "two checkpoints in the replica")  # fmt: skip
    assert not ended(job_fields(first.job_id)), logs(first)

    lost = cluster_alone.tool("kill-node", "node2")  # node2 and its disk are gone
    assert lost.returncode == 0, lost.stderr
    assert not cluster_alone.nodelocal("node2").exists()
    # SlurmdTimeout=10, but a busy slurmctld may take minutes to set DOWN: Slurm has noticed the
    # loss once it shows node2 not responding ('*', e.g. 'mix*') or down; a generous bound.
    state = _wait_node_state("node2", ("down",), 360, not_responding=True)
    assert state.startswith("down") or state.endswith("*"), state
    fields = wait_for(first.job_id, lambda f: ended(f) or f.get("JobState") == "PENDING", 180,
                      "the end or a requeue")  # fmt: skip
    if not ended(fields):  # requeued (NODE_FAIL): it waits for two nodes; cancel it
        assert int(fields.get("Restarts", "0")) >= 1, fields
        scancel(first.job_id)
        wait_for(first.job_id, ended, 60, "the cancellation")
    else:
        assert fields["JobState"] in {"FAILED", "NODE_FAIL"}, (fields, logs(first))

    started = cluster_alone.tool("start", timeout=300)  # node2 comes back, its disk empty
    assert started.returncode == 0, started.stderr
    again = submit(run, resources(nodes=1, constraint="node2"), distributed=True)
    fields = wait_for(again.job_id, ended, 300, "the end")
    assert (fields["JobState"], exit_code(fields)) == ("COMPLETED", 0), logs(again)
    assert fields["NodeList"] == "node2"
    assert "it is gone (node-local storage on another node?)" in Path(again.stderr_path).read_text()

    seen = sample_log(Path(run.run_dir))
    resumed = [s for s in seen if s.attempt.startswith(f"{again.job_id}.")]
    earlier = [s for s in seen if not s.attempt.startswith(f"{again.job_id}.")]
    assert {(s.host, s.world) for s in resumed} == {("node2", 1)}
    assert {s.world for s in earlier} == {2}
    resume_step = min(s.step for s in resumed)
    # It resumed from what the replica held when node2 died (at least its second checkpoint),
    # not from the start; the steps the lost attempt trained after that checkpoint are redone.
    assert resume_step >= 6, resume_step
    kept = [s for s in earlier if s.step < resume_step] + resumed
    ids = sorted(i for s in kept for i in s.ids)
    assert ids == list(range(steps * GLOBAL_BATCH))  # every record exactly once
    assert _committed(replica)[-1] == f"step{steps:09d}.pt"
