"""Prepared runs through Scruffy (the Scruffy stub's controller) and through Slurm (Pazuzu
stand-in), end to end with prepare_run, the runner and the loop's Scruffy hooks:

- a PreparedWorkflow whose `infer` waits only for `train`'s numbered checkpoint
  `checkpoint/step000000009.pt` (artifact-only release) starts after that publication and
  verifies the bytes Scruffy handed it, via one submit_scruffy_workflow call;
- the same PreparedRun submitted to both backends runs the same argv, environment and config
  (the two preflight.json records agree on every digest).

Skipped only while the pieces of issues 10 and 11 (tests-integration/scruffy_stub,
koochak.jobs.prepare_run) are not on this branch."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import sys
import textwrap
import time
from pathlib import Path

import koochak.jobs
import pazuzu
import pytest
from koochak.jobs.backends import submit_pazuzu, submit_scruffy, submit_scruffy_workflow
from koochak.jobs.workflow import PreparedTask, PreparedWorkflow
from slurm_jobs import exit_code, wait_for_job

HERE = Path(__file__).resolve().parent
SCRUFFY_STUB = HERE.parent / "scruffy_stub"
SCRUFFY_E2E = HERE.parent / "test_scruffy_e2e.py"
if not hasattr(koochak.jobs, "prepare_run") or not (SCRUFFY_STUB / "stub_harness.py").exists():
    pytest.skip(
        "needs koochak.jobs.prepare_run (issue 11) and the Scruffy stub (issue 10)",
        allow_module_level=True,
    )
if str(SCRUFFY_STUB) not in sys.path:
    sys.path.insert(0, str(SCRUFFY_STUB))

import stub_harness  # noqa: E402

pytestmark = pytest.mark.slow
REQ = {"nodes": 1, "gpus_per_node": 0, "cpus_per_node": 1, "memory_gb_per_node": 1}
ARTIFACT = "checkpoint/step000000009.pt"


def _scruffy_e2e():
    """The user code and the verifying consumer of the Scruffy end-to-end test, reused."""
    spec = importlib.util.spec_from_file_location("koochak_scruffy_e2e", SCRUFFY_E2E)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _profile(tmp_path: Path, **variables: str):
    lines = ["version: 1", "id: both-backends", f"python: {sys.executable}", "environment:", "  set:",
             f'    PATH: "{Path(sys.executable).parent}:/usr/bin:/bin"',
             f'    PYTHONPATH: "{SCRUFFY_STUB}"']  # fmt: skip
    lines += [f'    {k}: "{v}"' for k, v in variables.items()]
    (tmp_path / "profile.yaml").write_text("\n".join(lines) + "\n")
    return koochak.jobs.load_environment_profile(tmp_path / "profile.yaml")


def test_infer_released_only_by_the_numbered_checkpoint_through_a_prepared_workflow(
    tmp_path, monkeypatch
):
    e2e = _scruffy_e2e()
    project = tmp_path / "project"
    project.mkdir()
    (project / "e2e_user.py").write_text(e2e.USER_CODE)
    (project / "cfg.yaml").write_text(textwrap.dedent("""
        train: {max_steps: 12, ckpt_every: 10, log_every: 1, device: cpu, progress_bar: false}
        optim: {optimizer: {name: sgd, lr: 0.01}}
        logging: {stdout: false}
        entry: {model: "e2e_user:make_model", dataset: "e2e_user:dataset", step: "e2e_user:step_fn"}
    """))  # fmt: skip
    profile = _profile(tmp_path, KOOCHAK_SCRUFFY_ARTIFACT_ACK_TIMEOUT_SECONDS="60")
    train = koochak.jobs.prepare_run(
        name="train", profile=profile, python_args=["-m", "koochak.loop.cli", "--config", "{config}"],
        cwd=str(project), run_dir=str(project / "run"), base_config=str(project / "cfg.yaml"),
    )  # fmt: skip
    infer = koochak.jobs.prepare_run(
        name="infer", profile=profile, python_args=["-c", e2e.CONSUMER],
        cwd=str(project), run_dir=str(project / "infer"),
    )  # fmt: skip
    gate = {"kind": "artifact", "task_id": "train", "artifact_id": ARTIFACT}
    workflow = PreparedWorkflow("both/attempt-1", "wf", "default", [
        PreparedTask("train", train, REQ),
        PreparedTask("infer", infer, REQ, needs=[], wait_for=[gate]),
    ])  # fmt: skip
    scruffy = stub_harness.load_client("0.1.1", monkeypatch)
    with stub_harness.StubController(tmp_path / "root", "0.1.1") as controller:
        root = controller.root
        sub = submit_scruffy_workflow(workflow, root=root)
        assert submit_scruffy_workflow(workflow, root=root)["deduplicated"] is True
        train_job, infer_job = (t["job_id"] for t in sub["tasks"])
        consumer = scruffy.wait_for_job(root, infer_job, timeout=240)
        assert consumer["state"] == "succeeded", (root / consumer["stderr"]).read_text()
        producer = scruffy.wait_for_job(root, train_job, timeout=240)
        assert producer["state"] == "succeeded", (root / producer["stderr"]).read_text()
        evidence = json.loads((root / consumer["stdout"]).read_text())
    assert evidence["publication"]["artifact_id"] == ARTIFACT
    assert evidence["publication"]["path"] == str(project / "run" / "step000000009.pt")
    assert evidence["producer_job_id"] == train_job


WORKLOAD = r"""
import json, os, sys
owned = ("SLURM_", "SCRUFFY_", "CUDA_", "HOME", "USER", "LOGNAME", "TMPDIR", "LANG", "LC_", "XDG_")
env = {k: v for k, v in os.environ.items() if not k.startswith(owned)}
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": env, "config": open(sys.argv[1]).read()}))
"""


def test_the_same_prepared_run_on_both_backends_runs_the_same_contract(
    local_slurm, tmp_path, monkeypatch
):
    (tmp_path / "work.py").write_text(WORKLOAD)
    (tmp_path / "cfg.yaml").write_text("train: {lr: 0.1}\n")
    prepared = koochak.jobs.prepare_run(
        name="same-run", profile=_profile(tmp_path, MODE="both"), python_args=[str(tmp_path / "work.py"), "{config}"],
        cwd=str(tmp_path), run_dir=str(tmp_path / "run"), base_config=str(tmp_path / "cfg.yaml"),
    )  # fmt: skip
    preflight = Path(prepared.preflight_path)
    scruffy = stub_harness.load_client("0.1.1", monkeypatch)
    with stub_harness.StubController(tmp_path / "root", "0.1.1") as controller:
        receipt = submit_scruffy(prepared, root=controller.root, resources=scruffy.ResourceRequest(1, 0, 1, 1),
                                 request_id="same/1", project_id="default")  # fmt: skip
        job = scruffy.wait_for_job(controller.root, receipt["job_id"], timeout=120)
        assert job["state"] == "succeeded", (controller.root / job["stderr"]).read_text()
        on_scruffy = (
            json.loads(preflight.read_text()),
            json.loads((controller.root / job["stdout"]).read_text()),
        )
    resources = pazuzu.SlurmResources(memory_gb_per_node=1, time_limit="00:05:00")
    handle = asyncio.run(
        submit_pazuzu(
            pazuzu.PazuzuClient(), prepared, resources=resources, log_dir=str(tmp_path / "logs")
        )
    )
    fields = wait_for_job(handle.job_id)
    assert (fields["JobState"], exit_code(fields)) == ("COMPLETED", 0), Path(
        handle.stderr_path
    ).read_text()
    on_slurm = (json.loads(preflight.read_text()), json.loads(Path(handle.stdout_path).read_text()))
    for record in (on_scruffy[0], on_slurm[0]):
        record.pop("recorded_at")
    # The manifest (argv, environment, config digest), the checks and the environment digest:
    # runtime-owned variables (SLURM_*, SCRUFFY_*, HOME, ...) differ by backend by design, so
    # the environment digest must be computed without them for the two to agree.
    assert on_scruffy[0] == on_slurm[0]
    assert on_scruffy[0]["manifest_sha256"] == prepared.manifest_sha256
    assert on_scruffy[1] == on_slurm[1]  # the workload saw the same argv, cwd, environment, config
    assert on_slurm[1]["env"]["MODE"] == "both" and on_slurm[1]["config"].startswith("train:")


def test_a_recovery_mapping_retries_an_evacuated_task_which_resumes_bit_identical(
    tmp_path, monkeypatch
):
    """Newer contract: the stub evacuates `train` (USR1 through the runner to the loop: 75);
    its recovery mapping retries it in place and it resumes; `straight`, the same training
    never interrupted, ends with the same weights."""
    import torch
    from koochak.loop.checkpoint import load
    from slurm_user import CONFIG

    shutil.copy(HERE / "slurm_user.py", tmp_path)
    (tmp_path / "cfg.yaml").write_text(CONFIG)

    def prepare(name: str, pause: str):
        (tmp_path / name).mkdir()
        profile = _profile(tmp_path / name, STEP_SLEEP=pause, MARK_DIR="{run_dir}")
        return koochak.jobs.prepare_run(
            name=name, profile=profile, python_args=["-m", "koochak.loop.cli", "--config", "{config}"],
            cwd=str(tmp_path), run_dir=str(tmp_path / name / "run"), base_config=str(tmp_path / "cfg.yaml"),
        )  # fmt: skip

    recovery = {
        "max_attempts": 2,
        "retry_on": ["evacuated"],
        "evacuation": {"signal": "USR1", "grace_seconds": 30},
    }
    train, straight = prepare("train", "0.3"), prepare("straight", "0")
    workflow = PreparedWorkflow("retry/attempt-1", "wf", "default", [
        PreparedTask("train", train, REQ, recovery=recovery),
        PreparedTask("straight", straight, REQ),
    ])  # fmt: skip
    scruffy = stub_harness.load_client("newer", monkeypatch)
    with stub_harness.StubController(tmp_path / "root", "newer") as controller:
        root = controller.root
        train_job, straight_job = (
            t["job_id"] for t in submit_scruffy_workflow(workflow, root=root)["tasks"]
        )
        started = Path(train.run_dir) / "started"
        while not started.exists():
            job = scruffy.status(root, train_job)
            assert job["state"] not in {"succeeded", "failed", "cancelled", "lost", "rejected"}, job
            time.sleep(0.1)
        controller.control(evacuate=[train_job])
        done = scruffy.wait_for_job(root, train_job, timeout=240)
        assert done["state"] == "succeeded", (root / done["stderr"]).read_text()
        other = scruffy.wait_for_job(root, straight_job, timeout=240)
        assert other["state"] == "succeeded", (root / other["stderr"]).read_text()
        retrying = [
            r
            for r in stub_harness.journal(root)
            if r.get("job_id") == train_job and r["kind"] == "job.retrying"
        ]
    assert [(r["data"]["reason"], r["data"]["exit_code"]) for r in retrying] == [("evacuated", 75)]
    resumed = load(str(Path(train.run_dir) / "step000000020.pt"))["model"]
    uninterrupted = load(str(Path(straight.run_dir) / "step000000020.pt"))["model"]
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)


def test_a_scruffy_without_recovery_rejects_it_with_its_own_error(tmp_path, monkeypatch):
    profile = _profile(tmp_path)
    run = koochak.jobs.prepare_run(name="t", profile=profile, python_args=["-c", "pass"], cwd=str(tmp_path),
                                   run_dir=str(tmp_path / "run"))  # fmt: skip
    recovery = {
        "max_attempts": 2,
        "retry_on": [],
        "evacuation": {"signal": "USR1", "grace_seconds": 0},
    }
    workflow = PreparedWorkflow(
        "r", "wf", "default", [PreparedTask("t", run, REQ, recovery=recovery)]
    )
    stub_harness.load_client("0.1.1", monkeypatch)
    with pytest.raises(ValueError, match=r"unexpected fields: \['recovery'\]"):
        submit_scruffy_workflow(workflow, root=tmp_path / "root")


def test_an_unacknowledged_checkpoint_exits_76_through_the_runner_and_the_retry_republishes(
    tmp_path, monkeypatch
):
    """Newer contract, a prepared koochak-train run under the runner: the controller holds
    every report until a retry, so the first numbered checkpoint is not acknowledged in time;
    the loop exits 76, the runner passes 76 on, the recovery mapping retries the task on
    `checkpoint_ack_timeout`, and the retry resumes from that checkpoint and republishes its
    artifact event under the same id (deduplicated: one accepted report per id)."""
    from slurm_user import CONFIG

    e2e = _scruffy_e2e()
    shutil.copy(HERE / "slurm_user.py", tmp_path)
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    profile = _profile(
        tmp_path, STEP_SLEEP="0", MARK_DIR="{run_dir}",
        KOOCHAK_SCRUFFY_ARTIFACT_ACK_TIMEOUT_SECONDS="3",
    )  # fmt: skip
    train = koochak.jobs.prepare_run(
        name="train", profile=profile, python_args=["-m", "koochak.loop.cli", "--config", "{config}"],
        cwd=str(tmp_path), run_dir=str(tmp_path / "run"), base_config=str(tmp_path / "cfg.yaml"),
    )  # fmt: skip
    recovery = {
        "max_attempts": 2,
        "retry_on": ["checkpoint_ack_timeout"],
        "evacuation": {"signal": "USR1", "grace_seconds": 30},
    }
    workflow = PreparedWorkflow(
        "ack/attempt-1", "wf", "default", [PreparedTask("train", train, REQ, recovery=recovery)]
    )
    scruffy = stub_harness.load_client("newer", monkeypatch)
    with stub_harness.StubController(tmp_path / "root", "newer") as controller:
        root = controller.root
        controller.control(hold_reports=True, until_retry=True)
        (job,) = (t["job_id"] for t in submit_scruffy_workflow(workflow, root=root)["tasks"])
        done = scruffy.wait_for_job(root, job, timeout=240)
        assert done["state"] == "succeeded", (root / done["stderr"]).read_text()
        retrying = [r for r in e2e.journal_of(root, job) if r["kind"] == "job.retrying"]
        events = e2e.artifact_events(root, job)
    assert [(r["data"]["reason"], r["data"]["exit_code"]) for r in retrying] == [
        ("checkpoint_ack_timeout", 76)
    ]
    record = e2e.exit_record(root, done)  # attempt 1's exit line, from the job's stderr.log
    assert record["reason"] == "checkpoint_ack_timeout" and record["retryable"] is True
    ids = [e["source_event_id"] for e in events]
    assert record["event_id"] in ids and len(ids) == len(set(ids))
    assert (Path(train.run_dir) / "step000000020.pt.ready.json").exists()
