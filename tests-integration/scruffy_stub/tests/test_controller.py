"""The stub controller as a real subprocess over a real root: jobs as child processes in their
own session with the SCRUFFY_* environment, reports validated/journaled/deduplicated, artifact
gates released only by the newest attempt's strict publication, cursors, cancels, retries."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import stub_harness

pytestmark = pytest.mark.slow

PY = sys.executable
REQ = {"nodes": 1, "gpus_per_node": 0, "cpus_per_node": 1, "memory_gb_per_node": 1}
PUB = {
    "v": 1,
    "artifact_id": "checkpoint/step000000009.pt",
    "path": "/r/step000000009.pt",
    "size_bytes": 3,
    "sha256": "1" * 64,
    "manifest_path": "/r/step000000009.pt.ready.json",
}


def task(tmp_path, task_id, code, **kw):
    return {
        "task_id": task_id,
        "argv": [PY, "-c", code],
        "cwd": str(tmp_path),
        "resources": REQ,
        **kw,
    }


def wait_until(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not reached")


def follow(scruffy, root, cursor, predicate, timeout=20.0):
    """Follow observe() from ``cursor`` until an event matches; returns that event."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        page = scruffy.observe(root, after=cursor, wait_seconds=1)
        for event in page["events"]:
            if predicate(event):
                return event
        cursor = page["next_cursor"]
    raise AssertionError("no such event")


def kinds_for(root, job_id):
    return [r["kind"] for r in stub_harness.journal(root) if r.get("job_id") == job_id]


ENV_PROBE = (
    "import json, os; print(json.dumps({k: v for k, v in os.environ.items() "
    "if k.startswith(('SCRUFFY_', 'CUDA_')) or k == 'MINE'} | {'own_session': os.getsid(0) == os.getpid()}))"
)


def test_a_job_runs_in_its_own_session_with_the_scruffy_environment(
    scruffy, controller, tmp_path, contract
):
    root = controller.root
    sub = scruffy.submit_job(
        root,
        argv=[PY, "-c", ENV_PROBE],
        name="probe",
        cwd=tmp_path,
        environment={"MINE": "1", "SCRUFFY_JOB_ID": "spoofed"},
        request=scruffy.ResourceRequest(1, 0, 1, 1),
        request_id="probe",
    )
    job = scruffy.wait_for_job(root, sub["job_id"], timeout=30)
    assert (job["state"], job["reason"], job["exit_code"]) == ("succeeded", "process_exit", 0)
    seen = json.loads((root / job["stdout"]).read_text())
    assert seen["own_session"] is True and seen["MINE"] == "1"
    assert seen["SCRUFFY_JOB_ID"] == sub["job_id"]  # controller-owned variables win
    assert seen["SCRUFFY_ROOT"] == str(root.resolve()) and seen["SCRUFFY_ATTEMPT"] == "1"
    assert seen["SCRUFFY_EVENT_DIR"] == str(root.resolve() / "reports" / sub["job_id"])
    assert seen["SCRUFFY_STUB_CONTRACT"] == contract and seen["SCRUFFY_NODE"] == "node0"
    launch = json.loads(Path(seen["SCRUFFY_PROVENANCE_PATH"]).read_text())
    assert launch["job"]["id"] == sub["job_id"]
    # Exit 76 is plain application_exit on 0.1.1; the newer contract names the reason.
    bad = scruffy.submit_job(
        root,
        argv=[PY, "-c", "raise SystemExit(76)"],
        name="n",
        cwd=tmp_path,
        environment={},
        request=scruffy.ResourceRequest(1, 0, 1, 1),
        request_id="exit76",
    )
    done = scruffy.wait_for_job(root, bad["job_id"], timeout=30)
    expected = "application_exit" if contract == "0.1.1" else "checkpoint_ack_timeout"
    assert (done["state"], done["reason"], done["exit_code"]) == ("failed", expected, 76)
    unfit = scruffy.submit_job(
        root,
        argv=[PY],
        name="n",
        cwd=tmp_path,
        environment={"X": 1},
        request=scruffy.ResourceRequest(1, 0, 1, 1),
        request_id="badenv",
    )
    assert scruffy.wait_for_job(root, unfit["job_id"], timeout=10)["reason"] == "invalid_spec"


