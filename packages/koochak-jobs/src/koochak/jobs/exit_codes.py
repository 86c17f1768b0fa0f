"""The runner's exit codes (``koochak-run`` / ``python -I -m koochak.jobs.runner``).

A scheduler maps them to its own outcomes: 75 and 76 are retryable (the workload stopped with
its checkpoint safe), 77 and 78 are not, 64 is a broken submission.
"""

from __future__ import annotations

# 76 and 77 are the loop's too (koochak-train under Scruffy): one definition, in koochak.events.
from koochak.events.errors import EXIT_CHECKPOINT_ACK_TIMEOUT, EXIT_PUBLICATION_REJECTED

__all__ = [
    "EXIT_CHECKPOINT_ACK_TIMEOUT",
    "EXIT_EVACUATED",
    "EXIT_OK",
    "EXIT_PREFLIGHT_FAILED",
    "EXIT_PUBLICATION_REJECTED",
    "EXIT_USAGE",
    "exit_code_for_signal",
]

EXIT_OK = 0
EXIT_USAGE = 64  # wrong arguments (EX_USAGE)
EXIT_EVACUATED = 75  # SIGUSR1 before the workload started, or the workload's own evacuation exit
EXIT_PREFLIGHT_FAILED = 78  # a preflight or contract check failed (one JSON line on stderr)


def exit_code_for_signal(signum: int) -> int:
    """128 + N, the shell's convention for "killed by signal N"."""
    return 128 + signum
