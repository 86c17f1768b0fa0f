"""The workload event envelope: one small, versioned, bounded JSON record per event.

An `Event` is what a training job tells an external coordinator (Scruffy, a dashboard): which
phase it is in, how far it got, which milestones it passed and which artifacts it published.
Payloads are bounded on purpose: an event is a signal, not a log, so it never carries a resolved
config or checkpoint contents. The bounds policy (documented in docs/formats.md):

- strings longer than `MAX_STRING_CHARS` are truncated and end with `TRUNCATION_MARKER` (a long
  exception message loses its tail, nothing else);
- everything else that does not fit is rejected with a ValueError naming the payload path: a
  non-JSON value (a tensor, a model), a non-finite float, nesting deeper than `MAX_DEPTH`, a
  container with more than `MAX_ITEMS` entries, or an encoded payload over `MAX_PAYLOAD_BYTES`.

`parse_event` is the strict reader: it truncates nothing and rejects unknown versions, kinds and
fields, naming the field.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

VERSION = 1
KINDS = (
    "workload.phase",
    "workload.progress",
    "workload.milestone",
    "workload.artifact",
    "workload.notice",
)
PHASES = ("starting", "training", "finished", "failed", "evacuated")

MAX_PAYLOAD_BYTES = 8192  # encoded payload, UTF-8
MAX_EVENT_BYTES = 16384  # a whole envelope as parse_event accepts it
MAX_DEPTH = 3  # payload itself is depth 1; metrics dicts inside it are depth 2
MAX_ITEMS = 64  # keys of one dict / entries of one list
MAX_STRING_CHARS = 1024
TRUNCATION_MARKER = "...[truncated]"

_FIELDS = ("version", "kind", "id", "time", "source", "job_id", "payload")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,6})?Z")

# Per-kind payload schema: key -> (allowed JSON types, required). Exact: other keys are refused,
# so a consumer can rely on what it finds (and a producer cannot smuggle a config in).
_INT = (int,)
_OPT_INT = (int, type(None))
_STR = (str,)
_METRICS = (dict,)
_SCHEMAS: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "workload.phase": {
        "phase": (_STR, True),
        "step": (_OPT_INT, False),
        "max_steps": (_OPT_INT, False),
        "world_size": (_INT, False),
        "resumed": ((bool,), False),
        "reason": (_STR, False),
        "error": (_STR, False),
    },
    "workload.progress": {
        "completed_steps": (_INT, True),
        "total_steps": (_OPT_INT, True),
        "metrics": (_METRICS, False),
    },
    "workload.milestone": {
        "milestone": (_STR, True),
        "step": (_OPT_INT, False),
        "metrics": (_METRICS, False),
        "artifact_id": (_STR, False),
        "path": ((str, type(None)), False),
    },
    "workload.artifact": {
        "artifact_id": (_STR, True),
        "path": (_STR, True),
        "size": (_INT, True),
        "sha256": (_STR, True),
        "manifest_path": (_STR, True),
        "step": (_INT, True),
    },
    "workload.notice": {
        "message": (_STR, True),
        "level": (_STR, False),
    },
}
_NOTICE_LEVELS = ("info", "warning", "error")


@dataclass(frozen=True)
class Event:
    """One workload event. Build it with `make_event`, which bounds and checks the payload."""

    kind: str
    id: str
    time: str  # UTC, RFC 3339 with a trailing Z
    source: str  # who produced it, e.g. "koochak.loop"
    job_id: str | None  # the coordinator's job id, when there is one
    payload: Mapping[str, Any] = field(default_factory=dict)
    version: int = VERSION

    def __post_init__(self) -> None:
        # Checked on every construction, so no Event (built by hand or parsed) encodes badly.
        _check_document(self.to_dict(), where="event")

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "kind": self.kind,
            "id": self.id,
            "time": self.time,
            "source": self.source,
            "job_id": self.job_id,
            "payload": _copy(self.payload),
        }

    def to_json(self) -> str:
        """Compact JSON, keys sorted, so equal events encode to equal bytes."""
        return json.dumps(
            self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=False,
            allow_nan=False,
        )


def artifact_event_id(job_id: str | None, artifact_id: str, sha256: str) -> str:
    """The id of the artifact event for these bytes: a retry publishes the same id again.

    Derived from the job, the artifact ID and the content digest, so a coordinator that already
    accepted it deduplicates, while different content under the same artifact ID conflicts.
    """
    text = f"{job_id or ''}\0{artifact_id}\0{sha256}"
    return "art-" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def make_event(
    kind: str,
    payload: Mapping[str, Any],
    *,
    job_id: str | None = None,
    source: str = "koochak",
    event_id: str | None = None,
    time: str | None = None,
) -> Event:
    """A checked, bounded `Event`; long strings truncated, anything else oversized refused.

    Artifact events get their id from `artifact_event_id` (passing another one is an error);
    every other kind gets a fresh random id unless ``event_id`` is given.
    """
    if kind not in KINDS:
        raise ValueError(f"event kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if not isinstance(payload, Mapping):
        raise ValueError(f"{kind} payload must be a mapping, got {type(payload).__name__}")
    bounded = _bound(payload, "payload", 1)
    _check_payload(kind, bounded, where=kind)
    if kind == "workload.artifact":
        derived = artifact_event_id(job_id, bounded["artifact_id"], bounded["sha256"])
        if event_id is not None and event_id != derived:
            raise ValueError(
                f"workload.artifact event_id {event_id!r} differs from the id derived from "
                f"job, artifact_id and sha256 ({derived!r}); leave event_id unset"
            )
        event_id = derived
    elif event_id is None:
        event_id = "evt-" + uuid.uuid4().hex
    return Event(
        kind=kind,
        id=event_id,
        time=time if time is not None else utc_now(),
        source=source,
        job_id=job_id,
        payload=bounded,
    )


def parse_event(text: str | bytes) -> Event:
    """Strictly read one encoded event; ValueError names the field that is wrong."""
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    if len(text.encode("utf-8")) > MAX_EVENT_BYTES:
        raise ValueError(f"event: larger than {MAX_EVENT_BYTES} bytes")
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise ValueError(f"event: not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"event: expected a JSON object, got {type(doc).__name__}")
    _check_envelope(doc, where="event")  # field names first: Event(...) needs exactly these
    return Event(
        kind=doc["kind"],
        id=doc["id"],
        time=doc["time"],
        source=doc["source"],
        job_id=doc["job_id"],
        payload=doc["payload"],
        version=doc["version"],
    )


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# ----------------------------------------------------------------------------- checks


def _check_document(doc: Mapping[str, Any], where: str) -> None:
    _check_envelope(doc, where)
    _check_bounded(doc["payload"], "payload", 1)
    _check_payload(doc["kind"], doc["payload"], where=f"{where} field 'payload'")
    if doc["kind"] == "workload.artifact":
        p = doc["payload"]
        derived = artifact_event_id(doc["job_id"], p["artifact_id"], p["sha256"])
        if doc["id"] != derived:
            raise ValueError(
                f"{where} field 'id': {doc['id']!r} is not the artifact event id {derived!r} "
                "derived from job_id, artifact_id and sha256"
            )


def _check_envelope(doc: Mapping[str, Any], where: str) -> None:
    unknown = sorted(set(doc) - set(_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r}; expected {', '.join(_FIELDS)}")
    missing = [k for k in _FIELDS if k not in doc]
    if missing:
        raise ValueError(f"{where}: missing field {missing[0]!r}")
    version = doc["version"]
    if type(version) is not int or version != VERSION:
        raise ValueError(f"{where} field 'version': unsupported version {version!r} (expected 1)")
    if doc["kind"] not in KINDS:
        raise ValueError(
            f"{where} field 'kind': unknown kind {doc['kind']!r}; expected one of {', '.join(KINDS)}"
        )
    for name in ("id", "source"):
        value = doc[name]
        if not isinstance(value, str) or not value or len(value) > 256:
            raise ValueError(f"{where} field {name!r}: expected a non-empty string (<= 256 chars)")
    if not isinstance(doc["time"], str) or not _TIME.fullmatch(doc["time"]):
        raise ValueError(
            f"{where} field 'time': expected UTC 'YYYY-MM-DDTHH:MM:SS[.ffffff]Z', "
            f"got {doc['time']!r}"
        )
    job_id = doc["job_id"]
    if job_id is not None and (not isinstance(job_id, str) or not job_id or len(job_id) > 256):
        raise ValueError(f"{where} field 'job_id': expected null or a non-empty string")
    if not isinstance(doc["payload"], dict):
        raise ValueError(f"{where} field 'payload': expected an object")


def _check_payload(kind: str, payload: Mapping[str, Any], where: str) -> None:
    schema = _SCHEMAS[kind]
    for key in payload:
        if key not in schema:
            raise ValueError(
                f"{where}: unknown {kind} payload field {key!r}; expected {', '.join(schema)}"
            )
    for key, (types, required) in schema.items():
        if key not in payload:
            if required:
                raise ValueError(f"{where}: {kind} payload is missing field {key!r}")
            continue
        value = payload[key]
        if isinstance(value, bool) and bool not in types:  # bool is an int to isinstance
            raise ValueError(f"{where}: {kind} payload field {key!r} must not be a boolean")
        if not isinstance(value, types):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise ValueError(
                f"{where}: {kind} payload field {key!r} must be {names}, got {type(value).__name__}"
            )
    if kind == "workload.phase" and payload["phase"] not in PHASES:
        raise ValueError(
            f"{where}: workload.phase payload field 'phase' must be one of {', '.join(PHASES)}, "
            f"got {payload['phase']!r}"
        )
    if kind == "workload.notice" and payload.get("level", "info") not in _NOTICE_LEVELS:
        raise ValueError(
            f"{where}: workload.notice payload field 'level' must be one of "
            f"{', '.join(_NOTICE_LEVELS)}"
        )
    if kind == "workload.artifact":
        _check_artifact(payload, where)
    for key in ("step", "completed_steps", "total_steps", "max_steps", "size", "world_size"):
        value = payload.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            raise ValueError(f"{where}: {kind} payload field {key!r} must be >= 0, got {value}")


def _check_artifact(p: Mapping[str, Any], where: str) -> None:
    if not _SHA256.fullmatch(p["sha256"]):
        raise ValueError(f"{where}: workload.artifact field 'sha256' must be 64 lowercase hex digits")
    for key in ("path", "manifest_path"):
        if not os.path.isabs(p[key]) or p[key].endswith(TRUNCATION_MARKER):
            raise ValueError(
                f"{where}: workload.artifact field {key!r} must be a whole absolute path, "
                f"got {p[key]!r}"
            )
    if "/" not in p["artifact_id"] or p["artifact_id"].startswith("/"):
        raise ValueError(
            f"{where}: workload.artifact field 'artifact_id' must look like "
            f"'<kind>/<name>', got {p['artifact_id']!r}"
        )


def _bound(value: Any, path: str, depth: int) -> Any:
    """A JSON-only copy of ``value`` with long strings truncated; refuses what cannot fit."""
    if isinstance(value, str):
        if len(value) > MAX_STRING_CHARS:
            return value[: MAX_STRING_CHARS - len(TRUNCATION_MARKER)] + TRUNCATION_MARKER
        return value
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path}: non-finite float {value!r} is not valid JSON")
        return value
    if isinstance(value, (Mapping, list, tuple)):
        if depth > MAX_DEPTH:
            raise ValueError(f"{path}: nested deeper than {MAX_DEPTH} levels")
        if len(value) > MAX_ITEMS:
            raise ValueError(f"{path}: {len(value)} entries, more than {MAX_ITEMS}")
        if isinstance(value, Mapping):
            out = {}
            for k, v in value.items():
                if not isinstance(k, str):
                    raise ValueError(f"{path}: key {k!r} is not a string")
                out[_bound(k, path, depth)] = _bound(v, f"{path}.{k}", depth + 1)
            if depth == 1:
                _check_size(out, path)
            return out
        return [_bound(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
    raise ValueError(
        f"{path}: {type(value).__name__} is not a JSON value (events carry references and "
        "scalars, never objects such as configs, models or tensors)"
    )


def _check_bounded(value: Any, path: str, depth: int) -> None:
    """The reader's side of `_bound`: the same limits, but nothing is truncated."""
    if isinstance(value, str):
        if len(value) > MAX_STRING_CHARS:
            raise ValueError(f"{path}: string longer than {MAX_STRING_CHARS} characters")
    elif isinstance(value, (dict, list)):
        if depth > MAX_DEPTH:
            raise ValueError(f"{path}: nested deeper than {MAX_DEPTH} levels")
        if len(value) > MAX_ITEMS:
            raise ValueError(f"{path}: {len(value)} entries, more than {MAX_ITEMS}")
        if isinstance(value, dict):
            for k, v in value.items():
                _check_bounded(k, path, depth)
                _check_bounded(v, f"{path}.{k}", depth + 1)
            if depth == 1:
                _check_size(value, path)
        else:
            for i, v in enumerate(value):
                _check_bounded(v, f"{path}[{i}]", depth + 1)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path}: non-finite float {value!r} is not valid JSON")
    elif value is not None and not isinstance(value, (bool, int)):
        raise ValueError(f"{path}: {type(value).__name__} is not a JSON value")


def _check_size(payload: Mapping[str, Any], path: str) -> None:
    size = len(json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))
    if size > MAX_PAYLOAD_BYTES:
        raise ValueError(f"{path}: {size} bytes encoded, more than {MAX_PAYLOAD_BYTES}")


def _copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_copy(v) for v in value]
    return value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc = dict(pairs)
    if len(doc) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"event: duplicate field {key!r}")
            seen.add(key)
    return doc


def _no_constant(name: str) -> Any:
    raise ValueError(f"event: {name} is not valid JSON")
