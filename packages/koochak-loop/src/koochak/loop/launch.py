"""``python -m koochak.loop.launch [torchrun options] (-m module | script) [args ...]``: torchrun
whose exit status is the workload's.

Plain ``torchrun`` turns any rank's non-zero exit into ``ChildFailedError`` and exits 1, so an
evacuation (every rank publishes, then exits 75) reaches Slurm or Scruffy as a failure, not a
requeue; and SIGUSR1 sent to torchrun itself kills it (the signal's default action), orphaning
the ranks. This launcher is torch's own launcher (``torch.distributed.run``, which drives
``torch.distributed.launcher.api.elastic_launch``) with the same options, plus two things:

- it exits with the ranks' status: 0 when every rank succeeded, else the exit code of the first
  rank to fail (torch's "root cause"; the ranks torch then stops with SIGTERM do not count), a
  rank killed by signal N as 128+N; so an evacuation exits 75;
- SIGUSR1 and SIGUSR2 sent to the launcher are forwarded to the ranks (torch starts each in its
  own session, so a signal to the launcher's process group does not reach them); a rank that
  also got the signal directly (``scancel --signal=USR1`` signals the whole step) just records
  the request twice.

SIGTERM/SIGINT/SIGHUP/SIGQUIT keep torch's handling (stop the ranks); the launcher then exits
128+N. Exit codes and the Slurm recipe: docs/checkpoints.md.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["FORWARDED_SIGNALS", "launch", "main", "workload_exit_code"]

FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
_PROG = "python -m koochak.loop.launch"


def workload_exit_code(failures: Mapping[int, Any]) -> int:
    """The launch's exit status from torch's per-rank failures (``ProcessFailure``: ``exitcode``,
    ``timestamp``): 0 with none; else the first failure's code, or 128+N for signal N."""
    if not failures:
        return 0
    first = min(failures.values(), key=lambda failure: failure.timestamp)
    code = int(first.exitcode)
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
        if int(fields[1]) == pid:
            children.append(int(entry))
    return children


def _forward(signum: int, frame: Any) -> None:
    for pid in _children(os.getpid()):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def launch(argv: Sequence[str]) -> int:
    """Parse torchrun's arguments from ``argv``, run the ranks, return the exit status."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    parser = torchrun.get_args_parser()
    parser.prog = _PROG
    args = parser.parse_args(list(argv))
    previous = {signum: signal.signal(signum, _forward) for signum in FORWARDED_SIGNALS}
    try:
        torchrun.run(args)
    except ChildFailedError as exc:
        code = workload_exit_code(exc.failures)
        rank = min(exc.failures.items(), key=lambda item: item[1].timestamp)[0]
        print(f"{_PROG}: rank {rank} exited {code}{_meaning(code)}; exiting {code}",
              file=sys.stderr, flush=True)  # fmt: skip
        return code
    except SignalException as exc:  # torch stopped the ranks on SIGTERM/SIGINT/...
        return 128 + int(exc.sigval)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 0


def _meaning(code: int) -> str:
    if code == 75:
        return " (evacuated; the same command resumes)"
    try:
        return f" (killed by {signal.Signals(code - 128).name})" if code > 128 else ""
    except ValueError:  # not a signal this platform names
        return ""


def main(argv: Sequence[str] | None = None) -> int:
    return launch(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
