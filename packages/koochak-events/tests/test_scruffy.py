"""make_scruffy_hooks against small in-process fakes of the Scruffy v1 client contract.

The fakes follow the contract file's signatures (0.1.1: keyword-only ``publish_event`` with no
``wait``, acknowledged through ``observe``; newer: ``wait=``/``timeout=``). The end-to-end tests
over the faithful stub and its real controller live in tests-integration/.
"""

from __future__ import annotations

import hashlib
import json
import sys
import types
from pathlib import Path

import pytest
from koochak.events import (
    EXIT_CHECKPOINT_ACK_TIMEOUT,
    EXIT_PUBLICATION_REJECTED,
    ArtifactAckTimeout,
    ArtifactRejected,
    artifact_event_id,
    make_scruffy_hooks,
)
from koochak.events.scruffy import TIMEOUT_ENV

ENV = {"SCRUFFY_ROOT": "/scruffy/root", "SCRUFFY_JOB_ID": "job-42", "SCRUFFY_NODE": " node\x07a "}


class ReportConflict(RuntimeError):
    """Shaped like scruffy.storage.ReportConflict (a ConflictError, a RuntimeError)."""


def report_id(job_id, event_id):
    return f"{job_id}/{hashlib.sha256(event_id.encode()).hexdigest()}.json"


class Released(types.ModuleType):
    """scruffy-gpu 0.1.1: publish_event spools; the controller's journal event is the ack."""

    def __init__(self) -> None:
        super().__init__("scruffy")
        self.calls: list[tuple[str, dict]] = []
        self.answer = "accept"  # accept | reject | never
        self.journal: list[dict] = []
        self.on_record: list[dict] = []
        self.deduplicated = False

    def publish_event(
        self, root, *, job_id, kind, data, event_id=None, occurred_at=None, source=None
    ):
        self.calls.append(
            (
                "publish",
                {
                    "root": root,
                    "job_id": job_id,
                    "kind": kind,
                    "data": data,
                    "event_id": event_id,
                    "occurred_at": occurred_at,
                    "source": source,
                },
            )
        )
        if self.answer == "conflict":
            raise ReportConflict(f"event_id {event_id!r} was already used for another report")
        rid = report_id(job_id, event_id)
        if self.answer == "accept":
            self.journal.append({"kind": kind, "report_id": rid, "data": data})
        elif self.answer == "reject":
            self.journal.append(
                {
                    "kind": "notice",
                    "report_id": rid,
                    "data": {
                        "kind": "workload.report_rejected",
                        "report_id": rid,
                        "reason": "nope",
                    },
                }
            )
        return {
            "event_id": event_id,
            "job_id": job_id,
            "state": "spooled",
            "deduplicated": self.deduplicated,
        }

    def observe(
        self, root, *, after=None, wait_seconds=0, include_output=False, limit=1000, project_id=None
    ):
        self.calls.append(
            ("observe", {"after": after, "wait_seconds": wait_seconds, "project_id": project_id})
        )
        start = len(self.journal) if after is None else int(after)
        return {
            "snapshot": {},
            "events": self.journal[start:],
            "next_cursor": str(len(self.journal)),
            "latest_cursor": str(len(self.journal)),
            "more": False,
            "reset": False,
        }

    def status(self, root, job_id=None, *, project_id=None):
        self.calls.append(("status", {"job_id": job_id}))
        return {"job_id": job_id, "workload": {"latest_artifacts": self.on_record}}

    def published(self):
        return [c for name, c in self.calls if name == "publish"]


class Newer(Released):
    """The newer contract: publish_event(..., wait=False, timeout=None) acknowledges itself."""

    def publish_event(
        self,
        root,
        *,
        job_id,
        kind,
        data,
        event_id=None,
        occurred_at=None,
        source=None,
        wait=False,
        timeout=None,
    ):
        self.calls.append(
            (
                "publish",
                {
                    "kind": kind,
                    "data": data,
                    "event_id": event_id,
                    "wait": wait,
                    "timeout": timeout,
                    "source": source,
                },
            )
        )
        if self.answer == "conflict":
            raise ReportConflict("conflict")
        if wait and self.answer == "never":
            raise TimeoutError("no acknowledgement")
        state = {"accept": "accepted", "reject": "rejected"}.get(self.answer, "spooled")
        return {
            "event_id": event_id,
            "job_id": job_id,
            "state": state,
            "deduplicated": False,
            "acknowledged": state == "accepted",
        }


