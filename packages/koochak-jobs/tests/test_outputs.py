"""Declared outputs: validated all first, revalidated before each event, idempotent event ids,
and the runner's exit codes for missing, corrupt, rejected and unacknowledged publications."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from koochak.events import ArtifactRejected
from koochak.jobs import DeclaredOutput, validate_output
from koochak.jobs.publish import publish_outputs
from koochak.storage.artifact import write_ready_manifest

PRODUCER = """\
import os, sys
from koochak.storage.artifact import write_ready_manifest
run_dir = sys.argv[1]
mode = sys.argv[2]
with open(os.path.join(run_dir, "model.bin"), "wb") as f:
    f.write(b"weights" * 100)
write_ready_manifest(os.path.join(run_dir, "model.bin"), artifact_id="model/final")
os.makedirs(os.path.join(run_dir, "shards"), exist_ok=True)
for i in range(3):
    with open(os.path.join(run_dir, "shards", f"{i}.bin"), "wb") as f:
        f.write(bytes([i]) * 10)
if mode != "missing":
    write_ready_manifest(os.path.join(run_dir, "shards"), artifact_id="dataset/shards")
if mode == "corrupt":
    path = os.path.join(run_dir, "model.bin")
    os.chmod(path, 0o644)
    with open(path, "ab") as f:
        f.write(b"!")
