"""make_event_hooks driven by hand-built info dicts shaped like koochak.loop's."""

from __future__ import annotations

import hashlib
import json
import warnings

import pytest
from koochak.events import (
    ArtifactAckTimeout,
    ArtifactRejected,
    artifact_event_id,
    make_event_hooks,
    parse_event,
)


def fire(hooks, event, info):
    for fn in hooks.get(event, ()):
        fn(info)


def run_steps(hooks, clock, first, last, seconds_per_step):
    for step in range(first, last):
        clock.advance(seconds_per_step)
        fire(hooks, "on_step_end", {"step": step, "outputs": {"loss": 1.0}})


def test_no_publisher_means_no_hooks():
    assert make_event_hooks(None) == {}


def test_a_whole_run_publishes_phases_progress_eval_artifact_and_finish(
    publisher, clock, train_start, ckpt_info, tmp_path
):
    hooks = make_event_hooks(publisher, clock=clock, job_id="job-7")
    fire(hooks, "on_train_start", train_start(max_steps=100))
    run_steps(hooks, clock, 0, 10, seconds_per_step=1.0)
    fire(hooks, "on_log", {"step": 9, "metrics": {"loss": 0.5, "lr": 0.1}})
    fire(hooks, "on_eval_end", {"step": 9, "metrics": {"eval_acc": 0.75}})
    fire(hooks, "on_checkpoint", ckpt_info(str(tmp_path), 9))
    run_steps(hooks, clock, 10, 100, seconds_per_step=1.0)
    fire(hooks, "on_train_end", {"step": 100, "checkpoint": {}, "metrics": {"loss": 0.1}})
    fire(hooks, "on_exception", {"step": 100, "exception": RuntimeError("late")})

    kinds = publisher.kinds()
    assert kinds[:2] == ["workload.phase", "workload.progress"]
    # Scruffy shows phase = data.phase, status = data.status of the newest phase event.
    states = [(e.payload["phase"], e.payload["status"]) for e in publisher.of("workload.phase")]
    assert states == [("training", "started"), ("training", "completed")]  # nothing after the end
    assert publisher.of("workload.phase")[0].payload == {
        "phase": "training",
        "status": "started",
        "step": 0,
        "max_steps": 100,
        "world_size": 2,
        "resumed": False,
    }
    assert publisher.of("workload.phase")[-1].payload == {
        "phase": "training",
        "status": "completed",
        "step": 100,
    }
    progress = publisher.of("workload.progress")
    # 100 steps of 1 s with a 30 s interval: the first update, then updates 31, 61 and 91.
    assert [p.payload["completed_steps"] for p in progress] == [1, 31, 61, 91]
    assert all(p.payload["total_steps"] == 100 for p in progress)
    assert "metrics" not in progress[0].payload  # nothing logged before the first update
    assert progress[1].payload["metrics"] == {"loss": 0.5, "lr": 0.1}
    (milestone,) = publisher.of("workload.milestone")
    assert milestone.payload == {
        "milestone": "eval",
        "phase": "evaluation",
        "step": 9,
        "metrics": {"eval_acc": 0.75},
    }
    (artifact,) = publisher.of("workload.artifact")
    assert artifact.job_id == "job-7"
    # Every event is a valid envelope on the wire.
    for event in publisher.events:
        assert parse_event(event.to_json()) == event
    # Only the strict artifact waits for an acknowledgement.
    assert [w for e, w in zip(publisher.events, publisher.waits) if w] == [True]
    assert publisher.waits[publisher.events.index(artifact)] is True


def test_checkpoint_artifact_is_a_strict_publication_record(publisher, ckpt_info, tmp_path):
    hooks = make_event_hooks(publisher, job_id="job-1")
    info = ckpt_info(str(tmp_path), 41, data=b"tensor bytes")
    fire(hooks, "on_checkpoint", info)
    (event,) = publisher.events
    pub = info["publication"]
    assert event.kind == "workload.artifact"
    assert event.payload == {
        "artifact_type": "checkpoint",
        "step": 41,
        "publication": {
            "v": 1,
            "artifact_id": "checkpoint/step000000041.pt",
            "path": f"{tmp_path}/step000000041.pt",
            "size_bytes": len(b"tensor bytes"),
            "sha256": pub.sha256,
            "manifest_path": f"{tmp_path}/step000000041.pt.ready.json",
        },
    }
    assert event.id == artifact_event_id(pub.artifact_id, pub.sha256)
    assert publisher.waits == [True]


