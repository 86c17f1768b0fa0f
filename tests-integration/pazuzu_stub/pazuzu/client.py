"""``PazuzuClient`` with a local transport: every command runs here under ``bash -c``.

The real client sends each call over a Unix socket to the gateway, which runs it on the
cluster's login node; the replies, limits and errors here are the same, so code that works
against this stub sends the same commands and bytes to a real gateway.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import posixpath
import shlex
from pathlib import Path
from typing import Any

from .errors import CommandTimedOut, PazuzuError
from .slurm import (
    SlurmHandle,
    SlurmJob,
    SlurmStatus,
    parse_submission,
    render_slurm_script,
    validate_job_id,
)

STDIN_LIMIT = 4 * 1024 * 1024
_OUTPUT_LIMIT = 4 * 1024 * 1024  # per stream, then truncated (the gateway's message bound)


@dataclasses.dataclass(frozen=True)
class CommandResult:
    exit_code: int
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    connection_generation: int
    replayed: bool = False

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _default_socket() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(cache, "pazuzu", "gateway.sock").expanduser().resolve()


def _decode(data: bytes) -> tuple[str, bool]:
    return data[:_OUTPUT_LIMIT].decode("utf-8", "replace"), len(data) > _OUTPUT_LIMIT


class PazuzuClient:
    def __init__(self, socket_path: str | os.PathLike[str] | None = None) -> None:
        self.socket_path = (
            Path(socket_path).expanduser().resolve()
            if socket_path is not None
            else _default_socket()
        )
        self.calls: list[tuple[str, str]] = []  # (op, command): what a gateway would have run

    async def _exec(
        self, op: str, command: str, stdin: bytes | str, timeout: float
    ) -> CommandResult:
        if isinstance(stdin, str):
            stdin = stdin.encode("utf-8")
        if len(stdin) > STDIN_LIMIT:
            raise ValueError(
                f"stdin is {len(stdin)} bytes; at most {STDIN_LIMIT} bytes are allowed"
            )
        self.calls.append((op, command))
        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", command,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )  # fmt: skip
        try:
            out, err = await asyncio.wait_for(proc.communicate(stdin), timeout)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            raise CommandTimedOut(f"command timed out after {timeout} s") from None
        stdout, out_cut = _decode(out)
        stderr, err_cut = _decode(err)
        return CommandResult(proc.returncode, stdout, stderr, out_cut, err_cut, 1)

    async def health(self, *, probe: bool = True, timeout: float = 90.0) -> dict[str, Any]:
        return {"gateway": "stub", "connection": "local", "host": "localhost", "generation": 1,
                "session_healthy": True, "last_error": None, "consecutive_failures": 0,
                "retry_in_seconds": None}  # fmt: skip

    async def reconnect(self) -> dict[str, Any]:
        return await self.health()

    async def run(
        self, command: str, *, stdin: bytes | str = b"", timeout: float = 120.0
    ) -> CommandResult:
        return await self._exec("run", command, stdin, timeout)

    async def read(
        self, command: str, *, stdin: bytes | str = b"", timeout: float = 120.0
    ) -> CommandResult:
        return await self._exec("read", command, stdin, timeout)

    async def run_script(
        self, interpreter: str, source: str, *, arguments=(), timeout: float = 120.0
    ) -> CommandResult:
        if not interpreter or "\0" in interpreter:
            raise ValueError("interpreter must be a non-empty str without NUL")
        command = shlex.join([interpreter, "-", *arguments])
        return await self._exec("run", command, source, timeout)

    async def slurm_queue(self) -> CommandResult:
        return await self.read('squeue -u "$USER"')

    async def inspect_slurm_job(self, job_id: str) -> CommandResult:
        return await self.read(f"scontrol show job -o {shlex.quote(validate_job_id(job_id))}")

    async def submit_slurm(self, job: SlurmJob) -> SlurmHandle:
        if not isinstance(job, SlurmJob):
            raise TypeError("job must be a SlurmJob")
        command = f"mkdir -p -- {shlex.quote(job.log_dir)} && sbatch --parsable"
        result = await self.run(command, stdin=render_slurm_script(job), timeout=30.0)
        if result.exit_code != 0:
            detail = result.stderr.strip() or result.stdout.strip() or "no remote error output"
            raise PazuzuError(f"sbatch failed with exit {result.exit_code}: {detail}")
        return parse_submission(result.stdout, job)

    async def slurm_status(self, job_id: str) -> SlurmStatus:
        job_id = validate_job_id(job_id)
        queue = await self.read(f"squeue -h -j {job_id} -o '%i|%T|%M|%l|%R'")
        for line in queue.stdout.splitlines():
            fields = line.strip().split("|")
            if len(fields) == 5 and fields[0].split("_", 1)[0] == job_id:
                return SlurmStatus(
                    job_id,
                    fields[1],
                    "squeue",
                    elapsed=fields[2],
                    time_limit=fields[3],
                    reason=fields[4],
                )
        acct = await self.read(
            f"sacct -n -P -X -j {job_id} --format=JobIDRaw,State,Elapsed,ExitCode"
        )
        if acct.exit_code != 0:
            raise PazuzuError(f"sacct failed with exit {acct.exit_code}: {acct.stderr.strip()}")
        for line in acct.stdout.splitlines():
            fields = line.strip().split("|")
            if len(fields) == 4 and fields[0] == job_id:
                state = fields[1].split()[0].rstrip("+") if fields[1].split() else "UNKNOWN"
                return SlurmStatus(job_id, state, "sacct", elapsed=fields[2], exit_code=fields[3])
        if queue.exit_code != 0:
            raise PazuzuError(f"squeue failed with exit {queue.exit_code}: {queue.stderr.strip()}")
        return SlurmStatus(job_id, "UNKNOWN", "none")

    async def cancel_slurm(self, job_id: str) -> CommandResult:
        result = await self.run(f"scancel -- {validate_job_id(job_id)}")
        if result.exit_code != 0:
            raise PazuzuError(
                f"scancel failed with exit {result.exit_code}: {result.stderr.strip()}"
            )
        return result

    async def tail(self, remote_path: str, *, lines: int = 100) -> CommandResult:
        if (
            not isinstance(remote_path, str)
            or not posixpath.isabs(remote_path)
            or "\0" in remote_path
        ):
            raise ValueError("remote_path must be an absolute POSIX path")
        if type(lines) is not int or not 1 <= lines <= 1000:
            raise ValueError("lines must be an integer from 1 to 1000")
        return await self.read(f"tail -n {lines} -- {shlex.quote(remote_path)}")