@pytest.fixture(params=["released", "newer"])
def client(request, monkeypatch):
    module = Released() if request.param == "released" else Newer()
    module.ReportConflict = ReportConflict
    monkeypatch.setitem(sys.modules, "scruffy", module)
    return module


@pytest.fixture
def released(monkeypatch):
    module = Released()
    monkeypatch.setitem(sys.modules, "scruffy", module)
    return module


def fire(hooks, event, info):
    for fn in hooks.get(event, ()):
        fn(info)


def test_events_use_the_keyword_contract_and_scruffys_envelope(
    client, train_start, ckpt_info, tmp_path
):
    hooks = make_scruffy_hooks(env=ENV)
    fire(hooks, "on_train_start", train_start())
    fire(hooks, "on_checkpoint", ckpt_info(str(tmp_path), 3))
    start, artifact = client.published()
    assert start["kind"] == "workload.phase"
    assert (start["data"]["phase"], start["data"]["status"]) == ("training", "started")
    assert start["source"] == {"name": "koochak", "node": "node?a"}  # trimmed, control char -> ?
    if type(client) is Released:
        assert start["root"] == Path("/scruffy/root") and start["job_id"] == "job-42"
        assert start["occurred_at"].endswith("+00:00")
    else:
        assert (start["wait"], start["timeout"]) == (False, None)  # lifecycle never waits
        assert (artifact["wait"], artifact["timeout"]) == (True, 300.0)
    pub = artifact["data"]["publication"]
    assert sorted(pub) == sorted(
        ["v", "artifact_id", "path", "size_bytes", "sha256", "manifest_path"]
    )
    assert artifact["event_id"] == artifact_event_id("checkpoint/step000000003.pt", pub["sha256"])
    # The stable artifact event is the same bytes from any node: its source names no node.
    assert artifact["source"] == {"name": "koochak"}


def test_on_0_1_1_the_cursor_is_taken_before_publishing(released, ckpt_info, tmp_path):
    fire(make_scruffy_hooks(env=ENV), "on_checkpoint", ckpt_info(str(tmp_path), 3))
    names = [name for name, _ in released.calls]
    assert names[:2] == ["observe", "publish"] and "observe" in names[2:]
    assert released.calls[0][1]["after"] is None
    assert "status" not in names  # acknowledged: the durable record is never scanned


def test_observation_is_filtered_to_the_jobs_project(released, ckpt_info, tmp_path):
    hooks = make_scruffy_hooks(env={**ENV, "SCRUFFY_PROJECT": "demo"})
    fire(hooks, "on_checkpoint", ckpt_info(str(tmp_path), 3))
    observed = [c for name, c in released.calls if name == "observe"]
    assert observed and all(c["project_id"] == "demo" for c in observed)


def test_a_rejection_fails_closed_with_exit_77(client, ckpt_info, tmp_path):
    client.answer = "reject"
    with pytest.raises(ArtifactRejected) as err:
        fire(make_scruffy_hooks(env=ENV), "on_checkpoint", ckpt_info(str(tmp_path), 3))
    assert err.value.exit_code == EXIT_PUBLICATION_REJECTED == 77
    assert len(client.published()) == 1


def test_a_report_conflict_fails_closed_after_one_publish(client, ckpt_info, tmp_path):
    client.answer = "conflict"
    with pytest.raises(ArtifactRejected, match="already used|conflict") as err:
        fire(make_scruffy_hooks(env=ENV), "on_checkpoint", ckpt_info(str(tmp_path), 3))
    assert err.value.exit_code == 77 and not err.value.retryable
    assert len(client.published()) == 1


def test_a_timeout_reconciles_once_without_publishing_again_then_exits_76(
    client, ckpt_info, tmp_path
):
    client.answer = "never"
    info = ckpt_info(str(tmp_path), 9)
    with pytest.raises(ArtifactAckTimeout) as err:
        fire(make_scruffy_hooks(env=ENV, artifact_ack_timeout_s=0.2), "on_checkpoint", info)
    assert len(client.published()) == 1
    assert [name for name, _ in client.calls].count("status") == 1
    exc = err.value
    assert (exc.exit_code, exc.retryable, exc.reason) == (76, True, "checkpoint_ack_timeout")
    assert exc.exit_code == EXIT_CHECKPOINT_ACK_TIMEOUT
    line = json.loads(exc.exit_line())
    assert line["reason"] == "checkpoint_ack_timeout"
    assert line["checkpoint_path"] == info["path"]
    assert line["event_id"] == client.published()[0]["event_id"]
    assert "\n" not in exc.exit_line()


