"""The Python client: every function takes ``root`` first, everything else keyword-only."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from scruffy import _contract, storage
from scruffy.models import ModelError, ResourceRequest, check_project_id
from scruffy.protocol import ProtocolError, canonical, validate_event
from scruffy.storage import ReportConflict, RequestConflict
from scruffy.workflows import (
    WorkflowError,
    check_graph,
    check_id,
    check_needs,
    check_recovery,
    check_wait_for,
    task_keys,
)

TERMINAL = ("succeeded", "failed", "cancelled", "lost", "rejected", "skipped")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _job_id(project_id: str, request_id: str | None) -> str:
    if request_id is None:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
        return f"job-{stamp}-{uuid.uuid4().hex[:10]}"
    return "job-" + storage.scoped_hash(project_id, request_id)


def _check_argv(argv: Any, where: str = "argv") -> list[str]:
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) and a for a in argv):
        raise ValueError(f"{where} must be a non-empty list of non-empty strings")
    return list(argv)


def _identity(spec: Mapping[str, Any]) -> dict[str, Any]:
    ident = {k: v for k, v in spec.items() if k not in ("job_id", "submitted_at")}
    if ident.get("project_id", "default") == "default":
        ident.pop("project_id", None)
    return ident


def _job_spec(
    *,
    argv: Any,
    name: Any,
    cwd: str,
    environment: Any,
    resources: dict[str, Any],
    request_id: str | None,
    project_id: str,
    workflow_id: str | None,
    task_id: str | None,
    needs: Any,
    wait_for: Any,
    recovery: Any,
    job_id: str,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "v": 1,
        "job_id": job_id,
        "request_id": request_id,
        "name": name,
        "submitted_at": _now(),
        "argv": argv,
        "cwd": cwd,
        "env": environment,
        "resources": resources,
    }
    if project_id != "default":
        spec["project_id"] = project_id
    if workflow_id is not None:
        spec.update(
            workflow_id=workflow_id, task_id=task_id, needs=needs or [], wait_for=wait_for or []
        )
    if recovery is not None:
        spec["recovery"] = recovery
    return spec


def _submit_job(
    root: Path,
    *,
    argv: list[str],
    name: str,
    cwd: Path,
    environment: dict[str, str],
    request: ResourceRequest,
    request_id: str | None,
    project_id: str = "default",
    workflow_id: str | None = None,
    task_id: str | None = None,
    needs: Sequence[Mapping] | None = None,
    wait_for: Sequence[Mapping] | None = None,
    recovery: Mapping | None = None,
) -> dict:
    root = Path(root).expanduser().resolve()
    argv = _check_argv(argv)
    if not isinstance(name, str) or not name.strip():
        raise ValueError("name must be a non-empty string")
    check_project_id(project_id)
    if not isinstance(request, ResourceRequest):
        raise ModelError("request must be a ResourceRequest")
    if workflow_id is not None:
        check_id(workflow_id, "workflow_id", colon=True)
        check_id(task_id, "task_id")
        needs, wait_for = check_needs(needs), check_wait_for(wait_for)
    elif task_id is not None or needs or wait_for:
        raise WorkflowError("task_id, needs and wait_for need a workflow_id")
    recovery = check_recovery(recovery)
    resolved = cwd.expanduser().resolve()  # a str cwd raises AttributeError, as 0.1.1 does
    job_id = _job_id(project_id, request_id)
    spec = _job_spec(
        argv=argv,
        name=name,
        cwd=str(resolved),
        environment=environment,
        resources=request.to_wire(),
        request_id=request_id,
        project_id=project_id,
        workflow_id=workflow_id,
        task_id=task_id,
        needs=needs,
        wait_for=wait_for,
        recovery=recovery,
        job_id=job_id,
    )
    deduplicated = not storage.create_dir_only(root / "requests" / job_id, "spec.json", spec)
    if deduplicated:
        existing = storage.read_json(root / "requests" / job_id / "spec.json")
        if _identity(existing) != _identity(spec):
            raise RequestConflict(f"request_id {request_id!r} was already used for another job")
    return {
        "job_id": job_id,
        "project_id": project_id,
        "state": "submitted",
        "deduplicated": deduplicated,
    }


def _workflow_document(
    root: Path, request_id: str, workflow_id: str, tasks: Sequence[Mapping], project_id: str
) -> dict[str, Any]:
    check_id(request_id, "request_id", colon=True)
    check_id(workflow_id, "workflow_id", colon=True)
    check_project_id(project_id)
    if isinstance(tasks, (str, bytes, Mapping)) or not isinstance(tasks, Sequence):
        raise ValueError("tasks must be a list")
    if not 1 <= len(tasks) <= 256:
        raise ValueError("a workflow has 1 to 256 tasks")
    allowed = task_keys()
    specs: list[dict[str, Any]] = []
    for i, task in enumerate(tasks):
        if not isinstance(task, Mapping):
            raise ValueError(f"tasks[{i}] must be an object")
        extra = sorted(set(task) - set(allowed))
        if extra:
            raise ValueError(f"tasks[{i}] has unexpected fields: {extra}")
        for key in ("task_id", "argv", "cwd", "resources"):
            if key not in task:
                raise ValueError(f"tasks[{i}] is missing {key}")
        task_id = check_id(task["task_id"], f"tasks[{i}].task_id")
        argv = _check_argv(task["argv"], f"tasks[{i}].argv")
        cwd = task["cwd"]
        if not isinstance(cwd, str) or not Path(cwd).is_absolute():
            raise ValueError(f"tasks[{i}].cwd must be an absolute path string")
        resources = ResourceRequest.from_wire(task["resources"]).to_wire()
        env = task.get("environment", {})
        if not isinstance(env, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise ValueError(f"tasks[{i}].environment must map strings to strings")
        task_request = task.get("request_id", f"{request_id}/{task_id}")
        check_id(task_request, f"tasks[{i}].request_id", colon=True)
        name = task.get("name", task_id)
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"tasks[{i}].name must be a non-empty string")
        specs.append(
            _job_spec(
                argv=argv,
                name=name,
                cwd=cwd,
                environment=dict(env),
                resources=resources,
                request_id=task_request,
                project_id=project_id,
                workflow_id=workflow_id,
                task_id=task_id,
                needs=check_needs(task.get("needs")),
                wait_for=check_wait_for(task.get("wait_for")),
                recovery=check_recovery(task.get("recovery")),
                job_id=_job_id(project_id, task_request),
            )
        )
    for key in ("task_id", "request_id", "job_id"):
        values = [s[key] for s in specs]
        if len(set(values)) != len(values):
            raise ValueError(f"workflow has duplicate {key} values")
    check_graph(specs)
    state = storage.read_state(Path(root).expanduser().resolve())
    inventory = (state or {}).get("allocation", {}).get("inventory")
    if inventory:
        from scruffy.controller import fits_inventory

        unfit = [s["task_id"] for s in specs if not fits_inventory(s["resources"], inventory)]
        if unfit:
            raise ValueError(f"tasks cannot fit this allocation: {unfit}")
    identity = storage.digest(
        {
            "request_id": request_id,
            "project_id": project_id,
            "workflow_id": workflow_id,
            "jobs": [_identity(s) for s in specs],
        }
    )
    return {
        "v": 1,
        "kind": "workflow",
        "submission_id": "submission-" + storage.scoped_hash(project_id, request_id),
        "request_id": request_id,
        "project_id": project_id,
        "workflow_id": workflow_id,
        "submitted_at": _now(),
        "jobs": specs,
        "identity_sha256": identity,
    }


def _summary(doc: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "submission_id": doc["submission_id"],
        "project_id": doc["project_id"],
        "workflow_id": doc["workflow_id"],
        "identity_sha256": doc["identity_sha256"],
        "tasks": [
            {"task_id": j["task_id"], "job_id": j["job_id"], "request_id": j["request_id"]}
            for j in doc["jobs"]
        ],
    }


def validate_workflow(
    root: Path,
    *,
    request_id: str,
    workflow_id: str,
    tasks: Sequence[Mapping],
    project_id: str = "default",
) -> dict:
    doc = _workflow_document(root, request_id, workflow_id, tasks, project_id)
    return {"valid": True, **_summary(doc)}


def submit_workflow(
    root: Path,
    *,
    request_id: str,
    workflow_id: str,
    tasks: Sequence[Mapping],
    project_id: str = "default",
) -> dict:
    root = Path(root).expanduser().resolve()
    doc = _workflow_document(root, request_id, workflow_id, tasks, project_id)
    where = root / "requests" / doc["submission_id"]
    deduplicated = not storage.create_dir_only(where, "submission.json", doc)
    if deduplicated:
        existing = storage.read_json(where / "submission.json")
        if existing.get("identity_sha256") != doc["identity_sha256"]:
            raise RequestConflict(
                f"request_id {request_id!r} was already used for another workflow"
            )
        doc = existing
    return {**_summary(doc), "state": "submitted", "deduplicated": deduplicated}


def _spool(root: Path, envelope: dict[str, Any]) -> bool:
    """Write the report create-only; True when an identical one was there (deduplicated)."""
    job_id, event_id = envelope["job_id"], envelope["event_id"]
    ident = storage.digest({k: v for k, v in envelope.items() if k != "occurred_at"})
    inbox = storage.report_path(root, job_id, event_id)
    receipt = storage.receipt_path(root, job_id, event_id)
    for _ in range(3):
        if inbox.exists():
            try:
                pending = storage.read_json(inbox)
            except FileNotFoundError:
                continue  # accepted meanwhile: look at the receipt
            pending.pop("occurred_at", None)
            if storage.digest(pending) != ident:
                raise ReportConflict(f"event_id {event_id!r} was already used for another report")
            return True
        if receipt.exists():
            kept = storage.read_json(receipt)
            if kept.get("digest") != ident:
                raise ReportConflict(f"event_id {event_id!r} was already used for another report")
            return True
        if storage.create_only(inbox, canonical(envelope)):
            return False
    raise ReportConflict(f"event_id {event_id!r}: the report changed while it was published")


def _publish_event(
    root: Path,
    *,
    job_id: str,
    kind: str,
    data: dict,
    event_id: str | None = None,
    occurred_at: str | None = None,
    source: dict[str, str] | None = None,
) -> dict:
    root = Path(root).expanduser().resolve()
    envelope = {
        "v": 1,
        "event_id": event_id if event_id is not None else f"event-{uuid.uuid4().hex}",
        "job_id": job_id,
        "occurred_at": occurred_at if occurred_at is not None else _now(),
        "kind": kind,
        "source": source if source is not None else {},
        "data": data,
    }
    validate_event(envelope)
    deduplicated = _spool(root, envelope)
    return {
        "event_id": envelope["event_id"],
        "job_id": job_id,
        "state": "spooled",
        "deduplicated": deduplicated,
    }


def _publish_event_newer(
    root: Path,
    *,
    job_id: str,
    kind: str,
    data: dict,
    event_id: str | None = None,
    occurred_at: str | None = None,
    source: dict[str, str] | None = None,
    wait: bool = False,
    timeout: float | None = None,
) -> dict:
    if not isinstance(wait, bool):
        raise ValueError("wait must be a bool")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0
    ):
        raise ValueError("timeout must be a non-negative number or None")
    cursor = observe(root)["next_cursor"] if wait else None
    result = _publish_event(
        root,
        job_id=job_id,
        kind=kind,
        data=data,
        event_id=event_id,
        occurred_at=occurred_at,
        source=source,
    )
    if not wait:
        return result
    state, reason = _await_report(Path(root), job_id, result["event_id"], cursor, result, timeout)
    if state == "accepted":
        return {**result, "state": "accepted", "acknowledged": True}
    return {**result, "state": "rejected", "acknowledged": False, "reason": reason}


def _await_report(
    root: Path, job_id: str, event_id: str, cursor: str, result: dict, timeout: float | None
) -> tuple[str, str | None]:
    """Wait for the controller's verdict on this report: its journal event after ``cursor``,
    or (for a report it handled before the cursor was taken) its receipt."""
    report_id = f"{job_id}/{storage.sha256_text(event_id)}.json"
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        page = observe(root, after=cursor, wait_seconds=0.2)
        for record in page["events"]:
            if record.get("report_id") != report_id:
                continue
            if record["kind"].startswith("workload."):
                return "accepted", None
            return "rejected", record.get("data", {}).get("reason")
        cursor = page["next_cursor"]
        kept = _receipt(root, job_id, event_id)
        if kept is not None:
            return kept.get("state", "rejected"), kept.get("reason")
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"no acknowledgement of event {event_id!r} within {timeout} s")


def _receipt(root: Path, job_id: str, event_id: str) -> dict | None:
    try:
        return storage.read_json(
            storage.receipt_path(root.expanduser().resolve(), job_id, event_id)
        )
    except FileNotFoundError:
        return None


if _contract.NEWER:
    publish_event = _publish_event_newer
    submit_job = _submit_job
else:
    publish_event = _publish_event

    def submit_job(
        root: Path,
        *,
        argv: list[str],
        name: str,
        cwd: Path,
        environment: dict[str, str],
        request: ResourceRequest,
        request_id: str | None,
        project_id: str = "default",
        workflow_id: str | None = None,
        task_id: str | None = None,
        needs: Sequence[Mapping] | None = None,
        wait_for: Sequence[Mapping] | None = None,
    ) -> dict:
        return _submit_job(
            root,
            argv=argv,
            name=name,
            cwd=cwd,
            environment=environment,
            request=request,
            request_id=request_id,
            project_id=project_id,
            workflow_id=workflow_id,
            task_id=task_id,
            needs=needs,
            wait_for=wait_for,
        )


publish_event.__name__ = "publish_event"
submit_job.__name__ = "submit_job"


# ----------------------------------------------------------------------------- observation


def _parse_cursor(cursor: str) -> tuple[str, int, int]:
    try:
        qid, _generation, seq, offset = cursor.rsplit(":", 3)
        return qid, int(seq), int(offset)
    except (AttributeError, ValueError):
        raise ValueError(f"invalid cursor: {cursor!r}") from None


def observe(
    root: Path,
    *,
    after: str | None = None,
    wait_seconds: float = 0,
    include_output: bool = False,
    limit: int = 1000,
    project_id: str | None = None,
) -> dict:
    root = Path(root).expanduser().resolve()
    if (
        isinstance(wait_seconds, bool)
        or not isinstance(wait_seconds, (int, float))
        or wait_seconds < 0
    ):
        raise ValueError("wait_seconds must be a non-negative number")
    if type(limit) is not int or not 1 <= limit <= 1000:
        raise ValueError("limit must be an integer from 1 through 1000")
    deadline = time.monotonic() + wait_seconds
    while True:
        page = _observe_once(root, after, include_output, limit, project_id)
        if page["events"] or page["reset"] or after is None or time.monotonic() >= deadline:
            return page
        time.sleep(0.05)


def _observe_once(
    root: Path, after: str | None, include_output: bool, limit: int, project_id: str | None
) -> dict:
    state = storage.read_state(root) or {}
    qid = state.get("queue_id", storage.queue_id(root))
    journal = state.get("journal", {"seq": 0, "offset": 0})
    tail = f"{qid}:0:{journal['seq']}:{journal['offset']}"
    page = {"snapshot": state, "events": [], "next_cursor": tail, "latest_cursor": tail}
    page.update(more=False, reset=False)
    if after is None:
        return page
    cursor_qid, seq, offset = _parse_cursor(after)
    if cursor_qid != qid or offset > journal["offset"]:
        page.update(
            reset=True, reset_reason="queue_replaced" if cursor_qid != qid else "cursor_ahead"
        )
        return page
    records, offset, more = storage.read_journal(root, offset, journal["offset"], limit)
    if records:
        seq = records[-1]["seq"]
    page["events"] = [
        r
        for r in records
        if (include_output or r["kind"] != "job.output")
        and (project_id is None or r.get("project_id") in (None, project_id))
    ]
    page.update(next_cursor=f"{qid}:0:{seq}:{offset}", more=more)
    return page


def _jobs(root: Path) -> dict[str, dict]:
    state = storage.read_state(root) or {}
    return state.get("jobs", {})


def _pending_job(root: Path, job_id: str) -> dict | None:
    """A submitted job the controller has not admitted yet (state "submitted")."""
    spec_path = root / "requests" / job_id / "spec.json"
    if spec_path.exists():
        spec = storage.read_json(spec_path)
        return {"job_id": job_id, "state": "submitted", "request_id": spec["request_id"]}
    for sub in (root / "requests").glob("submission-*/submission.json"):
        for spec in storage.read_json(sub)["jobs"]:
            if spec["job_id"] == job_id:
                return {"job_id": job_id, "state": "submitted", "request_id": spec["request_id"]}
    return None


def status(root: Path, job_id: str | None = None, *, project_id: str | None = None) -> dict:
    root = Path(root).expanduser().resolve()
    jobs = _jobs(root)
    if job_id is None:
        state = storage.read_state(root) or {}
        listed = [j for j in jobs.values() if project_id is None or j["project_id"] == project_id]
        return {"allocation": state.get("allocation"), "jobs": listed}
    job = jobs.get(job_id)
    if job is None:
        state = storage.read_state(root) or {}
        pending = _pending_job(root, job_id)
        # A workflow the controller rejected leaves no jobs: its job ids are unknown.
        if pending is None or job_id in state.get("dropped_jobs", ()):
            raise KeyError(job_id)
        return pending
    if project_id is not None and job["project_id"] != project_id:
        raise KeyError(job_id)
    return job


def wait_for_job(root: Path, job_id: str, *, timeout: float | None = None) -> dict:
    deadline = None if timeout is None else time.monotonic() + timeout
    unknown_since: float | None = None
    while True:
        try:
            job = status(root, job_id)
            unknown_since = None
        except KeyError:
            unknown_since = unknown_since or time.monotonic()
            if time.monotonic() - unknown_since >= 1.0:
                raise
            job = None
        if job is not None and job["state"] in TERMINAL:
            return job
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"job {job_id} did not finish within {timeout} s")
        time.sleep(0.2)


def cancel_job(root: Path, job_id: str) -> dict:
    root = Path(root).expanduser().resolve()
    job = status(root, job_id)
    storage.create_only(root / "cancels" / f"{job_id}.json", b"{}\n")
    return {"job_id": job_id, "request_id": job.get("request_id"), "state": "cancel_requested"}


__all__ = [
    "ProtocolError",
    "cancel_job",
    "observe",
    "publish_event",
    "status",
    "submit_job",
    "submit_workflow",
    "validate_workflow",
    "wait_for_job",
]
