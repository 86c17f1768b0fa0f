"""make_scruffy_hooks against a tiny fake ``scruffy`` module injected through sys.modules."""

from __future__ import annotations

import json
import sys
import types

import pytest
from koochak.events import (
    ArtifactAckTimeout,
    ArtifactRejected,
    make_scruffy_hooks,
    parse_event,
)
from koochak.events.scruffy import DEFAULT_ARTIFACT_ACK_TIMEOUT_S, TIMEOUT_ENV

ENV = {"SCRUFFY_ROOT": "/scruffy/root", "SCRUFFY_JOB_ID": "job-42"}


class FakeScruffy(types.ModuleType):
    """The ScruffyEventClient contract: publish_event(root, job_id, event, *, wait, timeout)."""

    def __init__(self) -> None:
        super().__init__("scruffy")
        self.calls: list[dict] = []
        self.ack = "accepted"
        self.timeout = False
        self.on_record: set[str] = set()

    def publish_event(self, root, job_id, event, *, wait, timeout):
        self.calls.append(
            {"root": root, "job_id": job_id, "event": event, "wait": wait, "timeout": timeout}
        )
        if wait and self.timeout:
            raise TimeoutError("no acknowledgement")
        return self.ack if wait else None


@pytest.fixture
def fake_scruffy(monkeypatch):
    module = FakeScruffy()
    monkeypatch.setitem(sys.modules, "scruffy", module)
    return module


def fire(hooks, event, info):
    for fn in hooks.get(event, ()):
        fn(info)


def test_events_reach_scruffy_for_the_job(fake_scruffy, train_start, ckpt_info, tmp_path):
    hooks = make_scruffy_hooks(env=ENV)
    fire(hooks, "on_train_start", train_start())
    fire(hooks, "on_checkpoint", ckpt_info(str(tmp_path), 3))
    start, artifact = fake_scruffy.calls
    assert (start["root"], start["job_id"], start["wait"], start["timeout"]) == (
        "/scruffy/root", "job-42", False, None,
    )
    assert artifact["wait"] is True
    assert artifact["timeout"] == DEFAULT_ARTIFACT_ACK_TIMEOUT_S == 300.0
    event = parse_event(json.dumps(artifact["event"]))
    assert event.kind == "workload.artifact" and event.job_id == "job-42"


def test_a_duplicate_ack_is_an_idempotent_success(fake_scruffy, ckpt_info, tmp_path):
    fake_scruffy.ack = "duplicate"
    fire(make_scruffy_hooks(env=ENV), "on_checkpoint", ckpt_info(str(tmp_path), 3))


@pytest.mark.parametrize("ack", ["rejected", "conflict", None])
def test_a_rejected_ack_fails_closed(fake_scruffy, ckpt_info, tmp_path, ack):
    fake_scruffy.ack = ack
    with pytest.raises(ArtifactRejected, match="job-42"):
        fire(make_scruffy_hooks(env=ENV), "on_checkpoint", ckpt_info(str(tmp_path), 3))


def test_a_timeout_raises_the_retryable_reason_without_publishing_again(
    fake_scruffy, ckpt_info, tmp_path
):
    fake_scruffy.timeout = True
    hooks = make_scruffy_hooks(env=ENV, artifact_ack_timeout_s=2)
    with pytest.raises(ArtifactAckTimeout, match="within 2 s") as err:
        fire(hooks, "on_checkpoint", ckpt_info(str(tmp_path), 3))
    assert err.value.reason == "checkpoint_ack_timeout"
    assert len(fake_scruffy.calls) == 1


def test_a_timeout_accepted_on_the_durable_record_is_success(fake_scruffy, ckpt_info, tmp_path):
    fake_scruffy.timeout = True
    fake_scruffy.artifact_accepted = lambda root, job_id, event_id: event_id in fake_scruffy.on_record
    hooks = make_scruffy_hooks(env=ENV)
    info = ckpt_info(str(tmp_path), 3)
    with pytest.raises(ArtifactAckTimeout):
        fire(hooks, "on_checkpoint", info)
    fake_scruffy.on_record.add(fake_scruffy.calls[0]["event"]["id"])
    fire(hooks, "on_checkpoint", info)  # the same event id is on record now
    assert len(fake_scruffy.calls) == 2


def test_lifecycle_errors_stay_non_fatal(fake_scruffy, train_start):
    def broken(*args, **kwargs):
        raise ConnectionError("spool unavailable")

    fake_scruffy.publish_event = broken
    hooks = make_scruffy_hooks(env=ENV)
    with pytest.warns(RuntimeWarning, match="spool unavailable"):
        fire(hooks, "on_train_start", train_start())


@pytest.mark.parametrize("missing", ["SCRUFFY_ROOT", "SCRUFFY_JOB_ID"])
def test_missing_worker_variables_are_named(fake_scruffy, missing):
    env = {k: v for k, v in ENV.items() if k != missing}
    with pytest.raises(RuntimeError, match=missing):
        make_scruffy_hooks(env=env)


def test_os_environ_is_the_default(fake_scruffy, monkeypatch):
    monkeypatch.setenv("SCRUFFY_ROOT", "/r")
    monkeypatch.delenv("SCRUFFY_JOB_ID", raising=False)
    with pytest.raises(RuntimeError, match="SCRUFFY_JOB_ID"):
        make_scruffy_hooks()
    monkeypatch.setenv("SCRUFFY_JOB_ID", "j")
    assert set(make_scruffy_hooks()) >= {"on_train_start", "on_checkpoint"}


def test_missing_client_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "scruffy", None)  # makes `import scruffy` fail
    with pytest.raises(ImportError, match=r"koochak-events\[scruffy\]") as err:
        make_scruffy_hooks(env=ENV)
    assert "\n" not in str(err.value)


def test_an_incompatible_client_is_refused_before_training(monkeypatch):
    monkeypatch.setitem(sys.modules, "scruffy", types.ModuleType("scruffy"))
    with pytest.raises(ImportError, match="publish_event"):
        make_scruffy_hooks(env=ENV)


def ack_timeout(fake_scruffy, ckpt_info, tmp_path, **kwargs):
    fake_scruffy.calls.clear()
    fire(make_scruffy_hooks(**kwargs), "on_checkpoint", ckpt_info(str(tmp_path), 1))
    return fake_scruffy.calls[-1]["timeout"]


def test_ack_timeout_env_and_argument_precedence(fake_scruffy, ckpt_info, tmp_path):
    assert ack_timeout(fake_scruffy, ckpt_info, tmp_path, env=ENV) == 300.0
    env = {**ENV, TIMEOUT_ENV: "12.5"}
    assert ack_timeout(fake_scruffy, ckpt_info, tmp_path, env=env) == 12.5
    assert ack_timeout(fake_scruffy, ckpt_info, tmp_path, env=env, artifact_ack_timeout_s=7) == 7.0


@pytest.mark.parametrize("raw", ["soon", "0", "-3", "inf", "nan"])
def test_a_bad_ack_timeout_env_is_named(fake_scruffy, raw):
    with pytest.raises(ValueError, match=TIMEOUT_ENV):
        make_scruffy_hooks(env={**ENV, TIMEOUT_ENV: raw})


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), True, "5"])
def test_a_bad_ack_timeout_argument_is_named(fake_scruffy, value):
    with pytest.raises(ValueError, match="artifact_ack_timeout_s"):
        make_scruffy_hooks(env=ENV, artifact_ack_timeout_s=value)


def test_importing_koochak_events_does_not_import_scruffy():
    import subprocess

    code = "import sys, koochak.events; print('scruffy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "False"
