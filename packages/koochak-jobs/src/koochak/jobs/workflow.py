"""Immutable Scruffy workflows: ``PreparedTask`` and ``PreparedWorkflow``.

A task is one prepared run plus where it may run (resources), when it may start (``needs`` on
other tasks' ends, ``wait_for`` on other tasks' published artifacts) and how Scruffy may
recover it (``recovery``). Everything is validated when the object is built, with an error
naming the task and the field, and frozen; ``PreparedWorkflow.scruffy_tasks()`` renders the
exact wire dicts of Scruffy's strict workflow protocol (plain lists and dicts, only the
allowed keys, ``recovery`` only when given). Nothing here imports Scruffy: a Scruffy that
rejects a field (an older client has no ``recovery``) raises its own error at submission.

Artifact-only release: a task with ``needs=()`` and a ``wait_for`` artifact condition starts
as soon as the producer publishes that artifact (for example ``checkpoint/step000000009.pt``),
whether or not the producer has finished.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol

# Once a protocol of its own here; the one record lives with the stager (importable here too).
from koochak.jobs.staging import StagedFile

__all__ = [
    "CONDITIONS",
    "RETRY_REASONS",
    "DeclaredOutputLike",
    "PreparedTask",
    "PreparedWorkflow",
    "SubmittableRun",
]

_IDENTIFIER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
CONDITIONS = ("succeeded", "terminal")
RETRY_REASONS = (
    "allocation_replaced",
    "allocation_incarnation_changed",
    "evacuated",
    "checkpoint_ack_timeout",
)
_MAX_ATTEMPTS = range(1, 11)
_MAX_ARTIFACT_ID = 256


class DeclaredOutputLike(Protocol):
    """What a workflow checks of a declared output: its id and its provenance mapping."""

    @property
    def artifact_id(self) -> str: ...
    @property
    def provenance(self) -> Mapping[str, Any] | None: ...


class SubmittableRun(Protocol):
    """Exactly what the backends and workflows use of a prepared run (``PreparedRun``).

    ``artifacts`` (`StagedFile` records, or anything with their ``path``, ``content`` and
    ``sha256``) are staged in order (the manifest last, so it never lands before what it
    pins); ``runner_argv`` is the command the scheduler runs, its first item the absolute
    Python that also runs the remote staging step.
    """

    @property
    def name(self) -> str: ...
    @property
    def cwd(self) -> str: ...
    @property
    def runner_argv(self) -> Sequence[str]: ...
    @property
    def artifacts(self) -> Sequence[StagedFile]: ...
    @property
    def outputs(self) -> Sequence[DeclaredOutputLike]: ...


def _check_identifier(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _IDENTIFIER.fullmatch(value):
        raise ValueError(f"{where} must match [A-Za-z0-9][A-Za-z0-9_.-]{{0,127}}, got {value!r}")
    return value


def _check_keys(item: Any, expected: set[str], where: str) -> Mapping[str, Any]:
    if not isinstance(item, Mapping):
        raise ValueError(f"{where} must be a mapping, got {type(item).__name__}")
    keys = set(item)
    if keys != expected:
        missing, unexpected = sorted(expected - keys), sorted(keys - expected, key=str)
        raise ValueError(
            f"{where} must have exactly {sorted(expected)}: missing {missing}, unexpected {unexpected}"
        )
    return item


def _check_sequence(value: Any, where: str) -> Sequence[Any]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{where} must be a list, got {type(value).__name__}")
    return value


def _needs(value: Any, where: str) -> tuple[Mapping[str, str], ...]:
    """``needs`` as frozen mappings: each exactly {task_id, condition}, no task twice."""
    out, seen = [], set()
    for i, item in enumerate(_check_sequence(value, where)):
        item = _check_keys(item, {"task_id", "condition"}, f"{where}[{i}]")
        task_id = _check_identifier(item["task_id"], f"{where}[{i}].task_id")
        if item["condition"] not in CONDITIONS:
            raise ValueError(
                f"{where}[{i}].condition must be 'succeeded' or 'terminal', got {item['condition']!r}"
            )
        if task_id in seen:
            raise ValueError(f"{where}[{i}].task_id {task_id!r} appears twice")
        seen.add(task_id)
        out.append(MappingProxyType({"task_id": task_id, "condition": item["condition"]}))
    return tuple(out)


def _artifact_id(value: Any, where: str) -> str:
    if (
        not isinstance(value, str)
        or not value
        or value != value.strip()
        or len(value) > _MAX_ARTIFACT_ID
        or not value.isprintable()
    ):
        raise ValueError(
            f"{where} must be 1 to 256 printable characters without surrounding spaces, got {value!r}"
        )
    return value


def _wait_for(value: Any, where: str) -> tuple[Mapping[str, str], ...]:
    """``wait_for`` as frozen mappings: each exactly {kind: artifact, task_id, artifact_id}."""
    out, seen = [], set()
    for i, item in enumerate(_check_sequence(value, where)):
        item = _check_keys(item, {"kind", "task_id", "artifact_id"}, f"{where}[{i}]")
        if item["kind"] != "artifact":
            raise ValueError(f"{where}[{i}].kind must be 'artifact', got {item['kind']!r}")
        task_id = _check_identifier(item["task_id"], f"{where}[{i}].task_id")
        artifact_id = _artifact_id(item["artifact_id"], f"{where}[{i}].artifact_id")
        if (task_id, artifact_id) in seen:
            raise ValueError(f"{where}[{i}] waits for {task_id!r}/{artifact_id!r} twice")
        seen.add((task_id, artifact_id))
        out.append(
            MappingProxyType({"kind": "artifact", "task_id": task_id, "artifact_id": artifact_id})
        )
    return tuple(out)


def _recovery(value: Any, where: str) -> Mapping[str, Any]:
    """The spec's recovery mapping, exactly: max_attempts 1..10, retry_on, evacuation."""
    value = _check_keys(value, {"max_attempts", "retry_on", "evacuation"}, where)
    attempts = value["max_attempts"]
    if type(attempts) is not int or attempts not in _MAX_ATTEMPTS:
        raise ValueError(f"{where}.max_attempts must be an int from 1 to 10, got {attempts!r}")
    retry_on = _check_sequence(value["retry_on"], f"{where}.retry_on")
    for i, reason in enumerate(retry_on):
        if reason not in RETRY_REASONS:
            raise ValueError(
                f"{where}.retry_on[{i}] must be one of {list(RETRY_REASONS)}, got {reason!r}"
            )
    if len(set(retry_on)) != len(retry_on):
        raise ValueError(f"{where}.retry_on must not repeat a reason, got {list(retry_on)}")
    evacuation = _check_keys(
        value["evacuation"], {"signal", "grace_seconds"}, f"{where}.evacuation"
    )
    if evacuation["signal"] != "USR1":
        raise ValueError(
            f"{where}.evacuation.signal must be exactly 'USR1', got {evacuation['signal']!r}"
        )
    grace = evacuation["grace_seconds"]
    if type(grace) is not int or grace < 0:
        raise ValueError(f"{where}.evacuation.grace_seconds must be an int >= 0, got {grace!r}")
    return MappingProxyType(
        {
            "max_attempts": attempts,
            "retry_on": tuple(retry_on),
            "evacuation": MappingProxyType({"signal": "USR1", "grace_seconds": grace}),
        }
    )


