"""koochak-train as a job of the Scruffy stub's controller, for both contracts (0.1.1 and newer):
events reach the controller, a consumer gated on checkpoint/step000000009.pt starts only after
that publication, a never-acknowledging controller makes the job exit 76 with the checkpoint
resumable (the retry resumes and republishes it under the same event id), a rejected
publication exits 77 and releases nothing, and (newer contract) an evacuation leaves with 75
without waiting for acknowledgements, its retry resuming from the evacuation checkpoint."""

from __future__ import annotations

import hashlib
import json
import sys
import textwrap
import time
from pathlib import Path

import pytest

STUB_DIR = Path(__file__).resolve().parent / "scruffy_stub"
if str(STUB_DIR) not in sys.path:
    sys.path.insert(0, str(STUB_DIR))

import stub_harness  # noqa: E402

pytestmark = pytest.mark.slow

USER_CODE = """
import torch
from torch.nn import functional as F


def make_model(cfg):
    torch.manual_seed(0)
    return torch.nn.Linear(2, 1)


def dataset(cfg, start_step=0):
    gen = torch.Generator().manual_seed(start_step)
    while True:
        x = torch.randn(4, 2, generator=gen)
        yield x, x.sum(1, keepdim=True)


def step_fn(model, batch, ctx):
    x, y = batch
    return {"loss": F.mse_loss(model(x), y)}


def val_dataset(cfg):
    return [(torch.ones(2, 2), torch.full((2, 1), 2.0))]


def eval_fn(model, data, ctx):
    return {"loss": sum(float(F.mse_loss(model(x), y)) for x, y in data)}
"""

# The consumer verifies the exact publication Scruffy handed it (launch.json) against the bytes.
CONSUMER = """
import hashlib, json, os, sys
(evidence,) = json.load(open(os.environ["SCRUFFY_PROVENANCE_PATH"]))["conditions"]
pub = evidence["publication"]
data = open(pub["path"], "rb").read()
ok = len(data) == pub["size_bytes"] and hashlib.sha256(data).hexdigest() == pub["sha256"]
ok = ok and os.path.exists(pub["manifest_path"])
print(json.dumps(evidence))
sys.exit(0 if ok else 3)
"""
ARTIFACT = "checkpoint/step000000009.pt"
REQ = {"nodes": 1, "gpus_per_node": 0, "cpus_per_node": 1, "memory_gb_per_node": 1}


@pytest.fixture(params=["0.1.1", "newer"])
def contract(request):
    return request.param


@pytest.fixture
def setup(tmp_path, contract, monkeypatch):
    """(scruffy client, running controller, project dir)"""
    scruffy = stub_harness.load_client(contract, monkeypatch)
    project = tmp_path / "project"
    project.mkdir()
    (project / "e2e_user.py").write_text(USER_CODE)
    (project / "cfg.yaml").write_text(
        textwrap.dedent(f"""
        train: {{max_steps: 12, ckpt_every: 10, log_every: 1, eval_every: 5, device: cpu,
                 out_dir: {project / "run"}, progress_bar: false}}
        optim: {{optimizer: {{name: sgd, lr: 0.01}}}}
        logging: {{stdout: false}}
        entry: {{model: "e2e_user:make_model", dataset: "e2e_user:dataset",
                 step: "e2e_user:step_fn", eval_dataset: "e2e_user:val_dataset",
                 eval_fn: "e2e_user:eval_fn"}}
    """)
    )
    with stub_harness.StubController(tmp_path / "root", contract) as controller:
        yield scruffy, controller, project


def train_task(project, ack_timeout, **extra):
    return {
        "task_id": "train",
        "argv": [sys.executable, "-m", "koochak.loop.cli", "--config", str(project / "cfg.yaml")],
        "cwd": str(project),
        "environment": {"KOOCHAK_SCRUFFY_ARTIFACT_ACK_TIMEOUT_SECONDS": str(ack_timeout)},
        "resources": REQ,
        **extra,
    }


def consumer_task(project):
    return {
        "task_id": "infer",
        "argv": [sys.executable, "-c", CONSUMER],
        "cwd": str(project),
        "resources": REQ,
        "wait_for": [{"kind": "artifact", "task_id": "train", "artifact_id": ARTIFACT}],
    }


