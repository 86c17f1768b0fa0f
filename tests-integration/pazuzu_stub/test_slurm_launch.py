"""DDP under torch's launcher with the workload's exit status (`python -m koochak.loop.launch`):
on the local Slurm, `scancel --signal=USR1` evacuates both ranks and the job exits 75 (plain
torchrun would exit 1), and a USR1 sent to the launcher alone is forwarded to the ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from slurm_jobs import exit_code, wait_for_job, wait_for_path

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
SBATCH = HERE.parents[1] / "examples" / "jobs" / "slurm_ddp" / "launch.sbatch"
RANK_SCRIPT = str(HERE / "ddp_rank.py")
STEPS = 400  # far more than run before the signal: each step sleeps STEP_SLEEP seconds


def _evacuation_checkpoint(out_dir: Path) -> dict:
    from koochak.loop.checkpoint import resolve_auto_resume

    found = resolve_auto_resume(str(out_dir))
    assert found is not None, f"no checkpoint in {out_dir}"
    return found[1]


def test_scancel_usr1_evacuates_both_ranks_and_the_job_exits_75(local_slurm, tmp_path):
    out = tmp_path / "ddp"
    env = {**os.environ, "PYTHON": sys.executable, "STEP_SLEEP": "0.5", "OMP_NUM_THREADS": "1"}
    cmd = ["sbatch", "--parsable", f"--output={tmp_path}/launch-%j.log", f"--chdir={tmp_path}",
           str(SBATCH), "2", RANK_SCRIPT, str(out), str(STEPS)]  # fmt: skip
    job = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    job = job.strip().split(";")[0]
    log = tmp_path / f"launch-{job}.log"
    wait_for_path(out / "started", job_id=job)
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    fields = wait_for_job(job)
    assert (fields["JobState"], exit_code(fields)) == ("FAILED", 75), log.read_text()
    checkpoint = _evacuation_checkpoint(out)
    assert checkpoint["reason"] == "evacuation" and 0 < checkpoint["next_step"] < STEPS
    assert checkpoint["world_size"] == 2


def test_usr1_to_the_launcher_alone_reaches_the_ranks(tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "koochak.loop.launch", "--standalone", "--nproc-per-node=2",
           RANK_SCRIPT, str(out), str(STEPS)]  # fmt: skip
    env = {**os.environ, "STEP_SLEEP": "0.5", "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for_path(out / "started")
        launcher.send_signal(signal.SIGUSR1)  # as a runner or a batch shell forwards it
        output = launcher.communicate(timeout=120)[0].decode()
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 75, output
    assert _evacuation_checkpoint(out)["reason"] == "evacuation"
