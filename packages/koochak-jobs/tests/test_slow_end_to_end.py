"""Slow end-to-end runs: real Inductor on CPU as a preflight check, and a real koochak-train
digits run started from a launch manifest by the runner."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from koochak.jobs import ConfigPatch, DeclaredOutput

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow
GCC, GXX = shutil.which("gcc"), shutil.which("g++")
needs_compilers = pytest.mark.skipif(not (GCC and GXX), reason="needs gcc and g++")


def compile_profile(kit, tmp_path, cxx, name="p.yaml"):
    return kit.basic_profile(
        tmp_path,
        f"CC: {GCC}\nCXX: {cxx}\n"
        'TORCHINDUCTOR_CACHE_DIR: "{run_dir}/inductor-cache"\n'
        'TRITON_CACHE_DIR: "{run_dir}/triton-cache"\n',
        'create_directories: ["{run_dir}/inductor-cache"]\n',
        "preflight: [c_compiler, torch_compile]\n",
        name=name,
    )


@needs_compilers
def test_torch_compile_with_inductor_on_cpu_passes_and_a_broken_cxx_fails_first(
    kit, tmp_path, marker
):
    script = kit.workload(tmp_path, f"open({str(marker)!r}, 'w').close()\n")
    prepared = kit.staged(tmp_path, compile_profile(kit, tmp_path, GXX), script)
    done = kit.run_runner(prepared, timeout=900)
    assert done.returncode == 0, done.stderr
    assert marker.exists()
    record = json.loads(Path(prepared.preflight_path).read_text())
    assert record["checks"] == ["c_compiler", "torch_compile"]
    assert record["observed"]["torch_compile"]["device"] == "cpu"
    assert record["observed"]["torch_compile"]["backend"] == "inductor"

    marker.unlink()
    broken = tmp_path / "g++"
    broken.write_text("#!/bin/sh\necho 'g++: internal compiler error' >&2\nexit 4\n")
    broken.chmod(0o755)
    prepared = kit.staged(
        tmp_path,
        compile_profile(kit, tmp_path, str(broken), "b.yaml"),
        script,
        run_dir=str(tmp_path / "broken"),
    )
    done = kit.run_runner(prepared, timeout=900)
    assert done.returncode == 78
    assert kit.failure(done.stderr)["check"] == "torch_compile"
    assert not marker.exists()


FAKE_SCRUFFY = """\
import json, os
def publish_event(root, job_id, event, *, wait, timeout):
    with open(os.path.join(root, "events.jsonl"), "a") as f:
        f.write(json.dumps(event) + "\\n")
    return "accepted"
"""


def test_a_real_digits_training_run_through_a_manifest(kit, tmp_path):
    lib = tmp_path / "scruffy-src"
    lib.mkdir()
    (lib / "scruffy.py").write_text(FAKE_SCRUFFY)
    queue = tmp_path / "queue"
    queue.mkdir()
    profile = kit.basic_profile(
        tmp_path,
        f"PYTHONPATH: {lib}\nOMP_NUM_THREADS: '1'\n",
        environment="secrets: [TRACKING_TOKEN]\n",
        tail="requirements:\n  packages: {torch: '*', sklearn: '*', scruffy: '*'}\n",
    )
    prepared = kit.staged(
        tmp_path,
        profile,
        None,
        name="digits-smoke",
        python_args=["-m", "koochak.loop.cli", "--config", "{config}"],
        cwd=str(REPO),
        base_config=REPO / "examples" / "digits" / "config.yaml",
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
    env = dict(
        os.environ,
        SCRUFFY_ROOT=str(queue),
        SCRUFFY_JOB_ID="digits-1",
        TRACKING_TOKEN="tok-digits-secret",
    )
    done = kit.run_runner(prepared, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = Path(prepared.run_dir)
    assert (run_dir / "log.csv").exists()  # the config's ${train.out_dir} resolved to the run
    assert (run_dir / "step000000012.pt.ready.json").exists()
    events = [json.loads(x) for x in (queue / "events.jsonl").read_text().splitlines()]
    ours = [e for e in events if e["source"] == "koochak.jobs.runner"]
    assert [e["payload"]["artifact_id"] for e in ours] == ["checkpoint/step000000012.pt"]
    # The loop published the same checkpoint itself: same job, id and digest, so the same
    # event id, which the coordinator deduplicates.
    loop_ids = {e["id"] for e in events if e["source"] != "koochak.jobs.runner"}
    assert ours[0]["id"] in loop_ids
    record = json.loads(Path(prepared.preflight_path).read_text())
    assert record["state"] == "completed" and record["outputs"] == ["checkpoint/step000000012.pt"]
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert b"tok-digits-secret" not in path.read_bytes(), path
    assert sys.executable == prepared.python