def journal_of(root, job_id):
    return [r for r in stub_harness.journal(root) if r.get("job_id") == job_id]


def artifact_events(root, job_id):
    return [r for r in journal_of(root, job_id) if r["kind"] == "workload.artifact"]


def workload_view(scruffy, root, job_id, status, seconds=30.0):
    """The job's ``workload`` projection once it shows ``status`` (its last reports may still
    sit in the inbox for a tick after the job ended); fails with the view it last saw."""
    deadline = time.monotonic() + seconds
    while True:
        view = scruffy.status(root, job_id)["workload"]
        if view["status"] == status or time.monotonic() > deadline:
            assert view["status"] == status, view
            return view
        time.sleep(0.1)


def exit_record(root, job):
    lines = [ln for ln in (root / job["stderr"]).read_text().splitlines() if ln.startswith("{")]
    return json.loads(lines[-1])


def test_events_reach_the_controller_and_the_gate_opens_on_the_checkpoint(setup):
    scruffy, controller, project = setup
    root = controller.root
    cursor = scruffy.observe(root)["next_cursor"]
    sub = scruffy.submit_workflow(
        root,
        request_id="e2e",
        workflow_id="wf",
        tasks=[train_task(project, 60), consumer_task(project)],
    )
    train, infer = (t["job_id"] for t in sub["tasks"])
    consumer = scruffy.wait_for_job(root, infer, timeout=240)
    assert consumer["state"] == "succeeded", (root / consumer["stderr"]).read_text()
    producer = scruffy.wait_for_job(root, train, timeout=240)
    assert producer["state"] == "succeeded", (root / producer["stderr"]).read_text()

    seen, deadline = [], time.monotonic() + 10  # an observer following the journal
    while time.monotonic() < deadline:
        page = scruffy.observe(root, after=cursor, wait_seconds=0.5)
        seen += page["events"]
        cursor = page["next_cursor"]
        if not page["events"] and not page["more"]:
            break
    kinds = {e["kind"] for e in seen if e.get("job_id") == train}
    assert {
        "workload.phase",
        "workload.progress",
        "workload.milestone",
        "workload.artifact",
    } <= kinds
    phases = [
        (e["data"]["phase"], e["data"]["status"])
        for e in seen
        if e["kind"] == "workload.phase" and e["job_id"] == train
    ]
    assert phases == [("training", "started"), ("training", "completed")]
    assert workload_view(scruffy, root, train, "completed")["phase"] == "training"
    (nine,) = [
        e
        for e in artifact_events(root, train)
        if e["data"]["publication"]["artifact_id"] == ARTIFACT
    ]
    pub = nine["data"]["publication"]
    data = Path(pub["path"]).read_bytes()
    assert pub["size_bytes"] == len(data) and pub["sha256"] == hashlib.sha256(data).hexdigest()
    assert nine["source"] == {"name": "koochak"}
    assert nine["source_event_id"].startswith("koochak-checkpoint-")
    evidence = json.loads((root / consumer["stdout"]).read_text())
    assert evidence["publication"] == pub and evidence["producer_job_id"] == train
    order = {(r["kind"], r.get("job_id")): r["seq"] for r in reversed(stub_harness.journal(root))}
    satisfied, running = order[("condition.satisfied", infer)], order[("job.running", infer)]
    assert nine["seq"] < satisfied < running