def test_a_timeout_that_the_durable_record_shows_accepted_is_success(client, ckpt_info, tmp_path):
    client.answer = "never"
    info = ckpt_info(str(tmp_path), 9)
    pub = info["publication"]
    eid = artifact_event_id(pub.artifact_id, pub.sha256)
    publication = {
        "v": 1,
        "artifact_id": pub.artifact_id,
        "path": info["path"],
        "size_bytes": pub.size,
        "sha256": pub.sha256,
        "manifest_path": info["path"] + ".ready.json",
    }
    client.on_record = [
        {
            "artifact_type": "checkpoint",
            "step": 9,
            "publication": publication,
            "event_id": eid,
            "occurred_at": "2026-01-01T00:00:00+00:00",
        }
    ]
    fire(make_scruffy_hooks(env=ENV, artifact_ack_timeout_s=0.1), "on_checkpoint", info)
    assert len(client.published()) == 1


def test_a_record_with_another_publication_does_not_count(released, ckpt_info, tmp_path):
    released.answer = "never"
    info = ckpt_info(str(tmp_path), 9)
    eid = artifact_event_id("checkpoint/step000000009.pt", info["publication"].sha256)
    released.on_record = [{"event_id": eid, "publication": {"v": 1, "artifact_id": "other"}}]
    with pytest.raises(ArtifactAckTimeout):
        fire(make_scruffy_hooks(env=ENV, artifact_ack_timeout_s=0.1), "on_checkpoint", info)


def test_a_deduplicated_publish_already_on_record_needs_no_journal_event(
    released, ckpt_info, tmp_path
):
    released.answer, released.deduplicated = "never", True
    info = ckpt_info(str(tmp_path), 9)
    hooks = make_scruffy_hooks(env=ENV, artifact_ack_timeout_s=30)
    sha = info["publication"].sha256
    released.on_record = [
        {
            "event_id": artifact_event_id("checkpoint/step000000009.pt", sha),
            "publication": {
                "v": 1,
                "artifact_id": "checkpoint/step000000009.pt",
                "path": info["path"],
                "size_bytes": info["publication"].size,
                "sha256": sha,
                "manifest_path": info["path"] + ".ready.json",
            },
        }
    ]
    fire(hooks, "on_checkpoint", info)  # returns at once, no 30 s wait
    assert [name for name, _ in released.calls] == ["observe", "publish", "status"]


def test_lifecycle_errors_stay_non_fatal(client, train_start):
    def broken(root, *, job_id, kind, data, event_id=None, occurred_at=None, source=None):
        raise ConnectionError("spool unavailable")

    hooks = make_scruffy_hooks(env=ENV)
    client.publish_event = broken
    with pytest.warns(RuntimeWarning, match="spool unavailable"):
        fire(hooks, "on_train_start", train_start())


@pytest.mark.parametrize("missing", ["SCRUFFY_ROOT", "SCRUFFY_JOB_ID"])
def test_missing_worker_variables_are_named(released, missing):
    env = {k: v for k, v in ENV.items() if k != missing}
    with pytest.raises(RuntimeError, match=missing):
        make_scruffy_hooks(env=env)


def test_os_environ_is_the_default(released, monkeypatch):
    monkeypatch.setenv("SCRUFFY_ROOT", "/r")
    monkeypatch.delenv("SCRUFFY_JOB_ID", raising=False)
    with pytest.raises(RuntimeError, match="SCRUFFY_JOB_ID"):
        make_scruffy_hooks()
    monkeypatch.setenv("SCRUFFY_JOB_ID", "j")
    assert set(make_scruffy_hooks()) >= {"on_train_start", "on_checkpoint"}


def test_a_missing_client_says_to_put_it_on_pythonpath_not_an_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "scruffy", None)  # makes `import scruffy` fail
    with pytest.raises(ImportError, match="PYTHONPATH") as err:
        make_scruffy_hooks(env=ENV)
    assert "[" not in str(err.value) and "pip install" not in str(err.value)
    assert "\n" not in str(err.value)


