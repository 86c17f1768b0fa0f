"""What to kill: a trainer under `uv run` or the launcher dies with it, even on kill -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# A parent that starts one child and waits; the child ties itself to it (or not) and sleeps.
PARENT = textwrap.dedent("""
    import os, subprocess, sys
    env = dict(os.environ)
    if sys.argv[1] == "launcher":
        env["KOOCHAK_LAUNCHER_PID"] = str(os.getpid())
    elif sys.argv[1] == "uv":  # this parent's executable is the "uv" the child sees
        env["UV"] = sys.executable
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2]], env=env)
    print(child.pid, flush=True)
    child.wait()
""")
CHILD = textwrap.dedent("""
    import importlib.util, time
    spec = importlib.util.spec_from_file_location("parent_death", {path!r})
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    print("tied" if module.tie_to_parent() else "free", flush=True)
    time.sleep(60)
""")
MODULE = Path(__file__).parents[1] / "src" / "koochak" / "loop" / "parent_death.py"


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" in f.read()
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize(("parent", "tied"), [("launcher", True), ("uv", True), ("shell", False)])
def test_a_trainer_dies_with_the_launcher_or_uv_that_waits_for_it(parent, tied):
    env = {k: v for k, v in os.environ.items() if k not in ("UV", "KOOCHAK_LAUNCHER_PID")}
    proc = subprocess.Popen([sys.executable, "-c", PARENT, parent, CHILD.format(path=str(MODULE))],
                            stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    child = int(proc.stdout.readline())
    try:
        assert proc.stdout.readline().strip() == ("tied" if tied else "free")
        proc.kill()  # kill -9: nothing can forward a signal
        proc.wait()
        deadline = time.monotonic() + (10 if tied else 1)
        while not _gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(child) is tied
    finally:
        if not _gone(child):
            os.kill(child, signal.SIGKILL)

