"""Backends stage first and submit second: write-once staging (locally and through a Pazuzu
client's stdin), one strict Scruffy call, and nothing submitted after a failed stage.

Pazuzu: the stand-in client in tests-integration/pazuzu_stub runs the staging commands through
a real local bash (its real-sbatch path is tested in tests-integration). Scruffy: a small fake
module stands in for the client until the Scruffy stub is available on this branch."""

from __future__ import annotations

import asyncio
import os
import stat
import sys
import threading
import types
from pathlib import Path

import pytest
from koochak.jobs.backends import (
    stage_remote,
    stage_write_once,
    submit_pazuzu,
    submit_scruffy,
    submit_scruffy_workflow,
)
from koochak.jobs.workflow import PreparedTask, PreparedWorkflow

STUB = Path(__file__).resolve().parents[3] / "tests-integration" / "pazuzu_stub"
RESOURCES = {"nodes": 1, "gpus_per_node": 0, "cpus_per_node": 1, "memory_gb_per_node": 1}


@pytest.fixture
def pazuzu(monkeypatch):
    monkeypatch.syspath_prepend(str(STUB))
    for name in [m for m in sys.modules if m == "pazuzu" or m.startswith("pazuzu.")]:
        monkeypatch.delitem(sys.modules, name)
    import pazuzu

    return pazuzu


