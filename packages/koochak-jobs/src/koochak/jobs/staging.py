"""Write-once staging of a prepared run's files (config, then the launch manifest last).

One writer, `stage_write_once`, serves both sides: `stage_run` (and so ``PreparedRun.stage()``
and the Scruffy backends) calls it on the shared filesystem, and the Pazuzu backend ships its
source to the execution side (`staging_program`), where it runs under ``python -I`` with only
the standard library. That is why it imports inside itself and names no module-level constant.

Each file is written under a hidden temp name in its own directory, made read-only (0444) and
fsynced *before* it becomes visible, hard-linked into place (a link never replaces) and the
directory fsynced. `LocalStore.put` does the same dance but publishes 0644 files and has no
"identical bytes are fine" rule; staging needs both, so it has this small writer of its own.
A rerun with identical bytes is a no-op (a loosened mode is re-hardened); different bytes, a
symlink or anything that is not a regular file in the way are refused with FileExistsError.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

__all__ = ["StagedFile", "stage_run", "stage_write_once", "staging_program"]


@dataclass(frozen=True, slots=True)
class StagedFile:
    """One file a run needs on the execution side before it starts (its config, its launch
    manifest): ``content`` to be written write-once at the absolute ``path``; ``sha256`` is
    the content's digest, checked again by the stager."""

    path: str
    content: bytes
    sha256: str


class _Staged(Protocol):
    """What staging needs of a run: a `PreparedRun`, or any `workflow.SubmittableRun` (this
    module stays below workflow, which imports `StagedFile` from here)."""

    @property
    def artifacts(self) -> Sequence[StagedFile]: ...


def stage_run(prepared: _Staged) -> list[str]:
    """Write ``prepared.artifacts`` in order (the manifest is last); return the paths written
    now (empty when everything was already staged with identical bytes)."""
    written = []
    for staged in prepared.artifacts:
        if stage_write_once(staged.path, staged.content, staged.sha256) == "written":
            written.append(staged.path)
    return written


def stage_write_once(path: str, data: bytes, sha256: str) -> str:
    """Write ``data`` at absolute ``path`` exactly once; ``"written"`` or ``"unchanged"``.

    The bytes must hash to ``sha256`` (else ValueError "artifact digest differs"). An existing
    regular file with the same bytes is a no-op (made 0444 again if its mode was loosened);
    different bytes raise FileExistsError ("refusing to replace different artifact"), and so
    do a symlink or any other non-regular file in the way ("refusing to stage over a
    non-regular file"). A new file goes to a temporary name in the same directory, is made
    read-only (0444) and fsynced, then hard-linked into place, which never replaces anything;
    a lost race re-checks what won.

    This function is also the remote staging program (`staging_program`): its source alone is
    shipped to the execution side, so it imports only the standard library, inside itself.
    """
    import errno
    import hashlib
    import os
    import stat

    mode = 0o444
    # koochak.storage.keys.TEMP_PREFIX, spelled out (a test keeps the two equal): LocalStore's
    # list() hides such names, so a crashed stager's leftover never shows up as an object.
    temp_prefix = ".koochak-tmp-"

    actual = hashlib.sha256(data).hexdigest()
    if actual != sha256:
        raise ValueError(f"{path}: artifact digest differs: expected {sha256}, got {actual}")
    if not os.path.isabs(path):
        raise ValueError(f"{path}: artifact path must be absolute")
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)

    def already_staged() -> bool:
        """False when nothing is at ``path``, True when a regular file with ``data`` is."""
        try:
            # O_NONBLOCK: a FIFO in the way must not block this open.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise FileExistsError(
                    f"{path}: refusing to stage over a non-regular file (a symlink)"
                ) from None
            if exc.errno == errno.ENXIO:
                raise FileExistsError(
                    f"{path}: refusing to stage over a non-regular file (a socket)"
                ) from None
            raise
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise FileExistsError(f"{path}: refusing to stage over a non-regular file")
            theirs = hashlib.sha256()
            while chunk := os.read(fd, 1 << 20):
                theirs.update(chunk)
            if theirs.hexdigest() != sha256:
                raise FileExistsError(
                    f"{path}: refusing to replace different artifact (different content: on "
                    f"disk sha256 {theirs.hexdigest()}, staging {sha256})"
                )
            if stat.S_IMODE(info.st_mode) != mode:
                os.fchmod(fd, mode)
        finally:
            os.close(fd)
        return True

    if already_staged():
        return "unchanged"
    temp = os.path.join(
        parent, f"{temp_prefix}{os.urandom(16).hex()}-{os.path.basename(path)[:100]}"
    )
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, mode)  # whatever the umask did
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(temp, path)
        except FileExistsError:
            # Lost a race with a concurrent stager: fine if it staged the same bytes.
            if already_staged():
                return "unchanged"
            raise FileExistsError(
                f"{path}: another stager created and removed it meanwhile; stage again"
            ) from None
    finally:
        try:
            os.unlink(temp)
        except OSError:
            pass
    dir_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return "written"


@lru_cache(maxsize=1)
def staging_program() -> str:
    """The program ``python -I -c PROGRAM PATH SHA256`` runs remotely, the bytes on stdin:
    `stage_write_once`'s own source, then a call that prints its result or one error line."""
    body = textwrap.dedent(inspect.getsource(stage_write_once))
    return body + textwrap.dedent(
        """
        import sys
        try:
            print(stage_write_once(sys.argv[1], sys.stdin.buffer.read(), sys.argv[2]))
        except Exception as exc:
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
            sys.exit(1)
        """
    )