def _resources(value: Any, where: str) -> Mapping[str, Any]:
    """Backend resources as a frozen plain mapping: a mapping, or a dataclass such as
    ``scruffy.ResourceRequest`` (its unset optional fields, None, left out as on its wire)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        value = {k: v for k, v in fields.items() if v is not None}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ValueError(
            f"{where} must be a mapping with str keys or a ResourceRequest, got {type(value).__name__}"
        )
    return MappingProxyType(dict(value))


def _thaw(value: Any) -> Any:
    """Frozen mappings and tuples back to the plain dicts and lists of the wire."""
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


def _needs_wire(value: Any, where: str = "needs") -> list[dict[str, str]]:
    """Validate ``needs`` and return it as Scruffy's plain list (for ``submit_job``)."""
    return _thaw(_needs(value, where))


def _wait_for_wire(value: Any, where: str = "wait_for") -> list[dict[str, str]]:
    """Validate ``wait_for`` and return it as Scruffy's plain list (for ``submit_job``)."""
    return _thaw(_wait_for(value, where))


@dataclasses.dataclass(frozen=True, slots=True)
class PreparedTask:
    """One task of a workflow: a prepared run, its resources, its gates and its recovery.

    ``needs``: ``[{"task_id", "condition": "succeeded"|"terminal"}]``; ``wait_for``:
    ``[{"kind": "artifact", "task_id", "artifact_id"}]``; ``recovery``: ``{"max_attempts":
    1..10, "retry_on": [reasons, no repeats, may be empty], "evacuation": {"signal": "USR1",
    "grace_seconds": int >= 0}}`` or None (not sent). Stored frozen.
    """

    task_id: str
    run: SubmittableRun
    resources: Mapping[str, Any]
    needs: tuple[Mapping[str, str], ...] = ()
    wait_for: tuple[Mapping[str, str], ...] = ()
    recovery: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        task_id = _check_identifier(self.task_id, "task_id")
        where = f"task {task_id!r}"
        set_ = object.__setattr__  # frozen: normalise once, here
        set_(self, "resources", _resources(self.resources, f"{where}: resources"))
        set_(self, "needs", _needs(self.needs, f"{where}: needs"))
        set_(self, "wait_for", _wait_for(self.wait_for, f"{where}: wait_for"))
        if self.recovery is not None:
            set_(self, "recovery", _recovery(self.recovery, f"{where}: recovery"))

    def to_scruffy_spec(self, workflow_request_id: str) -> dict[str, Any]:
        """This task's wire dict in a workflow whose request id is ``workflow_request_id``."""
        spec: dict[str, Any] = {
            "task_id": self.task_id,
            "request_id": f"{workflow_request_id}/{self.task_id}",
            "name": self.run.name,
            "argv": list(self.run.runner_argv),
            "cwd": str(self.run.cwd),
            # The real environment travels inside the hashed launch manifest.
            "environment": {},
            "resources": _thaw(self.resources),
            "needs": _thaw(self.needs),
            "wait_for": _thaw(self.wait_for),
        }
        if self.recovery is not None:
            spec["recovery"] = _thaw(self.recovery)
        return spec


