"""``python -m koochak.loop.launch``: torch's launcher, exiting with the ranks' own status."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from koochak.loop.launch import SignalHold, first_cause, signal_caught, workload_exit_code

DDP_SCRIPT = str(Path(__file__).with_name("test_ddp.py"))  # also the per-rank training script
RANK_SCRIPT = str(Path(__file__).with_name("launch_rank.py"))


@dataclass
class _Failure:
    exitcode: int
    timestamp: float
    pid: int = 0


def test_the_first_failure_sets_the_exit_status_and_signals_are_128_plus_n():
    assert workload_exit_code({}) == 0
    # Rank 1 evacuated first; torch then stopped rank 0 with SIGTERM: that does not count.
    assert workload_exit_code({0: _Failure(-15, 2.0, pid=9), 1: _Failure(75, 1.0)}, {9}) == 75
    assert workload_exit_code({0: _Failure(-9, 1.0)}) == 137
    assert workload_exit_code({3: _Failure(1, 5.0), 2: _Failure(2, 6.0)}) == 1


def test_a_rank_killed_by_a_signal_is_the_cause_even_in_the_same_poll():
    # The issue's case: kill -9 of rank 1; rank 0's collective fails; torch's whole-second
    # timestamps tie. The signal decides, whichever rank sorts first.
    killed = {0: _Failure(1, 7.0, pid=100), 1: _Failure(-9, 7.0, pid=101)}
    assert first_cause(killed) == (1, killed[1]) and workload_exit_code(killed) == 137
    # A rank killed later than another rank's own failure still names the signal.
    assert workload_exit_code({0: _Failure(1, 7.0), 1: _Failure(-9, 8.0)}) == 137
    # Of two signals, the first in time; then the lower rank.
    assert workload_exit_code({0: _Failure(-6, 9.0), 1: _Failure(-9, 8.0)}) == 137
    assert first_cause({0: _Failure(-6, 8.0), 1: _Failure(-9, 8.0)})[0] == 0


def test_ranks_the_launcher_stopped_do_not_count():
    # Rank 1 evacuated (or failed its GPU check); torch then stopped rank 0 with SIGTERM in the
    # same second: the stop is torch's, the exit code the workload's.
    for code in (75, 79, 1):
        failures = {0: _Failure(-15, 3.0, pid=200), 1: _Failure(code, 3.0, pid=201)}
        assert workload_exit_code(failures, stopped={200}) == code
        assert first_cause(failures, stopped={200})[0] == 1
    # Everything that failed was stopped (the launcher itself was signalled): report it anyway.
    assert workload_exit_code({0: _Failure(-15, 3.0, pid=200)}, stopped={200}) == 143


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


_HANDLES_LATE = (
    "import signal, sys, time\n"
    "time.sleep(1.5)  # still starting: SIGUSR1 would kill it\n"
    "signal.signal(signal.SIGUSR1, lambda *a: sys.exit(75))\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
    "sys.exit(3)\n"
)


def test_signal_caught_reads_the_handler_table():
    child = _child(_HANDLES_LATE)
    try:
        assert signal_caught(child.pid, signal.SIGUSR1) is False
        assert child.stdout.readline() == "ready\n"
        assert signal_caught(child.pid, signal.SIGUSR1) is True
        assert signal_caught(child.pid, signal.SIGUSR2) is False
    finally:
        child.kill()
        child.wait()
    assert signal_caught(child.pid, signal.SIGUSR1) is None  # gone


def test_a_signal_for_a_child_still_starting_is_held_until_it_can_take_it(capfd):
    child = _child(_HANDLES_LATE)
    hold = SignalHold(children=lambda: [child.pid] if child.poll() is None else [])
    try:
        hold.request(signal.SIGUSR1)  # what the launcher's handler does, at once
        assert child.wait(timeout=30) == 75  # not -SIGUSR1: it got it once it handled it
    finally:
        hold.close()
        if child.poll() is None:
            child.kill()
    assert "SIGUSR1 held for 1 rank(s) still starting" in capfd.readouterr().err


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


def _launch(out_dir: Path, steps: int, *options: str, **env: str) -> subprocess.Popen:
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "koochak.loop.launch", "--standalone", "--nproc-per-node=2",
           *options, RANK_SCRIPT, str(out_dir), str(steps)]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **env})  # fmt: skip


def _wait_for(*paths: Path, proc: subprocess.Popen, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while not all(p.exists() for p in paths):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{paths} never appeared"
        time.sleep(0.05)


@pytest.mark.slow
def test_kill_9_of_rank_1_exits_137(tmp_path):
    # Rank 0 waits in the all-reduce for rank 1, so rank 1's death fails its collective at once;
    # a 2 s monitor interval puts both in one poll, with equal (whole-second) timestamps.
    launcher = _launch(tmp_path, 100000, "--monitor-interval=2", STEP_DELAY="0.5", SLOW_RANK="1")
    try:
        _wait_for(tmp_path / "stepped-0", tmp_path / "stepped-1", proc=launcher)
        os.kill(int((tmp_path / "pid-1").read_text()), signal.SIGKILL)
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 137, err
    assert "rank 1 exited 137 (killed by SIGKILL); exiting 137" in err


@pytest.mark.slow
def test_an_evacuation_asked_for_while_the_ranks_start_exits_75(tmp_path):
    from koochak.loop.checkpoint import resolve_auto_resume

    # 50 steps of 0.1 s: the run is still going when the held request is delivered.
    launcher = _launch(tmp_path, 50, STARTUP_DELAY="3", STEP_DELAY="0.1")
    try:
        _wait_for(tmp_path / "pid-0", tmp_path / "pid-1", proc=launcher)  # alive, no handler yet
        launcher.send_signal(signal.SIGUSR1)
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 75, err
    assert "SIGUSR1 held for 2 rank(s) still starting" in err
    _, checkpoint = resolve_auto_resume(tmp_path)
    assert checkpoint["reason"] == "evacuation" and checkpoint["next_step"] < 50


@pytest.mark.slow
def test_kill_9_of_the_launcher_takes_its_ranks(tmp_path):
    """Each rank has its own session, so nothing but the tie reaches them."""
    launcher = _launch(tmp_path, 100000, STEP_DELAY="0.2")
    try:
        _wait_for(tmp_path / "stepped-0", tmp_path / "stepped-1", proc=launcher)
        ranks = [int((tmp_path / f"pid-{r}").read_text()) for r in (0, 1)]
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 30
        while not all(map(_gone, ranks)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(map(_gone, ranks)), "ranks outlived the launcher"
    finally:
        for pid in ranks:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" in f.read()
    except FileNotFoundError:
        return True