def test_reports_are_validated_journaled_deduplicated_and_acknowledged(
    scruffy, controller, tmp_path
):
    root = controller.root
    sub = scruffy.submit_job(
        root,
        argv=[PY, "-c", "import time; time.sleep(30)"],
        name="n",
        cwd=tmp_path,
        environment={},
        request=scruffy.ResourceRequest(1, 0, 1, 1),
        request_id="sleeper",
    )
    job_id = sub["job_id"]
    cursor = scruffy.observe(root)["next_cursor"]
    scruffy.publish_event(
        root,
        job_id=job_id,
        kind="workload.progress",
        data={"phase": "training", "completed": 3},
        event_id="p-1",
    )
    record = follow(scruffy, root, cursor, lambda r: r.get("source_event_id") == "p-1")
    assert record["kind"] == "workload.progress" and record["job_id"] == job_id
    assert record["report_id"].startswith(f"{job_id}/") and record["event_id"].endswith(
        f":{record['seq']}"
    )
    assert (
        scruffy.publish_event(
            root,
            job_id=job_id,
            kind="workload.progress",
            data={"phase": "training", "completed": 3},
            event_id="p-1",
        )["deduplicated"]
        is True
    )
    with pytest.raises(scruffy.ConflictError):
        scruffy.publish_event(
            root, job_id=job_id, kind="workload.progress", data={}, event_id="p-1"
        )
    view = scruffy.status(root, job_id)["workload"]
    assert view["progress"] == {"phase": "training", "completed": 3} and view["status"] == "active"
    # A report for an unknown job is rejected as a notice carrying the report id.
    cursor = scruffy.observe(root)["next_cursor"]
    scruffy.publish_event(
        root, job_id="job-nobody", kind="workload.notice", data={}, event_id="n-1"
    )
    notice = follow(scruffy, root, cursor, lambda r: r["kind"] == "notice")
    assert notice["data"]["kind"] == "workload.report_rejected"
    assert notice["data"]["reason"] == "unknown job job-nobody" and "job_id" not in notice
    # Cursor pages: limit 1 gives one event at a time with more=True.
    start = scruffy.observe(root)["next_cursor"]
    for i in range(3):
        scruffy.publish_event(root, job_id=job_id, kind="workload.notice", data={"i": i})
    notices = lambda page: [e for e in page["events"] if e["kind"] == "workload.notice"]  # noqa: E731
    wait_until(lambda: len(notices(scruffy.observe(root, after=start))) == 3)
    first = scruffy.observe(root, after=start, limit=1)
    assert len(first["events"]) == 1 and first["more"] is True
    rest = scruffy.observe(root, after=first["next_cursor"])
    assert [e["data"]["i"] for e in notices(first) + notices(rest)] == [0, 1, 2]
    foreign = "queue-0000000000000000:0:0:0"
    assert scruffy.observe(root, after=foreign)["reset"] is True
    assert scruffy.cancel_job(root, job_id)["state"] == "cancel_requested"
    done = scruffy.wait_for_job(root, job_id, timeout=30)
    assert (done["state"], done["reason"], done["signal"]) == ("cancelled", "cancelled", 15)


PRODUCER = """
import os, sys, time, scruffy
root, job = os.environ["SCRUFFY_ROOT"], os.environ["SCRUFFY_JOB_ID"]
pub = json_pub = {pub!r}
def send(event_id, data):
    scruffy.publish_event(root, job_id=job, kind="workload.artifact", data=data, event_id=event_id)
send("obs", {{"artifact_type": "checkpoint"}})                      # an observation only
send("other", {{"publication": {{**pub, "artifact_id": "checkpoint/step000000001.pt"}}}})
time.sleep(1.0)
open(os.path.join(os.getcwd(), "released-before"), "w").write("x")
send("real", {{"publication": pub}})
time.sleep(1.5)
"""
CONSUMER = """
import json, os
launch = json.load(open(os.environ["SCRUFFY_PROVENANCE_PATH"]))
print(json.dumps(launch["conditions"]))
"""


