"""Multi-node DDP through Slurm, on the local Slurm: examples/jobs/slurm_ddp/ddp.sbatch starts
2 gloo ranks in one srun step (rendezvous from SLURM_*), `scancel --signal=USR1 --batch`
evacuates them (every rank exits 75 after one terminal checkpoint), the resubmitted job
resumes, and the result equals one process trained on the concatenated batches."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from slurm_jobs import exit_code, wait_for_job, wait_for_path

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
SBATCH = HERE.parents[1] / "examples" / "jobs" / "slurm_ddp" / "ddp.sbatch"
STEPS = 6


def _sbatch(tmp_path: Path, out_dir: Path, *options: str, steps: int = STEPS, **env: str) -> str:
    cmd = ["sbatch", "--parsable", f"--output={tmp_path}/ddp-%j.log", f"--chdir={tmp_path}", *options,
           str(SBATCH), sys.executable, str(HERE / "ddp_rank.py"), str(out_dir), str(steps)]  # fmt: skip
    done = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, **env}, check=True
    )
    return done.stdout.strip().split(";")[0]


def _log(tmp_path: Path, job_id: str) -> str:
    return (tmp_path / f"ddp-{job_id}.log").read_text()


def test_two_ranks_through_slurm_evacuate_resume_and_match_one_process(local_slurm, tmp_path):
    import torch

    sys.path.insert(0, str(HERE))
    from ddp_rank import load_recipe
    from koochak.loop.checkpoint import load, resolve_auto_resume

    recipe, out = load_recipe(), tmp_path / "ddp"
    first = _sbatch(tmp_path, out, STEP_SLEEP="0.5")
    wait_for_path(out / "started", job_id=first)
    subprocess.run(["scancel", "--signal=USR1", "--batch", first], check=True)
    fields = wait_for_job(first)
    assert (fields["JobState"], exit_code(fields)) == ("FAILED", 75), _log(tmp_path, first)
    path, ckpt = resolve_auto_resume(str(out))
    assert ckpt["reason"] == "evacuation" and 0 < ckpt["next_step"] < STEPS, _log(tmp_path, first)
    assert ckpt["world_size"] == 2 and len(ckpt["rng_per_rank"]) == 2

    second = _sbatch(tmp_path, out)  # the same job again resumes from the terminal checkpoint
    fields = wait_for_job(second)
    assert (fields["JobState"], exit_code(fields)) == ("COMPLETED", 0), _log(tmp_path, second)
    ddp_final = load(str(out / f"step{STEPS:09d}.pt"))
    single_final = recipe._train(str(tmp_path / "single"), STEPS, ddp=False)
    assert ddp_final["world_size"] == 2
    assert torch.allclose(recipe._weights(ddp_final), recipe._weights(single_final), atol=1e-6)


def test_the_pre_timeout_warning_signal_evacuates_before_the_time_limit(local_slurm, tmp_path):
    from koochak.loop.checkpoint import resolve_auto_resume

    # A 2-minute limit with the warning 30 s before it. Slurm may send it up to 60 s early, so
    # it arrives 30 to 90 s in: after both ranks installed their evacuation handlers (a USR1
    # before that ends a rank like a kill, 128 + 10) and long before 400 slowed steps finish.
    job = _sbatch(
        tmp_path, tmp_path / "ddp", "--time=2", "--signal=B:USR1@30", steps=400, STEP_SLEEP="0.5"
    )
    fields = wait_for_job(job, timeout=240)
    assert (fields["JobState"], exit_code(fields)) == ("FAILED", 75), _log(tmp_path, job)
    _, ckpt = resolve_auto_resume(str(tmp_path / "ddp"))
    assert ckpt["reason"] == "evacuation" and ckpt["next_step"] < 400
