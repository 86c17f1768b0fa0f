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
from scruffy.observation import cancel_job, observe, status, wait_for_job
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
