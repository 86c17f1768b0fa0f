"""examples/jobs: the site-neutral profile loads, and the submission script prepares a digits
run whose manifest the runner accepts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from koochak.jobs import load_environment_profile

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "jobs"


def test_the_example_profile_is_valid_and_site_neutral():
    profile = load_environment_profile(EXAMPLES / "environment.yaml")
    assert profile.preflight == ("c_compiler", "cuda", "torch_compile")
    assert profile.secrets == ("TRACKING_TOKEN",)
    for path in EXAMPLES.iterdir():
        if path.is_file():
            text = path.read_text()
            assert not re.search(r"/(home|scratch|gpfs|lustre|users?)/", text), path
            assert not re.search(r"\b[a-z0-9-]+\.(edu|org|com|net)\b", text), path


@pytest.mark.slow
def test_the_submission_script_prepares_a_run_the_runner_accepts(tmp_path):
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
