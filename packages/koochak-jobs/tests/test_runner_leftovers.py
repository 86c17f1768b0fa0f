"""Nothing the workload (or a check) starts outlives the runner: a daemon that double-forks out
of the workload's process group with setsid() is found as an orphan reparented to the runner,
terminated, and the run fails closed (78) as for descendants left in the group."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="a child subreaper and /proc are Linux"
)

# Fork; the child calls setsid() (a new session and group) and forks again; the grandchild
# execs a long sleep with its output away from the runner's pipes; the middle one writes the
# daemon's pid and exits, so the daemon is an orphan. Nothing in the group is left.
DAEMONIZE = """\
import os, sys

def daemonize(pid_file):
    if os.fork() == 0:
        os.setsid()
        pid = os.fork()
        if pid == 0:
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.execv("/bin/sleep", ["sleep", "300"])
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(pid))
        os.rename(pid_file + ".tmp", pid_file)
        os._exit(0)
    os.wait()
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def daemons():
    """Pids to kill after the test, whatever happened (a failing test must not leak one)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def daemon_pid(path: Path, daemons: list[int]) -> int:
    pid = int(path.read_text())
    daemons.append(pid)
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:  # SIGTERM takes a moment to land
        time.sleep(0.02)
    return pid


@pytest.mark.parametrize("exit_code", [0, 3])
def test_a_daemon_that_left_the_group_is_terminated_and_fails_the_run(
    kit, tmp_path, daemons, exit_code
):
    pid_file = tmp_path / "daemon.pid"
    script = kit.workload(tmp_path, DAEMONIZE + f"daemonize(sys.argv[1])\nsys.exit({exit_code})\n")
    prepared = kit.staged(
        tmp_path, kit.basic_profile(tmp_path), script, python_args=[str(script), str(pid_file)]
    )
    done = kit.run_runner(prepared)
    pid = daemon_pid(pid_file, daemons)
    assert not alive(pid), "the daemon outlived the runner"
    record = json.loads(Path(prepared.preflight_path).read_text())
    assert record["child_returncode"] == exit_code
    if exit_code == 0:
        assert done.returncode == 78, done.stderr
        line = kit.failure(done.stderr)
        assert line["check"] == "descendants" and "background descendants" in line["error"]
        assert "setsid" in line["error"] and str(pid) in line["error"]
        assert record["state"] == "failed" and record["check"] == "descendants"
    else:  # the workload's own failure stays the outcome; the cleanup is a notice
        assert done.returncode == exit_code, done.stderr
        notice = json.loads([ln for ln in done.stderr.splitlines() if ln.startswith("{")][-1])
        assert notice["kind"] == "managed_workload_notice" and str(pid) in notice["error"]


def test_a_package_that_starts_a_daemon_when_imported_fails_its_check(
    kit, tmp_path, daemons, marker
):
    lib = tmp_path / "lib"
    lib.mkdir()
    pid_file = tmp_path / "daemon.pid"
    (lib / "spawner.py").write_text(
        DAEMONIZE + f"daemonize({str(pid_file)!r})\n__version__ = '1'\n"
    )
    script = kit.workload(tmp_path, f"open({str(marker)!r}, 'w').close()\n")
    profile = kit.basic_profile(
        tmp_path, f"PYTHONPATH: {lib}\n", tail="requirements:\n  packages: {spawner: '1'}\n"
    )
    done = kit.run_runner(kit.staged(tmp_path, profile, script))
    pid = daemon_pid(pid_file, daemons)
    assert done.returncode == 78, done.stderr
    line = kit.failure(done.stderr)
    assert line["check"] == "requirements.packages"
    assert "left background processes running" in line["error"] and str(pid) in line["error"]
    assert not alive(pid) and not marker.exists()


@pytest.mark.skipif(not shutil.which("gcc"), reason="needs gcc")
@pytest.mark.parametrize("compiles", [True, False])
def test_a_compiler_wrapper_that_leaves_a_daemon_fails_the_c_compiler_check(
    kit, tmp_path, daemons, marker, compiles
):
    """Whether the wrapper then compiles or fails, its daemon does not outlive the runner."""
    pid_file = tmp_path / "daemon.pid"
    cc = tmp_path / "cc"
    then = (
        f"os.execv({shutil.which('gcc')!r}, ['gcc', *sys.argv[1:]])\n"
        if compiles
        else "sys.exit('cc: license server unreachable')\n"
    )
    cc.write_text(f"#!{sys.executable}\n" + DAEMONIZE + f"daemonize({str(pid_file)!r})\n" + then)
    cc.chmod(0o755)
    script = kit.workload(tmp_path, f"open({str(marker)!r}, 'w').close()\n")
    profile = kit.basic_profile(tmp_path, f"CC: {cc}\n", tail="preflight: [c_compiler]\n")
    done = kit.run_runner(kit.staged(tmp_path, profile, script))
    pid = daemon_pid(pid_file, daemons)
    assert done.returncode == 78, done.stderr
    line = kit.failure(done.stderr)
    assert line["check"] == "c_compiler"
    if compiles:
        assert "left background processes running" in line["error"]
    else:
        assert "license server unreachable" in line["error"]
    assert not alive(pid) and not marker.exists()