def _check_request_id(value: Any) -> str:
    if (
        not isinstance(value, str)
        or not value.strip()
        or any(ord(c) < 32 or c == "\x7f" for c in value)
    ):
        raise ValueError(
            f"workflow request_id must be a non-blank str without control characters, got {value!r}"
        )
    return value


def _check_provenance(task: PreparedTask, workflow: PreparedWorkflow) -> None:
    expected = {
        "project_id": workflow.project_id,
        "workflow_id": workflow.workflow_id,
        "task_id": task.task_id,
    }
    for output in task.run.outputs:
        where = f"task {task.task_id!r}: declared output {output.artifact_id!r}"
        provenance = output.provenance
        if not isinstance(provenance, Mapping):
            raise ValueError(
                f"{where}: provenance must be a mapping with {sorted(expected)} and code_commit, got {provenance!r}"
            )
        for key, value in expected.items():
            if provenance.get(key) != value:
                raise ValueError(
                    f"{where}: provenance.{key} must equal {value!r}, got {provenance.get(key)!r}"
                )
        commit = provenance.get("code_commit")
        if not isinstance(commit, str) or not commit.strip():
            raise ValueError(
                f"{where}: provenance.code_commit must be a non-blank str, got {commit!r}"
            )


@dataclasses.dataclass(frozen=True, slots=True)
class PreparedWorkflow:
    """A whole DAG for one strict ``scruffy.submit_workflow`` call.

    Tasks are unique by id; every ``needs`` and ``wait_for`` names a task of this workflow;
    every declared output's provenance names this project, workflow and its own task (with a
    ``code_commit``). Cycles and self-dependencies are Scruffy's validator's to reject.
    """

    request_id: str
    workflow_id: str
    project_id: str
    tasks: tuple[PreparedTask, ...]

    def __post_init__(self) -> None:
        _check_request_id(self.request_id)
        _check_identifier(self.workflow_id, "workflow_id")
        _check_identifier(self.project_id, "project_id")
        if isinstance(self.tasks, (str, bytes)) or not isinstance(self.tasks, Sequence):
            raise TypeError(
                f"workflow tasks must be a sequence of PreparedTask, got {type(self.tasks).__name__}"
            )
        tasks = tuple(self.tasks)
        if not tasks:
            raise ValueError("workflow tasks must not be empty")
        for i, task in enumerate(tasks):
            if not isinstance(task, PreparedTask):
                raise TypeError(
                    f"workflow tasks[{i}] must be a PreparedTask, got {type(task).__name__}"
                )
        ids = [task.task_id for task in tasks]
        repeated = sorted({t for t in ids if ids.count(t) > 1})
        if repeated:
            raise ValueError(f"workflow task ids must be unique, repeated: {repeated}")
        object.__setattr__(self, "tasks", tasks)
        for task in tasks:
            for need in task.needs:
                if need["task_id"] not in ids:
                    raise ValueError(
                        f"task {task.task_id!r}: needs names a task outside this workflow: {need['task_id']!r}"
                    )
            for gate in task.wait_for:
                if gate["task_id"] not in ids:
                    raise ValueError(
                        f"task {task.task_id!r}: wait_for names a task outside this workflow: {gate['task_id']!r}"
                    )
            _check_provenance(task, self)

    def scruffy_tasks(self) -> list[dict[str, Any]]:
        """The ``tasks`` argument of ``scruffy.submit_workflow``, in task order."""
        return [task.to_scruffy_spec(self.request_id) for task in self.tasks]
