"""Shared helpers: real profile files, prepared and staged runs, the runner as a subprocess;
and, for the workflow and backend tests, a tiny real run of exactly what
``koochak.jobs.workflow.SubmittableRun`` names (``Run`` below, built from real files)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from koochak.jobs import load_environment_profile, prepare_run

PYTHON = sys.executable
BIN = os.path.dirname(PYTHON)
PATH = f"{BIN}:/usr/bin:/bin"


def write_profile(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def basic_profile(
    tmp_path: Path, extra_set: str = "", environment: str = "", tail: str = "", name="p.yaml"
) -> Path:
    """A minimal valid profile for this machine. ``extra_set`` holds more ``NAME: value`` lines
    for ``environment.set``, ``environment`` more keys of ``environment`` (``secrets: [X]``),
    ``tail`` top-level YAML (``requirements:``, ``preflight:``), all written unindented."""
    lines = [
        "version: 1",
        "id: test-cpu",
        f"python: {PYTHON}",
        "environment:",
        "  set:",
        f'    PATH: "{PATH}"',
        '    PYTHONUNBUFFERED: "1"',
    ]
    lines += ["    " + line for line in textwrap.dedent(extra_set).splitlines() if line.strip()]
    lines += ["  " + line for line in textwrap.dedent(environment).splitlines() if line.strip()]
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n" + textwrap.dedent(tail), encoding="utf-8")
    return path


def workload(tmp_path: Path, code: str, name: str = "work.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(code), encoding="utf-8")
    return path


def staged(tmp_path: Path, profile: Path, script: Path, **kwargs):
    prepared = prepare_run(
        name=kwargs.pop("name", "t1"),
        profile=load_environment_profile(profile),
        python_args=kwargs.pop("python_args", None) or [str(script)],
        cwd=kwargs.pop("cwd", str(tmp_path)),
        run_dir=kwargs.pop("run_dir", str(tmp_path / "run")),
        **kwargs,
    )
    prepared.stage()
    return prepared


def run_runner(prepared, *extra: str, env=None, timeout=120, **popen):
    """The runner exactly as a scheduler starts it (``python -I -m koochak.jobs.runner``)."""
    argv = [*prepared.runner_argv[:4], *extra, *prepared.runner_argv[4:]]
    return subprocess.run(
        argv,
        env=env if env is not None else dict(os.environ),
        capture_output=True,
        text=True,
        timeout=timeout,
        **popen,
    )


def failure(stderr: str) -> dict:
    """The runner's one JSON failure line."""
    lines = [line for line in stderr.splitlines() if line.startswith("{")]
    assert len(lines) == 1, stderr
    return json.loads(lines[0])


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    """A file the workload creates first thing: its absence proves user code never started."""
    return tmp_path / "user-code-started"


@pytest.fixture
def kit():
    """These helpers as a namespace (test modules cannot import conftest in importlib mode)."""
    return sys.modules[__name__]


# A stand-in Scruffy client of the newer v1 contract, publish_event(root, *, job_id, kind, data,
# event_id, occurred_at, source, wait, timeout) -> {"state": ...}. Events append to <root>/events.jsonl as {id, kind, job_id,
# payload, source}; <root>/mode answers accepted (default), reject or timeout. A repeated id
# with the same payload deduplicates; with another payload it is a ReportConflict.
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


def publication(payload: dict) -> dict:
    """The publication record of an artifact event's payload."""
    return payload["publication"]


# ----------------------------------------------------------------- a tiny SubmittableRun


@dataclasses.dataclass(frozen=True)
class Artifact:
    path: str
    content: bytes
    sha256: str


@dataclasses.dataclass(frozen=True)
class Output:
    artifact_id: str
    provenance: dict | None


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    cwd: str
    runner_argv: tuple[str, ...]
    artifacts: tuple[Artifact, ...]
    outputs: tuple[Output, ...] = ()


def artifact(path: Path | str, content: bytes) -> Artifact:
    return Artifact(str(path), content, hashlib.sha256(content).hexdigest())


def make_run(run_dir: Path, name: str = "train", program: str = "print('hi')\n", outputs=()) -> Run:
    """A run that stages `program.py` and a manifest naming its digest under run_dir, and
    whose runner argv checks the manifest digest and then runs the program."""
    prog = artifact(run_dir / "program.py", program.encode())
    manifest = artifact(
        run_dir / "launch.json", f'{{"program_sha256": "{prog.sha256}"}}\n'.encode()
    )
    return Run(
        name=name,
        cwd=str(run_dir),
        runner_argv=(sys.executable, "-I", prog.path, manifest.path, manifest.sha256),
        artifacts=(prog, manifest),
        outputs=tuple(outputs),
    )


@pytest.fixture
def run_factory():
    return make_run


@pytest.fixture
def artifact_factory():
    return artifact


@pytest.fixture
def output_factory():
    return Output
