"""Evidence from Slurm about a lease's or publish intent's holder: its job, not its machine.

A holder that runs under Slurm records its job (``SLURM_JOB_ID``, ``SLURM_RESTART_COUNT``,
``SLURM_CLUSTER_NAME``) in its lease and intent records. When the node holding a run is lost,
Slurm requeues the job onto another machine; machine evidence then cannot tell the dead attempt
from a live run elsewhere, but the job can:

* the record names this very job (same cluster, same job id) with a lower restart count: Slurm
  has requeued the job since, which ends every process of its earlier attempt;
* ``squeue`` (only where it exists, within ``SQUEUE_TIMEOUT_SECONDS``, and only for a job of this
  process's own cluster) says the record's job is unknown to Slurm or in a terminal state.

A failed or unclear answer proves nothing: the holder is then judged by the other rules. An
array task has a job id of its own that a requeue keeps, so the array ids add nothing here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

SQUEUE_TIMEOUT_SECONDS = 5.0
# Job states after which none of the job's processes runs any more (squeue %T).
ENDED_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                          "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})  # fmt: skip
# The record keys, written together and only by a holder that runs under Slurm.
FIELDS = ("slurm_cluster", "slurm_job_id", "slurm_restarts")
# What squeue is asked about: a job id, an array task's or a heterogeneous job's component's.
_JOB_ID = re.compile(r"[0-9]+([_+][0-9]+)?")


@dataclass(frozen=True)
class SlurmJob:
    """One attempt of a Slurm job: ``job_id`` "" outside Slurm."""

    job_id: str = ""
    restart_count: int = 0
    cluster: str = ""  # "" where Slurm does not say (then only the job id tells jobs apart)

    def describe(self) -> str:
        return f"attempt {self.restart_count} of Slurm job {self.job_id}"

    def fields(self) -> dict:
        """The record keys for this attempt; none outside Slurm (the record is then unchanged)."""
        if not self.job_id:
            return {}
        return {"slurm_cluster": self.cluster, "slurm_job_id": self.job_id,
                "slurm_restarts": self.restart_count}  # fmt: skip


def current() -> SlurmJob:
    """The Slurm job attempt this process runs in (read now: the environment may change)."""
    job_id = os.environ.get("SLURM_JOB_ID", "").strip()
    if not job_id:
        return SlurmJob()
    try:
        restarts = max(0, int(os.environ.get("SLURM_RESTART_COUNT", "0") or "0"))
    except ValueError:
        restarts = 0
    return SlurmJob(job_id, restarts, os.environ.get("SLURM_CLUSTER_NAME", "").strip())


def parse_fields(doc: dict, where: str) -> SlurmJob:
    """The Slurm job named by record ``doc`` (its keys removed from ``doc``); ValueError naming
    ``where`` and the field when they are partial or of the wrong type."""
    present = [name for name in FIELDS if name in doc]
    if not present:
        return SlurmJob()
    if len(present) != len(FIELDS):
        missing = next(name for name in FIELDS if name not in doc)
        raise ValueError(f"{where}: missing field {missing!r} (the Slurm fields go together)")
    job_id, restarts, cluster = (doc.pop(name) for name in
                                 ("slurm_job_id", "slurm_restarts", "slurm_cluster"))  # fmt: skip
    if type(job_id) is not str or not job_id:
        raise ValueError(f"{where}: field 'slurm_job_id' must be a non-empty str")
    if type(restarts) is not int or restarts < 0:
        raise ValueError(f"{where}: field 'slurm_restarts' must be an int >= 0")
    if type(cluster) is not str:
        raise ValueError(f"{where}: field 'slurm_cluster' must be a str")
    return SlurmJob(job_id, restarts, cluster)


def why_ended(theirs: SlurmJob, ours: SlurmJob | None = None) -> str | None:
    """Why Slurm proves the job attempt ``theirs`` ended, or None when it cannot (``ours``: this
    process's attempt, ``current()`` by default)."""
    ours = current() if ours is None else ours
    if not theirs.job_id or not ours.job_id or theirs.cluster != ours.cluster:
        return None  # no job to ask about, or one of another cluster (its ids are not ours)
    if theirs.job_id == ours.job_id:
        if theirs.restart_count < ours.restart_count:
            restarted = ours.restart_count
            return f"Slurm has requeued job {ours.job_id} since (this is attempt {restarted})"
        return None  # this very attempt (or a later one): running
    state = squeue_state(theirs.job_id)
    if state == "":
        return f"Slurm no longer knows its job {theirs.job_id}"
    if state is not None and state in ENDED_STATES:
        return f"its Slurm job {theirs.job_id} has ended ({state})"
    return None


def squeue_state(job_id: str) -> str | None:
    """The state of Slurm job ``job_id`` as ``squeue`` reports it; "" when Slurm does not know
    the job ("Invalid job id"); None when that cannot be told: no squeue, a failure, a timeout,
    no answer, a job of several states (an array's tasks) not all ended, or an id that is no
    Slurm job id (a record says what it likes: squeue is never asked about "1,2" or "-h")."""
    squeue = shutil.which("squeue")
    if squeue is None or not _JOB_ID.fullmatch(job_id):
        return None
    try:
        done = subprocess.run(
            [squeue, "--noheader", "--states=all", f"--jobs={job_id}", "--format=%T"],
            capture_output=True,
            text=True,
            timeout=SQUEUE_TIMEOUT_SECONDS,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return "" if "invalid job id" in done.stderr.lower() else None
    states = {line.strip() for line in done.stdout.splitlines() if line.strip()}
    if len(states) == 1:
        return states.pop()
    if states and states <= ENDED_STATES:
        return sorted(states)[0]
    return None
