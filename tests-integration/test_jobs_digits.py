"""koochak-jobs with koochak-loop: a real ``koochak-train`` digits run started from a launch
manifest by the isolated runner, and the examples/jobs submission script end to end.

Cross-package (torch, scikit-learn and koochak-loop besides koochak-jobs), so it lives here and
not in packages/koochak-jobs/tests, which must pass with only koochak-jobs' dependencies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from koochak.jobs import ConfigPatch, DeclaredOutput, load_environment_profile, prepare_run

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "jobs"
pytestmark = pytest.mark.slow

# A stand-in Scruffy client on the profile's PYTHONPATH, of the newer v1 keyword contract; every
# event appends to <root>/events.jsonl, a repeated id with another payload is a ReportConflict.
FAKE_SCRUFFY = """\
import json, os


class ReportConflict(Exception):
    pass


def publish_event(root, *, job_id, kind, data, event_id=None, occurred_at=None, source=None,
                  wait=False, timeout=None):
    root = str(root)
    record = {"id": event_id, "kind": kind, "job_id": job_id, "payload": data, "source": source}
    mode_file = os.path.join(root, "mode")
    mode = open(mode_file).read().strip() if os.path.exists(mode_file) else "accepted"
    if mode == "timeout":
        raise TimeoutError("no acknowledgement")
    if mode == "reject":
        return {"state": "rejected", "reason": "test rejects"}
    path = os.path.join(root, "events.jsonl")
    seen = {}
    if os.path.exists(path):
        for line in open(path):
            kept = json.loads(line)
            seen[kept["id"]] = kept
    if record["id"] in seen:
        if seen[record["id"]]["payload"] != record["payload"]:
            raise ReportConflict(f"event_id {record['id']!r} was already used for another report")
        return {"state": "accepted", "acknowledged": True, "deduplicated": True}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\\n")
    return {"state": "accepted", "acknowledged": True}
"""


def _profile(tmp_path: Path, scruffy_src: Path) -> Path:
    bin_dir = os.path.dirname(sys.executable)
    path = tmp_path / "profile.yaml"
    path.write_text(
        "version: 1\n"
        "id: digits-cpu\n"
        f"python: {sys.executable}\n"
        "environment:\n"
        "  set:\n"
        f'    PATH: "{bin_dir}:/usr/bin:/bin"\n'
        f"    PYTHONPATH: {scruffy_src}\n"
        '    OMP_NUM_THREADS: "1"\n'
        "  secrets: [TRACKING_TOKEN]\n"
        "requirements:\n"
        "  packages: {torch: '*', sklearn: '*', scruffy: '*'}\n"
    )
    return path


def test_a_real_digits_training_run_through_a_manifest(tmp_path):
    scruffy_src = tmp_path / "scruffy-src"
    scruffy_src.mkdir()
    (scruffy_src / "scruffy.py").write_text(FAKE_SCRUFFY)
    queue = tmp_path / "queue"
    queue.mkdir()
    prepared = prepare_run(
        name="digits-smoke",
        profile=load_environment_profile(_profile(tmp_path, scruffy_src)),
        python_args=["-m", "koochak.loop.cli", "--config", "{config}"],
        cwd=str(ROOT),
        run_dir=str(tmp_path / "run"),
        base_config=ROOT / "examples" / "digits" / "config.yaml",
        patches=[
            ConfigPatch("train.max_steps", 12),
            ConfigPatch("train.ckpt_every", 6),
            ConfigPatch("train.eval_every", 6),
            ConfigPatch("train.log_every", 6),
            ConfigPatch("train.device", "cpu"),
            ConfigPatch("optim.scheduler.warmup_steps", 2),
        ],
        outputs=[DeclaredOutput("checkpoint/step000000012.pt", "{run_dir}/step000000012.pt")],
    )
    prepared.stage()
    env = dict(
        os.environ,
        SCRUFFY_ROOT=str(queue),
        SCRUFFY_JOB_ID="digits-1",
        TRACKING_TOKEN="tok-digits-secret",
    )
    done = subprocess.run(
        list(prepared.runner_argv), env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = Path(prepared.run_dir)
    assert (run_dir / "log.csv").exists()  # the config's ${train.out_dir} resolved to the run
    assert (run_dir / "step000000012.pt.ready.json").exists()
    events = [json.loads(x) for x in (queue / "events.jsonl").read_text().splitlines()]
    record = json.loads((run_dir / "preflight.json").read_text())
    assert record["state"] == "completed" and record["outputs"] == ["checkpoint/step000000012.pt"]
    # The loop published that checkpoint itself, with the same id and the same payload: the
    # runner's event deduplicated (the stand-in refuses a repeated id with other content).
    [ours] = record["event_ids"]
    [event] = [e for e in events if e["id"] == ours]
    publication = event["payload"]["publication"]
    assert publication["artifact_id"] == "checkpoint/step000000012.pt"
    assert event["payload"]["step"] == 12
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert b"tok-digits-secret" not in path.read_bytes(), path


def test_the_example_submission_script_prepares_a_run_the_runner_accepts(tmp_path):
    run_dir = tmp_path / "digits"
    argv = [
        sys.executable,
        str(EXAMPLES / "submit_digits.py"),
        "--local",
        "--run-dir",
        str(run_dir),
        "--steps",
        "4",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
    again = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
    assert "already staged (identical)" in again.stdout
    runner_argv = done.stdout.strip().splitlines()[-1].split()
    assert runner_argv[1:4] == ["-I", "-m", "koochak.jobs.runner"]
    check = subprocess.run(
        [*runner_argv[:4], "--preflight-only", *runner_argv[4:]],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert check.returncode == 0, check.stderr
    record = json.loads((run_dir / "preflight.json").read_text())
    assert record["state"] == "passed" and record["preflight_only"] is True
    assert f"out_dir: {run_dir}" in (run_dir / "config.yaml").read_text()