def test_a_never_acknowledging_controller_gives_exit_76_and_the_retry_resumes(setup, contract):
    scruffy, controller, project = setup
    root = controller.root
    controller.control(hold_reports=True, until_retry=True)
    extra = {}
    if contract == "newer":
        extra = {"recovery": {"max_attempts": 2, "retry_on": ["checkpoint_ack_timeout"]}}
    sub = scruffy.submit_workflow(
        root,
        request_id="e2e-76",
        workflow_id="wf",
        tasks=[train_task(project, 2, **extra), consumer_task(project)],
    )
    train, infer = (t["job_id"] for t in sub["tasks"])
    checkpoint = project / "run" / "step000000009.pt"

    if contract == "0.1.1":
        first = scruffy.wait_for_job(root, train, timeout=240)
        assert (first["state"], first["reason"], first["exit_code"]) == (
            "failed",
            "application_exit",
            76,
        )
        record = exit_record(root, first)
        assert scruffy.status(root, infer)["state"] == "blocked"
        # An explicit new attempt of the task (0.1.1 retries nothing itself); then the
        # controller acknowledges again.
        retry = scruffy.submit_job(
            root,
            argv=train_task(project, 60)["argv"],
            name="train",
            cwd=project,
            environment={"KOOCHAK_SCRUFFY_ARTIFACT_ACK_TIMEOUT_SECONDS": "60"},
            request=scruffy.ResourceRequest(1, 0, 1, 1),
            request_id="e2e-76/train#2",
            workflow_id="wf",
            task_id="train",
        )
        controller.control()
        producer = retry["job_id"]
    else:
        producer = train
    consumer = scruffy.wait_for_job(root, infer, timeout=240)
    assert consumer["state"] == "succeeded", (root / consumer["stderr"]).read_text()
    done = scruffy.wait_for_job(root, producer, timeout=240)
    assert done["state"] == "succeeded", (root / done["stderr"]).read_text()
    if contract == "newer":
        (retrying,) = [r for r in journal_of(root, train) if r["kind"] == "job.retrying"]
        assert (retrying["data"]["reason"], retrying["data"]["exit_code"]) == (
            "checkpoint_ack_timeout",
            76,
        )
        record = exit_record(root, done)  # attempt 1's line, in the job's stderr.log

    assert record["reason"] == "checkpoint_ack_timeout" and record["retryable"] is True
    assert record["checkpoint_path"] == str(checkpoint)
    assert (project / "run" / "step000000009.pt.ready.json").exists()
    # The retry resumed from step 9's checkpoint, republished it under the same event id and
    # named the selection; the consumer was released by the newest attempt's publication.
    republished = [
        e for e in artifact_events(root, producer) if e["source_event_id"] == record["event_id"]
    ]
    assert len(republished) == 1  # newer: attempt 2's identical report was deduplicated
    milestones = [
        e["data"] for e in journal_of(root, producer) if e["kind"] == "workload.milestone"
    ]
    (selected,) = [m for m in milestones if m["milestone"] == "resume_selected"]
    assert selected["artifact_event_id"] == record["event_id"] and selected["step"] == 10
    evidence = json.loads((root / consumer["stdout"]).read_text())
    assert evidence["producer_job_id"] == producer
    assert evidence["producer_event_id"] == record["event_id"]


def test_a_rejected_publication_exits_77_and_releases_nothing(setup):
    scruffy, controller, project = setup
    root = controller.root
    train = "job-" + hashlib.sha256(b"e2e-77/train").hexdigest()[:20]
    controller.control(reject_reports_of=[train])
    sub = scruffy.submit_workflow(
        root,
        request_id="e2e-77",
        workflow_id="wf",
        tasks=[train_task(project, 60), consumer_task(project)],
    )
    assert sub["tasks"][0]["job_id"] == train
    infer = sub["tasks"][1]["job_id"]
    done = scruffy.wait_for_job(root, train, timeout=240)
    assert (done["state"], done["exit_code"]) == ("failed", 77), (root / done["stderr"]).read_text()
    record = exit_record(root, done)
    assert record["reason"] == "checkpoint_publication_rejected" and record["retryable"] is False
    assert record["checkpoint_path"] == str(project / "run" / "step000000009.pt")
    time.sleep(0.5)
    blocked = scruffy.status(root, infer)
    assert blocked["state"] == "blocked" and blocked["condition_satisfactions"] == []
    assert not (project / "run" / "step000000012.pt").exists()  # training stopped there
    scruffy.cancel_job(root, infer)


SLOW_DATA = """

def slow_dataset(cfg, start_step=0):
    import time
    for batch in dataset(cfg, start_step):
        time.sleep(0.003)
        yield batch
"""


