"""Launching a job: its SCRUFFY_* environment, ``launch.json``, and the child process.

As the local launcher does: the job inherits the controller's environment plus its own, the
controller-owned variables applied last (a submitter cannot override them); it runs in a new
session (its own process group, so cancels and evacuations signal the whole group); stdout and
stderr are appended to ``jobs/<id>/{stdout,stderr}.log``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from scruffy import _contract, storage


def spawn(
    root: Path,
    job: dict[str, Any],
    *,
    node: str,
    allocation_id: str,
    upstreams: dict[str, str | None],
) -> subprocess.Popen:
    job_id = job["job_id"]
    jobs_dir = root / "jobs" / job_id
    jobs_dir.mkdir(parents=True, exist_ok=True)
    provenance = root / "provenance" / job_id / "launch.json"
    attempt = job["attempt"] + job["run"] - 1  # in-place retries count on
    launch = {
        "v": 1,
        "job": {k: job[k] for k in ("project_id", "request_id", "name", "workflow_id", "task_id")}
        | {"id": job_id, "attempt": attempt},
        "allocation_id": allocation_id,
        "submitted_at": job["submitted_at"],
        "started_at": job["started_at"],
        "argv": job["argv"],
        "cwd": job["cwd"],
        "request": job["resources"],
        "dependencies": [{**n, "job_id": upstreams.get(n["task_id"])} for n in job["needs"]],
        "conditions": job["resolved_conditions"],
        "result_path": str(provenance.parent / "result.json"),
    }
    launch["assignment_sha256"] = hashlib.sha256(
        json.dumps(launch, sort_keys=True).encode()
    ).hexdigest()
    storage.write_atomic(provenance, launch, mode=0o444)
    env = environment(root, job, node=node, attempt=attempt, provenance=provenance)
    env["SCRUFFY_ASSIGNMENT_SHA256"] = launch["assignment_sha256"]
    with open(jobs_dir / "stdout.log", "ab") as out, open(jobs_dir / "stderr.log", "ab") as err:
        return subprocess.Popen(
            job["argv"],
            cwd=job["cwd"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )


def environment(
    root: Path, job: dict[str, Any], *, node: str, attempt: int, provenance: Path
) -> dict[str, str]:
    gpus = ",".join(str(g) for g in job["gpu_ids"])
    env = {**os.environ, **job["env"]}
    env.update(
        SCRUFFY_ROOT=str(root),
        SCRUFFY_JOB_ID=job["job_id"],
        SCRUFFY_PROJECT=job["project_id"],
        SCRUFFY_NODE=node,
        SCRUFFY_EVENT_DIR=str(root / "reports" / job["job_id"]),
        SCRUFFY_PROVENANCE_PATH=str(provenance),
        SCRUFFY_ATTEMPT=str(attempt),
        SCRUFFY_GPU_IDS=gpus,
        SCRUFFY_RESERVED_GPU_IDS=gpus,
        CUDA_VISIBLE_DEVICES=gpus,
        CUDA_DEVICE_ORDER="PCI_BUS_ID",
        SCRUFFY_STUB_CONTRACT=_contract.CONTRACT,
    )
    if job["workflow_id"] is not None:
        env.update(SCRUFFY_WORKFLOW_ID=job["workflow_id"], SCRUFFY_TASK_ID=job["task_id"])
    return env


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
