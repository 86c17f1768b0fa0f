"""A prepared run is one run on every attempt (issue 35, defects 5 and 6): koochak-run of the same
manifest twice and re-staging the same prepared run exit 0 and resume; a resubmission after its
node is lost, logging to another run directory, resumes the same run from the durable tier and
ends bit-identical to a run that was never interrupted."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from koochak.jobs import ConfigPatch, prepare_run

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "jobs"
pytestmark = pytest.mark.slow


def _submit(run_dir: Path) -> tuple[str, str, subprocess.CompletedProcess]:
    argv = [sys.executable, str(EXAMPLES / "submit_digits.py"), "--local", "--run-dir",
            str(run_dir), "--steps", "4"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    _, manifest, _, sha = done.stdout.splitlines()[0].split()
    return manifest, sha, done


def _koochak_run(manifest: str, sha: str) -> subprocess.CompletedProcess:
    tool = os.path.join(os.path.dirname(sys.executable), "koochak-run")
    return subprocess.run([tool, manifest, sha], capture_output=True, text=True, timeout=600)


def test_a_prepared_run_retried_twice_and_restaged_exits_0_and_resumes(tmp_path):
    run_dir = tmp_path / "digits"
    manifest, sha, _ = _submit(run_dir)
    staged = (run_dir / "config.yaml").read_bytes()
    first = _koochak_run(manifest, sha)
    assert first.returncode == 0, first.stderr[-2000:]
    assert (run_dir / "config.yaml").read_bytes() == staged  # the pinned file is never rewritten
    assert (run_dir / "config.resolved.yaml").is_file()  # the resolved config goes beside it
    again = _koochak_run(manifest, sha)  # a Slurm requeue, a Scruffy retry
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed_from=" in again.stdout
    _, _, restaged = _submit(run_dir)  # staging the same prepared run again
    assert "already staged (identical)" in restaged.stdout
    third = _koochak_run(manifest, sha)
    assert third.returncode == 0, third.stderr[-2000:]


def _local_profile():
    spec = importlib.util.spec_from_file_location("submit_digits", EXAMPLES / "submit_digits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.local_profile()


def _prepared(name: str, run_dir: Path, node_local: Path, durable: Path):
    return prepare_run(
        name=name,
        profile=_local_profile(),
        python_args=["-m", "koochak.loop.cli", "--config", "{config}"],
        cwd=str(ROOT),
        run_dir=str(run_dir),
        base_config=str(ROOT / "examples" / "digits" / "config.yaml"),
        patches=[
            ConfigPatch("train.max_steps", 400),
            ConfigPatch("train.ckpt_every", 20),
            ConfigPatch("train.eval_every", 0),
            ConfigPatch("train.device", "cpu"),
            ConfigPatch("train.evacuation_enabled", True),
            ConfigPatch("train.checkpoint_dir", f"{node_local}/{{node}}"),
            ConfigPatch("train.checkpoint_replicas", [str(durable)]),
        ],
    )


def _final_model(durable: Path) -> dict:
    from koochak.loop.checkpoint import resolve_auto_resume

    found = resolve_auto_resume(durable)
    assert found is not None and found.checkpoint["step"] == 400
    return found.checkpoint["model"]


def test_a_resubmission_after_node_loss_to_another_run_dir_resumes_the_same_run(tmp_path):
    # The run, never interrupted: what the resubmitted run must equal, bit for bit.
    straight = _prepared(
        "digits-straight", tmp_path / "s", tmp_path / "s-local", tmp_path / "s-durable"
    )
    straight.stage()
    done = subprocess.run(list(straight.runner_argv), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    # The same run on a node that is lost mid-run: evacuated (exit 75) after a durable commit.
    attempt = _prepared("digits-lost", tmp_path / "a1", tmp_path / "local", tmp_path / "durable")
    attempt.stage()
    live = subprocess.Popen(list(attempt.runner_argv), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not list((tmp_path / "durable").glob("step*.pt.ready.json")):
            assert live.poll() is None, live.communicate()[1][-2000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        live.send_signal(signal.SIGUSR1)
        out, err = live.communicate(timeout=300)
    finally:
        if live.poll() is None:
            live.kill()
            live.wait()
    assert live.returncode == 75, err[-2000:]
    shutil.rmtree(tmp_path / "local")  # the node and its node-local first tier are gone
    # Resubmitted on another node, logging to another run directory: the same run.
    again = _prepared("digits-lost", tmp_path / "a2", tmp_path / "local", tmp_path / "durable")
    again.stage()
    done = subprocess.run(list(again.runner_argv), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resumed_from=" in done.stdout
    expected, resumed = _final_model(tmp_path / "s-durable"), _final_model(tmp_path / "durable")
    assert expected.keys() == resumed.keys()
    assert all(torch.equal(expected[k], resumed[k]) for k in expected)
