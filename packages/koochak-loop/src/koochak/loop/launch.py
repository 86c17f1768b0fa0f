"""``python -m koochak.loop.launch [torchrun options] (-m module | script) [args ...]``: torchrun
whose exit status is the workload's.

Plain ``torchrun`` turns any rank's non-zero exit into ``ChildFailedError`` and exits 1, so an
evacuation (every rank publishes, then exits 75) reaches Slurm or Scruffy as a failure, not a
requeue; and SIGUSR1 sent to torchrun itself kills it (the signal's default action), orphaning
the ranks. This launcher is torch's own launcher (``torch.distributed.run``, which drives
``torch.distributed.launcher.api.elastic_launch``) with the same options, plus four things:

- it exits with the ranks' status (`workload_exit_code`): 0 when every rank succeeded; else, of
  the ranks that failed on their own (not those the launcher then stopped), the first that died
  of a signal N as 128+N (a ``kill -9`` or an OOM kill is 137 even when another rank's failed
  collective lands in the same poll), else the first failure in time; so an evacuation exits 75
  and a GPU-health stop 79;
- SIGUSR1 and SIGUSR2 sent to the launcher are forwarded to the ranks (torch starts each in its
  own session, so a signal to the launcher's process group does not reach them); a rank that
  also got the signal directly (``scancel --signal=USR1`` signals the whole step) just records
  the request twice;
- such a signal is held for a rank that cannot take it yet (still starting: it has no handler for
  it, so the signal's default action would kill it) and delivered as soon as the rank installs
  one (`SignalHold`); an evacuation asked for during start-up therefore still ends in 75. A rank
  that never handles it (``train.evacuation_enabled`` false) never gets it;
- it sets ``KOOCHAK_LAUNCHER_PID`` for the ranks, so a ``koochak-train`` rank dies with the
  launcher even when the launcher is killed with SIGKILL (`koochak.loop.parent_death`).

SIGTERM/SIGINT/SIGHUP/SIGQUIT keep torch's handling (stop the ranks with the same signal); the
launcher then exits 128+N. Exit codes, what to kill and the Slurm recipe: docs/loop.md and
docs/checkpoints.md.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from koochak.loop.parent_death import LAUNCHER_PID_ENV

__all__ = [
    "FORWARDED_SIGNALS",
    "SignalHold",
    "first_cause",
    "launch",
    "main",
    "signal_caught",
    "workload_exit_code",
]

FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
_PROG = "python -m koochak.loop.launch"
_HOLD_POLL_S = 0.1  # while ranks start (the first _HOLD_FAST_S after a request)
_HOLD_FAST_S = 60.0
_HOLD_POLL_SLOW_S = 1.0  # then, for a rank that never takes the signal


def first_cause(
    failures: Mapping[int, Any], stopped: Collection[int] = ()
) -> tuple[int, Any] | None:
    """The rank whose failure the launch reports, and that failure, from torch's per-rank
    failures (``ProcessFailure``: ``exitcode``, negative for a signal; ``timestamp``; ``pid``).

    The failures of ``stopped`` (pids the launcher itself stopped after the first failure) do not
    count, unless nothing else failed. Of the rest, the first (by time, then rank) that died of a
    signal; else the first failure in time. Torch's timestamps are whole seconds, so a killed
    rank and the rank whose collective failed because of it often tie: the signal decides.
    """
    if not failures:
        return None
    own = {r: f for r, f in failures.items() if getattr(f, "pid", None) not in stopped}
    candidates = own or dict(failures)
    signalled = {r: f for r, f in candidates.items() if int(f.exitcode) < 0}
    pool = signalled or candidates
    return min(pool.items(), key=lambda item: (item[1].timestamp, item[0]))


def workload_exit_code(failures: Mapping[int, Any], stopped: Collection[int] = ()) -> int:
    """The launch's exit status (see `first_cause`): 0 with no failure; 128+N for a rank that
    died of signal N; else that rank's exit code (75 evacuated, 79 GPU health, 1 an error)."""
    cause = first_cause(failures, stopped)
    if cause is None:
        return 0
    code = int(cause[1].exitcode)
    return 128 - code if code < 0 else code


def _children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (Linux: /proc)."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        # Field 4 is the parent; the command name (field 2) may hold spaces and parentheses.
        fields = stat[stat.rindex(b")") + 2 :].split()
        if int(fields[1]) == pid and fields[0] != b"Z":
            children.append(int(entry))
    return children


