"""submit_pazuzu end to end: a prepared run is staged through the Pazuzu stand-in's stdin
staging, submitted with the real sbatch to the local Slurm, evacuated with
``scancel --signal=USR1 --batch`` (exit 75) and resubmitted, and the new attempt resumes from
its own durable state and ends where an uninterrupted run ends."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pazuzu
import pytest
from koochak.jobs.backends import submit_pazuzu
from slurm_jobs import exit_code, wait_for_job, wait_for_path

pytestmark = pytest.mark.slow

# The workload: checks the staged manifest's digest, counts steps with durable progress, and
# on SIGUSR1 saves and exits 75 (what the runner and the loop do, in a dozen lines).
PROGRAM = r"""
import hashlib, json, os, signal, sys, time
manifest_path, expected = sys.argv[1], sys.argv[2]
raw = open(manifest_path, "rb").read()
if hashlib.sha256(raw).hexdigest() != expected:
    sys.exit("launch manifest digest differs")
manifest = json.loads(raw)
run_dir = os.path.dirname(manifest_path)
state_path = os.path.join(run_dir, "state.json")
state = json.load(open(state_path)) if os.path.exists(state_path) else {"step": 0, "total": 0}
asked = []
signal.signal(signal.SIGUSR1, lambda *_: asked.append(1))
with open(os.path.join(run_dir, "attempts.log"), "a") as log:
    log.write(f"{os.environ['SLURM_JOB_ID']} {state['step']}\n")

def save():
    with open(state_path + ".tmp", "w") as f:
        json.dump(state, f)
        f.flush(); os.fsync(f.fileno())
    os.replace(state_path + ".tmp", state_path)

while state["step"] < manifest["steps"]:
    if asked:
        save()
        print(f"evacuated at step {state['step']}", flush=True)
        sys.exit(75)
    state["step"] += 1
    state["total"] += state["step"] ** 2
    save()
    time.sleep(manifest["sleep"])
print(json.dumps(state), flush=True)
"""


@dataclasses.dataclass(frozen=True)
class Artifact:
    path: str
    content: bytes
    sha256: str


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    cwd: str
    runner_argv: tuple[str, ...]
    artifacts: tuple[Artifact, ...]
    outputs: tuple = ()


def _artifact(path: Path, content: bytes) -> Artifact:
    return Artifact(str(path), content, hashlib.sha256(content).hexdigest())


def _prepared(run_dir: Path, steps: int, sleep: float) -> Run:
    program = _artifact(run_dir / "program.py", PROGRAM.encode())
    manifest = _artifact(
        run_dir / "launch.json",
        json.dumps({"steps": steps, "sleep": sleep, "program": program.sha256}).encode(),
    )
    argv = (sys.executable, "-I", program.path, manifest.path, manifest.sha256)
    return Run("koochak-e2e", str(run_dir), argv, (program, manifest))


def _submit(run: Run, log_dir: Path) -> pazuzu.SlurmHandle:
    resources = pazuzu.SlurmResources(memory_gb_per_node=1, time_limit="00:05:00")
    return asyncio.run(
        submit_pazuzu(pazuzu.PazuzuClient(), run, resources=resources, log_dir=str(log_dir))
    )


def test_staged_submitted_evacuated_and_resumed_through_slurm(local_slurm, tmp_path):
    run_dir = tmp_path / "run"
    run = _prepared(run_dir, steps=40, sleep=0.1)
    first = _submit(run, tmp_path / "logs")
    wait_for_path(run_dir / "state.json", job_id=first.job_id)  # it is past its first step
    subprocess.run(["scancel", "--signal=USR1", "--batch", first.job_id], check=True)
    fields = wait_for_job(first.job_id)
    assert (fields["JobState"], exit_code(fields)) == ("FAILED", 75), Path(
        first.stderr_path
    ).read_text()
    evacuated_at = json.loads((run_dir / "state.json").read_text())["step"]
    assert 0 < evacuated_at < 40
    assert Path(first.stdout_path).read_text() == f"evacuated at step {evacuated_at}\n"

    second = _submit(run, tmp_path / "logs")  # the same prepared run: staging is a no-op
    fields = wait_for_job(second.job_id)
    assert (fields["JobState"], exit_code(fields)) == ("COMPLETED", 0), Path(
        second.stderr_path
    ).read_text()
    attempts = (run_dir / "attempts.log").read_text().split("\n")[:-1]
    assert attempts == [f"{first.job_id} 0", f"{second.job_id} {evacuated_at}"]
    assert json.loads(Path(second.stdout_path).read_text()) == {
        "step": 40,
        "total": sum(i * i for i in range(1, 41)),
    }
    for artifact in run.artifacts:  # staged once, read-only, unchanged by the second submit
        assert Path(artifact.path).read_bytes() == artifact.content
        assert Path(artifact.path).stat().st_mode & 0o222 == 0


def test_a_corrupted_stage_target_stops_submission(local_slurm, tmp_path):
    run = _prepared(tmp_path / "run", steps=1, sleep=0)
    Path(run.artifacts[1].path).parent.mkdir(parents=True)
    Path(run.artifacts[1].path).write_text("{}")
    queued = subprocess.run(
        ["squeue", "-h", "-o", "%i"], capture_output=True, text=True, check=True
    ).stdout
    with pytest.raises(RuntimeError, match="failed to stage .*launch.json: FileExistsError"):
        _submit(run, tmp_path / "logs")
    after = subprocess.run(
        ["squeue", "-h", "-o", "%i"], capture_output=True, text=True, check=True
    ).stdout
    assert set(after.split()) <= set(queued.split())  # nothing new reached Slurm
    assert not (tmp_path / "logs").exists()
