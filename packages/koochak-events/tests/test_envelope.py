"""The event envelope: round trip, strict reading, bounds, idempotent artifact ids."""

from __future__ import annotations

import json

import pytest
from koochak.events import Event, artifact_event_id, make_event, parse_event, publication_record
from koochak.events.envelope import (
    MAX_ITEMS,
    MAX_PAYLOAD_BYTES,
    MAX_STRING_CHARS,
    TRUNCATION_MARKER,
)

SHA = "a" * 64


def artifact_payload(**overrides):
    """A checkpoint artifact payload; ``overrides`` change keys of its publication record."""
    publication = {
        "v": 1,
        "artifact_id": "checkpoint/step000000100.pt",
        "path": "/runs/exp/step000000100.pt",
        "size_bytes": 123,
        "sha256": SHA,
        "manifest_path": "/runs/exp/step000000100.pt.ready.json",
    }
    publication.update(overrides)
    publication = {k: v for k, v in publication.items() if v is not _DROP}
    return {"artifact_type": "checkpoint", "step": 100, "publication": publication}


_DROP = object()


def test_every_kind_round_trips_through_json():
    payloads = {
        "workload.phase": {
            "phase": "training",
            "status": "started",
            "step": 0,
            "max_steps": 10,
            "resumed": False,
        },
        "workload.progress": {"completed_steps": 3, "total_steps": None, "metrics": {"loss": 1.5}},
        "workload.milestone": {"milestone": "eval", "step": 4, "metrics": {"eval_acc": 0.9}},
        "workload.artifact": artifact_payload(),
        "workload.notice": {"message": "hello", "level": "warning"},
    }
    for kind, payload in payloads.items():
        event = make_event(kind, payload, job_id="job-1", source="test")
        assert parse_event(event.to_json()) == event
        assert parse_event(event.to_json().encode()) == event
        assert json.loads(event.to_json())["version"] == 1


def test_to_json_is_canonical():
    event = make_event(
        "workload.phase",
        {"step": 1, "phase": "training", "status": "started"},
        time="2026-01-01T00:00:00Z",
    )
    text = event.to_json()
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))


def test_non_artifact_events_get_distinct_ids():
    a = make_event("workload.notice", {"message": "x"})
    b = make_event("workload.notice", {"message": "x"})
    assert a.id != b.id


def test_artifact_event_id_derives_from_artifact_and_digest_only():
    a = make_event("workload.artifact", artifact_payload(), job_id="job-1")
    retry = make_event("workload.artifact", artifact_payload(), job_id="job-1")
    assert a.id == retry.id == artifact_event_id("checkpoint/step000000100.pt", SHA)
    assert a.id.startswith("koochak-checkpoint-") and len(a.id) <= 256
    # A resumed attempt (another Scruffy job) republishes the very same event id.
    assert make_event("workload.artifact", artifact_payload(), job_id="job-2").id == a.id
    other_bytes = make_event("workload.artifact", artifact_payload(sha256="b" * 64), job_id="job-1")
    assert other_bytes.id != a.id
    with pytest.raises(ValueError, match="event_id"):
        make_event("workload.artifact", artifact_payload(), job_id="job-1", event_id="mine")


def test_the_publication_record_has_exactly_scruffys_six_keys():
    event = make_event("workload.artifact", artifact_payload(), job_id="j")
    pub = event.payload["publication"]
    assert list(pub) == ["v", "artifact_id", "path", "size_bytes", "sha256", "manifest_path"]
    assert (
        publication_record(
            pub["artifact_id"], pub["path"], pub["size_bytes"], pub["sha256"], pub["manifest_path"]
        )
        == pub
    )


def test_parse_rejects_a_tampered_artifact_id():
    doc = json.loads(make_event("workload.artifact", artifact_payload(), job_id="j").to_json())
    doc["id"] = "koochak-checkpoint-0000"
    with pytest.raises(ValueError, match="'id'"):
        parse_event(json.dumps(doc))


def _doc(**changes):
    started = {"phase": "training", "status": "started"}
    doc = json.loads(make_event("workload.phase", started, job_id="j").to_json())
    doc.update(changes)
    return doc


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        (_doc(version=2), "'version'"),
        (_doc(version="1"), "'version'"),
        (_doc(kind="workload.gossip"), "'kind'"),
        (_doc(extra=1), "'extra'"),
        (_doc(time="yesterday"), "'time'"),
        (_doc(id=""), "'id'"),
        (_doc(job_id=5), "'job_id'"),
        (_doc(payload=[]), "'payload'"),
        (_doc(payload={"phase": "training", "status": "started", "config": {}}), "'config'"),
        (_doc(payload={"phase": "napping", "status": "started"}), "'phase'"),
        (_doc(payload={"phase": "starting", "status": "started"}), "'phase'"),
        (_doc(payload={"phase": "training", "status": "finished"}), "'status'"),
        (_doc(payload={"phase": "training"}), "'status'"),
        (_doc(payload={"step": 1, "status": "started"}), "'phase'"),
        (_doc(payload={"phase": "training", "status": "started", "step": -1}), "'step'"),
        (_doc(payload={"phase": "training", "status": "started", "step": True}), "'step'"),
    ],
)
def test_parse_rejects_and_names_the_field(doc, field):
    with pytest.raises(ValueError, match=field):
        parse_event(json.dumps(doc))


def test_parse_rejects_a_missing_field():
    doc = _doc()
    del doc["source"]
    with pytest.raises(ValueError, match="missing field 'source'"):
        parse_event(json.dumps(doc))