def signal_caught(pid: int, signum: int) -> bool | None:
    """Whether process ``pid`` can take ``signum`` without dying of it: it has a handler for it,
    or ignores it (Linux: ``SigCgt``/``SigIgn`` of /proc/PID/status). None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return None
    if fields.get("State", "").strip().startswith("Z"):
        return None  # exited, not reaped yet
    bit = 1 << (signum - 1)
    return any(int(fields.get(key, "0").strip() or "0", 16) & bit for key in ("SigCgt", "SigIgn"))


class SignalHold:
    """Forwards signals to the ranks, holding each one for a rank until it can take it.

    `request` (the launcher's signal handler: it only queues) hands ``signum`` to a thread that
    delivers it to every child that handles it, and to each other child (one still starting, or
    one started later by a restart) once that child installs a handler, until `close`. Each child
    gets each request once; one line on stderr says when a request is held.
    """

    def __init__(self, children: Callable[[], list[int]] | None = None) -> None:
        self._children = children or (lambda: _children(os.getpid()))
        self._requests: queue.SimpleQueue[int] = queue.SimpleQueue()  # safe in a signal handler
        self._pending: dict[int, set[int]] = {}  # signum -> pids that got it (the thread's own)
        self._thread = threading.Thread(target=self._run, name="koochak-signal-hold", daemon=True)
        self._thread.start()

    def request(self, signum: int, frame: Any = None) -> None:
        self._requests.put(signum)

    def _run(self) -> None:
        since = time.monotonic()  # of the last request: polls slow down after _HOLD_FAST_S
        while True:
            fast = time.monotonic() - since < _HOLD_FAST_S
            wait = _HOLD_POLL_S if fast else _HOLD_POLL_SLOW_S
            try:
                signum = self._requests.get(timeout=wait if self._pending else None)
            except queue.Empty:
                signum = 0
            if signum < 0:
                return
            if signum:
                self._pending[signum] = set()
                since = time.monotonic()
            held = self._deliver()
            if signum and held:
                print(f"{_PROG}: {signal.Signals(signum).name} held for {len(held)} rank(s) "
                      "still starting; each gets it once it can take it", file=sys.stderr,
                      flush=True)  # fmt: skip

    def _deliver(self) -> list[int]:
        """Send each pending signal to the children that can take it; the pids still held."""
        held = []
        for pid in self._children():
            for signum, sent in self._pending.items():
                if pid in sent:
                    continue
                caught = signal_caught(pid, signum)
                if caught is None:
                    continue  # exited meanwhile
                if not caught:
                    held.append(pid)
                    continue
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass
                sent.add(pid)
        return held

    def close(self) -> None:
        self._requests.put(-1)
        self._thread.join(timeout=5)


@contextmanager
def _recording_stops() -> Iterator[set[int]]:
    """The pids of the ranks torch stops itself (still running when it closes the ranks after
    the first failure, or on a signal to the launcher): their deaths are not the cause."""
    stopped: set[int] = set()
    try:
        from torch.distributed.elastic.multiprocessing.api import SubprocessContext
    except ImportError:  # another torch: the timestamps alone decide
        yield stopped
        return
    original = SubprocessContext.close

    def close(self: Any, *args: Any, **kwargs: Any) -> None:
        for local_rank in set(getattr(self, "_running_local_ranks", ())):
            handler = getattr(self, "subprocess_handlers", {}).get(local_rank)
            proc = getattr(handler, "proc", None)
            if proc is not None and proc.poll() is None:
                stopped.add(proc.pid)
        original(self, *args, **kwargs)

    SubprocessContext.close = close  # type: ignore[method-assign]
    try:
        yield stopped
    finally:
        SubprocessContext.close = original  # type: ignore[method-assign]


def launch(argv: Sequence[str]) -> int:
    """Parse torchrun's arguments from ``argv``, run the ranks, return the exit status."""
    # The hold first: a SIGUSR1 while torch imports is held too, not the launcher's death.
    hold = SignalHold()
    previous = {signum: signal.signal(signum, hold.request) for signum in FORWARDED_SIGNALS}
    try:
        from torch.distributed import run as torchrun
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        parser = torchrun.get_args_parser()
        parser.prog = _PROG
        args = parser.parse_args(list(argv))
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # ranks die with it (tie_to_parent)
        with _recording_stops() as stopped:
            try:
                torchrun.run(args)
            except ChildFailedError as exc:
                cause = first_cause(exc.failures, stopped)
                code = workload_exit_code(exc.failures, stopped)
                rank = cause[0] if cause is not None else "?"
                print(f"{_PROG}: rank {rank} exited {code}{_meaning(code)}; exiting {code}",
                      file=sys.stderr, flush=True)  # fmt: skip
                return code
            except SignalException as exc:  # torch stopped the ranks on SIGTERM/SIGINT/...
                return 128 + int(exc.sigval)
    finally:
        hold.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 0


def _meaning(code: int) -> str:
    if code == 75:
        return " (evacuated; the same command resumes)"
    if code == 79:
        return " (GPU health check failed)"
    try:
        return f" (killed by {signal.Signals(code - 128).name})" if code > 128 else ""
    except ValueError:  # not a signal this platform names
        return ""


def main(argv: Sequence[str] | None = None) -> int:
    return launch(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