def test_an_artifact_gate_opens_on_the_matching_publication_only(scruffy, controller, tmp_path):
    root = controller.root
    gate = [{"kind": "artifact", "task_id": "train", "artifact_id": PUB["artifact_id"]}]
    sub = scruffy.submit_workflow(
        root,
        request_id="wf",
        workflow_id="wf",
        tasks=[
            task(tmp_path, "train", PRODUCER.format(pub=PUB)),
            task(tmp_path, "infer", CONSUMER, wait_for=gate),
        ],
    )
    train, infer = (t["job_id"] for t in sub["tasks"])
    assert wait_until(lambda: scruffy.status(root, infer)["state"] == "blocked")
    done = scruffy.wait_for_job(root, infer, timeout=30)
    assert done["state"] == "succeeded"
    (evidence,) = json.loads((root / done["stdout"]).read_text())
    assert evidence["publication"] == PUB and evidence["producer_job_id"] == train
    assert evidence["producer_event_id"] == "real"
    journal = stub_harness.journal(root)
    seq = {(r["kind"], r.get("job_id"), r.get("source_event_id")): r["seq"] for r in journal}
    assert seq[("workload.artifact", train, "real")] < seq[("condition.satisfied", infer, None)]
    assert seq[("condition.satisfied", infer, None)] < seq[("job.running", infer, None)]
    assert scruffy.status(root, train)["state"] in ("running", "succeeded")  # gate is not exit


def test_retries_newest_attempt_and_rejection(scruffy, controller, tmp_path, contract):
    """A failed producer's retry (explicit on 0.1.1, in place under recovery on newer) is the
    attempt whose publication counts; a rejected report releases nothing."""
    root = controller.root
    flaky = (
        "import os, scruffy\n"
        "n = os.environ['SCRUFFY_ATTEMPT']\n"
        "if n == '1': raise SystemExit(76)\n"
        f"scruffy.publish_event(os.environ['SCRUFFY_ROOT'], job_id=os.environ['SCRUFFY_JOB_ID'], kind='workload.artifact', data={{'publication': {PUB!r}}}, event_id='ckpt-9')\n"
    )
    gate = [{"kind": "artifact", "task_id": "train", "artifact_id": PUB["artifact_id"]}]
    extra = {}
    if contract == "newer":
        extra = {"recovery": {"max_attempts": 2, "retry_on": ["checkpoint_ack_timeout"]}}
    sub = scruffy.submit_workflow(
        root,
        request_id="wf2",
        workflow_id="wf2",
        tasks=[
            task(tmp_path, "train", flaky, **extra),
            task(tmp_path, "infer", CONSUMER, wait_for=gate),
        ],
    )
    train, infer = (t["job_id"] for t in sub["tasks"])
    if contract == "0.1.1":
        first = scruffy.wait_for_job(root, train, timeout=30)
        assert (first["state"], first["reason"]) == ("failed", "application_exit")
        retry = scruffy.submit_job(
            root,
            argv=[PY, "-c", flaky.replace("n == '1'", "n == 'x'")],
            name="train",
            cwd=tmp_path,
            environment={},
            request=scruffy.ResourceRequest(1, 0, 1, 1),
            request_id="wf2/train#2",
            workflow_id="wf2",
            task_id="train",
        )
        producer = retry["job_id"]
    else:
        producer = train
    done = scruffy.wait_for_job(root, infer, timeout=30)
    (evidence,) = json.loads((root / done["stdout"]).read_text())
    assert evidence["producer_job_id"] == producer
    final = scruffy.status(root, producer)
    assert final["state"] == "succeeded"
    if contract == "newer":
        assert "job.retrying" in kinds_for(root, train) and final["artifact_evidence"]

    # Rejection: the producer's reports are refused; the consumer stays blocked for good.
    controller.control(
        reject_reports_of=["job-" + __import__("hashlib").sha256(b"wf3/train").hexdigest()[:20]]
    )
    sub = scruffy.submit_workflow(
        root,
        request_id="wf3",
        workflow_id="wf3",
        tasks=[
            task(tmp_path, "train", flaky.replace("n == '1'", "n == 'x'")),
            task(tmp_path, "infer", CONSUMER, wait_for=gate),
        ],
    )
    train, infer = (t["job_id"] for t in sub["tasks"])
    assert scruffy.wait_for_job(root, train, timeout=30)["state"] == "succeeded"
    time.sleep(0.5)
    blocked = scruffy.status(root, infer)
    assert blocked["state"] == "blocked"
    assert blocked["blockers"][0]["reason"] == "condition_pending"
    rejected = [
        r
        for r in stub_harness.journal(root)
        if r["kind"] == "notice" and r["report_id"].startswith(train)
    ]
    assert rejected and rejected[0]["data"]["kind"] == "workload.report_rejected"
    # A rejected event id can never be reused, not even with valid content.
    with pytest.raises(scruffy.ConflictError):
        scruffy.publish_event(
            root,
            job_id=train,
            kind="workload.artifact",
            data={"publication": PUB},
            event_id="ckpt-9",
        )
    assert scruffy.cancel_job(root, infer)["state"] == "cancel_requested"
    assert scruffy.wait_for_job(root, infer, timeout=10)["reason"] == "cancelled_before_start"


