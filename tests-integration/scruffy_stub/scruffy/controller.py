"""The stub's controller: one local node, one tick loop, over a real root directory.

Each tick: admit new requests (all-or-nothing for a workflow), apply cancels, process at most
128 reports (validate, journal, project, release artifact gates), resolve blockers, launch what
fits, reap what ended (retrying in place under the newer contract's recovery), then append the
tick's journal records and commit ``state.json``. Jobs run as child processes in their own
session with the SCRUFFY_* environment; stdout/stderr go to ``jobs/<id>/{stdout,stderr}.log``.

Test knobs (not Scruffy's), read each tick from ``ROOT/stub-control.json``:

* ``{"hold_reports": true}`` leaves reports in the inbox (a controller that never
  acknowledges); with ``"until_retry": true`` the hold ends once the controller schedules an
  in-place retry (newer contract), so the retried attempt is acknowledged.
* ``{"reject_reports_of": [job_id, ...]}`` rejects those jobs' reports with a
  ``workload.report_rejected`` notice, as the controller does for a report it refuses.
* ``{"evacuate": [job_id, ...]}`` sends the task's evacuation signal (newer contract), once per
  job: an in-place retry is not signalled again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from scruffy import _contract, projection, storage, worker
from scruffy.protocol import ProtocolError, validate_event

ACTIVE = ("submitted", "queued", "blocked", "starting", "running", "finishing", "cancelling")
TERMINAL = ("succeeded", "failed", "cancelled", "lost", "rejected", "skipped")
REPORTS_PER_TICK = 128
_EXIT_REASONS = {75: "evacuated", 76: "checkpoint_ack_timeout"}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def fits_inventory(resources: dict[str, Any], inventory: dict[str, Any]) -> bool:
    nodes = inventory.get("nodes", {})
    if resources["nodes"] > len(nodes) or not nodes:
        return False
    node = next(iter(nodes.values()))
    return (
        resources["gpus_per_node"] <= len(node["gpu_ids"])
        and resources["cpus_per_node"] <= node["cpus"]
        and resources["memory_gb_per_node"] <= node["memory_gb"]
    )


def load_inventory(path: Path) -> dict[str, Any]:
    doc = storage.read_json(path)
    nodes = doc.get("nodes") if isinstance(doc, dict) else None
    if not isinstance(nodes, dict) or len(nodes) != 1:
        raise ValueError("the local launcher accepts exactly one node")
    for entry in nodes.values():
        if "name" in entry:
            raise ValueError("inventory entries must not contain a name key")
        ids = entry.get("gpu_ids")
        if not isinstance(ids, list) or not ids:
            raise ValueError("gpu_ids must contain at least one GPU ID")
        if len(set(ids)) != len(ids) or not all(type(i) is int and i >= 0 for i in ids):
            raise ValueError("gpu_ids must be unique integers >= 0")
        for key in ("cpus", "memory_gb"):
            if type(entry.get(key)) is not int or entry[key] <= 0:
                raise ValueError(f"{key} must be a positive integer")
    return doc


class Controller:
    def __init__(
        self,
        root: Path,
        inventory: dict[str, Any],
        *,
        allocation_id: str,
        poll_interval: float = 0.1,
        cancel_grace: float = 30.0,
    ) -> None:
        self.root = root.expanduser().resolve()
        self.poll_interval = poll_interval
        self.cancel_grace = cancel_grace
        old = storage.read_state(self.root)
        if old and any(j["state"] in ACTIVE for j in old.get("jobs", {}).values()):
            raise RuntimeError(f"UnsafeRecovery: {self.root} still has active jobs")
        self.node_name = next(iter(inventory["nodes"]))
        self.state: dict[str, Any] = old or {
            "v": 1,
            "queue_id": storage.queue_id(self.root),
            "jobs": {},
            "tasks": {},
            "admitted": [],
            "dropped_jobs": [],
            "journal": {"seq": 0, "offset": 0},
        }
        self.state["allocation"] = {
            "id": allocation_id,
            "state": "running",
            "inventory": inventory,
            "contract": _contract.CONTRACT,
        }
        self.procs: dict[str, subprocess.Popen] = {}
        self.kill_at: dict[str, float] = {}
        self.evacuated: set[str] = set()
        self.pending: list[dict[str, Any]] = []  # this tick's journal records
        self.receipts: list[tuple[Path, dict[str, Any], Path]] = []
        self.stopping = False
        self.retried = False
        self.refused: set[str] = set()
        self._commit()

    # ------------------------------------------------------------------ main loop

    def serve(self) -> None:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        while not self.stopping:
            self.tick()
            time.sleep(self.poll_interval)
        self.shutdown()

    def _stop(self, *_: Any) -> None:
        self.stopping = True

    def tick(self) -> None:
        self._admit()
        self._cancels()
        control = self._control()
        self.refused = set(control.get("reject_reports_of") or ())
        if not control.get("hold_reports") or (control.get("until_retry") and self.retried):
            self._reports()
        self._evacuations(control.get("evacuate") or [])
        self._resolve()
        self._launch()
        self._reap()
        self._commit()

    def shutdown(self) -> None:
        for proc in self.procs.values():
            worker.signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + self.cancel_grace
        for job_id, proc in list(self.procs.items()):
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.signal_group(proc, signal.SIGKILL)
                proc.wait()
            self._finish(job_id, "lost", "controller_stopped", None, None)
        self.procs.clear()
        self.state["allocation"]["state"] = "ended"
        self._commit()

    # ------------------------------------------------------------------ journal

    def _record(self, kind: str, data: dict[str, Any], **top: Any) -> dict[str, Any]:
        seq = self.state["journal"]["seq"] + len(self.pending) + 1
        record = {
            "v": 1,
            "queue_id": self.state["queue_id"],
            "seq": seq,
            "event_id": f"{self.state['queue_id']}:{seq}",
            "at": _now(),
            "recorded_at": _now(),
            "allocation_id": self.state["allocation"]["id"],
            "kind": kind,
            "data": data,
            **top,
        }
        self.pending.append(record)
        return record

    def _job_event(self, kind: str, job: dict[str, Any], **data: Any) -> None:
        self._record(
            kind, {"job": dict(job), **data}, job_id=job["job_id"], project_id=job["project_id"]
        )

    def _commit(self) -> None:
        if self.pending:
            path = self.root / "journal.jsonl"
            with open(path, "ab") as f:
                for record in self.pending:
                    f.write(
                        (json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n").encode()
                    )
                f.flush()
                os.fsync(f.fileno())
                offset = f.tell()
            self.state["journal"] = {"seq": self.pending[-1]["seq"], "offset": offset}
            self.pending = []
        storage.write_atomic(self.root / "state.json", self.state)
        # After the commit: receipts, then the inbox files go (so one of them always exists).
        for receipt, doc, inbox in self.receipts:
            storage.write_atomic(receipt, doc)
            inbox.unlink(missing_ok=True)
        self.receipts = []

    def _control(self) -> dict[str, Any]:
        try:
            doc = storage.read_json(self.root / "stub-control.json")
        except (FileNotFoundError, ValueError):
            return {}
        return doc if isinstance(doc, dict) else {}

    # ------------------------------------------------------------------ admission

    def _admit(self) -> None:
        requests = self.root / "requests"
        if not requests.is_dir():
            return
        admitted = set(self.state["admitted"])
        for entry in sorted(requests.iterdir(), key=lambda p: p.stat().st_mtime_ns):
            if entry.name.startswith(".") or entry.name in admitted:
                continue
            if (entry / "spec.json").exists():
                self.state["admitted"].append(entry.name)
                self._admit_job(storage.read_json(entry / "spec.json"), submission_id=None)
            elif (entry / "submission.json").exists():
                self.state["admitted"].append(entry.name)
                self._admit_submission(storage.read_json(entry / "submission.json"))

    def _task_key(self, spec: dict[str, Any]) -> str | None:
        if spec.get("workflow_id") is None:
            return None
        project = spec.get("project_id", "default")
        return json.dumps([project, spec["workflow_id"], spec["task_id"]])

    def _collides(self, spec: dict[str, Any]) -> bool:
        key = self._task_key(spec)
        if key is None:
            return False
        for job_id in self.state["tasks"].get(key, []):
            if self.state["jobs"][job_id]["state"] in (*ACTIVE, "succeeded"):
                return True
        return False

    def _admit_submission(self, doc: dict[str, Any]) -> None:
        colliding = [s["task_id"] for s in doc["jobs"] if self._collides(s)]
        data = {
            "submission_id": doc["submission_id"],
            "project_id": doc["project_id"],
            "workflow_id": doc["workflow_id"],
        }
        if colliding:
            self._record(
                "submission.rejected",
                {
                    **data,
                    "reason": f"task identity collides with an active or succeeded attempt: {colliding}",
                },
            )
            self.state["dropped_jobs"].extend(s["job_id"] for s in doc["jobs"])
            return
        self._record("submission.admitted", {**data, "jobs": doc["jobs"]})
        for spec in doc["jobs"]:
            self._admit_job(spec, submission_id=doc["submission_id"])

    def _admit_job(self, spec: dict[str, Any], submission_id: str | None) -> None:
        job = {
            "job_id": spec["job_id"],
            "project_id": spec.get("project_id", "default"),
            "request_id": spec["request_id"],
            "name": spec["name"],
            "argv": spec["argv"],
            "cwd": spec["cwd"],
            "env": spec["env"],
            "resources": spec["resources"],
            "workflow_id": spec.get("workflow_id"),
            "task_id": spec.get("task_id"),
            "needs": spec.get("needs", []),
            "wait_for": spec.get("wait_for", []),
            "recovery": spec.get("recovery"),
            "attempt": 1,
            "run": 0,
            "submitted_at": spec["submitted_at"],
            "state": "submitted",
            "reason": None,
            "exit_code": None,
            "signal": None,
            "blockers": [],
            "condition_satisfactions": [],
            "resolved_conditions": [],
            "workload": projection.empty_workload(),
            "stdout": f"jobs/{spec['job_id']}/stdout.log",
            "stderr": f"jobs/{spec['job_id']}/stderr.log",
        }
        if _contract.NEWER:
            job["artifact_evidence"] = []
        extra = {"submission_id": submission_id} if submission_id else {}
        self.state["jobs"][job["job_id"]] = job
        env = spec["env"]
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            return self._reject(job, "invalid_spec", "env must map strings to strings", extra)
        if not fits_inventory(spec["resources"], self.state["allocation"]["inventory"]):
            return self._reject(
                job, "request_cannot_fit", "request cannot fit the allocation", extra
            )
        key = self._task_key(spec)
        if key is not None:
            if self._collides(spec):
                return self._reject(
                    job, "invalid_workflow", "task has an active or succeeded attempt", extra
                )
            attempts = self.state["tasks"].setdefault(key, [])
            job["attempt"] = len(attempts) + 1
            attempts.append(job["job_id"])
            self._satisfy_at_admission(job)
        job["state"] = "blocked" if (job["needs"] or job["wait_for"]) else "queued"
        self._job_event(f"job.{job['state']}", job, **extra)

    def _reject(self, job: dict[str, Any], reason: str, message: str, extra: dict) -> None:
        job.update(state="rejected", reason=reason, message=message)
        self._job_event("job.rejected", job, **extra)

    # ------------------------------------------------------------------ reports and gates

    def _reports(self) -> None:
        base = self.root / "reports"
        if not base.is_dir():
            return
        inboxes = [d for d in sorted(base.iterdir()) if d.is_dir() and not d.name.startswith(".")]
        # Oldest first within a job's inbox (the order the job published in).
        queues = [sorted(d.glob("*.json"), key=_arrival) for d in inboxes]
        done = 0
        while done < REPORTS_PER_TICK and any(queues):
            for queue in queues:  # round-robin across job inboxes
                if queue and done < REPORTS_PER_TICK:
                    self._report(queue.pop(0))
                    done += 1

    def _report(self, path: Path) -> None:
        job_dir = path.parent.name
        report_id = f"{job_dir}/{path.name}"
        try:
            envelope = json.loads(path.read_bytes())
            validate_event(envelope)
        except (ValueError, ProtocolError) as exc:
            return self._refuse(path, report_id, str(exc), "-")
        ident = storage.digest({k: v for k, v in envelope.items() if k != "occurred_at"})
        if (
            envelope["job_id"] != job_dir
            or path.name != f"{storage.sha256_text(envelope['event_id'])}.json"
        ):
            return self._refuse(path, report_id, "report directory mismatch", ident)
        job = self.state["jobs"].get(job_dir)
        if job is None:
            if (self.root / "requests" / job_dir).exists():
                return  # its request is still pending: deferred
            return self._refuse(path, report_id, f"unknown job {job_dir}", ident)
        if job_dir in self.refused:
            return self._refuse(path, report_id, "rejected by stub-control.json", "-")
        record = self._record(
            envelope["kind"],
            envelope["data"],
            job_id=job["job_id"],
            project_id=job["project_id"],
            occurred_at=envelope["occurred_at"],
            source=envelope["source"],
            source_event_id=envelope["event_id"],
            report_id=report_id,
            report_digest=ident,
        )
        projection.project(job["workload"], envelope, record)
        pub = envelope["data"].get("publication")
        if envelope["kind"] == "workload.artifact" and isinstance(pub, dict):
            evidence = {
                "kind": "artifact",
                "task_id": job["task_id"],
                "artifact_id": pub["artifact_id"],
                "producer_job_id": job["job_id"],
                "producer_event_id": envelope["event_id"],
                "occurred_at": envelope["occurred_at"],
                "publication": pub,
                "queue_event_id": record["event_id"],
            }
            if "artifact_evidence" in job:
                job["artifact_evidence"].append(evidence)
            if self._newest_attempt(job):
                self._release(job, evidence)
        receipt = storage.receipt_path(self.root, job_dir, envelope["event_id"])
        self.receipts.append((receipt, {"digest": ident, "state": "accepted"}, path))

    def _refuse(self, path: Path, report_id: str, reason: str, ident: str) -> None:
        data = {
            "kind": "workload.report_rejected",
            "report": path.name,
            "report_id": report_id,
            "reason": reason,
        }
        self._record("notice", data, report_id=report_id)
        receipt = path.parent.parent / ".accepted" / path.parent.name / path.name
        self.receipts.append(
            (receipt, {"digest": ident, "state": "rejected", "reason": reason}, path)
        )

    def _newest_attempt(self, job: dict[str, Any]) -> bool:
        key = self._task_key(job)
        return key is not None and self.state["tasks"][key][-1] == job["job_id"]

    def _release(self, producer: dict[str, Any], evidence: dict[str, Any]) -> None:
        for job in self.state["jobs"].values():
            if (
                job["state"] != "blocked"
                or job["project_id"] != producer["project_id"]
                or job["workflow_id"] != producer["workflow_id"]
            ):
                continue
            for cond in job["wait_for"]:
                if (cond["task_id"], cond["artifact_id"]) != (
                    evidence["task_id"],
                    evidence["artifact_id"],
                ):
                    continue
                if any(_same_condition(s, cond) for s in job["condition_satisfactions"]):
                    continue  # the first matching publication wins
                job["condition_satisfactions"].append(evidence)
                self._record(
                    "condition.satisfied",
                    evidence,
                    job_id=job["job_id"],
                    project_id=job["project_id"],
                )

    def _satisfy_at_admission(self, job: dict[str, Any]) -> None:
        for cond in job["wait_for"]:
            producer = self._newest(job, cond["task_id"])
            if producer is None:
                continue
            for art in producer["workload"]["latest_artifacts"]:
                pub = art.get("publication")
                if isinstance(pub, dict) and pub.get("artifact_id") == cond["artifact_id"]:
                    job["condition_satisfactions"].append(
                        {
                            "kind": "artifact",
                            "task_id": cond["task_id"],
                            "artifact_id": cond["artifact_id"],
                            "producer_job_id": producer["job_id"],
                            "producer_event_id": art["event_id"],
                            "occurred_at": art["occurred_at"],
                            "publication": pub,
                        }
                    )
                    break

    def _newest(self, job: dict[str, Any], task_id: str) -> dict[str, Any] | None:
        key = json.dumps([job["project_id"], job["workflow_id"], task_id])
        attempts = self.state["tasks"].get(key)
        return self.state["jobs"][attempts[-1]] if attempts else None

    # ------------------------------------------------------------------ blockers

    def _resolve(self) -> None:
        for job in list(self.state["jobs"].values()):
            if job["state"] != "blocked":
                continue
            blockers, skip = [], False
            for need in job["needs"]:
                up = self._newest(job, need["task_id"])
                reason = None
                if up is None:
                    reason = "dependency_missing"
                elif up["state"] not in TERMINAL:
                    reason = "dependency_pending"
                elif need["condition"] == "succeeded" and up["state"] != "succeeded":
                    reason, skip = "dependency_unsatisfied", True
                if reason:
                    blockers.append(
                        {
                            "task_id": need["task_id"],
                            "condition": need["condition"],
                            "state": up["state"] if up else None,
                            "reason": reason,
                        }
                    )
            for cond in job["wait_for"]:
                if any(_same_condition(s, cond) for s in job["condition_satisfactions"]):
                    continue
                up = self._newest(job, cond["task_id"])
                blockers.append(
                    {
                        **cond,
                        "state": up["state"] if up else None,
                        "reason": "condition_pending" if up else "condition_source_missing",
                    }
                )
            job["blockers"] = blockers
            if skip:
                job.update(state="skipped", reason="dependency_unsatisfied")
                self._job_event("job.skipped", job)
            elif not blockers:
                job.update(state="queued", resolved_conditions=list(job["condition_satisfactions"]))
                self._job_event("job.queued", job)

    # ------------------------------------------------------------------ launch and reap

    def _free(self) -> dict[str, Any]:
        node = self.state["allocation"]["inventory"]["nodes"][self.node_name]
        used_gpus = {g for j in self.procs for g in self.state["jobs"][j].get("gpu_ids", [])}
        used_cpus = sum(self.state["jobs"][j]["resources"]["cpus_per_node"] for j in self.procs)
        used_mem = sum(self.state["jobs"][j]["resources"]["memory_gb_per_node"] for j in self.procs)
        return {
            "gpus": [g for g in node["gpu_ids"] if g not in used_gpus],
            "cpus": node["cpus"] - used_cpus,
            "memory_gb": node["memory_gb"] - used_mem,
        }

    def _launch(self) -> None:
        for job in self.state["jobs"].values():
            if job["state"] != "queued":
                continue
            free, res = self._free(), job["resources"]
            if (
                res["gpus_per_node"] > len(free["gpus"])
                or res["cpus_per_node"] > free["cpus"]
                or res["memory_gb_per_node"] > free["memory_gb"]
            ):
                continue
            job["gpu_ids"] = free["gpus"][: res["gpus_per_node"]]
            self._start(job)

    def _start(self, job: dict[str, Any]) -> None:
        job.update(state="starting", started_at=_now(), reason=None, exit_code=None, signal=None)
        job["run"] += 1
        self._job_event("job.starting", job)
        upstreams = {
            n["task_id"]: (self._newest(job, n["task_id"]) or {}).get("job_id")
            for n in job["needs"]
        }
        try:
            proc = worker.spawn(
                self.root,
                job,
                node=self.node_name,
                allocation_id=self.state["allocation"]["id"],
                upstreams=upstreams,
            )
        except OSError as exc:
            job["message"] = str(exc)
            return self._finish(job["job_id"], "failed", "launch_failed", None, None)
        self.procs[job["job_id"]] = proc
        limit = job["resources"].get("time_limit_seconds")
        job["deadline"] = time.monotonic() + limit if limit else None
        job["state"] = "running"
        self._job_event("job.running", job)

    def _cancels(self) -> None:
        base = self.root / "cancels"
        if not base.is_dir():
            return
        for request in base.glob("*.json"):
            job = self.state["jobs"].get(request.stem)
            request.unlink()
            if job is None or job["state"] in TERMINAL:
                continue
            if job["job_id"] in self.procs:
                job["state"] = "cancelling"
                self._job_event("job.cancelling", job)
                worker.signal_group(self.procs[job["job_id"]], signal.SIGTERM)
                self.kill_at[job["job_id"]] = time.monotonic() + self.cancel_grace
            else:
                self._finish(job["job_id"], "cancelled", "cancelled_before_start", None, None)

    def _evacuations(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            job = self.state["jobs"].get(job_id)
            evac = ((job or {}).get("recovery") or {}).get("evacuation")
            if job_id in self.evacuated or job_id not in self.procs or not evac:
                continue
            self.evacuated.add(job_id)
            worker.signal_group(self.procs[job_id], signal.SIGUSR1)
            self._job_event("job.evacuating", job, grace_seconds=evac["grace_seconds"])
            self.kill_at[job_id] = time.monotonic() + evac["grace_seconds"] + self.cancel_grace

    def _reap(self) -> None:
        for job_id, proc in list(self.procs.items()):
            job = self.state["jobs"][job_id]
            now = time.monotonic()
            if job.get("deadline") and now > job["deadline"] and job_id not in self.kill_at:
                job["timed_out"] = True
                worker.signal_group(proc, signal.SIGTERM)
                self.kill_at[job_id] = now + self.cancel_grace
            if job_id in self.kill_at and now > self.kill_at[job_id]:
                worker.signal_group(proc, signal.SIGKILL)
            code = proc.poll()
            if code is None:
                continue
            del self.procs[job_id]
            self.kill_at.pop(job_id, None)
            if job["state"] == "cancelling":
                self._finish(job_id, "cancelled", "cancelled", None, -code if code < 0 else None)
            elif job.pop("timed_out", False):
                self._finish(job_id, "failed", "timeout", None, -code if code < 0 else 15)
            elif code == 0:
                self._finish(job_id, "succeeded", "process_exit", 0, None)
            elif code < 0:
                self._finish(job_id, "failed", "signal", None, -code)
            else:
                reason = (
                    _EXIT_REASONS.get(code, "application_exit")
                    if _contract.NEWER
                    else "application_exit"
                )
                if not self._retry(job, reason, code):
                    self._finish(job_id, "failed", reason, code, None)

    def _retry(self, job: dict[str, Any], reason: str, code: int) -> bool:
        """Newer contract: retry in place (same job id, next attempt) on a listed reason."""
        recovery = job.get("recovery")
        if not _contract.NEWER or not recovery or reason not in recovery["retry_on"]:
            return False
        if job["attempt"] + job["run"] - 1 >= recovery["max_attempts"]:
            return False
        self.retried = True
        job.update(state="queued", reason=reason, exit_code=code)
        self._job_event(
            "job.retrying", job, reason=reason, exit_code=code, next_attempt=job["run"] + 1
        )
        return True

    def _finish(
        self, job_id: str, state: str, reason: str, code: int | None, sig: int | None
    ) -> None:
        job = self.state["jobs"][job_id]
        job.update(state=state, reason=reason, exit_code=code, signal=sig, ended_at=_now())
        self._job_event(f"job.{state}", job)
        result = self.root / "provenance" / job_id / "result.json"
        if result.parent.exists():
            storage.write_atomic(
                result, {"v": 1, "state": state, "reason": reason, "exit_code": code, "signal": sig}
            )


def _arrival(path: Path) -> tuple[int, str]:
    try:
        return path.stat().st_mtime_ns, path.name
    except FileNotFoundError:
        return 0, path.name


def _same_condition(evidence: dict[str, Any], cond: dict[str, Any]) -> bool:
    return (evidence["task_id"], evidence["artifact_id"]) == (cond["task_id"], cond["artifact_id"])
