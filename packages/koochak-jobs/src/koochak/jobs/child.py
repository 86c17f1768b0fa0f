"""The managed workload: one child in its own process group, signals forwarded to that group.

The runner installs `Signals` before anything else, so a SIGUSR1 (evacuation request) or
SIGTERM that arrives while checks run is remembered and the workload is never started. Once
the child runs, each signal is forwarded with ``killpg`` to the child's group only, never to
the runner's own group (which, under Slurm, may be the whole allocation step).

When the leader exits, nothing it started may outlive it: the runner is a child subreaper
(Linux), so every orphaned descendant, also one that left the group with ``setsid()`` (a
daemon's double fork), is reparented to the runner. `terminate_leftovers` finds them as the
runner's own children (from ``/proc``; only processes that were not its children before the
workload started), together with anything left in the leader's group, and ends them: SIGTERM,
then SIGKILL after a grace period, round after round as their own children are reparented in
turn. Only direct children are signalled by pid: their pids cannot be reused until the runner
reaps them. The workload is started with a parent-death signal, so a runner killed with SIGKILL
takes the workload's leader with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from types import FrameType
from typing import Any

__all__ = [
    "FORWARDED_SIGNALS",
    "Signals",
    "become_subreaper",
    "children_now",
    "run_managed",
    "terminate_leftovers",
]

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


def _process_table() -> dict[int, tuple[str, int]] | None:
    """``pid -> (state, parent pid)`` for every process, from ``/proc``; None without it."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    table = {}
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after it.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) >= 2:
            table[int(name)] = (fields[0].decode("ascii", "replace"), int(fields[1]))
    return table


def children_now() -> frozenset[int]:
    """This process's children at this moment (empty where there is no ``/proc``)."""
    me = os.getpid()
    table = _process_table() or {}
    return frozenset(pid for pid, (_, ppid) in table.items() if ppid == me)


def _live_children(known: Collection[int]) -> list[int] | None:
    """This process's children outside ``known``, with the exited ones reaped; None where
    there is no ``/proc``."""
    table = _process_table()
    if table is None:
        return None
    me = os.getpid()
    live = []
    for pid, (state, ppid) in table.items():
        if ppid != me or pid in known:
            continue
        if state == "Z":
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            continue
        live.append(pid)
    return live


def _group_alive(group: int) -> bool:
    while True:  # collect exited members reparented to us, so they do not count as alive
        try:
            pid, _ = os.waitpid(-group, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal(pid: int, signum: int, group: bool = False) -> None:
    try:
        (os.killpg if group else os.kill)(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def terminate_leftovers(group: int | None, known: Collection[int] = ()) -> list[int]:
    """End what the workload left running; return the pids found (empty: nothing was left).

    ``group`` is the leader's process group (None after a check, which has none); ``known`` are
    this process's children from before, which are left alone. SIGTERM first; after
    ``_GRACE_S`` SIGKILL to whatever is still there or appears, for another ``_GRACE_S`` at
    most (a process stuck in the kernel is reported, not waited for). Without ``/proc`` only
    the group is seen. Never blocks longer than twice the grace period.
    """
    found: list[int] = []
    saw_group = group_termed = False
    termed: set[int] = set()
    term_until = kill_until = None
    while True:
        pids = _live_children(known) or []
        group_alive = group is not None and _group_alive(group)
        if not pids and not group_alive:
            # Without /proc the group's members are not listed: report the group itself.
            return found or ([group] if saw_group and group is not None else [])
        found += [pid for pid in pids if pid not in found]
        saw_group = saw_group or group_alive
        now = time.monotonic()
        term_until = now + _GRACE_S if term_until is None else term_until
        if now < term_until:
            for pid in pids:
                if pid not in termed:
                    _signal(pid, signal.SIGTERM)
                    termed.add(pid)
            if group_alive and not group_termed:
                _signal(group, signal.SIGTERM, group=True)  # type: ignore[arg-type]
                group_termed = True
        else:
            kill_until = now + _GRACE_S if kill_until is None else kill_until
            if now > kill_until:  # could not be quiesced: the caller fails closed all the same
                return found or ([group] if saw_group and group is not None else [])
            for pid in pids:
                _signal(pid, signal.SIGKILL)
            if group_alive:
                _signal(group, signal.SIGKILL, group=True)  # type: ignore[arg-type]
        time.sleep(0.02)


def run_managed(
    argv: Sequence[str], *, cwd: str, env: Mapping[str, str], signals: Signals
) -> tuple[int, list[int]]:
    """Run ``argv`` as the leader of a new process group; return ``(returncode, left_behind)``.

    ``returncode`` is Popen's (negative N for "killed by signal N"); ``left_behind`` lists the
    pids of descendants that outlived the leader (in its group, or reparented to this process
    after leaving it) and had to be terminated. Call `become_subreaper` first, or orphans that
    left the group are reparented to init instead and stay out of reach.
    """
    known = children_now()
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
        terminate_leftovers(proc.pid, known)
        proc.wait()
        raise
    left_behind = terminate_leftovers(proc.pid, known)
    signals.child_group = None
    return returncode, left_behind
