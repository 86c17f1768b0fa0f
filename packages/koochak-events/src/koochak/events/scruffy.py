"""The Scruffy publisher: workload events from a job that runs under a Scruffy allocation.

Written against the Scruffy v1 client contract (``scruffy-gpu`` 0.1.1 as released, and the
newer contract the Koochak spec describes; docs/events.md says which was tested how)::

    publish_event(root, *, job_id, kind, data, event_id=None, occurred_at=None, source=None)
        -> {"event_id", "job_id", "state": "spooled", "deduplicated"}          # 0.1.1
    publish_event(..., wait=False, timeout=None)                               # newer
        -> {..., "state": "accepted", "acknowledged": True} or raises TimeoutError
    observe(root, *, after=None, wait_seconds=0, ...) -> {"events", "next_cursor", "more", "reset", ...}
    status(root, job_id) -> the job, with "workload"["latest_artifacts"] (and, newer,
        "artifact_evidence")

The ``scruffy`` module is imported only here, when the hooks are built (before training), and
its signatures are checked then; koochak-events itself needs only the standard library.
Scruffy is not on the package registry: put its source root on ``PYTHONPATH`` (for a managed
run, on the execution profile's ``PYTHONPATH``).

Acknowledgement of a strict checkpoint artifact: with a client whose ``publish_event`` takes
``wait``/``timeout``, those are used; on 0.1.1 the cursor is taken before publishing and
``observe()`` is followed until the controller's journal event for this report
(``report_id == f"{job_id}/{sha256(event_id)}.json"``) appears: a ``workload.*`` kind is an
acceptance, a ``workload.report_rejected`` notice a rejection. When the deadline passes, the
job's durable evidence (``status``) is asked once, without publishing a second event; if it
does not show the publication either, `ArtifactAckTimeout` (exit 76) is raised.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import math
import os
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from koochak.events.envelope import Event
from koochak.events.errors import ArtifactAckTimeout, ArtifactRejected
from koochak.events.hooks import Hook, make_event_hooks

DEFAULT_ARTIFACT_ACK_TIMEOUT_S = 300.0
TIMEOUT_ENV = "KOOCHAK_SCRUFFY_ARTIFACT_ACK_TIMEOUT_SECONDS"
MAX_WIRE_BYTES = 65536  # Scruffy's bound on the canonical (sorted, compact, ASCII) envelope
SOURCE_NAME = "koochak"
_PUBLISH_KEYWORDS = ("job_id", "kind", "data", "event_id", "occurred_at", "source")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_ACCEPTED, _TIMED_OUT, _REJECTED = "accepted", "timed_out", "rejected"


def make_scruffy_hooks(
    *,
    artifact_ack_timeout_s: float | None = None,
    progress_every_s: float = 30.0,
    clock: Callable[[], float] = time.monotonic,
    env: Mapping[str, str] | None = None,
) -> dict[str, list[Hook]]:
    """`make_event_hooks` publishing to Scruffy for the job named by SCRUFFY_ROOT/SCRUFFY_JOB_ID.

    Strict numbered checkpoint artifacts wait up to ``artifact_ack_timeout_s`` for Scruffy's
    acknowledgement (default 300 s, or KOOCHAK_SCRUFFY_ARTIFACT_ACK_TIMEOUT_SECONDS; the argument
    wins). Everything else is published without waiting. The client is imported and checked
    now, so a missing or incompatible one fails before training starts.
    """
    publisher = make_scruffy_publisher(artifact_ack_timeout_s=artifact_ack_timeout_s, env=env)
    return make_event_hooks(
        publisher, progress_every_s=progress_every_s, clock=clock, job_id=publisher.job_id
    )


def make_scruffy_publisher(
    *, artifact_ack_timeout_s: float | None = None, env: Mapping[str, str] | None = None
) -> ScruffyPublisher:
    """The checked `ScruffyPublisher` for the job SCRUFFY_ROOT/SCRUFFY_JOB_ID in ``env``
    (default ``os.environ``): the client imported and checked, the ack timeout resolved as for
    `make_scruffy_hooks`, SCRUFFY_NODE and SCRUFFY_PROJECT honoured."""
    env = os.environ if env is None else env
    root = _required(env, "SCRUFFY_ROOT")
    job_id = _required(env, "SCRUFFY_JOB_ID")
    timeout = _ack_timeout(artifact_ack_timeout_s, env)
    client = import_client()
    project = env.get("SCRUFFY_PROJECT", "").strip() or None
    return ScruffyPublisher(client, root, job_id, timeout, node=_node(env), project_id=project)


class ScruffyPublisher:
    """A `Publisher` for one Scruffy job over a checked ``scruffy`` client module."""

    def __init__(
        self,
        client: Any,
        root: str | os.PathLike[str],
        job_id: str,
        ack_timeout_s: float,
        *,
        node: str | None = None,
        project_id: str | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.client = client
        self.root = Path(root)
        self.job_id = job_id
        self.ack_timeout_s = ack_timeout_s
        self.node = node
        # Observe only this job's project (rejection notices are allocation-wide: still seen).
        self._observe_filter = {"project_id": project_id} if project_id else {}
        self.waits = client_acknowledges_on_publish(client.publish_event)
        self._monotonic = monotonic
        self._sleep = sleep

    def __call__(self, event: Event, *, wait: bool = False) -> None:
        if not wait:
            self.client.publish_event(self.root, **self.wire_arguments(event))
            return
        try:
            kwargs = self.wire_arguments(event)
        except ValueError as exc:  # a checkpoint that cannot be published never gates: fail closed
            raise self._rejected(event, str(exc)) from exc
        self._publish_acknowledged(event, kwargs)

    def wire_arguments(self, event: Event) -> dict[str, Any]:
        """The keyword arguments of ``publish_event`` for ``event``, checked against Scruffy's
        envelope bound (the canonical ASCII-escaped encoding is at most 64 KiB)."""
        source = {"name": SOURCE_NAME}
        # A stable artifact event must be byte-identical when a retry on another node republishes
        # it (Scruffy's identity includes the source), so only the other kinds name the node.
        if self.node and event.kind != "workload.artifact":
            source["node"] = self.node
        kwargs = {
            "job_id": self.job_id,
            "kind": event.kind,
            "data": dict(event.to_dict()["payload"]),
            "event_id": event.id,
            # Python 3.10's fromisoformat (which Scruffy validates with) does not read "Z".
            "occurred_at": event.time[:-1] + "+00:00" if event.time.endswith("Z") else event.time,
            "source": source,
        }
        envelope = {"v": 1, **{k: kwargs[k] for k in ("event_id", "job_id", "occurred_at")}}
        envelope.update(kind=event.kind, source=source, data=kwargs["data"])
        size = (
            len(json.dumps(envelope, sort_keys=True, separators=(",", ":"), ensure_ascii=True)) + 1
        )
        if size > MAX_WIRE_BYTES:
            raise ValueError(
                f"{event.kind} event {event.id}: {size} bytes as Scruffy encodes it, more than "
                f"{MAX_WIRE_BYTES}"
            )
        return kwargs

    # -- acknowledged checkpoint publication

    def _publish_acknowledged(self, event: Event, kwargs: dict[str, Any]) -> None:
        publication = event.payload.get("publication")
        deadline = self._monotonic() + self.ack_timeout_s
        detail: str | None = None
        verdict: tuple[str, str | None] = (_TIMED_OUT, None)
        try:
            if self.waits:
                verdict = self._publish_waiting(event, kwargs)
            else:
                cursor = self.client.observe(self.root, **self._observe_filter)["next_cursor"]
                result = self._publish_once(event, kwargs)
                if (
                    isinstance(result, Mapping)
                    and result.get("deduplicated") is True
                    and (self._on_record(event.id, publication))
                ):
                    return  # accepted before (a retry of this very report): no new journal event
                verdict = self._follow(cursor, event.id, deadline)
        except ArtifactRejected:
            raise
        except Exception as exc:
            detail = f"{type(exc).__name__}: {exc}"  # unknown fate: reconcile, then time out
        state, reason = verdict
        if state == _ACCEPTED:
            return
        if state == _REJECTED:
            raise self._rejected(event, reason)
        # Once, against durable evidence; a second publish could race the first.
        if self._on_record(event.id, publication):
            return
        raise ArtifactAckTimeout(
            f"Scruffy did not acknowledge checkpoint artifact {self._artifact_id(event)} (event "
            f"{event.id}, job {self.job_id}) within {self.ack_timeout_s:g} s; the checkpoint "
            "stays published for resume: auto",
            checkpoint_path=self._path(event),
            event_id=event.id,
            publication=publication,
            detail=detail,
        )

    def _publish_once(self, event: Event, kwargs: dict[str, Any], **wait: Any) -> Any:
        try:
            return self.client.publish_event(self.root, **kwargs, **wait)
        except Exception as exc:
            # A conflicting event id (ReportConflict), or a report the client refuses
            # (ProtocolError, a ValueError): either never gates anything. Fail closed.
            if self._is_conflict(exc) or isinstance(exc, ValueError):
                raise self._rejected(event, f"{type(exc).__name__}: {exc}") from exc
            raise

    def _publish_waiting(self, event: Event, kwargs: dict[str, Any]) -> tuple[str, str | None]:
        try:
            result = self._publish_once(event, kwargs, wait=True, timeout=self.ack_timeout_s)
        except TimeoutError:
            return _TIMED_OUT, None
        if not isinstance(result, Mapping):
            return _REJECTED, f"unexpected acknowledgement {result!r}"
        state, reason = result.get("state"), result.get("reason")
        if state == "accepted" and result.get("acknowledged", True) is True:
            return _ACCEPTED, None
        if state == "retryable_timeout" or reason == "checkpoint_ack_timeout":
            return _TIMED_OUT, None
        return _REJECTED, f"state={state!r} reason={reason!r}"

    def _follow(self, cursor: Any, event_id: str, deadline: float) -> tuple[str, str | None]:
        """Follow ``observe()`` from ``cursor`` until this report's journal event or the deadline."""
        report_id = f"{self.job_id}/{hashlib.sha256(event_id.encode('utf-8')).hexdigest()}.json"
        while True:
            remaining = deadline - self._monotonic()
            if remaining <= 0:
                return _TIMED_OUT, None
            page = self.client.observe(
                self.root,
                after=cursor,
                wait_seconds=1 if remaining >= 1 else 0,
                **self._observe_filter,
            )
            for record in page.get("events", ()):
                if record.get("report_id") != report_id:
                    continue
                kind, data = record.get("kind"), record.get("data")
                if isinstance(kind, str) and kind.startswith("workload."):
                    return _ACCEPTED, None
                rejected = (
                    isinstance(data, Mapping) and data.get("kind") == "workload.report_rejected"
                )
                if kind == "notice" and rejected:
                    return _REJECTED, str(data.get("reason"))
            cursor = page.get("next_cursor", cursor)
            if page.get("reset") and self._on_record(event_id, None):
                return _ACCEPTED, None  # the journal was replaced: the snapshot is the evidence
            if not page.get("events") and remaining < 1:
                self._sleep(min(0.1, remaining))

    def _on_record(self, event_id: str, publication: Any) -> bool:
        """Does the job's durable state show this publication accepted (status, not the journal)?"""
        status = getattr(self.client, "status", None)
        if not callable(status):
            return False
        try:
            job = status(self.root, self.job_id)
        except Exception:
            return False
        if not isinstance(job, Mapping):
            return False
        workload = job.get("workload")
        entries = list(job.get("artifact_evidence") or ())
        if isinstance(workload, Mapping):
            entries += list(workload.get("latest_artifacts") or ())
        for entry in entries:
            if not isinstance(entry, Mapping):
                continue
            ids = (
                entry.get("producer_event_id"),
                entry.get("source_event_id"),
                entry.get("event_id"),
            )
            if event_id in ids and (publication is None or entry.get("publication") == publication):
                return True
        return False

    def _is_conflict(self, exc: BaseException) -> bool:
        conflict = getattr(self.client, "ConflictError", None)
        if isinstance(conflict, type) and isinstance(exc, conflict):
            return True
        return any(c.__name__ in ("ConflictError", "ReportConflict") for c in type(exc).__mro__)

    def _rejected(self, event: Event, reason: str | None) -> ArtifactRejected:
        return ArtifactRejected(
            f"Scruffy rejected checkpoint artifact {self._artifact_id(event)} (event {event.id}, "
            f"job {self.job_id}): {reason}",
            checkpoint_path=self._path(event),
            event_id=event.id,
            publication=event.payload.get("publication"),
            detail=reason,
        )

    @staticmethod
    def _artifact_id(event: Event) -> Any:
        return (event.payload.get("publication") or {}).get("artifact_id")

    @staticmethod
    def _path(event: Event) -> Any:
        return (event.payload.get("publication") or {}).get("path")