def test_newer_publish_waits_for_the_ack_and_times_out_when_held(newer, tmp_path):
    with stub_harness.StubController(tmp_path / "root", "newer") as ctl:
        root = ctl.root
        sub = newer.submit_job(
            root,
            argv=[PY, "-c", "import time; time.sleep(20)"],
            name="n",
            cwd=tmp_path,
            environment={},
            request=newer.ResourceRequest(1, 0, 1, 1),
            request_id="w",
        )
        wait_until(lambda: newer.status(root, sub["job_id"])["state"] == "running")
        args = dict(job_id=sub["job_id"], kind="workload.artifact", data={"publication": PUB})
        acked = newer.publish_event(root, **args, event_id="a", wait=True, timeout=10)
        assert (acked["state"], acked["acknowledged"]) == ("accepted", True)
        again = newer.publish_event(root, **args, event_id="a", wait=True, timeout=10)
        assert again["deduplicated"] is True and again["state"] == "accepted"
        ctl.control(hold_reports=True)
        time.sleep(0.2)
        with pytest.raises(TimeoutError):
            newer.publish_event(root, **args, event_id="b", wait=True, timeout=0.5)
        ctl.control(reject_reports_of=[sub["job_id"]])
        refused = newer.publish_event(root, **args, event_id="c", wait=True, timeout=10)
        assert refused["state"] == "rejected" and refused["acknowledged"] is False
        newer.cancel_job(root, sub["job_id"])


def test_needs_skip_run_and_a_colliding_submission_is_rejected_whole(scruffy, controller, tmp_path):
    root = controller.root
    sub = scruffy.submit_workflow(
        root,
        request_id="wf4",
        workflow_id="wf4",
        tasks=[
            task(tmp_path, "prep", "raise SystemExit(75)"),
            task(tmp_path, "strict", "pass", needs=[{"task_id": "prep", "condition": "succeeded"}]),
            task(tmp_path, "any", "pass", needs=[{"task_id": "prep", "condition": "terminal"}]),
        ],
    )
    prep, strict, anyway = (t["job_id"] for t in sub["tasks"])
    assert scruffy.wait_for_job(root, prep, timeout=30)["exit_code"] == 75
    skipped = scruffy.wait_for_job(root, strict, timeout=30)
    assert (skipped["state"], skipped["reason"]) == ("skipped", "dependency_unsatisfied")
    assert scruffy.wait_for_job(root, anyway, timeout=30)["state"] == "succeeded"
    # A single job duplicating a succeeded task is rejected (a retry needs a failed attempt).
    dup = scruffy.submit_job(
        root,
        argv=[PY, "-c", "pass"],
        name="any",
        cwd=tmp_path,
        environment={},
        request=scruffy.ResourceRequest(1, 0, 1, 1),
        request_id="wf4/any#2",
        workflow_id="wf4",
        task_id="any",
    )
    rejected_job = scruffy.wait_for_job(root, dup["job_id"], timeout=10)
    assert (rejected_job["state"], rejected_job["reason"]) == ("rejected", "invalid_workflow")
    # A second workflow whose task identity collides with the succeeded "any": all or nothing.
    cursor = scruffy.observe(root)["next_cursor"]
    clash = scruffy.submit_workflow(
        root,
        request_id="wf4-again",
        workflow_id="wf4",
        tasks=[task(tmp_path, "any", "pass"), task(tmp_path, "fresh", "pass")],
    )
    # observe() shows an event only once the snapshot holding it is committed.
    rejected = follow(scruffy, root, cursor, lambda r: r["kind"] == "submission.rejected")
    assert rejected["data"]["submission_id"] == clash["submission_id"]
    with pytest.raises(KeyError):
        scruffy.status(root, clash["tasks"][1]["job_id"])