def _digest(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


# -- the write-once primitive -------------------------------------------------------------


def test_stage_writes_once_read_only_and_repeats_as_a_no_op(tmp_path):
    target = tmp_path / "deep" / "launch.json"
    assert stage_write_once(str(target), b"one", _digest(b"one")) == "written"
    assert target.read_bytes() == b"one" and stat.S_IMODE(target.stat().st_mode) == 0o444
    assert stage_write_once(str(target), b"one", _digest(b"one")) == "unchanged"
    with pytest.raises(FileExistsError, match="refusing to replace different artifact"):
        stage_write_once(str(target), b"two", _digest(b"two"))
    assert target.read_bytes() == b"one"
    assert sorted(os.listdir(target.parent)) == ["launch.json"]  # no temporary left behind


def test_stage_refuses_wrong_digests_relative_paths_and_symlinks(tmp_path):
    with pytest.raises(ValueError, match="artifact digest differs"):
        stage_write_once(str(tmp_path / "a"), b"bytes", _digest(b"other"))
    assert not (tmp_path / "a").exists()
    with pytest.raises(ValueError, match="must be absolute"):
        stage_write_once("rel/a", b"x", _digest(b"x"))
    (tmp_path / "real").write_bytes(b"x")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(FileExistsError, match="non-regular"):
        stage_write_once(str(tmp_path / "link"), b"x", _digest(b"x"))


def test_stage_hardens_a_loosened_identical_file(tmp_path):
    target = tmp_path / "a"
    stage_write_once(str(target), b"x", _digest(b"x"))
    target.chmod(0o644)
    assert stage_write_once(str(target), b"x", _digest(b"x")) == "unchanged"
    assert stat.S_IMODE(target.stat().st_mode) == 0o444


def test_concurrent_stagers_of_the_same_bytes_all_succeed(tmp_path):
    target, data, results = tmp_path / "m.json", os.urandom(1 << 16), []

    def stage():
        results.append(stage_write_once(str(target), data, _digest(data)))

    threads = [threading.Thread(target=stage) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (
        sorted(set(results)) in (["unchanged", "written"], ["written"])
        and results.count("written") == 1
    )
    assert target.read_bytes() == data


# -- submit_pazuzu ------------------------------------------------------------------------


def _recording_client(pazuzu):
    class Client(pazuzu.PazuzuClient):
        """The stand-in's real local transport; submission recorded instead of sbatch'ed."""

        def __init__(self):
            super().__init__()
            self.jobs = []

        async def submit_slurm(self, job):
            self.jobs.append(job)
            return pazuzu.SlurmHandle(
                "7", job.name, f"{job.log_dir}/{job.name}-7.out", f"{job.log_dir}/{job.name}-7.err"
            )

    return Client()


def _slurm_resources(pazuzu):
    return pazuzu.SlurmResources(memory_gb_per_node=1, time_limit="00:05:00")


def test_submit_pazuzu_stages_over_stdin_then_submits_the_runner_argv(
    pazuzu, tmp_path, run_factory
):
    run = run_factory(tmp_path / "run", program="print('ok')\n" * 1000)
    client, resources = _recording_client(pazuzu), _slurm_resources(pazuzu)
    handle = asyncio.run(
        submit_pazuzu(client, run, resources=resources, log_dir=str(tmp_path / "logs"))
    )
    assert handle.job_id == "7"
    for a in run.artifacts:  # staged write-once by the remote staging program
        assert Path(a.path).read_bytes() == a.content
        assert stat.S_IMODE(Path(a.path).stat().st_mode) == 0o444
    assert [op for op, _ in client.calls] == ["run", "run"]
    for (_, command), a in zip(client.calls, run.artifacts):
        assert command.startswith(f"{sys.executable} -I -c ") and command.endswith(
            f"{a.path} {a.sha256}"
        )
        assert "print('ok')" not in command  # the bytes went over stdin only
    (job,) = client.jobs
    assert (job.name, job.argv, job.cwd, job.log_dir) == (
        run.name,
        run.runner_argv,
        run.cwd,
        str(tmp_path / "logs"),
    )
    assert job.resources is resources and dict(job.environment) == {}
    # The same run again: identical content is a no-op, and it is submitted again.
    asyncio.run(submit_pazuzu(client, run, resources=resources, log_dir=str(tmp_path / "logs")))
    assert len(client.jobs) == 2


def test_a_refused_stage_submits_nothing(pazuzu, tmp_path, run_factory):
    run = run_factory(tmp_path / "run")
    manifest = Path(run.artifacts[-1].path)
    manifest.parent.mkdir(parents=True)
    manifest.write_bytes(b"someone else's manifest\n")
    client = _recording_client(pazuzu)
    with pytest.raises(
        RuntimeError,
        match=f"^failed to stage {manifest}: FileExistsError: .*refusing to replace different artifact",
    ):
        asyncio.run(
            submit_pazuzu(client, run, resources=_slurm_resources(pazuzu), log_dir=str(tmp_path))
        )
    assert client.jobs == [] and manifest.read_bytes() == b"someone else's manifest\n"


def test_bad_artifacts_and_jobs_fail_before_any_remote_call(
    pazuzu, tmp_path, run_factory, artifact_factory
):
    client, resources = _recording_client(pazuzu), _slurm_resources(pazuzu)
    run = run_factory(tmp_path / "run")
    big = run.__class__(
        **{
            **run.__dict__,
            "artifacts": (artifact_factory(tmp_path / "big", b"x" * (4 * 1024 * 1024 + 1)),),
        }
    )
    with pytest.raises(ValueError, match="at most 4194304 bytes per call"):
        asyncio.run(submit_pazuzu(client, big, resources=resources, log_dir=str(tmp_path)))
    lying = run.__class__(
        **{
            **run.__dict__,
            "artifacts": (
                run.artifacts[0].__class__(
                    run.artifacts[0].path, b"changed", run.artifacts[0].sha256
                ),
            ),
        }
    )
    with pytest.raises(ValueError, match="artifact digest differs"):
        asyncio.run(submit_pazuzu(client, lying, resources=resources, log_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="sbatch directive"):  # SlurmJob validation comes first
        asyncio.run(submit_pazuzu(client, run, resources=resources, log_dir="/logs with space"))
    assert client.calls == [] and client.jobs == []


def test_the_stage_result_is_read_by_exit_code_not_returncode(pazuzu, tmp_path, run_factory):
    class Client:  # a transport that failed remotely; returncode would say all is well
        jobs: list = []

        async def run(self, command, *, stdin=b"", timeout=120.0):
            return types.SimpleNamespace(
                exit_code=3, returncode=0, stdout="", stderr="disk quota exceeded\n"
            )

        async def submit_slurm(self, job):
            self.jobs.append(job)

    run, client = run_factory(tmp_path / "run"), Client()
    with pytest.raises(RuntimeError, match=r"failed to stage .*program.py: disk quota exceeded$"):
        asyncio.run(submit_pazuzu(client, run, resources=_slurm_resources(pazuzu), log_dir="/l"))
    assert client.jobs == []
    with pytest.raises(RuntimeError, match="disk quota exceeded"):
        asyncio.run(stage_remote(client, run))


def test_submit_pazuzu_without_the_client_says_what_is_missing(monkeypatch, tmp_path, run_factory):
    monkeypatch.setitem(sys.modules, "pazuzu", None)
    with pytest.raises(RuntimeError, match="requires the optional pazuzu client"):
        asyncio.run(submit_pazuzu(object(), run_factory(tmp_path), resources=None, log_dir="/l"))


# -- Scruffy ------------------------------------------------------------------------------


@pytest.fixture
def scruffy(monkeypatch):
    """A minimal Scruffy client: deduplicates by request id, checks what is staged."""
    module = types.ModuleType("scruffy")
    module.calls = []
    seen: dict = {}

    def _receipt(kind, key, spec, **extra):
        if key in seen and seen[key] != spec:
            raise RuntimeError(f"request {key!r} reused with a different spec")
        deduplicated = key in seen
        seen[key] = spec
        return {"state": "submitted", "deduplicated": deduplicated, **extra}

    def submit_job(root, *, argv, name, cwd, environment, request, request_id, project_id="default",
                   workflow_id=None, task_id=None, needs=None, wait_for=None):  # fmt: skip
        assert isinstance(root, Path) and isinstance(cwd, Path)
        staged = all(Path(a).exists() for a in argv[2:4])  # program + manifest on disk
        module.calls.append(("submit_job", locals() | {"staged": staged}))
        spec = (
            tuple(argv),
            name,
            str(cwd),
            request,
            project_id,
            workflow_id,
            task_id,
            str(needs),
            str(wait_for),
        )
        return _receipt("job", (project_id, request_id), spec, job_id=f"job-{len(seen)}")

    def submit_workflow(root, *, request_id, workflow_id, tasks, project_id="default"):
        for i, task in enumerate(tasks):
            unexpected = sorted(set(task) - {"task_id", "request_id", "name", "argv", "cwd", "environment",
                                             "resources", "needs", "wait_for", *module.extra_keys})  # fmt: skip
            if unexpected:
                raise ValueError(f"tasks[{i}] has unexpected fields: {unexpected}")
        module.calls.append(("submit_workflow", {"root": root, "request_id": request_id, "workflow_id": workflow_id,
                                                 "project_id": project_id, "tasks": tasks}))  # fmt: skip
        return _receipt("workflow", (project_id, request_id), str(tasks), workflow_id=workflow_id)

    module.submit_job, module.submit_workflow, module.extra_keys = (
        submit_job,
        submit_workflow,
        ("recovery",),
    )
    monkeypatch.setitem(sys.modules, "scruffy", module)
    return module


def test_submit_scruffy_stages_then_makes_one_strict_call(scruffy, tmp_path, run_factory):
    run, request = (
        run_factory(tmp_path / "infer", "infer"),
        object(),
    )  # resources pass through untouched
    gate = {"kind": "artifact", "task_id": "train", "artifact_id": "checkpoint/step000000009.pt"}
    receipt = submit_scruffy(run, root=str(tmp_path / "q"), resources=request, request_id="c/infer/1",
                             project_id="proj", workflow_id="wf", task_id="infer", needs=[], wait_for=(gate,))  # fmt: skip
    assert receipt["deduplicated"] is False
    ((name, call),) = scruffy.calls
    assert name == "submit_job" and call["staged"] is True
    assert (
        call["argv"] == list(run.runner_argv)
        and call["cwd"] == Path(run.cwd)
        and call["environment"] == {}
    )
    assert call["request"] is request and (call["request_id"], call["project_id"]) == (
        "c/infer/1",
        "proj",
    )
    assert (call["workflow_id"], call["task_id"], call["needs"], call["wait_for"]) == (
        "wf",
        "infer",
        [],
        [gate],
    )
    # The same request id again is passed unchanged: Scruffy deduplicates.
    again = submit_scruffy(run, root=str(tmp_path / "q"), resources=request, request_id="c/infer/1",
                           project_id="proj", workflow_id="wf", task_id="infer", needs=[], wait_for=[gate])  # fmt: skip
    assert again["deduplicated"] is True and scruffy.calls[1][1]["request_id"] == "c/infer/1"


def test_submit_scruffy_rejects_a_bad_gate_before_staging(scruffy, tmp_path, run_factory):
    run = run_factory(tmp_path / "run")
    with pytest.raises(ValueError, match=r"wait_for\[0\].kind must be 'artifact'"):
        submit_scruffy(run, root=tmp_path, resources=RESOURCES, request_id="r", project_id="p",
                       wait_for=[{"kind": "file", "task_id": "t", "artifact_id": "a"}])  # fmt: skip
    assert scruffy.calls == [] and not Path(run.artifacts[0].path).exists()


def _workflow(tmp_path, run_factory, **train):
    tasks = (
        PreparedTask("train", run_factory(tmp_path / "train", "train"), RESOURCES, **train),
        PreparedTask(
            "infer",
            run_factory(tmp_path / "infer", "infer"),
            RESOURCES,
            needs=[],
            wait_for=[
                {
                    "kind": "artifact",
                    "task_id": "train",
                    "artifact_id": "checkpoint/step000000009.pt",
                }
            ],
        ),  # fmt: skip
    )
    return PreparedWorkflow("campaign-1/attempt-1", "campaign-1", "proj", tasks)


def test_workflow_stages_every_run_then_one_call_and_dedups(scruffy, tmp_path, run_factory):
    recovery = {
        "max_attempts": 2,
        "retry_on": ["evacuated"],
        "evacuation": {"signal": "USR1", "grace_seconds": 0},
    }
    workflow = _workflow(tmp_path, run_factory, recovery=recovery)
    receipt = submit_scruffy_workflow(workflow, root=tmp_path / "q")
    ((name, call),) = scruffy.calls
    assert (name, call["request_id"], call["workflow_id"], call["project_id"]) == (
        "submit_workflow", "campaign-1/attempt-1", "campaign-1", "proj")  # fmt: skip
    assert call["tasks"] == workflow.scruffy_tasks() and call["tasks"][0]["recovery"] == recovery
    for task in workflow.tasks:
        assert all(Path(a.path).read_bytes() == a.content for a in task.run.artifacts)
    assert receipt["deduplicated"] is False
    assert submit_scruffy_workflow(workflow, root=tmp_path / "q")["deduplicated"] is True


def test_a_scruffy_without_recovery_raises_its_own_error(scruffy, tmp_path, run_factory):
    scruffy.extra_keys = ()  # like scruffy-gpu 0.1.1: recovery is an unexpected task field
    recovery = {
        "max_attempts": 2,
        "retry_on": [],
        "evacuation": {"signal": "USR1", "grace_seconds": 5},
    }
    with pytest.raises(ValueError, match=r"tasks\[0\] has unexpected fields: \['recovery'\]"):
        submit_scruffy_workflow(
            _workflow(tmp_path, run_factory, recovery=recovery), root=tmp_path / "q"
        )


def test_a_failed_stage_submits_no_workflow(scruffy, tmp_path, run_factory):
    workflow = _workflow(tmp_path, run_factory)
    clash = Path(workflow.tasks[1].run.artifacts[-1].path)
    clash.parent.mkdir(parents=True)
    clash.write_bytes(b"different\n")
    with pytest.raises(FileExistsError, match="refusing to replace different artifact"):
        submit_scruffy_workflow(workflow, root=tmp_path / "q")
    assert scruffy.calls == []
    with pytest.raises(TypeError, match="expects a PreparedWorkflow, got list"):
        submit_scruffy_workflow(workflow.scruffy_tasks(), root=tmp_path / "q")


def test_without_scruffy_the_error_says_what_to_install(monkeypatch, tmp_path, run_factory):
    monkeypatch.setitem(sys.modules, "scruffy", None)
    with pytest.raises(RuntimeError, match="submit_scruffy requires the optional Scruffy client"):
        submit_scruffy(
            run_factory(tmp_path),
            root=tmp_path,
            resources=RESOURCES,
            request_id=None,
            project_id="p",
        )
    with pytest.raises(
        RuntimeError, match="submit_scruffy_workflow requires the optional Scruffy client"
    ):
        submit_scruffy_workflow(_workflow(tmp_path, run_factory), root=tmp_path)


def test_submit_pazuzu_on_several_nodes_launches_the_runner_argv_on_each(
    pazuzu, tmp_path, run_factory
):
    from koochak.jobs.slurm_nodes import NODES_SCRIPT

    run = run_factory(tmp_path / "run")
    client = _recording_client(pazuzu)
    two = pazuzu.SlurmResources(memory_gb_per_node=1, time_limit="00:05:00", nodes=2,
                                tasks_per_node=2)  # fmt: skip
    asyncio.run(submit_pazuzu(client, run, resources=two, log_dir=str(tmp_path / "logs")))
    one = _slurm_resources(pazuzu)
    asyncio.run(submit_pazuzu(client, run, resources=one, log_dir=str(tmp_path), distributed=True))
    asyncio.run(submit_pazuzu(client, run, resources=one, log_dir=str(tmp_path)))
    wide, narrow, plain = client.jobs
    assert wide.argv == ("bash", "-c", NODES_SCRIPT, "koochak-nodes", "2", *run.runner_argv)
    assert narrow.argv == ("bash", "-c", NODES_SCRIPT, "koochak-nodes", "1", *run.runner_argv)
    assert plain.argv == run.runner_argv and wide.resources is two