def test_newer_evacuation_publishes_without_waiting_and_the_retry_resumes(tmp_path, monkeypatch):
    """Under a controller that acknowledges nothing, an evacuation still leaves at once (75, not
    76): its checkpoint artifact and milestone do not wait. The in-place retry resumes from it."""
    scruffy = stub_harness.load_client("newer", monkeypatch)
    project = tmp_path / "project"
    project.mkdir()
    (project / "e2e_user.py").write_text(USER_CODE + SLOW_DATA)
    (project / "cfg.yaml").write_text(
        textwrap.dedent(f"""
        train: {{max_steps: 1500, log_every: 10, device: cpu, out_dir: {project / "run"},
                 progress_bar: false, evacuation_enabled: true}}
        optim: {{optimizer: {{name: sgd, lr: 0.01}}}}
        logging: {{stdout: false}}
        entry: {{model: "e2e_user:make_model", dataset: "e2e_user:slow_dataset",
                 step: "e2e_user:step_fn"}}
    """)
    )
    recovery = {
        "max_attempts": 2,
        "retry_on": ["evacuated"],
        "evacuation": {"signal": "USR1", "grace_seconds": 30},
    }
    with stub_harness.StubController(tmp_path / "root", "newer") as controller:
        root = controller.root
        sub = scruffy.submit_workflow(
            root,
            request_id="e2e-75",
            workflow_id="wf",
            tasks=[train_task(project, 60, recovery=recovery)],
        )
        train = sub["tasks"][0]["job_id"]
        deadline = time.monotonic() + 120
        while not (project / "run" / "log.csv").exists():  # training has started
            assert time.monotonic() < deadline
            time.sleep(0.05)
        controller.control(hold_reports=True, until_retry=True, evacuate=[train])
        done = scruffy.wait_for_job(root, train, timeout=240)
    events = journal_of(root, train)
    assert done["state"] == "succeeded", (done["reason"], (root / done["stderr"]).read_text())
    (retrying,) = [e for e in events if e["kind"] == "job.retrying"]
    assert (retrying["data"]["reason"], retrying["data"]["exit_code"]) == ("evacuated", 75)
    milestones = [e["data"] for e in events if e["kind"] == "workload.milestone"]
    (evacuation,) = [m for m in milestones if m["milestone"] == "evacuation"]
    (selected,) = [m for m in milestones if m["milestone"] == "resume_selected"]
    pub = evacuation["publication"]
    assert Path(pub["path"]).exists() and pub["path"] == selected["path"]
    assert selected["artifact_event_id"] == evacuation["artifact_event_id"]
    assert selected["step"] == evacuation["step"] == int(pub["artifact_id"][-12:-3])
    same = [
        e
        for e in artifact_events(root, train)
        if e["source_event_id"] == evacuation["artifact_event_id"]
    ]
    assert len(same) == 1 and same[0]["data"]["publication"] == pub  # the republish deduplicated
    statuses = [e["data"]["status"] for e in events if e["kind"] == "workload.phase"]
    assert statuses == ["started", "evacuated", "started", "completed"]
    assert workload_view(scruffy, root, train, "completed")["phase"] == "training"


FAILING_STEP = """

def failing_step(model, batch, ctx):
    if ctx.step >= 3:
        raise RuntimeError("loss diverged at update 3")
    return step_fn(model, batch, ctx)
"""


def test_a_failed_run_shows_status_failed(setup):
    scruffy, controller, project = setup
    root = controller.root
    with open(project / "e2e_user.py", "a") as f:
        f.write(FAILING_STEP)
    task = train_task(project, 60)
    task["argv"] = [*task["argv"], "entry.step=e2e_user:failing_step"]
    sub = scruffy.submit_workflow(root, request_id="e2e-fail", workflow_id="wf", tasks=[task])
    train = sub["tasks"][0]["job_id"]
    done = scruffy.wait_for_job(root, train, timeout=240)
    assert (done["state"], done["exit_code"]) == ("failed", 1), (root / done["stderr"]).read_text()
    view = workload_view(scruffy, root, train, "failed")
    assert view["phase"] == "training"
    (failed,) = [
        e["data"]
        for e in journal_of(root, train)
        if e["kind"] == "workload.phase" and e["data"]["status"] == "failed"
    ]
    assert failed["error_type"] == "RuntimeError" and failed["step"] == 3
    assert failed["message"] == "loss diverged at update 3"


