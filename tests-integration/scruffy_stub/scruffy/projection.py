"""A job's ``workload`` projection of its accepted reports (contract section 6)."""

from __future__ import annotations

from typing import Any

LATEST_ARTIFACTS = 8


def empty_workload() -> dict[str, Any]:
    keys = (
        "phase", "status", "phase_at", "phase_event_id", "progress", "progress_at",
        "progress_event_id", "last_milestone", "milestone_at", "milestone_event_id",
        "last_notice", "notice_at", "notice_event_id", "last_update_at", "last_update_event_id",
        "last_recorded_at",
    )  # fmt: skip
    return {**dict.fromkeys(keys), "latest_artifacts": []}


def project(view: dict[str, Any], envelope: dict[str, Any], record: dict[str, Any]) -> None:
    """The job's ``workload`` projection: a newer report wins by (occurred_at, event_id)."""
    kind, data = envelope["kind"], envelope["data"]
    at, eid = envelope["occurred_at"], envelope["event_id"]
    view["last_recorded_at"] = record["recorded_at"]
    if kind == "workload.artifact":
        view["latest_artifacts"] = (
            view["latest_artifacts"] + [{**data, "occurred_at": at, "event_id": eid}]
        )[-LATEST_ARTIFACTS:]
    field = {
        "workload.phase": "phase",
        "workload.progress": "progress",
        "workload.milestone": "milestone",
        "workload.notice": "notice",
    }.get(kind)
    if field is not None and (at, eid) >= (
        view.get(f"{field}_at") or "",
        view.get(f"{field}_event_id") or "",
    ):
        view[f"{field}_at"], view[f"{field}_event_id"] = at, eid
        if kind == "workload.phase":
            view["phase"], view["status"] = data.get("phase"), data.get("status")
        elif kind == "workload.progress":
            view["progress"], view["status"] = data, "active"
            if isinstance(data.get("phase"), str):
                view["phase"] = data["phase"]
        elif kind == "workload.milestone":
            view["last_milestone"] = data
        else:
            view["last_notice"] = data
    if (at, eid) >= (view.get("last_update_at") or "", view.get("last_update_event_id") or ""):
        view["last_update_at"], view["last_update_event_id"] = at, eid
