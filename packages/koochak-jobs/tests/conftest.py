"""A tiny real prepared run for the workflow and backend tests.

``koochak.jobs``' backends need only what ``koochak.jobs.workflow.SubmittableRun`` names: a
name, a cwd, the runner argv (its first item the Python) and the artifacts to stage (path,
bytes, sha256), plus the declared outputs. ``Run`` below is such a run, built from real files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from pathlib import Path

import pytest


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
