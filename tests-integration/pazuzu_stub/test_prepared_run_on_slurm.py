"""A real PreparedRun (prepare_run + the isolated runner, issue 11) on the real local Slurm:
through submit_pazuzu, evacuated by ``scancel --signal=USR1 --batch`` (the runner forwards it
to the workload's process group; exit 75) and resumed by resubmitting the same prepared run;
and 2 DDP ranks, each under its own runner, through examples/jobs/slurm_ddp/ddp.sbatch.

Skipped only while koochak.jobs has no prepare_run (before issue 11 is merged)."""

from __future__ import annotations

import asyncio
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import koochak.jobs
import pazuzu
import pytest
from koochak.jobs.backends import stage_remote, submit_pazuzu
from slurm_jobs import exit_code, wait_for_job, wait_for_path

if not hasattr(koochak.jobs, "prepare_run"):
    pytest.skip("needs koochak.jobs.prepare_run and the runner (issue 11)", allow_module_level=True)

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
SBATCH = HERE.parents[1] / "examples" / "jobs" / "slurm_ddp" / "ddp.sbatch"

WORKLOAD = r"""
import json, os, signal, sys, time
state_path = os.path.join(sys.argv[1], "state.json")
state = json.load(open(state_path)) if os.path.exists(state_path) else {"step": 0}
asked = []
signal.signal(signal.SIGUSR1, lambda *_: asked.append(1))
print("start", state["step"], os.environ["SLURM_JOB_ID"], os.environ.get("AMBIENT", "-"), flush=True)
while state["step"] < 30:
    if asked:
        sys.exit(75)
    state["step"] += 1
    with open(state_path + ".tmp", "w") as f:
        json.dump(state, f)
    os.replace(state_path + ".tmp", state_path)
    time.sleep(0.2)
print("done", state["step"], flush=True)
"""


def _profile(tmp_path: Path, name: str = "profile", **variables: str) -> Path:
    lines = ["version: 1", "id: slurm-test", f"python: {sys.executable}", "environment:", "  set:",
             f'    PATH: "{Path(sys.executable).parent}:/usr/bin:/bin"']  # fmt: skip
    lines += [f'    {k}: "{v}"' for k, v in variables.items()]
    path = tmp_path / f"{name}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _prepare(tmp_path: Path, name: str, python_args: list[str], **variables: str):
    return koochak.jobs.prepare_run(
        name=name,
        profile=koochak.jobs.load_environment_profile(_profile(tmp_path, **variables)),
        python_args=python_args,
        cwd=str(tmp_path),
        run_dir=str(tmp_path / "run"),
    )


def test_prepared_run_through_pazuzu_evacuates_via_the_runner_and_resumes(
    local_slurm, tmp_path, monkeypatch
):
    (tmp_path / "work.py").write_text(WORKLOAD)
    prepared = _prepare(tmp_path, "koochak-runner-e2e", [str(tmp_path / "work.py"), "{run_dir}"])
    resources = pazuzu.SlurmResources(memory_gb_per_node=1, time_limit="00:05:00")
    monkeypatch.setenv("AMBIENT", "leaks")  # sbatch exports it; the runner must drop it

    def submit():
        client = pazuzu.PazuzuClient()
        return asyncio.run(
            submit_pazuzu(client, prepared, resources=resources, log_dir=str(tmp_path / "logs"))
        )

    first = submit()
    wait_for_path(tmp_path / "run" / "state.json", job_id=first.job_id)
    subprocess.run(["scancel", "--signal=USR1", "--batch", first.job_id], check=True)
    fields = wait_for_job(first.job_id)
    assert (fields["JobState"], exit_code(fields)) == ("FAILED", 75), Path(
        first.stderr_path
    ).read_text()
    stopped_at = json.loads((tmp_path / "run" / "state.json").read_text())["step"]
    assert Path(first.stdout_path).read_text() == f"start 0 {first.job_id} -\n"

    second = submit()  # same prepared run: staging is a no-op, the workload resumes
    fields = wait_for_job(second.job_id)
    assert (fields["JobState"], exit_code(fields)) == ("COMPLETED", 0), Path(
        second.stderr_path
    ).read_text()
    assert (
        Path(second.stdout_path).read_text() == f"start {stopped_at} {second.job_id} -\ndone 30\n"
    )
    preflight = json.loads(Path(prepared.preflight_path).read_text())
    assert preflight["manifest_sha256"] == prepared.manifest_sha256
    assert preflight["state"] in {"completed", "passed"}


