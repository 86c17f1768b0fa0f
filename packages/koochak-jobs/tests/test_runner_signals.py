"""Real signals through the real runner: forwarding to the workload's process group only,
evacuation before the workload starts, and descendants left behind by the leader."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def wait_for(path: Path, proc: subprocess.Popen, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def start_runner(prepared) -> subprocess.Popen:
    return subprocess.Popen(
        list(prepared.runner_argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        process_group=0,  # the runner leads its own group, like a job step
    )


WAITS_FOR_USR1 = """\
import signal, sys, time
got = []
signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
open(sys.argv[1], "w").close()
deadline = time.monotonic() + 60
while not got and time.monotonic() < deadline:
    time.sleep(0.01)
open(sys.argv[2], "w").write("evacuating")
sys.exit(75)
"""


def test_sigusr1_reaches_the_workload_group_and_never_the_runners_own(kit, tmp_path):
    ready, evacuated, hit = tmp_path / "ready", tmp_path / "evacuated", tmp_path / "bystander-hit"
    script = kit.workload(tmp_path, WAITS_FOR_USR1)
    prepared = kit.staged(
        tmp_path,
        kit.basic_profile(tmp_path),
        script,
        python_args=[str(script), str(ready), str(evacuated)],
    )
    runner = start_runner(prepared)
    bystander_ready = tmp_path / "bystander-ready"
    bystander = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, sys, time\n"
            f"signal.signal(signal.SIGUSR1, lambda *a: open({str(hit)!r}, 'w').close())\n"
            f"open({str(bystander_ready)!r}, 'w').close()\ntime.sleep(120)\n",
        ],
        process_group=runner.pid,  # a sibling in the runner's group: the "parent allocation"
    )
    try:
        wait_for(ready, runner)
        wait_for(bystander_ready, bystander)
        os.kill(runner.pid, signal.SIGUSR1)
        out, err = runner.communicate(timeout=60)
    finally:
        bystander.kill()
        bystander.wait()
    assert runner.returncode == 75, err
    assert evacuated.read_text() == "evacuating"
    assert not hit.exists()


def test_sigterm_is_forwarded_and_a_killed_workload_gives_128_plus_n(kit, tmp_path):
    ready = tmp_path / "ready"
    script = kit.workload(
        tmp_path, "import sys, time\nopen(sys.argv[1], 'w').close()\ntime.sleep(120)\n"
    )
    prepared = kit.staged(
        tmp_path, kit.basic_profile(tmp_path), script, python_args=[str(script), str(ready)]
    )
    runner = start_runner(prepared)
    wait_for(ready, runner)
    os.kill(runner.pid, signal.SIGTERM)
    runner.communicate(timeout=60)
    assert runner.returncode == 128 + signal.SIGTERM
    record = json.loads(Path(prepared.preflight_path).read_text())
    assert record["child_returncode"] == 128 + signal.SIGTERM


def test_sigusr1_before_the_workload_starts_exits_75_without_starting_it(kit, tmp_path, marker):
    lib = tmp_path / "lib"
    lib.mkdir()
    importing = tmp_path / "importing"
    (lib / "slowpkg.py").write_text(
        f"import time\nopen({str(importing)!r}, 'w').close()\ntime.sleep(2)\n__version__ = '1'\n"
    )
    script = kit.workload(tmp_path, f"open({str(marker)!r}, 'w').close()\n")
    profile = kit.basic_profile(
        tmp_path, f"PYTHONPATH: {lib}\n", tail="requirements:\n  packages: {slowpkg: '1'}\n"
    )
    prepared = kit.staged(tmp_path, profile, script)
    runner = start_runner(prepared)
    wait_for(importing, runner)  # the runner is busy with its package check
    os.kill(runner.pid, signal.SIGUSR1)
    out, err = runner.communicate(timeout=60)
    assert runner.returncode == 75, err
    assert not marker.exists()
    assert json.loads(Path(prepared.preflight_path).read_text())["state"] == "evacuated"


LEAVES_GRANDCHILD = """\
import subprocess, sys
child = subprocess.Popen(["sleep", "300"])
open(sys.argv[1], "w").write(str(child.pid))
sys.exit(0)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_leader_that_leaves_descendants_fails_closed_and_they_are_terminated(kit, tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    script = kit.workload(tmp_path, LEAVES_GRANDCHILD)
    prepared = kit.staged(
        tmp_path, kit.basic_profile(tmp_path), script, python_args=[str(script), str(pid_file)]
    )
    done = kit.run_runner(prepared)
    grandchild = int(pid_file.read_text())
    assert done.returncode == 78, done.stderr
    line = kit.failure(done.stderr)
    assert line["check"] == "descendants" and "background descendants" in line["error"]
    assert not alive(grandchild)
    record = json.loads(Path(prepared.preflight_path).read_text())
    assert record["state"] == "failed" and record["check"] == "descendants"
    assert record["child_returncode"] == 0


def test_a_signal_to_the_runners_whole_group_during_a_check_is_an_evacuation(kit, tmp_path, marker):
    """A scheduler that signals the runner's group also kills the check's subprocess; that is
    an evacuation (75), not a failed check (78)."""
    lib = tmp_path / "lib"
    lib.mkdir()
    importing = tmp_path / "importing"
    (lib / "slowpkg.py").write_text(
        f"import time\nopen({str(importing)!r}, 'w').close()\ntime.sleep(30)\n__version__ = '1'\n"
    )
    script = kit.workload(tmp_path, f"open({str(marker)!r}, 'w').close()\n")
    profile = kit.basic_profile(
        tmp_path, f"PYTHONPATH: {lib}\n", tail="requirements:\n  packages: {slowpkg: '1'}\n"
    )
    prepared = kit.staged(tmp_path, profile, script)
    runner = start_runner(prepared)
    wait_for(importing, runner)
    os.killpg(runner.pid, signal.SIGUSR1)
    out, err = runner.communicate(timeout=60)
    assert runner.returncode == 75, err
    assert not marker.exists()
    assert json.loads(Path(prepared.preflight_path).read_text())["state"] == "evacuated"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_a_runner_killed_hard_takes_its_workload_with_it(kit, tmp_path):
    ready = tmp_path / "ready"
    script = kit.workload(
        tmp_path,
        "import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\ntime.sleep(300)\n",
    )
    prepared = kit.staged(
        tmp_path, kit.basic_profile(tmp_path), script, python_args=[str(script), str(ready)]
    )
    runner = start_runner(prepared)
    wait_for(ready, runner)
    while not ready.read_text():
        time.sleep(0.01)
    workload = int(ready.read_text())
    os.kill(runner.pid, signal.SIGKILL)
    runner.wait(timeout=60)
    deadline = time.monotonic() + 30
    while alive(workload) and time.monotonic() < deadline:
        time.sleep(0.05)
    survived = alive(workload)
    if survived:
        os.kill(workload, signal.SIGKILL)
    assert not survived
