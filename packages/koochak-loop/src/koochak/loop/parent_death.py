"""A trainer that dies with the parent that only waits for it.

``uv run koochak-train`` and ``python -m koochak.loop.launch`` each start the trainer as a child
and wait for it. Stopping them with SIGTERM works (uv forwards it; the launcher stops its ranks
with it), but a SIGKILL (``kill -9``, the OOM killer, a job's cgroup being torn down part-way)
ends only the parent, and the trainer runs on as an orphan, holding its GPU, its checkpoint
directory and, under the launcher, its peers in a collective: each rank has a session of its
own, so killing the launcher's process group misses the ranks.

`tie_to_parent` asks the kernel (Linux ``PR_SET_PDEATHSIG``) to send this process SIGTERM when
its parent dies, but only when that parent is one of these two waiters: the koochak launcher
(it sets ``KOOCHAK_LAUNCHER_PID`` for its ranks) or ``uv run`` (the parent's executable is the
``UV`` that uv sets). A trainer started from a shell (``nohup koochak-train ... &``) is never
tied: its shell may exit long before it. ``koochak-train`` calls it first thing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["LAUNCHER_PID_ENV", "tie_to_parent"]

LAUNCHER_PID_ENV = "KOOCHAK_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def _waiting_parent(ppid: int) -> bool:
    if os.environ.get(LAUNCHER_PID_ENV) == str(ppid):
        return True
    uv = os.environ.get("UV")
    if not uv:
        return False
    try:
        return os.path.realpath(f"/proc/{ppid}/exe") == os.path.realpath(uv)
    except OSError:
        return False


def tie_to_parent(signum: int = signal.SIGTERM) -> bool:
    """End this process with ``signum`` when its parent dies, if that parent is the koochak
    launcher or ``uv run``; True when tied. A no-op (False) elsewhere and off Linux."""
    if not sys.platform.startswith("linux"):
        return False
    ppid = os.getppid()
    if ppid <= 1 or not _waiting_parent(ppid):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != ppid:  # the parent died before the request took effect
        os.kill(os.getpid(), signum)
    return True