def client_acknowledges_on_publish(publish_event: Callable[..., Any]) -> bool:
    """True for the newer Scruffy client contract: its ``publish_event`` takes keyword-only
    ``wait`` and ``timeout`` and so waits for the acknowledgement itself (0.1.1 has neither; the
    publisher then follows ``observe()``)."""
    try:
        params = inspect.signature(publish_event).parameters
    except (TypeError, ValueError):
        return False
    return all(
        name in params and params[name].kind in (params[name].KEYWORD_ONLY,)
        for name in ("wait", "timeout")
    )


def import_client() -> Any:
    """Import ``scruffy`` and check it has the v1 client surface the publisher calls."""
    try:
        client = importlib.import_module("scruffy")
    except ImportError as exc:
        raise ImportError(
            f"make_scruffy_hooks needs the Scruffy client ({exc}); Scruffy is not on the package "
            "registry: put its source root on PYTHONPATH (for koochak-run, on the execution "
            "profile's PYTHONPATH and declare scruffy in its packages)"
        ) from None
    where = getattr(client, "__file__", None) or "scruffy"
    publish = getattr(client, "publish_event", None)
    problem = _publish_signature_problem(publish)
    if (
        problem is None
        and not client_acknowledges_on_publish(publish)
        and not callable(getattr(client, "observe", None))
    ):
        problem = "has neither publish_event(wait=, timeout=) nor observe() to wait for the ack"
    if problem is not None:
        raise ImportError(
            f"the scruffy module at {where} {problem}; koochak-events needs the Scruffy v1 client "
            "(publish_event(root, *, job_id, kind, data, event_id, occurred_at, source))"
        )
    return client