def test_parse_rejects_duplicate_keys_nan_and_non_objects():
    text = json.dumps(_doc(), separators=(",", ":"))
    with pytest.raises(ValueError, match="duplicate field 'kind'"):
        parse_event(text[:-1] + ',"kind":"workload.phase"}')
    notice = json.loads(make_event("workload.notice", {"message": "m"}).to_json())
    notice["payload"] = {"message": "m", "level": "NAN_HERE"}
    with pytest.raises(ValueError, match="NaN"):
        parse_event(json.dumps(notice).replace('"NAN_HERE"', "NaN"))
    with pytest.raises(ValueError, match="expected a JSON object"):
        parse_event("[1]")
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_event("{")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"sha256": "XYZ"}, "'sha256'"),
        ({"sha256": "A" * 64}, "'sha256'"),
        ({"path": "relative/step.pt"}, "'path'"),
        ({"path": " /padded/step.pt"}, "'path'"),
        ({"manifest_path": "m.ready.json"}, "'manifest_path'"),
        ({"artifact_id": "step000000100.pt"}, "'artifact_id'"),
        ({"artifact_id": "checkpoint/a\tb"}, "'artifact_id'"),
        ({"size_bytes": "12"}, "'size_bytes'"),
        ({"size_bytes": True}, "'size_bytes'"),
        ({"size_bytes": 1.0}, "'size_bytes'"),
        ({"size_bytes": -1}, "'size_bytes'"),
        ({"v": "1"}, "'v'"),
        ({"v": True}, "'v'"),
        ({"extra": 1}, "exactly the keys"),
        ({"manifest_path": _DROP}, "exactly the keys"),
    ],
)
def test_artifact_payload_is_strict(change, field):
    with pytest.raises(ValueError, match=field):
        make_event("workload.artifact", artifact_payload(**change), job_id="j")


def test_long_strings_are_truncated_with_a_marker():
    event = make_event("workload.notice", {"message": "x" * 50_000})
    message = event.payload["message"]
    assert len(message) == MAX_STRING_CHARS
    assert message.endswith(TRUNCATION_MARKER)
    assert parse_event(event.to_json()) == event


def test_a_truncated_path_cannot_become_an_artifact():
    long_path = "/" + "d" * (2 * MAX_STRING_CHARS)
    with pytest.raises(ValueError, match="whole absolute path"):
        make_event("workload.artifact", artifact_payload(path=long_path), job_id="j")


@pytest.mark.parametrize(
    ("metrics", "message"),
    [
        ({"loss": float("nan")}, "non-finite"),
        ({"model": object()}, "not a JSON value"),
        ({"deep": {"deeper": {"deepest": 1}}}, "deeper than"),
        ({f"m{i}": 1.0 for i in range(MAX_ITEMS + 1)}, "more than"),
        ({1: 2.0}, "not a string"),
    ],
)
def test_unbounded_payloads_are_refused_naming_the_path(metrics, message):
    with pytest.raises(ValueError, match=message) as err:
        make_event(
            "workload.progress", {"completed_steps": 1, "total_steps": 2, "metrics": metrics}
        )
    assert "payload.metrics" in str(err.value)


def test_the_byte_limit_counts_non_ascii_text_as_scruffy_escapes_it():
    # 700 x "e-acute" is 1400 UTF-8 bytes but 4200 ASCII-escaped: twelve such strings overflow.
    metrics = {f"m{i}": "\u00e9" * 700 for i in range(12)}
    with pytest.raises(ValueError, match=f"more than {MAX_PAYLOAD_BYTES}"):
        make_event(
            "workload.progress", {"completed_steps": 1, "total_steps": 2, "metrics": metrics}
        )
    assert make_event("workload.notice", {"message": "\u00e9" * 1000}).payload["message"]


def test_payload_byte_limit():
    metrics = {f"m{i}": "v" * 200 for i in range(MAX_ITEMS)}
    with pytest.raises(ValueError, match=f"more than {MAX_PAYLOAD_BYTES}"):
        make_event(
            "workload.progress", {"completed_steps": 1, "total_steps": 2, "metrics": metrics}
        )


def test_parse_does_not_truncate_it_refuses():
    doc = json.loads(make_event("workload.notice", {"message": "ok"}).to_json())
    doc["payload"]["message"] = "y" * (MAX_STRING_CHARS + 1)
    with pytest.raises(ValueError, match="longer than"):
        parse_event(json.dumps(doc))
    with pytest.raises(ValueError, match="bytes"):
        parse_event(" " * 20_000 + json.dumps(doc))


def test_unknown_kind_at_construction():
    with pytest.raises(ValueError, match="kind"):
        make_event("workload.chat", {})


def test_event_is_frozen():
    event = make_event("workload.notice", {"message": "m"})
    with pytest.raises(AttributeError):
        event.kind = "workload.phase"  # type: ignore[misc]
    assert isinstance(event, Event)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"version": 2}, "'version'"),
        ({"kind": "workload.gossip"}, "'kind'"),
        ({"payload": {"message": "m", "blob": "x"}}, "'blob'"),
        ({"payload": {"message": "m", "raw": b"x"}}, "bytes is not a JSON value"),
        ({"payload": {"message": object()}}, "not a JSON value"),
        ({"payload": {"message": "m", "level": float("nan")}}, "non-finite"),
        ({"time": "now"}, "'time'"),
    ],
)
def test_an_event_built_by_hand_is_checked_too(changes, message):
    fields = {
        "kind": "workload.notice",
        "id": "evt-1",
        "time": "2026-01-01T00:00:00Z",
        "source": "me",
        "job_id": None,
        "payload": {"message": "m"},
    }
    with pytest.raises(ValueError, match=message):
        Event(**{**fields, **changes})
    assert parse_event(Event(**fields).to_json()) == Event(**fields)
