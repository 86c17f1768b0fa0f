"""Observation: ``observe`` (cursors, pages, ``wait_seconds``), ``status``, ``wait_for_job``,
``cancel_job`` (contract section 8). Reads only committed state: ``state.json`` and the journal
up to the offset that snapshot records."""

from __future__ import annotations

import time
from pathlib import Path

from scruffy import storage

TERMINAL = ("succeeded", "failed", "cancelled", "lost", "rejected", "skipped")


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
