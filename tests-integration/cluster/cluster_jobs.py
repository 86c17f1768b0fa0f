"""Prepared koochak-train runs submitted through submit_pazuzu (the Pazuzu stand-in, whose
sbatch is the cluster's) and what the tests read back: job fields, checkpoints, the sample-id
log (see cluster_user.py). Importable: conftest puts this folder on sys.path."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import koochak.jobs
import pazuzu
from koochak.jobs.backends import submit_pazuzu
from slurm_jobs import job_fields

HERE = Path(__file__).resolve().parent


def prepare(tmp_path: Path, name: str, config: str, **variables: str):
    """A prepared koochak-train run of cluster_user.py; ``variables`` join the profile's set
    (MARK_DIR defaults to ``{run_dir}``)."""
    work = tmp_path / name
    work.mkdir(parents=True, exist_ok=True)
    shutil.copy(HERE / "cluster_user.py", work)
    (work / "cfg.yaml").write_text(config)
    variables = {"MARK_DIR": "{run_dir}", "OMP_NUM_THREADS": "1", **variables}
    lines = ["version: 1", f"id: {name}", f"python: {sys.executable}", "environment:", "  set:",
             f'    PATH: "{Path(sys.executable).parent}:/usr/bin:/bin"']  # fmt: skip
    lines += [f'    {k}: "{v}"' for k, v in variables.items()]
    (work / "profile.yaml").write_text("\n".join(lines) + "\n")
    return koochak.jobs.prepare_run(
        name=name,
        profile=koochak.jobs.load_environment_profile(work / "profile.yaml"),
        python_args=["-m", "koochak.loop.cli", "--config", "{config}"],
        cwd=str(work),
        run_dir=str(work / "run"),
        base_config=str(work / "cfg.yaml"),
    )


def resources(nodes: int = 2, ranks_per_node: int = 1, constraint: str | None = None):
    return pazuzu.SlurmResources(memory_gb_per_node=1, time_limit="00:10:00", nodes=nodes,
                                 tasks_per_node=ranks_per_node, constraint=constraint)  # fmt: skip


def submit(prepared, res, distributed: bool | None = None):
    log_dir = str(Path(prepared.run_dir).parent / "logs")
    client = pazuzu.PazuzuClient()
    return asyncio.run(submit_pazuzu(client, prepared, resources=res, log_dir=log_dir,
                                     distributed=distributed))  # fmt: skip


def logs(handle) -> str:
    out = [f"--- {p}\n{Path(p).read_text()}" for p in (handle.stdout_path, handle.stderr_path)
           if Path(p).exists()]  # fmt: skip
    return "\n".join(out)[-6000:]


def wait_for(job_id: str, predicate, timeout: float, what: str) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        fields = job_fields(job_id)
        if predicate(fields):
            return fields
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id}: {what} not seen within {timeout} s: {fields}")
        time.sleep(0.5)


def ended(fields: dict[str, str]) -> bool:
    from slurm_jobs import TERMINAL

    return fields.get("JobState") in TERMINAL


def scancel(*args: str) -> None:
    subprocess.run(["scancel", *args], check=True, timeout=60)


@dataclass(frozen=True)
class Seen:
    attempt: str
    step: int
    rank: int
    world: int
    host: str
    ids: tuple[int, ...]


def sample_log(mark_dir: Path) -> list[Seen]:
    """Every line of every rank's sample-id log."""
    seen = []
    for path in sorted(Path(mark_dir).glob("ids-*.log")):
        for line in path.read_text().splitlines():
            attempt, step, rank, world, host, ids = line.split()
            seen.append(Seen(attempt, int(step), int(rank), int(world), host,
                             tuple(int(i) for i in ids.split(","))))  # fmt: skip
    return seen


def model_state(path: str):
    from koochak.loop.checkpoint import load

    return load(path)["model"]