def test_newer_an_evacuation_that_is_not_retried_shows_status_evacuated(tmp_path, monkeypatch):
    scruffy = stub_harness.load_client("newer", monkeypatch)
    project = tmp_path / "project"
    project.mkdir()
    (project / "e2e_user.py").write_text(USER_CODE + SLOW_DATA)
    (project / "cfg.yaml").write_text(
        textwrap.dedent(f"""
        train: {{max_steps: 1500, log_every: 10, device: cpu, out_dir: {project / "run"},
                 progress_bar: false, evacuation_enabled: true}}
        optim: {{optimizer: {{name: sgd, lr: 0.01}}}}
        logging: {{stdout: false}}
        entry: {{model: "e2e_user:make_model", dataset: "e2e_user:slow_dataset",
                 step: "e2e_user:step_fn"}}
    """)
    )
    recovery = {
        "max_attempts": 1,
        "retry_on": [],
        "evacuation": {"signal": "USR1", "grace_seconds": 30},
    }
    with stub_harness.StubController(tmp_path / "root", "newer") as controller:
        root = controller.root
        sub = scruffy.submit_workflow(
            root,
            request_id="e2e-75-once",
            workflow_id="wf",
            tasks=[train_task(project, 60, recovery=recovery)],
        )
        train = sub["tasks"][0]["job_id"]
        deadline = time.monotonic() + 120
        while not (project / "run" / "log.csv").exists():  # training has started
            assert time.monotonic() < deadline
            time.sleep(0.05)
        controller.control(evacuate=[train])
        done = scruffy.wait_for_job(root, train, timeout=240)
        assert (done["state"], done["reason"], done["exit_code"]) == ("failed", "evacuated", 75)
        view = workload_view(scruffy, root, train, "evacuated")
    assert view["phase"] == "training"
    assert view["last_milestone"]["milestone"] == "evacuation"
    assert view["last_milestone"]["status"] == "checkpointed"


def _upstream_hook_table() -> dict[str, str]:
    """hook name -> its data-fields cell, from shared/contracts/koochak-jobs-upstream.md."""
    paths = [p.parent / "koochak-jobs-upstream.md" for p in stub_harness.CONTRACT_CANDIDATES]
    found = [p for p in paths if p.is_file()]
    if not found:
        pytest.skip("shared/contracts/koochak-jobs-upstream.md is not next to this checkout")
    rows = {}
    for line in found[0].read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`on_"):
            rows[cells[0].strip("`").split("(")[0]] = cells[2]
    return rows


def test_phase_and_status_are_the_upstream_hook_tables():
    """What the loop's hooks publish for each lifecycle hook, against the table's values."""
    from koochak.events import make_event_hooks

    table = _upstream_hook_table()
    assert 'phase:"training"' in table["on_train_start"]
    assert 'status:"started"' in table["on_train_start"]
    assert '"evacuated"' in table["on_train_end"] and '"completed"' in table["on_train_end"]
    assert 'status:"failed"' in table["on_exception"]
    assert 'phase:"evaluation"' in table["on_eval_end"]

    def run(*calls):
        events = []
        hooks = make_event_hooks(lambda event: events.append(event))
        for name, info in calls:
            for fn in hooks[name]:
                fn(info)
        return [(e.kind, dict(e.payload)) for e in events]

    start = ("on_train_start", {"step": 0, "rank": 0, "world_size": 1, "max_steps": 3})
    phases = [
        (p["phase"], p["status"])
        for runs in (
            run(start, ("on_train_end", {"step": 3})),
            run(start, ("on_train_end", {"step": 3, "reason": "evacuation"})),
            run(start, ("on_exception", {"step": 1, "exception": ValueError("x")})),
        )
        for kind, p in runs
        if kind == "workload.phase"
    ]
    assert phases == [
        ("training", "started"),
        ("training", "completed"),
        ("training", "started"),
        ("training", "evacuated"),
        ("training", "started"),
        ("training", "failed"),
    ]
    failed = run(start, ("on_exception", {"step": 1, "exception": ValueError("x")}))[-1][1]
    for field in ("error_type", "message", "step"):
        assert f"`{field}`" in table["on_exception"] and field in failed
    (evaluation,) = run(start, ("on_eval_end", {"step": 2, "metrics": {"loss": 1.0}}))[1:]
    assert evaluation[1]["phase"] == "evaluation"
