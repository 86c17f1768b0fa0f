"""Workload event envelopes and strict publications (contract sections 6 and 7)."""

from __future__ import annotations

import json
import math
import os
import re
from datetime import datetime
from typing import Any

KINDS = (
    "workload.phase",
    "workload.progress",
    "workload.milestone",
    "workload.artifact",
    "workload.notice",
)
ENVELOPE_KEYS = ("v", "event_id", "job_id", "occurred_at", "kind", "source", "data")
PUBLICATION_KEYS = ("v", "artifact_id", "path", "size_bytes", "sha256", "manifest_path")
MAX_ENCODED_BYTES = 65536
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class ProtocolError(ValueError):
    """An event envelope or publication that Scruffy refuses."""


def canonical(doc: Any) -> bytes:
    return (
        json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
        + "\n"
    ).encode("ascii")


def check_job_id(job_id: Any) -> str:
    if (
        not isinstance(job_id, str)
        or len(job_id) > 128
        or not _JOB_ID.fullmatch(job_id)
        or job_id in (".", "..")
    ):
        raise ProtocolError(f"invalid job_id: {job_id!r}")
    return job_id


def _text(value: Any, name: str, limit: int) -> str:
    if (
        not isinstance(value, str)
        or not value
        or value != value.strip()
        or len(value) > limit
        or _CONTROL.search(value)
    ):
        raise ProtocolError(
            f"{name} must be a non-empty trimmed string of at most {limit} characters"
        )
    return value


def _plain_json(value: Any, depth: int) -> None:
    if depth > 32:
        raise ProtocolError("data is nested too deeply")
    if value is None or isinstance(value, (bool, str)):
        return
    if isinstance(value, int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ProtocolError("data must contain only finite numbers")
        return
    if isinstance(value, list):
        for item in value:
            _plain_json(item, depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ProtocolError("data object keys must be strings")
            _plain_json(item, depth + 1)
        return
    raise ProtocolError(f"data must contain only plain JSON values, not {type(value).__name__}")


def validate_publication(pub: Any) -> dict[str, Any]:
    if not isinstance(pub, dict) or set(pub) != set(PUBLICATION_KEYS):
        raise ProtocolError(f"publication must have exactly the fields {list(PUBLICATION_KEYS)}")
    if type(pub["v"]) is not int or pub["v"] != 1:
        raise ProtocolError("publication.v must be 1")
    _text(pub["artifact_id"], "publication.artifact_id", 256)
    for key in ("path", "manifest_path"):
        _text(pub[key], f"publication.{key}", 4096)
        if not os.path.isabs(pub[key]):
            raise ProtocolError(f"publication.{key} must be absolute")
    if type(pub["size_bytes"]) is not int or pub["size_bytes"] < 0:
        raise ProtocolError("publication.size_bytes must be a non-negative integer")
    if not isinstance(pub["sha256"], str) or not _SHA256.fullmatch(pub["sha256"]):
        raise ProtocolError("publication.sha256 must be 64 lowercase hexadecimal characters")
    return pub


def validate_event(event: Any) -> dict[str, Any]:
    if not isinstance(event, dict) or set(event) != set(ENVELOPE_KEYS):
        raise ProtocolError(f"event must have exactly the fields {list(ENVELOPE_KEYS)}")
    if type(event["v"]) is not int or event["v"] != 1:
        raise ProtocolError("event v must be 1")
    if event["kind"] not in KINDS:
        raise ProtocolError(f"unsupported event kind: {event['kind']!r}")
    _text(event["event_id"], "event_id", 256)
    check_job_id(event["job_id"])
    occurred = event["occurred_at"]
    if not isinstance(occurred, str) or len(occurred) > 64:
        raise ProtocolError("occurred_at must be an ISO 8601 timestamp")
    try:
        parsed = datetime.fromisoformat(
            occurred[:-1] + "+00:00" if occurred.endswith("Z") else occurred
        )
    except ValueError:
        raise ProtocolError("occurred_at must be an ISO 8601 timestamp") from None
    if parsed.utcoffset() is None:
        raise ProtocolError("occurred_at must include a UTC offset")
    source = event["source"]
    if not isinstance(source, dict) or len(source) > 32:
        raise ProtocolError("source must be an object with at most 32 entries")
    for key, value in source.items():
        _text(key, "source key", 64)
        _text(value, "source value", 256)
    if not isinstance(event["data"], dict):
        raise ProtocolError("data must be an object")
    _plain_json(event["data"], 1)
    if len(canonical(event)) > MAX_ENCODED_BYTES:
        raise ProtocolError(f"event exceeds {MAX_ENCODED_BYTES} encoded bytes")
    if event["kind"] == "workload.artifact" and "publication" in event["data"]:
        validate_publication(event["data"]["publication"])
    return event