def test_a_client_with_the_assumed_positional_api_is_refused_before_training(monkeypatch):
    module = types.ModuleType("scruffy")
    module.publish_event = lambda root, job_id, event, *, wait, timeout: "accepted"
    monkeypatch.setitem(sys.modules, "scruffy", module)
    with pytest.raises(ImportError, match="keyword-only"):
        make_scruffy_hooks(env=ENV)
    monkeypatch.setitem(sys.modules, "scruffy", types.ModuleType("scruffy"))
    with pytest.raises(ImportError, match="publish_event"):
        make_scruffy_hooks(env=ENV)


def test_a_0_1_1_client_without_observe_cannot_acknowledge(monkeypatch):
    module = Released()
    module.observe = None
    monkeypatch.setitem(sys.modules, "scruffy", module)
    with pytest.raises(ImportError, match="observe"):
        make_scruffy_hooks(env=ENV)


def test_ack_timeout_env_and_argument_precedence(monkeypatch, ckpt_info, tmp_path):
    module = Newer()
    monkeypatch.setitem(sys.modules, "scruffy", module)

    def timeout_of(**kwargs):
        module.calls.clear()
        fire(make_scruffy_hooks(**kwargs), "on_checkpoint", ckpt_info(str(tmp_path), 1))
        return module.published()[-1]["timeout"]

    assert timeout_of(env=ENV) == 300.0
    env = {**ENV, TIMEOUT_ENV: "12.5"}
    assert timeout_of(env=env) == 12.5
    assert timeout_of(env=env, artifact_ack_timeout_s=7) == 7.0


@pytest.mark.parametrize("raw", ["soon", "0", "-3", "inf", "nan"])
def test_a_bad_ack_timeout_env_is_named(released, raw):
    with pytest.raises(ValueError, match=TIMEOUT_ENV):
        make_scruffy_hooks(env={**ENV, TIMEOUT_ENV: raw})


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), True, "5"])
def test_a_bad_ack_timeout_argument_is_named(released, value):
    with pytest.raises(ValueError, match="artifact_ack_timeout_s"):
        make_scruffy_hooks(env=ENV, artifact_ack_timeout_s=value)


def test_the_wire_envelope_is_measured_ascii_escaped_before_it_reaches_scruffy(
    released, monkeypatch, ckpt_info
):
    from koochak.events import make_event
    from koochak.events import scruffy as adapter

    publisher = adapter.ScruffyPublisher(released, "/r", "job-1", 1.0, node="n" * 256)
    event = make_event("workload.notice", {"message": "\U0001f600" * 600}, job_id="job-1")
    args = publisher.wire_arguments(event)  # 12 bytes a character escaped: ~7.3 kB, accepted
    assert args["source"]["node"] == "n" * 256
    monkeypatch.setattr(adapter, "MAX_WIRE_BYTES", 7000)
    with pytest.raises(ValueError, match="more than 7000"):
        publisher.wire_arguments(event)
    # A checkpoint artifact over the bound is a rejection (exit 77), never a warning.
    monkeypatch.setattr(adapter, "MAX_WIRE_BYTES", 300)
    hooks = make_scruffy_hooks(env=ENV)
    with pytest.raises(ArtifactRejected, match="more than 300"):
        fire(hooks, "on_checkpoint", ckpt_info("/runs/exp", 9))
    assert released.published() == []


def test_importing_koochak_events_does_not_import_scruffy():
    import subprocess

    code = "import sys, koochak.events; print('scruffy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("error", "expected", "code"),
    [
        (ValueError("publication.sha256 must be 64 lowercase hex"), ArtifactRejected, 77),
        (OSError("reports directory is read-only"), ArtifactAckTimeout, 76),
    ],
)
def test_a_failing_publish_is_a_rejection_or_an_unknown_fate(
    client, ckpt_info, tmp_path, error, expected, code
):
    def failing(
        root,
        *,
        job_id,
        kind,
        data,
        event_id=None,
        occurred_at=None,
        source=None,
        wait=False,
        timeout=None,
    ):
        client.calls.append(("publish", {"kind": kind}))
        raise error

    hooks = make_scruffy_hooks(env=ENV, artifact_ack_timeout_s=0.1)
    client.publish_event = failing
    with pytest.raises(expected) as err:
        fire(hooks, "on_checkpoint", ckpt_info(str(tmp_path), 3))
    assert err.value.exit_code == code and str(error) in err.value.detail
    assert len(client.published()) == 1