def test_newer_evacuation_signal_and_in_place_retry(newer, tmp_path):
    script = (
        "import os, signal, sys, time\n"
        "if os.environ['SCRUFFY_ATTEMPT'] == '2': sys.exit(0)\n"
        "signal.signal(signal.SIGUSR1, lambda *a: sys.exit(75))\n"
        "open('started', 'w').close()\n"
        "time.sleep(30)\n"
    )
    recovery = {
        "max_attempts": 2,
        "retry_on": ["evacuated"],
        "evacuation": {"signal": "USR1", "grace_seconds": 5},
    }
    with stub_harness.StubController(tmp_path / "root", "newer") as ctl:
        sub = newer.submit_workflow(
            ctl.root,
            request_id="ev",
            workflow_id="ev",
            tasks=[task(tmp_path, "train", script, recovery=recovery)],
        )
        job_id = sub["tasks"][0]["job_id"]
        wait_until(lambda: (tmp_path / "started").exists())
        ctl.control(evacuate=[job_id])
        done = newer.wait_for_job(ctl.root, job_id, timeout=30)
        assert done["state"] == "succeeded"
        kinds = kinds_for(ctl.root, job_id)
        assert "job.evacuating" in kinds and "job.retrying" in kinds
        (retry,) = [r for r in stub_harness.journal(ctl.root) if r["kind"] == "job.retrying"]
        assert (retry["data"]["reason"], retry["data"]["exit_code"]) == ("evacuated", 75)


def test_serve_refuses_a_bad_inventory_like_scruffy(tmp_path, contract):
    import subprocess

    bad = tmp_path / "inv.json"
    bad.write_text(json.dumps({"nodes": {"n": {"gpu_ids": [], "cpus": 2, "memory_gb": 4}}}))
    argv = [PY, "-m", "scruffy", "--root", str(tmp_path / "root"), "serve", "--launcher", "local"]
    env = stub_harness.stub_env(contract)
    out = subprocess.run([*argv, "--inventory", str(bad)], env=env, capture_output=True, text=True)
    assert out.returncode == 2 and "gpu_ids must contain at least one GPU ID" in out.stderr
    out = subprocess.run(argv, env=env, capture_output=True, text=True)
    assert out.returncode == 2 and "--inventory is required" in out.stderr


def test_time_limits_and_a_stopped_controller(scruffy, tmp_path, contract):
    ctl = stub_harness.StubController(tmp_path / "root", contract).start()
    root = ctl.root
    try:
        sleeper = [PY, "-c", "import time; time.sleep(60)"]
        limited = scruffy.submit_job(
            root,
            argv=sleeper,
            name="n",
            cwd=tmp_path,
            environment={},
            request=scruffy.ResourceRequest(1, 0, 1, 1, 1),
            request_id="limited",
        )
        done = scruffy.wait_for_job(root, limited["job_id"], timeout=30)
        assert (done["state"], done["reason"], done["signal"]) == ("failed", "timeout", 15)
        running = scruffy.submit_job(
            root,
            argv=sleeper,
            name="n",
            cwd=tmp_path,
            environment={},
            request=scruffy.ResourceRequest(1, 0, 1, 1),
            request_id="running",
        )
        wait_until(lambda: scruffy.status(root, running["job_id"])["state"] == "running")
    finally:
        ctl.stop()
    lost = scruffy.status(root, running["job_id"])
    assert (lost["state"], lost["reason"]) == ("lost", "controller_stopped")
    assert scruffy.status(root)["allocation"]["state"] == "ended"
