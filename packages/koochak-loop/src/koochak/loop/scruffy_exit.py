"""koochak-train's exit for a strict checkpoint publication that Scruffy did not accept.

`koochak.events` raises `ArtifactAckTimeout` (exit 76, retryable: the numbered checkpoint stays
published for ``resume: auto``) or `ArtifactRejected` (exit 77, fail closed) from the checkpoint
hook; the CLI then prints one JSON line on stderr naming the reason, the checkpoint path and
the event id, and exits with that code. koochak-events is an optional extra, so it is imported
only here, when training has already failed.
"""

from __future__ import annotations

import sys


def checkpoint_exit_code(exc: BaseException) -> int | None:
    """The exit code for ``exc`` when it is (or was caused by) a checkpoint publication failure,
    after printing its JSON line on stderr; None for any other error."""
    try:
        from koochak.events import artifact_failure
    except ImportError:
        return None
    failure = artifact_failure(exc)
    if failure is None:
        return None
    print(failure.exit_line(), file=sys.stderr, flush=True)
    return failure.exit_code