"""

OUTPUTS = [
    DeclaredOutput("model/final", "{run_dir}/model.bin"),
    DeclaredOutput("dataset/shards", "{run_dir}/shards", kind="directory"),
]


@pytest.fixture
def scruffy(tmp_path, kit):
    lib = tmp_path / "scruffy-src"
    lib.mkdir()
    (lib / "scruffy.py").write_text(kit.FAKE_SCRUFFY)
    root = tmp_path / "queue"
    root.mkdir()
    return lib, root


def producer_run(kit, tmp_path, scruffy, mode="ok", run="run"):
    lib, _ = scruffy
    script = kit.workload(tmp_path, PRODUCER, "producer.py")
    profile = kit.basic_profile(tmp_path, f"PYTHONPATH: {lib}\n")
    return kit.staged(
        tmp_path,
        profile,
        script,
        python_args=[str(script), "{run_dir}", mode],
        run_dir=str(tmp_path / run),
        outputs=OUTPUTS,
    )


def events(root: Path) -> list[dict]:
    path = root / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def scruffy_env(root: Path) -> dict:
    return dict(os.environ, SCRUFFY_ROOT=str(root), SCRUFFY_JOB_ID="job-7")


def test_every_output_is_published_once_with_stable_ids(kit, tmp_path, scruffy):
    _, root = scruffy
    prepared = producer_run(kit, tmp_path, scruffy)
    done = kit.run_runner(prepared, env=scruffy_env(root))
    assert done.returncode == 0, done.stderr
    published = events(root)
    record = json.loads(Path(prepared.preflight_path).read_text())
    assert [e["id"] for e in published] == record["event_ids"]
    pubs = [kit.publication(e["payload"]) for e in published]
    assert [p["artifact_id"] for p in pubs] == ["model/final", "dataset/shards"]
    for event, pub in zip(published, pubs):
        assert event["kind"] == "workload.artifact" and event["job_id"] == "job-7"
        assert pub["manifest_path"] == pub["path"] + ".ready.json"
        assert len(pub["sha256"]) == 64
    record = json.loads(Path(prepared.preflight_path).read_text())
    assert record["state"] == "completed"
    assert record["outputs"] == ["model/final", "dataset/shards"]
    # Rerunning the same manifest republishes the same ids: the coordinator deduplicates.
    os.chmod(prepared.run_dir, 0o755)
    for name in ("model.bin", "model.bin.ready.json", "shards.ready.json"):
        p = Path(prepared.run_dir) / name
        os.chmod(p, 0o644)
        p.unlink()
    import shutil

    for p in Path(prepared.run_dir, "shards").iterdir():
        os.chmod(p, 0o644)
    shutil.rmtree(Path(prepared.run_dir) / "shards")
    assert kit.run_runner(prepared, env=scruffy_env(root)).returncode == 0
    assert len(events(root)) == 2  # the same bytes again: the same ids, deduplicated
    again = json.loads(Path(prepared.preflight_path).read_text())
    assert again["event_ids"] == record["event_ids"]


@pytest.mark.parametrize(
    "mode,expected", [("missing", "not published"), ("corrupt", "ready.json says")]
)
def test_a_bad_output_fails_the_run_before_any_event(kit, tmp_path, scruffy, mode, expected):
    _, root = scruffy
    done = kit.run_runner(producer_run(kit, tmp_path, scruffy, mode), env=scruffy_env(root))
    assert done.returncode == 78
    line = kit.failure(done.stderr)
    assert line["check"] == "outputs" and expected in line["error"]
    assert events(root) == []  # validated all first: not even the good one went out


@pytest.mark.parametrize("answer,code", [("reject", 77), ("timeout", 76)])
def test_rejected_and_unacknowledged_publications_have_their_exit_codes(
    kit, tmp_path, scruffy, answer, code
):
    _, root = scruffy
    (root / "mode").write_text(answer)
    done = kit.run_runner(producer_run(kit, tmp_path, scruffy), env=scruffy_env(root))
    assert done.returncode == code, done.stderr
    assert kit.failure(done.stderr)["check"] == "outputs"


def test_outputs_that_cannot_be_published_fail_before_the_workload_starts(kit, tmp_path, scruffy):
    _, root = scruffy
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCRUFFY_")}
    prepared = producer_run(kit, tmp_path, scruffy)
    done = kit.run_runner(prepared, env=env)
    assert done.returncode == 78
    line = kit.failure(done.stderr)
    assert line["check"] == "outputs" and "SCRUFFY_ROOT" in line["error"]
    assert not (Path(prepared.run_dir) / "model.bin").exists()  # the producer never ran

    (Path(scruffy[0]) / "scruffy.py").unlink()  # no client on the profile's PYTHONPATH
    prepared = producer_run(kit, tmp_path, scruffy, run="run2")
    done = kit.run_runner(prepared, env=scruffy_env(root))
    assert done.returncode == 78
    assert "Scruffy client" in kit.failure(done.stderr)["error"]
    assert not (Path(prepared.run_dir) / "model.bin").exists()


def make_outputs(tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"a" * 10)
    b.write_bytes(b"b" * 10)
    write_ready_manifest(a, artifact_id="x/a")
    write_ready_manifest(b, artifact_id="x/b")
    return [DeclaredOutput("x/a", str(a)), DeclaredOutput("x/b", str(b))]


def test_a_retry_after_a_partial_spool_reuses_ids_and_continues(tmp_path, kit):
    outputs = make_outputs(tmp_path)
    accepted: dict[str, dict] = {}

    def flaky(event, *, wait):
        assert wait is True
        if event.id in accepted:
            return  # the coordinator deduplicates
        if (
            kit.publication(event.payload)["artifact_id"] == "x/b"
            and "fail-once-done" not in accepted
        ):
            accepted["fail-once-done"] = {}
            raise ArtifactRejected("spool full")
        accepted[event.id] = event.payload

    with pytest.raises(ArtifactRejected):
        publish_outputs(outputs, flaky, job_id="j")
    first_ids = [k for k in accepted if k != "fail-once-done"]
    ids = publish_outputs(outputs, flaky, job_id="j")
    assert ids[0] == first_ids[0]  # the same id again: deduplicated
    assert len([k for k in accepted if k != "fail-once-done"]) == 2


def test_each_output_is_revalidated_just_before_its_event(tmp_path, kit):
    outputs = make_outputs(tmp_path)
    sent = []

    def tamper_then_send(event, *, wait):
        sent.append(kit.publication(event.payload)["artifact_id"])
        os.chmod(outputs[1].path, 0o644)
        with open(outputs[1].path, "ab") as f:
            f.write(b"late write")

    with pytest.raises(ValueError, match="x/b"):
        publish_outputs(outputs, tamper_then_send, job_id="j")
    assert sent == ["x/a"]


def test_validate_output_refuses_symlinks_wrong_ids_and_kinds(tmp_path):
    target = tmp_path / "real.bin"
    target.write_bytes(b"data")
    link = tmp_path / "link.bin"
    os.symlink(target, link)
    with pytest.raises(ValueError, match="symlink"):
        validate_output(DeclaredOutput("x/link", str(link)))
    write_ready_manifest(target, artifact_id="x/other")
    with pytest.raises(ValueError, match="x/other"):
        validate_output(DeclaredOutput("x/real", str(target)))
    with pytest.raises(ValueError, match="declared as a directory"):
        validate_output(DeclaredOutput("x/other", str(target), kind="directory"))
    record = validate_output(DeclaredOutput("x/other", str(target)))
    assert record["size"] == 4 and record["manifest_path"] == str(target) + ".ready.json"
