"""A named secret's value never lands on disk or in the logs of a real run: the isolated runner
starts ``koochak-train`` as a Scruffy job (the stub's 0.1.1 client, spooling reports), the
workload's exception message holds the token, and neither the runner's output, koochak-train's
error line, ``preflight.json``, the Scruffy reports (the ``failed`` phase event) nor any other
file written holds it or a fragment of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from koochak.jobs import load_environment_profile, prepare_run

pytestmark = pytest.mark.slow
STUB_DIR = Path(__file__).resolve().parent / "scruffy_stub"
TOKEN = 'trk-"9Zq\\Lw-7f3e1c"-2b'
FRAGMENTS = (TOKEN, json.dumps(TOKEN)[1:-1], repr(TOKEN)[1:-1], "9Zq", "7f3e1c")

USER = """
import os

import torch


def make_model(cfg):
    return torch.nn.Linear(2, 1)


def dataset(cfg, start_step=0):
    while True:
        yield torch.ones(2, 2), torch.ones(2, 1)


def leaky_step(model, batch, ctx):
    if ctx.step == 2:
        raise RuntimeError("tracker refused token " + repr(os.environ["TRACKING_TOKEN"]))
    x, y = batch
    return {"loss": ((model(x) - y) ** 2).mean()}
"""


def test_a_workload_exception_holding_the_token_is_masked_everywhere(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "secret_user.py").write_text(USER)
    (project / "cfg.yaml").write_text(
        textwrap.dedent("""
        train: {max_steps: 5, device: cpu, progress_bar: false}
        optim: {optimizer: {name: sgd, lr: 0.1}}
        logging: {stdout: true}
        entry: {model: "secret_user:make_model", dataset: "secret_user:dataset",
                step: "secret_user:leaky_step"}
        """)
    )
    bin_dir = os.path.dirname(sys.executable)
    profile = tmp_path / "profile.yaml"
    profile.write_text(
        "version: 1\n"
        "id: secrets-e2e\n"
        f"python: {sys.executable}\n"
        "environment:\n"
        "  set:\n"
        f'    PATH: "{bin_dir}:/usr/bin:/bin"\n'
        f"    PYTHONPATH: {STUB_DIR}\n"
        '    OMP_NUM_THREADS: "1"\n'
        "  secrets: [TRACKING_TOKEN]\n"
        "requirements:\n"
        "  packages: {scruffy: '*'}\n"
    )
    prepared = prepare_run(
        name="secrets",
        profile=load_environment_profile(profile),
        python_args=["-m", "koochak.loop.cli", "--config", "{config}", "--resume", "none"],
        cwd=str(project),
        run_dir=str(tmp_path / "run"),
        base_config=str(project / "cfg.yaml"),
    )
    prepared.stage()
    root = tmp_path / "scruffy-root"
    root.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCRUFFY_")}
    env.update(
        TRACKING_TOKEN=TOKEN,
        SCRUFFY_ROOT=str(root),
        SCRUFFY_JOB_ID="job-secrets",
        SCRUFFY_STUB_CONTRACT="0.1.1",
    )
    done = subprocess.run(
        list(prepared.runner_argv), env=env, capture_output=True, text=True, timeout=600
    )
    output = done.stdout + done.stderr
    assert done.returncode == 1, output  # the workload's own failure, passed through
    error_lines = [ln for ln in done.stderr.splitlines() if ln.startswith("koochak-train:")]
    assert len(error_lines) == 1 and "tracker refused token" in error_lines[0], output
    assert "[masked TRACKING_TOKEN]" in error_lines[0]

    reports = [json.loads(p.read_text()) for p in (root / "reports").rglob("*.json")]
    (failed,) = [
        r["data"]
        for r in reports
        if r["kind"] == "workload.phase" and r["data"]["status"] == "failed"
    ]
    assert failed["error_type"] == "RuntimeError"
    assert failed["message"].startswith("tracker refused token '[masked TRACKING_TOKEN]'")
    assert json.loads(Path(prepared.preflight_path).read_text())["child_returncode"] == 1

    written = [Path(d, f) for d, _, files in os.walk(tmp_path) for f in files]
    assert any(p.name == "preflight.json" for p in written)
    for fragment in FRAGMENTS:
        assert fragment not in output, fragment
        for path in written:
            assert fragment.encode() not in path.read_bytes(), (fragment, path)
