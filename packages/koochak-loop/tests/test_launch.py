"""``python -m koochak.loop.launch``: torch's launcher, exiting with the ranks' own status."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from koochak.loop.launch import workload_exit_code

DDP_SCRIPT = str(Path(__file__).with_name("test_ddp.py"))  # also the per-rank training script


@dataclass
class _Failure:
    exitcode: int
    timestamp: float


def test_the_first_failure_sets_the_exit_status_and_signals_are_128_plus_n():
    assert workload_exit_code({}) == 0
    # Rank 1 evacuated first; torch then stopped rank 0 with SIGTERM: that does not count.
    assert workload_exit_code({0: _Failure(-15, 2.0), 1: _Failure(75, 1.0)}) == 75
    assert workload_exit_code({0: _Failure(-9, 1.0)}) == 137
    assert workload_exit_code({3: _Failure(1, 5.0), 2: _Failure(2, 6.0)}) == 1


def _run(launcher: list[str], out_dir: Path, **env: str) -> subprocess.CompletedProcess:
    cmd = [*launcher, "--standalone", "--nproc-per-node=2", DDP_SCRIPT, "train", str(out_dir), "6"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env})  # fmt: skip


@pytest.mark.slow
def test_an_evacuation_exits_75_where_torchrun_exits_1(tmp_path):
    from koochak.loop.checkpoint import resolve_auto_resume

    launched = _run([sys.executable, "-m", "koochak.loop.launch"], tmp_path / "a", EVACUATE_AT="2")
    assert launched.returncode == 75, launched.stdout + launched.stderr
    assert re.search(r"rank [01] exited 75 \(evacuated", launched.stderr), launched.stderr
    _, checkpoint = resolve_auto_resume(tmp_path / "a")
    assert (checkpoint["reason"], checkpoint["next_step"]) == ("evacuation", 3)

    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    plain = _run([torchrun], tmp_path / "b", EVACUATE_AT="2")
    assert plain.returncode == 1  # what docs/checkpoints.md says plain torchrun does
