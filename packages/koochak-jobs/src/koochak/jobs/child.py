"""The managed workload: one child in its own process group, signals forwarded to that group.

The runner installs `Signals` before anything else, so a SIGUSR1 (evacuation request) or
SIGTERM that arrives while checks run is remembered and the workload is never started. Once
the child runs, each signal is forwarded with ``killpg`` to the child's group only, never to
the runner's own group (which, under Slurm, may be the whole allocation step).

When the leader exits, anything left in its group is terminated (SIGTERM, then SIGKILL) and
reported, so a stray data-loader or server never outlives the job unnoticed. On Linux the
runner is a child subreaper, so orphaned descendants are reparented to it and reaped here, and
the workload is started with a parent-death signal, so a runner killed with SIGKILL takes the
workload's leader with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Any

__all__ = ["FORWARDED_SIGNALS", "Signals", "run_managed"]

FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
_GRACE_S = 2.0


class Signals:
    """Remembers signals until a child exists, then forwards each to the child's group."""

    def __init__(self) -> None:
        self.pending: list[int] = []
        self.forwarded: list[int] = []
        self.child_group: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        for signum in FORWARDED_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.child_group is None:
            self.pending.append(signum)
        else:
            self._forward(signum)

    def _forward(self, signum: int) -> None:
        try:
            os.killpg(self.child_group, signum)  # type: ignore[arg-type]
        except ProcessLookupError:
            return  # the group is already gone; nothing left to tell
        self.forwarded.append(signum)


_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl  # noqa: B018 - fails here, not in a forked child, where there is none
        return libc
    except (OSError, AttributeError):
        return None


def become_subreaper() -> bool:
    """Ask Linux to reparent orphaned descendants to this process; False where unsupported."""
    libc = _libc()
    return libc is not None and libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def _die_with_runner() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the workload get SIGKILL if the runner dies (Linux): a
    runner killed hard must not leave a training job holding the node's GPUs."""
    libc = _libc()
    if libc is None:
        return None
    runner = os.getpid()

    def preexec() -> None:  # runs in the forked child, before exec: no allocation, no imports
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != runner:  # the runner died before prctl took effect
            os._exit(128 + signal.SIGKILL)

    return preexec


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reap(group: int) -> None:
    """Collect exited members of ``group`` that were reparented to us (never blocks)."""
    while True:
        try:
            pid, _ = os.waitpid(-group, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _wait_gone(group: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while True:
        _reap(group)
        if not _group_alive(group):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def terminate_group(group: int) -> bool:
    """SIGTERM then SIGKILL whatever remains in ``group``; True if anything was there."""
    _reap(group)
    if not _group_alive(group):
        return False
    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(group, signum)
        except ProcessLookupError:
            break
        if _wait_gone(group, _GRACE_S):
            break
    return True


def run_managed(
    argv: Sequence[str], *, cwd: str, env: Mapping[str, str], signals: Signals
) -> tuple[int, bool]:
    """Run ``argv`` as the leader of a new process group; return ``(returncode, left_behind)``.

    ``returncode`` is Popen's (negative N for "killed by signal N"); ``left_behind`` is True
    when descendants outlived the leader and had to be terminated.
    """
    # preexec_fn is safe here: the runner has no other threads.
    proc = subprocess.Popen(
        list(argv), cwd=cwd, env=dict(env), start_new_session=True, preexec_fn=_die_with_runner()
    )
    signals.child_group = proc.pid  # a session leader's group id is its pid, and stays so
    for signum in signals.pending:  # arrived while Popen was starting the child
        signals._forward(signum)
    signals.pending.clear()
    try:
        returncode = proc.wait()
    except BaseException:
        terminate_group(proc.pid)
        proc.wait()
        raise
    left_behind = terminate_group(proc.pid)
    signals.child_group = None
    return returncode, left_behind
