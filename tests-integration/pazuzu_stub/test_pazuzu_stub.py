"""The Pazuzu stand-in is pinned to the Pazuzu client contract: the same public names and
signatures, the same validation, byte-for-byte the same job script, and a real sbatch."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import sys
from pathlib import Path

import pazuzu
import pytest
from pazuzu.errors import (
    CommandTimedOut,
    ConnectionUnavailable,
    PazuzuError,
    ProtocolError,
    UncertainExecution,
)
from pazuzu.slurm import parse_submission, render_slurm_script
from slurm_jobs import exit_code, wait_for_job, wait_for_path


def _run(coro):
    return asyncio.run(coro)


def _resources(**overrides):
    return pazuzu.SlurmResources(memory_gb_per_node=1, time_limit="00:05:00", **overrides)


def test_exports_version_and_error_hierarchy():
    assert pazuzu.__version__ == "0.1.0"
    assert set(pazuzu.__all__) == {"PazuzuClient", "SlurmJob", "SlurmResources", "SlurmHandle",
                                   "SlurmStatus", "CommandResult"}  # fmt: skip
    assert issubclass(PazuzuError, RuntimeError)
    for error in (ConnectionUnavailable, CommandTimedOut, UncertainExecution, ProtocolError):
        assert issubclass(error, PazuzuError)
    assert not hasattr(pazuzu, "PazuzuError")  # errors live in pazuzu.errors only


def test_signatures_match_the_contract():
    sig = {name: str(inspect.signature(getattr(pazuzu.PazuzuClient, name)))
           for name in ("run", "read", "run_script", "submit_slurm", "tail", "health")}  # fmt: skip
    assert sig["run"].startswith(
        "(self, command: 'str', *, stdin: 'bytes | str' = b'', timeout: 'float' = 120.0)"
    )
    assert sig["read"] == sig["run"]
    assert (
        "(self, interpreter: 'str', source: 'str', *, arguments=(), timeout: 'float' = 120.0)"
        in sig["run_script"]
    )
    assert sig["submit_slurm"].startswith("(self, job: 'SlurmJob')")
    assert sig["tail"].startswith("(self, remote_path: 'str', *, lines: 'int' = 100)")
    assert sig["health"].startswith("(self, *, probe: 'bool' = True, timeout: 'float' = 90.0)")
    for name in ("health", "reconnect", "run", "read", "run_script", "slurm_queue", "inspect_slurm_job",
                 "submit_slurm", "slurm_status", "cancel_slurm", "tail"):  # fmt: skip
        assert inspect.iscoroutinefunction(getattr(pazuzu.PazuzuClient, name)), name
    fields = [(f.name, f.default) for f in dataclasses.fields(pazuzu.SlurmResources)]
    assert fields == [("memory_gb_per_node", dataclasses.MISSING), ("time_limit", dataclasses.MISSING),
                      ("cpus_per_task", 1), ("gpus_per_node", 0), ("nodes", 1), ("tasks_per_node", 1),
                      ("partition", None), ("account", None), ("qos", None), ("constraint", None),
                      ("array", None), ("dependency", None)]  # fmt: skip
    assert [f.name for f in dataclasses.fields(pazuzu.SlurmJob)] == [
        "name",
        "argv",
        "cwd",
        "log_dir",
        "resources",
        "environment",
    ]
    assert [f.name for f in dataclasses.fields(pazuzu.CommandResult)] == [
        "exit_code", "stdout", "stderr", "stdout_truncated", "stderr_truncated", "connection_generation", "replayed"]  # fmt: skip


def test_rendered_script_is_the_contracts_text():
    job = pazuzu.SlurmJob(
        name="train-1",
        argv=[
            "/opt/py/bin/python",
            "-I",
            "-m",
            "koochak.jobs.runner",
            "/runs/a b/launch.json",
            "ab12",
        ],
        cwd="/srv/my repo",
        log_dir="/runs/logs",
        resources=_resources(
            gpus_per_node=2,
            nodes=2,
            tasks_per_node=4,
            cpus_per_task=8,
            partition="gpu",
            qos="high",
            dependency="afterok:12",
        ),  # fmt: skip
        environment={"ZED": "last", "ALPHA": "it's"},
    )
    assert render_slurm_script(job) == (
        "#!/usr/bin/env bash\n"
        "#SBATCH --job-name=train-1\n"
        "#SBATCH --partition=gpu\n"
        "#SBATCH --qos=high\n"
        "#SBATCH --nodes=2\n"
        "#SBATCH --ntasks-per-node=4\n"
        "#SBATCH --cpus-per-task=8\n"
        "#SBATCH --mem=1G\n"
        "#SBATCH --time=00:05:00\n"
        "#SBATCH --gres=gpu:2\n"
        "#SBATCH --dependency=afterok:12\n"
        "#SBATCH --output=/runs/logs/train-1-%j.out\n"
        "#SBATCH --error=/runs/logs/train-1-%j.err\n"
        "\n"
        "set -euo pipefail\n"
        "cd '/srv/my repo'\n"
        "export ALPHA='it'\"'\"'s'\n"
        "export ZED=last\n"
        "\n"
        "exec /opt/py/bin/python -I -m koochak.jobs.runner '/runs/a b/launch.json' ab12\n"
    )
    # No GPUs: no --gres line; no environment: no export lines.
    plain = pazuzu.SlurmJob(
        name="x", argv=["/bin/true"], cwd="/", log_dir="/l", resources=_resources()
    )
    assert "--gres" not in render_slurm_script(plain) and "export" not in render_slurm_script(plain)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"nodes": True}, ValueError, "nodes must be a positive integer"),
        ({"cpus_per_task": 0}, ValueError, "cpus_per_task must be a positive integer"),
        ({"gpus_per_node": -1}, ValueError, "gpus_per_node"),
        ({"partition": "gpu\n#SBATCH --x"}, ValueError, "without whitespace"),
        ({"account": ""}, ValueError, "without whitespace"),
    ],
)
def test_resources_are_validated(kwargs, error, match):
    with pytest.raises(error, match=match):
        _resources(**kwargs)
    with pytest.raises(TypeError):
        pazuzu.SlurmResources(memory_gb_per_node=1, time_limit=300)


def test_job_is_validated_and_frozen():
    ok = {
        "name": "n",
        "argv": ["/bin/true"],
        "cwd": "/",
        "log_dir": "/logs",
        "resources": _resources(),
    }
    with pytest.raises(ValueError, match="^name must contain only ASCII"):
        pazuzu.SlurmJob(**{**ok, "name": "-bad"})
    with pytest.raises(TypeError):
        pazuzu.SlurmJob(**{**ok, "argv": "/bin/true"})
    with pytest.raises(ValueError):
        pazuzu.SlurmJob(**{**ok, "argv": ["/bin/true", ""]})
    with pytest.raises(TypeError):
        pazuzu.SlurmJob(**{**ok, "resources": {"nodes": 1}})
    with pytest.raises(ValueError, match="sbatch directive"):
        pazuzu.SlurmJob(**{**ok, "log_dir": "/my logs"})
    with pytest.raises(ValueError):
        pazuzu.SlurmJob(**{**ok, "cwd": "relative"})
    with pytest.raises(ValueError):
        pazuzu.SlurmJob(**{**ok, "environment": {"1BAD": "x"}})
    argv = ["/bin/echo", "a"]
    job = pazuzu.SlurmJob(**{**ok, "argv": argv, "environment": {"A": "1"}})
    argv.append("b")
    assert job.argv == ("/bin/echo", "a")  # a defensive copy
    with pytest.raises(TypeError):
        job.environment["A"] = "2"  # read-only
    assert job.stdout_pattern == "/logs/n-%j.out" and job.stderr_pattern == "/logs/n-%j.err"


def test_parse_submission_takes_the_last_line_and_drops_the_cluster():
    job = pazuzu.SlurmJob(
        name="n", argv=["/bin/true"], cwd="/", log_dir="/logs", resources=_resources()
    )
    handle = parse_submission("warning: something\n4711;cluster\n\n", job)
    assert handle.as_dict() == {"job_id": "4711", "name": "n", "stdout_path": "/logs/n-4711.out",
                                "stderr_path": "/logs/n-4711.err"}  # fmt: skip
    with pytest.raises(PazuzuError):
        parse_submission("Submitted batch job x\n", job)


def test_run_reports_exit_code_and_enforces_the_stdin_limit():
    client = pazuzu.PazuzuClient()
    result = _run(client.run("cat; echo err >&2; exit 3", stdin="héllo"))
    assert (result.exit_code, result.stdout, result.stderr) == (3, "héllo", "err\n")
    assert not hasattr(result, "returncode")  # Pazuzu's field is exit_code
    assert result.as_dict()["replayed"] is False
    with pytest.raises(ValueError):
        _run(client.run("cat", stdin=b"x" * (4 * 1024 * 1024 + 1)))
    assert _run(client.run("wc -c", stdin=b"x" * (4 * 1024 * 1024))).stdout.strip() == str(
        4 * 1024 * 1024
    )
    with pytest.raises(CommandTimedOut):
        _run(client.run("sleep 5", timeout=0.2))
    script = _run(
        client.run_script(sys.executable, "import sys; print(sys.argv[1:])", arguments=["a"])
    )
    assert script.stdout.strip() == "['a']"


def test_submit_slurm_runs_the_job_on_the_real_slurm(local_slurm, tmp_path):
    client = pazuzu.PazuzuClient()
    job = pazuzu.SlurmJob(
        name="stub-smoke",
        argv=["/bin/sh", "-c", 'echo "$GREETING from $(pwd) job $SLURM_JOB_ID"; echo oops >&2'],
        cwd=str(tmp_path),
        log_dir=str(tmp_path / "logs"),
        resources=_resources(),
        environment={"GREETING": "hello world"},
    )
    handle = _run(client.submit_slurm(job))
    fields = wait_for_job(handle.job_id)
    assert (fields["JobState"], exit_code(fields)) == ("COMPLETED", 0)
    wait_for_path(tmp_path / "logs" / f"stub-smoke-{handle.job_id}.out")
    out = Path(handle.stdout_path).read_text()
    assert out == f"hello world from {tmp_path} job {handle.job_id}\n"
    assert Path(handle.stderr_path).read_text() == "oops\n"
    # A finished job has left squeue; the local Slurm keeps no accounting, so sacct fails and
    # that failure surfaces as the contract says (never a made-up state).
    with pytest.raises(PazuzuError, match="^sacct failed"):
        _run(client.slurm_status(handle.job_id))
    sleeper = _run(
        client.submit_slurm(dataclasses.replace(job, name="stub-sleep", argv=["/bin/sleep", "60"]))
    )
    status = _run(client.slurm_status(sleeper.job_id))
    assert (status.source, status.state in {"PENDING", "RUNNING"}, status.terminal) == (
        "squeue",
        True,
        False,
    )
    assert _run(client.cancel_slurm(sleeper.job_id)).exit_code == 0
    assert wait_for_job(sleeper.job_id)["JobState"] == "CANCELLED"
    # A script sbatch refuses (an unknown partition) is a PazuzuError carrying sbatch's words.
    bad = dataclasses.replace(job, resources=_resources(partition="no-such-partition"))
    with pytest.raises(PazuzuError, match="^sbatch failed with exit 1: .*partition"):
        _run(client.submit_slurm(bad))