def _publish_signature_problem(publish: Any) -> str | None:
    if not callable(publish):
        return "has no publish_event"
    try:
        params = inspect.signature(publish).parameters
    except (TypeError, ValueError):
        return "has a publish_event whose signature cannot be read"
    missing = [
        n
        for n in _PUBLISH_KEYWORDS
        if n not in params or params[n].kind is not params[n].KEYWORD_ONLY
    ]
    if missing:
        return f"has a publish_event without the keyword-only argument(s) {', '.join(missing)}"
    return None


def _required(env: Mapping[str, str], name: str) -> str:
    value = env.get(name, "")
    if not value:
        raise RuntimeError(
            f"make_scruffy_hooks: environment variable {name} is not set; Scruffy sets "
            "SCRUFFY_ROOT and SCRUFFY_JOB_ID for the jobs it runs"
        )
    return value


def _node(env: Mapping[str, str]) -> str | None:
    node = _CONTROL.sub("?", env.get("SCRUFFY_NODE", "").strip())[:256].strip()
    return node or None


def _ack_timeout(explicit: float | None, env: Mapping[str, str]) -> float:
    if explicit is not None:
        where, value = "artifact_ack_timeout_s", explicit
    elif env.get(TIMEOUT_ENV, "") != "":
        where, raw = TIMEOUT_ENV, env[TIMEOUT_ENV]
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{where}={raw!r}: expected a number of seconds > 0") from None
    else:
        return DEFAULT_ARTIFACT_ACK_TIMEOUT_S
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (math.isfinite(value) and value > 0)
    ):
        raise ValueError(f"{where}={value!r}: expected a finite number of seconds > 0")
    return float(value)