def _ready_manifest(directory, step, data=b"weights"):
    """A checkpoint file and its ready manifest as koochak-store writes them (formats.md)."""
    name = f"step{step:09d}.pt"
    (directory / name).write_bytes(data)
    manifest = {
        "artifact_id": f"checkpoint/{name}",
        "file_count": 1,
        "key": name,
        "provenance": None,
        "sha256": hashlib.sha256(data).hexdigest(),
        "size": len(data),
        "type": "file",
        "version": 1,
    }
    (directory / f"{name}.ready.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return str(directory / name)


def test_resume_republishes_the_selected_checkpoint_with_the_same_event_and_names_it(
    publisher, train_start, ckpt_info, tmp_path
):
    path = _ready_manifest(tmp_path, 9)
    first = make_event_hooks(publisher, job_id="job-1")
    fire(first, "on_checkpoint", ckpt_info(str(tmp_path), 9))  # what attempt 1 published
    (original,) = publisher.events
    hooks = make_event_hooks(publisher, job_id="job-2")
    fire(hooks, "on_train_start", {**train_start(step=10), "resumed": True, "resume_path": path})
    start, again, selected = publisher.events[1:]
    assert start.payload["resumed"] is True
    assert (again.kind, again.id, again.payload) == (original.kind, original.id, original.payload)
    assert selected.kind == "workload.milestone"
    assert selected.payload == {
        "milestone": "resume_selected",
        "step": 10,
        "path": path,
        "artifact_id": "checkpoint/step000000009.pt",
        "publication": original.payload["publication"],
        "artifact_event_id": original.id,
    }
    assert publisher.waits[1:] == [False, True, False]  # only the artifact waits


def test_resume_without_a_readable_manifest_only_names_the_selection(
    publisher, train_start, tmp_path
):
    path = _ready_manifest(tmp_path, 4)
    (tmp_path / "step000000004.pt.ready.json").write_text("{not json")
    hooks = make_event_hooks(publisher)
    fire(hooks, "on_train_start", {**train_start(step=5), "resumed": True, "resume_path": path})
    assert publisher.kinds() == ["workload.phase", "workload.milestone"]
    assert "publication" not in publisher.events[-1].payload


def test_a_tiered_resume_republishes_the_replica_tier_commit_only(
    publisher, train_start, ckpt_info, tmp_path
):
    # Tiered checkpoints: the run read step 9 from its fast first tier, but announces (and so
    # republishes) the copy in the first replica tier, the one path other nodes can read.
    (tmp_path / "fast").mkdir()
    (tmp_path / "durable").mkdir()
    fast = _ready_manifest(tmp_path / "fast", 9)
    durable = _ready_manifest(tmp_path / "durable", 9)
    fire(make_event_hooks(publisher), "on_checkpoint", ckpt_info(str(tmp_path / "durable"), 9))
    (original,) = publisher.events
    start = {**train_start(step=10), "resumed": True, "resume_path": fast}
    fire(
        make_event_hooks(publisher), "on_train_start", {**start, "resume_publication_path": durable}
    )
    again, selected = publisher.events[2:]
    assert (again.id, again.payload) == (original.id, original.payload)
    assert selected.payload["path"] == fast and selected.payload["artifact_event_id"] == original.id
    # Not in the replica tier yet: nothing to republish (replication announces it later).
    publisher.events.clear()
    fire(make_event_hooks(publisher), "on_train_start", {**start, "resume_publication_path": None})
    assert publisher.kinds() == ["workload.phase", "workload.milestone"]
    assert publisher.events[-1].payload == {
        "milestone": "resume_selected",
        "step": 10,
        "path": fast,
    }


def test_replication_commits_are_milestones_and_failures_are_notices(publisher, ckpt_info):
    hooks = make_event_hooks(publisher)
    pub = ckpt_info("/durable", 7)["publication"]
    fire(hooks, "on_replication", {"status": "committed", "step": 7, "name": "step000000007.pt",
                                   "tier": 2, "location": "archive://run", "path": "/durable/x",
                                   "publication": pub, "seconds": 1.5, "bytes": 100, "lag": 1,
                                   "behind_s": 2.0, "error": None, "retry_in_s": None})  # fmt: skip
    fire(hooks, "on_replication", {"status": "failed", "step": 8, "name": "step000000008.pt",
                                   "tier": 1, "location": "/scratch/run", "path": None,
                                   "publication": None, "lag": 2, "retry_in_s": 20.0,
                                   "error": "OSError: [Errno 28] No space left"})  # fmt: skip
    fire(hooks, "on_replication", {"status": "dropped", "step": 3, "name": "step000000003.pt",
                                   "tier": 1, "location": "/scratch/run",
                                   "error": "superseded"})  # fmt: skip
    milestone, failed, dropped = publisher.events
    assert milestone.kind == "workload.milestone"
    assert milestone.payload == {
        "milestone": "checkpoint_replicated",
        "step": 7,
        "path": "/durable/x",
        "artifact_id": "checkpoint/step000000007.pt",
        "metrics": {
            "behind_seconds": 2.0,
            "bytes": 100.0,
            "lag_checkpoints": 1.0,
            "seconds": 1.5,
            "tier": 2.0,
        },  # fmt: skip
    }
    assert failed.kind == dropped.kind == "workload.notice"
    assert failed.payload["level"] == "warning"
    assert "step000000008.pt to tier 1 (/scratch/run) failed: OSError" in failed.payload["message"]
    assert "retrying in 20.0 s" in failed.payload["message"]
    assert "step000000003.pt will not be replicated to tier 1" in dropped.payload["message"]
    assert publisher.waits == [False, False, False]  # nothing about replication waits
    for event in publisher.events:
        assert parse_event(event.to_json()) == event


def test_republishing_the_same_checkpoint_reuses_the_event_id(publisher, ckpt_info, tmp_path):
    hooks = make_event_hooks(publisher, job_id="job-1")
    fire(hooks, "on_checkpoint", ckpt_info(str(tmp_path), 5))
    fire(hooks, "on_checkpoint", ckpt_info(str(tmp_path), 5))  # a retried attempt, same bytes
    fire(hooks, "on_checkpoint", ckpt_info(str(tmp_path), 5, data=b"other"))
    ids = [e.id for e in publisher.events]
    assert ids[0] == ids[1] != ids[2]


def test_a_checkpoint_without_a_local_path_is_a_milestone_reference(publisher, ckpt_info):
    info = ckpt_info("/x", 3)
    info["path"] = None
    info["publication"] = type(info["publication"])(
        **{**info["publication"].__dict__, "path": None}
    )
    hooks = make_event_hooks(publisher)
    fire(hooks, "on_checkpoint", info)
    (event,) = publisher.events
    assert event.kind == "workload.milestone"
    assert event.payload == {
        "milestone": "checkpoint",
        "step": 3,
        "path": None,
        "artifact_id": "checkpoint/step000000003.pt",
    }
    assert publisher.waits == [False]


def test_the_checkpoint_hook_is_marked_fail_closed_for_the_loop(publisher):
    (hook,) = make_event_hooks(publisher)["on_checkpoint"]
    assert getattr(hook, "__koochak_fail_closed__", False) is True
    others = [
        fn
        for event, fns in make_event_hooks(publisher).items()
        for fn in fns
        if event != "on_checkpoint"
    ]
    assert not any(getattr(fn, "__koochak_fail_closed__", False) for fn in others)


@pytest.mark.parametrize("error", [ArtifactRejected("conflict"), ArtifactAckTimeout("late")])
def test_a_refused_artifact_raises(publisher, ckpt_info, tmp_path, error):
    hooks = make_event_hooks(publisher)
    publisher.fail_with = error
    with pytest.raises(type(error)):
        fire(hooks, "on_checkpoint", ckpt_info(str(tmp_path), 1))


def test_then_the_failure_is_reported_with_its_reason(publisher, train_start):
    hooks = make_event_hooks(publisher)
    fire(hooks, "on_train_start", train_start())
    fire(hooks, "on_exception", {"step": 4, "exception": ArtifactAckTimeout("no ack in 300 s")})
    failed = publisher.of("workload.phase")[-1].payload
    assert failed == {
        "phase": "training",
        "status": "failed",
        "step": 4,
        "reason": "checkpoint_ack_timeout",
        "error": "ArtifactAckTimeout: no ack in 300 s",
        "error_type": "ArtifactAckTimeout",
        "message": "no ack in 300 s",
    }


def test_publisher_errors_warn_once_and_never_raise(
    publisher, clock, train_start, ckpt_info, tmp_path
):
    hooks = make_event_hooks(publisher, clock=clock, progress_every_s=0)
    publisher.fail_with = OSError("spool full")
    with pytest.warns(RuntimeWarning, match="spool full") as record:
        fire(hooks, "on_train_start", train_start())
        run_steps(hooks, clock, 0, 5, seconds_per_step=1.0)
        fire(hooks, "on_checkpoint", ckpt_info(str(tmp_path), 4))  # an OSError is not a refusal
        fire(hooks, "on_train_end", {"step": 5, "checkpoint": {}, "metrics": {}})
    assert len(record) == 1
    publisher.fail_with = None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fire(hooks, "on_eval_end", {"step": 5, "metrics": {}})  # ended: nothing, no warning


def test_a_refusal_for_a_lifecycle_event_is_not_fatal(publisher, train_start):
    hooks = make_event_hooks(publisher)
    publisher.fail_with = ArtifactRejected("confused publisher")
    with pytest.warns(RuntimeWarning, match="confused publisher"):
        fire(hooks, "on_train_start", train_start())


def test_other_ranks_publish_nothing(publisher, clock, train_start, ckpt_info, tmp_path):
    hooks = make_event_hooks(publisher, clock=clock)
    fire(hooks, "on_train_start", train_start(rank=1))
    run_steps(hooks, clock, 0, 100, seconds_per_step=1.0)
    fire(hooks, "on_log", {"step": 9, "metrics": {"loss": 0.5}})
    fire(hooks, "on_eval_end", {"step": 9, "metrics": {"eval_acc": 0.75}})
    fire(hooks, "on_checkpoint", ckpt_info(str(tmp_path), 9))
    fire(hooks, "on_train_end", {"step": 100, "checkpoint": {}, "metrics": {}})
    fire(hooks, "on_exception", {"step": 100, "exception": RuntimeError("x")})
    assert publisher.events == []


def test_progress_waits_for_a_completed_step_boundary(publisher, clock, train_start):
    hooks = make_event_hooks(publisher, clock=clock, progress_every_s=30.0)
    fire(hooks, "on_train_start", train_start(max_steps=None))
    run_steps(hooks, clock, 0, 2, seconds_per_step=29.0)
    (first,) = publisher.of("workload.progress")  # the first update always reports
    assert first.payload == {"completed_steps": 1, "total_steps": None}
    clock.advance(500)  # a long pause: still one event, at the next completed update
    run_steps(hooks, clock, 2, 4, seconds_per_step=0.0)
    progress = publisher.of("workload.progress")[1:]
    assert [p.payload for p in progress] == [{"completed_steps": 3, "total_steps": None}]


def test_progress_counts_from_a_resumed_step(publisher, clock, train_start):
    hooks = make_event_hooks(publisher, clock=clock, progress_every_s=10.0)
    fire(hooks, "on_train_start", train_start(step=500, max_steps=1000))
    run_steps(hooks, clock, 500, 520, seconds_per_step=1.0)
    completed = [p.payload["completed_steps"] for p in publisher.of("workload.progress")]
    assert completed == [501, 511]
    assert publisher.of("workload.phase")[0].payload["step"] == 500


def test_evacuation_sends_milestone_and_phase_and_swallows_the_exit_exception(
    publisher, train_start, ckpt_info, tmp_path
):
    hooks = make_event_hooks(publisher)
    fire(hooks, "on_train_start", train_start())
    fire(hooks, "on_step_end", {"step": 0, "outputs": {}})
    evacuation_ckpt = {**ckpt_info(str(tmp_path), 1), "checkpoint": {"reason": "evacuation"}}
    fire(hooks, "on_checkpoint", evacuation_ckpt)
    fire(
        hooks, "on_train_end", {"step": 1, "checkpoint": {}, "metrics": {}, "reason": "evacuation"}
    )

    class Evacuated(Exception):
        pass

    fire(hooks, "on_exception", {"step": 1, "exception": Evacuated("exit 75")})
    tail = [(e.kind, e.payload.get("milestone"), e.payload.get("status")) for e in publisher.events]
    assert tail[-3:] == [
        ("workload.artifact", None, None),
        ("workload.milestone", "evacuation", "checkpointed"),
        ("workload.phase", None, "evacuated"),
    ]
    assert publisher.events[-1].payload == {"phase": "training", "status": "evacuated", "step": 1}
    # Nothing waits during the grace period, not even the terminal checkpoint's artifact.
    assert publisher.waits[-3:] == [False, False, False]
    artifact, milestone = publisher.events[-3:-1]
    assert milestone.payload["publication"] == artifact.payload["publication"]
    assert milestone.payload["artifact_event_id"] == artifact.id
    assert milestone.payload["path"] == artifact.payload["publication"]["path"]


def test_a_failure_publishes_failed_with_a_truncated_message(publisher, train_start):
    hooks = make_event_hooks(publisher)
    fire(hooks, "on_train_start", train_start())
    fire(hooks, "on_exception", {"step": 7, "exception": ValueError("boom " * 10_000)})
    (failed,) = [e for e in publisher.of("workload.phase") if e.payload["status"] == "failed"]
    assert failed.payload["reason"] == failed.payload["error_type"] == "ValueError"
    assert failed.payload["error"].startswith("ValueError: boom")
    assert failed.payload["error"].endswith("...[truncated]")
    # The upstream table's message is shorter: at most 512 characters.
    assert len(failed.payload["message"]) == 512 and failed.payload["message"].startswith("boom")


def test_payloads_never_carry_configs_models_or_tensors(
    publisher, clock, train_start, ckpt_info, tmp_path
):
    hooks = make_event_hooks(publisher, clock=clock, progress_every_s=0)
    fire(hooks, "on_train_start", train_start())  # carries a 100 kB train_cfg and a model
    fire(hooks, "on_log", {"step": 0, "metrics": {"loss": float("nan"), "tensor": object()}})
    run_steps(hooks, clock, 0, 2, seconds_per_step=1.0)
    fire(hooks, "on_checkpoint", ckpt_info(str(tmp_path), 1))
    text = "".join(e.to_json() for e in publisher.events)
    assert "huge" not in text and "lr" not in text and "object at" not in text
    assert len(text) < 4000
    assert publisher.of("workload.progress")[0].payload["metrics"] == {"loss": "nan"}


def test_a_plain_callable_without_wait_is_called_with_the_event_only(
    train_start, ckpt_info, tmp_path
):
    seen = []
    hooks = make_event_hooks(seen.append)
    fire(hooks, "on_train_start", train_start())
    fire(hooks, "on_checkpoint", ckpt_info(str(tmp_path), 2))
    assert [e.kind for e in seen] == ["workload.phase", "workload.artifact"]


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="publish"):
        make_event_hooks("not callable")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="progress_every_s"):
        make_event_hooks(print, progress_every_s=-1)


def test_malformed_publication_fails_closed(publisher, ckpt_info, tmp_path):
    info = ckpt_info(str(tmp_path), 2)
    info["publication"] = type(info["publication"])(
        **{**info["publication"].__dict__, "sha256": None}
    )
    hooks = make_event_hooks(publisher)
    with pytest.raises(ValueError, match="sha256"):
        fire(hooks, "on_checkpoint", info)


def test_before_train_start_the_torchrun_rank_decides(publisher, monkeypatch, ckpt_info, tmp_path):
    monkeypatch.setenv("RANK", "3")
    fire(make_event_hooks(publisher), "on_checkpoint", ckpt_info(str(tmp_path), 1))
    assert publisher.events == []
    monkeypatch.setenv("RANK", "0")
    fire(make_event_hooks(publisher), "on_checkpoint", ckpt_info(str(tmp_path), 1))
    assert publisher.kinds() == ["workload.artifact"]
