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
# Scruffy projects a job's ``phase = data.phase`` and ``status = data.status`` from its newest
# workload.phase report; the upstream hook table names these values.
PHASES = ("training", "evaluation")
STATUSES = ("started", "completed", "evacuated", "failed")

MAX_PAYLOAD_BYTES = 8192  # encoded payload, ASCII-escaped (as Scruffy measures its envelope)
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
        "status": (_STR, True),
        "step": (_OPT_INT, False),
        "max_steps": (_OPT_INT, False),
        "world_size": (_INT, False),
        "resumed": ((bool,), False),
        "reason": (_STR, False),
        "error": (_STR, False),
        "error_type": (_STR, False),
        "message": (_STR, False),
    },
    "workload.progress": {
        "completed_steps": (_INT, True),
        "total_steps": (_OPT_INT, True),
        "metrics": (_METRICS, False),
    },
    "workload.milestone": {
        "milestone": (_STR, True),
        "phase": (_STR, False),
        "status": (_STR, False),
        "step": (_OPT_INT, False),
        "metrics": (_METRICS, False),
        "artifact_id": (_STR, False),
        "path": ((str, type(None)), False),
        "artifact_event_id": (_STR, False),
        "publication": ((dict,), False),
    },
    "workload.artifact": {
        "artifact_type": (_STR, True),
        "step": (_INT, True),
        "publication": ((dict,), True),
    },
    "workload.notice": {
        "message": (_STR, True),
        "level": (_STR, False),
    },
}
_NOTICE_LEVELS = ("info", "warning", "error")
# Scruffy's strict publication record (its artifact gates read exactly these six keys).
PUBLICATION_KEYS = ("v", "artifact_id", "path", "size_bytes", "sha256", "manifest_path")
ARTIFACT_EVENT_PREFIX = "koochak-checkpoint-"
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


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
            self.to_dict(),
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=False,
            allow_nan=False,
        )


def artifact_event_id(artifact_id: str, sha256: str) -> str:
    """The event id of the artifact publication for these bytes, the same on every publish.

    Derived from the artifact ID and the content digest only, so the same checkpoint republished
    after a restart or by a resumed attempt carries the same id (Scruffy deduplicates it), while
    other bytes under the same artifact ID get another id. Scruffy scopes event ids per job.
    """
    text = f"{artifact_id}\0{sha256}"
    return ARTIFACT_EVENT_PREFIX + hashlib.sha256(text.encode("utf-8")).hexdigest()


def publication_record(
    artifact_id: str, path: str, size_bytes: int, sha256: str, manifest_path: str
) -> dict[str, Any]:
    """Scruffy's six-key strict publication record (``data.publication`` of an artifact event)."""
    record = {
        "v": 1,
        "artifact_id": artifact_id,
        "path": path,
        "size_bytes": size_bytes,
        "sha256": sha256,
        "manifest_path": manifest_path,
    }
    _check_publication(record, "publication")
    return record


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
        pub = bounded["publication"]
        derived = artifact_event_id(pub["artifact_id"], pub["sha256"])
        if event_id is not None and event_id != derived:
            raise ValueError(
                f"workload.artifact event_id {event_id!r} differs from the id derived from "
                f"the publication's artifact_id and sha256 ({derived!r}); leave event_id unset"
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
        p = doc["payload"]["publication"]
        derived = artifact_event_id(p["artifact_id"], p["sha256"])
        if doc["id"] != derived:
            raise ValueError(
                f"{where} field 'id': {doc['id']!r} is not the artifact event id {derived!r} "
                "derived from the publication's artifact_id and sha256"
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
    if kind == "workload.phase":
        for key, allowed in (("phase", PHASES), ("status", STATUSES)):
            if payload[key] not in allowed:
                raise ValueError(
                    f"{where}: workload.phase payload field {key!r} must be one of "
                    f"{', '.join(allowed)}, got {payload[key]!r}"
                )
    if kind == "workload.notice" and payload.get("level", "info") not in _NOTICE_LEVELS:
        raise ValueError(
            f"{where}: workload.notice payload field 'level' must be one of "
            f"{', '.join(_NOTICE_LEVELS)}"
        )
    if "publication" in payload:
        _check_publication(payload["publication"], f"{where}: {kind} field 'publication'")
    for key in ("step", "completed_steps", "total_steps", "max_steps", "size", "world_size"):
        value = payload.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            raise ValueError(f"{where}: {kind} payload field {key!r} must be >= 0, got {value}")


def _check_publication(p: Any, where: str) -> None:
    """Scruffy's strict publication rules (client-v1 section 7), plus Koochak's own."""
    if not isinstance(p, Mapping) or sorted(p) != sorted(PUBLICATION_KEYS):
        got = sorted(p) if isinstance(p, Mapping) else type(p).__name__
        raise ValueError(
            f"{where}: expected exactly the keys {', '.join(PUBLICATION_KEYS)}, got {got}"
        )
    if type(p["v"]) is not int or p["v"] != 1:
        raise ValueError(f"{where} key 'v': expected the integer 1, got {p['v']!r}")
    aid = p["artifact_id"]
    if (
        not isinstance(aid, str)
        or not aid
        or aid != aid.strip()
        or len(aid) > 256
        or _CONTROL.search(aid)
        or "/" not in aid
        or aid.startswith("/")
    ):
        raise ValueError(
            f"{where} key 'artifact_id': expected '<kind>/<name>' (trimmed, <= 256 chars, no "
            f"control characters), got {aid!r}"
        )
    for key in ("path", "manifest_path"):
        value = p[key]
        if (
            not isinstance(value, str)
            or value != value.strip()
            or not os.path.isabs(value)
            or len(value) > 4096
            or value.endswith(TRUNCATION_MARKER)
        ):
            raise ValueError(f"{where} key {key!r}: expected a whole absolute path, got {value!r}")
    if type(p["size_bytes"]) is not int or p["size_bytes"] < 0:
        raise ValueError(f"{where} key 'size_bytes': expected an int >= 0, got {p['size_bytes']!r}")
    if not isinstance(p["sha256"], str) or not _SHA256.fullmatch(p["sha256"]):
        raise ValueError(f"{where} key 'sha256': expected 64 lowercase hex digits")


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
    # ASCII-escaped, as Scruffy measures its envelope: non-ASCII text costs up to 6 bytes a char.
    size = len(json.dumps(payload, separators=(",", ":"), ensure_ascii=True))
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
