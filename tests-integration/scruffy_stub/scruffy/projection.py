"""A job's ``workload`` projection of its accepted reports (contract section 6).

``workload.phase`` sets ``phase = data.phase`` and ``status = data.status``. ``workload.progress``
stores its whole ``data`` as ``progress``, sets ``phase`` from ``data.phase`` when that is a
str and ``status = "active"``. A newer report wins by the ``(occurred_at, event_id)`` order, so
a late, older report does not regress the view: a progress report older than the newest phase
report (say, processed after the run's ``completed``) leaves ``phase``/``status`` alone, and a
progress report that does set them counts as the newest phase record. ``occurred_at`` compares
as a point in time (the contract accepts any UTC offset), not as text.
"""

from __future__ import annotations

from datetime import datetime
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


def _order(occurred_at: str, event_id: str) -> tuple[datetime, str]:
    return datetime.fromisoformat(occurred_at.replace("Z", "+00:00")), event_id


def _newer(view: dict[str, Any], field: str, at: str, eid: str) -> bool:
    seen_at, seen_id = view.get(f"{field}_at"), view.get(f"{field}_event_id")
    if not isinstance(seen_at, str) or not isinstance(seen_id, str):
        return True
    return _order(at, eid) >= _order(seen_at, seen_id)


def project(view: dict[str, Any], envelope: dict[str, Any], record: dict[str, Any]) -> None:
    """Apply one accepted report to the job's ``workload`` view."""
    kind, data = envelope["kind"], envelope["data"]
    at, eid = envelope["occurred_at"], envelope["event_id"]
    view["last_recorded_at"] = record["recorded_at"]
    if kind == "workload.artifact":
        view["latest_artifacts"] = (
            view["latest_artifacts"] + [{**data, "occurred_at": at, "event_id": eid}]
        )[-LATEST_ARTIFACTS:]
    elif kind == "workload.phase" and _newer(view, "phase", at, eid):
        view["phase"], view["status"] = data.get("phase"), data.get("status")
        view["phase_at"], view["phase_event_id"] = at, eid
    elif kind == "workload.progress":
        if _newer(view, "progress", at, eid):
            view["progress"] = data
            view["progress_at"], view["progress_event_id"] = at, eid
        if _newer(view, "phase", at, eid):
            if isinstance(data.get("phase"), str):
                view["phase"] = data["phase"]
            view["status"] = "active"
            view["phase_at"], view["phase_event_id"] = at, eid
    elif kind == "workload.milestone" and _newer(view, "milestone", at, eid):
        view["last_milestone"] = data
        view["milestone_at"], view["milestone_event_id"] = at, eid
    elif kind == "workload.notice" and _newer(view, "notice", at, eid):
        view["last_notice"] = data
        view["notice_at"], view["notice_event_id"] = at, eid
    if _newer(view, "last_update", at, eid):
        view["last_update_at"], view["last_update_event_id"] = at, eid
