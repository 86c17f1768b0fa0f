"""Typed Slurm jobs: resources, the job, its deterministic script, handles and status."""

from __future__ import annotations

import dataclasses
import posixpath
import re
import shlex
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from .errors import PazuzuError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
TERMINAL_STATES = frozenset(
    {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
     "PREEMPTED", "REVOKED", "SPECIAL_EXIT", "TIMEOUT"}
)  # fmt: skip


def _positive(name: str, value: Any, minimum: int = 1) -> None:
    if type(value) is not int or value < minimum:
        kind = "positive" if minimum == 1 else "non-negative"
        raise ValueError(f"{name} must be a {kind} integer")


def _token(name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str")
    if not value or any(c.isspace() for c in value):
        raise ValueError(f"{name} must be a non-empty token without whitespace")


@dataclasses.dataclass(frozen=True)
class SlurmResources:
    memory_gb_per_node: int
    time_limit: str
    cpus_per_task: int = 1
    gpus_per_node: int = 0
    nodes: int = 1
    tasks_per_node: int = 1
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    array: str | None = None
    dependency: str | None = None

    def __post_init__(self) -> None:
        for name in ("memory_gb_per_node", "cpus_per_task", "nodes", "tasks_per_node"):
            _positive(name, getattr(self, name))
        _positive("gpus_per_node", self.gpus_per_node, minimum=0)
        _token("time_limit", self.time_limit)
        for name in ("partition", "account", "qos", "constraint", "array", "dependency"):
            if getattr(self, name) is not None:
                _token(name, getattr(self, name))


def _absolute(name: str, value: Any) -> None:
    if not isinstance(value, str) or "\0" in value or not posixpath.isabs(value):
        raise ValueError(f"{name} must be an absolute POSIX path without NUL")


@dataclasses.dataclass(frozen=True)
class SlurmJob:
    name: str
    argv: tuple[str, ...]
    cwd: str
    log_dir: str
    resources: SlurmResources
    environment: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(
                "name must contain only ASCII letters, digits, '_', '.' or '-', start with a letter or digit, and be at most 128 characters"
            )
        if not isinstance(self.resources, SlurmResources):
            raise TypeError("resources must be a SlurmResources")
        if isinstance(self.argv, (str, bytes)):
            raise TypeError("argv must be a sequence of arguments, not a string")
        argv = tuple(self.argv)
        if not argv or not all(isinstance(a, str) and a and "\0" not in a for a in argv):
            raise ValueError(
                "argv must be non-empty and every argument a non-empty str without NUL"
            )
        object.__setattr__(self, "argv", argv)
        if not isinstance(self.environment, Mapping):
            raise TypeError("environment must be a mapping")
        for key, value in self.environment.items():
            if not isinstance(key, str) or not _ENV_NAME.fullmatch(key):
                raise ValueError(f"environment name {key!r} is not a valid variable name")
            if not isinstance(value, str) or "\0" in value:
                raise ValueError(f"environment value for {key} must be a str without NUL")
        object.__setattr__(self, "environment", MappingProxyType(dict(self.environment)))
        _absolute("cwd", self.cwd)
        _absolute("log_dir", self.log_dir)
        if any(c.isspace() for c in self.log_dir):
            raise ValueError(
                "log_dir must not contain whitespace because it is used in an sbatch directive"
            )

    @property
    def stdout_pattern(self) -> str:
        return f"{self.log_dir}/{self.name}-%j.out"

    @property
    def stderr_pattern(self) -> str:
        return f"{self.log_dir}/{self.name}-%j.err"


@dataclasses.dataclass(frozen=True)
class SlurmHandle:
    job_id: str
    name: str
    stdout_path: str
    stderr_path: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class SlurmStatus:
    job_id: str
    state: str
    source: str
    elapsed: str | None = None
    time_limit: str | None = None
    reason: str | None = None
    exit_code: str | None = None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "terminal": self.terminal}


def render_slurm_script(job: SlurmJob) -> str:
    """The job's sbatch script; deterministic, no I/O."""
    r = job.resources
    lines = ["#!/usr/bin/env bash", f"#SBATCH --job-name={job.name}"]
    for flag in ("partition", "account", "qos", "constraint"):
        if getattr(r, flag) is not None:
            lines.append(f"#SBATCH --{flag}={getattr(r, flag)}")
    lines += [
        f"#SBATCH --nodes={r.nodes}",
        f"#SBATCH --ntasks-per-node={r.tasks_per_node}",
        f"#SBATCH --cpus-per-task={r.cpus_per_task}",
        f"#SBATCH --mem={r.memory_gb_per_node}G",
        f"#SBATCH --time={r.time_limit}",
    ]
    if r.gpus_per_node > 0:
        lines.append(f"#SBATCH --gres=gpu:{r.gpus_per_node}")
    for flag in ("array", "dependency"):
        if getattr(r, flag) is not None:
            lines.append(f"#SBATCH --{flag}={getattr(r, flag)}")
    lines += [f"#SBATCH --output={job.stdout_pattern}", f"#SBATCH --error={job.stderr_pattern}"]
    lines += ["", "set -euo pipefail", f"cd {shlex.quote(job.cwd)}"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(job.environment.items())]
    lines += ["", f"exec {shlex.join(job.argv)}"]
    return "\n".join(lines) + "\n"


def validate_job_id(job_id: Any) -> str:
    if not isinstance(job_id, str) or not job_id.isascii() or not job_id.isdecimal():
        raise ValueError("job_id must contain only ASCII decimal digits")
    return job_id


def parse_submission(stdout: str, job: SlurmJob) -> SlurmHandle:
    """``sbatch --parsable`` output -> handle (last non-empty line, cluster name dropped)."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    job_id = lines[-1].split(";", 1)[0] if lines else ""
    try:
        validate_job_id(job_id)
    except ValueError:
        raise PazuzuError(f"could not parse sbatch output: {stdout!r}") from None
    return SlurmHandle(
        job_id=job_id,
        name=job.name,
        stdout_path=job.stdout_pattern.replace("%j", job_id),
        stderr_path=job.stderr_pattern.replace("%j", job_id),
    )