def test_ddp_ranks_each_under_the_runner_evacuate_resume_and_match_one_process(
    local_slurm, tmp_path
):
    import torch

    sys.path.insert(0, str(HERE))
    from ddp_rank import load_recipe
    from koochak.loop.checkpoint import load

    out = tmp_path / "run" / "ckpt"
    prepared = _prepare(
        tmp_path, "koochak-ddp", [str(HERE / "ddp_rank.py"), str(out), "6"], STEP_SLEEP="0.5"
    )
    client = pazuzu.PazuzuClient()
    asyncio.run(stage_remote(client, prepared))

    def submit() -> str:
        command = f"sbatch --parsable --output={tmp_path}/ddp-%j.log {SBATCH} {shlex.join(prepared.runner_argv)}"
        result = asyncio.run(client.run(command))
        assert result.exit_code == 0, result.stderr
        return result.stdout.strip().split(";")[0]

    first = submit()
    wait_for_path(out / "started", job_id=first)
    subprocess.run(["scancel", "--signal=USR1", "--batch", first], check=True)
    fields = wait_for_job(first)
    assert (fields["JobState"], exit_code(fields)) == ("FAILED", 75), (
        tmp_path / f"ddp-{first}.log"
    ).read_text()
    second = submit()
    fields = wait_for_job(second)
    assert (fields["JobState"], exit_code(fields)) == ("COMPLETED", 0), (
        tmp_path / f"ddp-{second}.log"
    ).read_text()
    recipe = load_recipe()
    ddp_final = load(str(out / "step000000006.pt"))
    single_final = recipe._train(str(tmp_path / "single"), 6, ddp=False)
    assert ddp_final["world_size"] == 2
    assert torch.allclose(recipe._weights(ddp_final), recipe._weights(single_final), atol=1e-6)


def test_koochak_train_evacuated_through_slurm_resumes_bit_identical(local_slurm, tmp_path):
    import torch
    from koochak.loop.checkpoint import load, resolve_auto_resume
    from slurm_user import CONFIG

    shutil.copy(HERE / "slurm_user.py", tmp_path)
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    resources = pazuzu.SlurmResources(memory_gb_per_node=1, time_limit="00:05:00")

    def prepare(name: str, pause: str):
        return koochak.jobs.prepare_run(
            name=name,
            profile=koochak.jobs.load_environment_profile(
                _profile(tmp_path, name, STEP_SLEEP=pause, MARK_DIR="{run_dir}")
            ),
            python_args=["-m", "koochak.loop.cli", "--config", "{config}"],
            cwd=str(tmp_path),
            run_dir=str(tmp_path / name / "run"),
            base_config=str(tmp_path / "cfg.yaml"),
        )

    def submit(prepared):
        client = pazuzu.PazuzuClient()
        log_dir = str(Path(prepared.run_dir) / "logs")
        return asyncio.run(submit_pazuzu(client, prepared, resources=resources, log_dir=log_dir))

    evacuated, straight = prepare("evacuated", "0.3"), prepare("straight", "0")
    first = submit(evacuated)
    wait_for_path(Path(evacuated.run_dir) / "started", job_id=first.job_id)
    subprocess.run(["scancel", "--signal=USR1", "--batch", first.job_id], check=True)
    fields = wait_for_job(first.job_id)
    assert (fields["JobState"], exit_code(fields)) == ("FAILED", 75), Path(
        first.stderr_path
    ).read_text()
    _, terminal = resolve_auto_resume(evacuated.run_dir)
    assert terminal["reason"] == "evacuation" and 0 < terminal["next_step"] < 20
    jobs = [submit(evacuated), submit(straight)]  # the same prepared run again: resume: auto
    for job in jobs:
        fields = wait_for_job(job.job_id)
        assert (fields["JobState"], exit_code(fields)) == ("COMPLETED", 0), Path(
            job.stderr_path
        ).read_text()
    resumed = load(str(Path(evacuated.run_dir) / "step000000020.pt"))["model"]
    uninterrupted = load(str(Path(straight.run_dir) / "step000000020.pt"))["model"]
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)
