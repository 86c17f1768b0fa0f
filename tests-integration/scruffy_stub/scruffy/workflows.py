"""Workflow metadata: ids, needs, wait_for, recovery, task dicts, cycles (contract section 3)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from scruffy import _contract

TASK_KEYS = (
    "task_id",
    "request_id",
    "name",
    "argv",
    "cwd",
    "environment",
    "resources",
    "needs",
    "wait_for",
)
NEWER_TASK_KEYS = (*TASK_KEYS, "recovery")
RETRY_REASONS = (
    "checkpoint_ack_timeout",
    "evacuated",
    "application_exit",
    "signal",
    "timeout",
    "lost",
)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class WorkflowError(ValueError):
    """Invalid workflow ids, needs, wait_for, recovery or graph."""


def check_id(value: Any, name: str, *, colon: bool = False) -> str:
    if not isinstance(value, str) or not value or value != value.strip():
        raise WorkflowError(f"{name} must be a non-empty string without surrounding whitespace")
    if not colon and ":" in value:
        raise WorkflowError(f"{name} must not contain ':'")
    return value


def check_needs(needs: Any) -> list[dict[str, str]]:
    if needs is None:
        return []
    if isinstance(needs, (str, bytes, Mapping)) or not isinstance(needs, Sequence):
        raise WorkflowError("needs must be a list")
    out, seen = [], set()
    for i, need in enumerate(needs):
        if not isinstance(need, Mapping) or set(need) != {"task_id", "condition"}:
            raise WorkflowError(f"needs[{i}] must have exactly task_id and condition")
        task_id = check_id(need["task_id"], f"needs[{i}].task_id")
        if need["condition"] not in ("succeeded", "terminal"):
            raise WorkflowError(f"needs[{i}].condition must be 'succeeded' or 'terminal'")
        if task_id in seen:
            raise WorkflowError(f"needs repeats task_id {task_id!r}")
        seen.add(task_id)
        out.append({"task_id": task_id, "condition": need["condition"]})
    return out


def check_wait_for(wait_for: Any) -> list[dict[str, str]]:
    if wait_for is None:
        return []
    if isinstance(wait_for, (str, bytes, Mapping)) or not isinstance(wait_for, Sequence):
        raise WorkflowError("wait_for must be a list")
    out, seen = [], set()
    for i, cond in enumerate(wait_for):
        if not isinstance(cond, Mapping) or set(cond) != {"kind", "task_id", "artifact_id"}:
            raise WorkflowError(f"wait_for[{i}] must have exactly kind, task_id and artifact_id")
        if cond["kind"] != "artifact":
            raise WorkflowError(f"wait_for[{i}].kind must be 'artifact'")
        task_id = check_id(cond["task_id"], f"wait_for[{i}].task_id")
        aid = cond["artifact_id"]
        if (
            not isinstance(aid, str)
            or not aid
            or aid != aid.strip()
            or len(aid) > 256
            or _CONTROL.search(aid)
        ):
            raise WorkflowError(f"wait_for[{i}].artifact_id must be a non-empty trimmed string")
        if (task_id, aid) in seen:
            raise WorkflowError(f"wait_for repeats ({task_id!r}, {aid!r})")
        seen.add((task_id, aid))
        out.append({"kind": "artifact", "task_id": task_id, "artifact_id": aid})
    return out


def check_recovery(recovery: Any) -> dict[str, Any] | None:
    """The newer contract's per-task recovery mapping; None stays None."""
    if recovery is None:
        return None
    if not isinstance(recovery, Mapping):
        raise WorkflowError("recovery must be an object")
    extra = sorted(set(recovery) - {"max_attempts", "retry_on", "evacuation"})
    if extra:
        raise WorkflowError(f"recovery has unexpected fields: {extra}")
    if "max_attempts" not in recovery:
        raise WorkflowError("recovery.max_attempts is required")
    attempts = recovery["max_attempts"]
    if type(attempts) is not int or not 1 <= attempts <= 10:
        raise WorkflowError("recovery.max_attempts must be an integer from 1 through 10")
    retry_on = recovery.get("retry_on", [])
    if not isinstance(retry_on, list) or len(set(map(str, retry_on))) != len(retry_on):
        raise WorkflowError("recovery.retry_on must be a duplicate-free array")
    for reason in retry_on:
        if reason not in RETRY_REASONS:
            raise WorkflowError(f"recovery.retry_on has unknown reason {reason!r}")
    out: dict[str, Any] = {"max_attempts": attempts, "retry_on": list(retry_on)}
    if "evacuation" in recovery:
        evac = recovery["evacuation"]
        if not isinstance(evac, Mapping) or set(evac) != {"signal", "grace_seconds"}:
            raise WorkflowError("recovery.evacuation must have exactly signal and grace_seconds")
        if evac["signal"] != "USR1":
            raise WorkflowError("recovery.evacuation.signal must be 'USR1'")
        grace = evac["grace_seconds"]
        if type(grace) is not int or grace < 0:
            raise WorkflowError("recovery.evacuation.grace_seconds must be a non-negative integer")
        out["evacuation"] = {"signal": "USR1", "grace_seconds": grace}
    return out


def task_keys() -> tuple[str, ...]:
    return NEWER_TASK_KEYS if _contract.NEWER else TASK_KEYS


def check_graph(specs: Sequence[Mapping[str, Any]]) -> None:
    """Every needs/wait_for target in the submission; no self-dependency, no cycle."""
    ids = {s["task_id"] for s in specs}
    edges: dict[str, set[str]] = {}
    missing = []
    for spec in specs:
        ups = {n["task_id"] for n in spec.get("needs", [])}
        ups |= {w["task_id"] for w in spec.get("wait_for", [])}
        if spec["task_id"] in ups:
            raise WorkflowError(f"task {spec['task_id']!r} depends on itself")
        missing += sorted(ups - ids)
        edges[spec["task_id"]] = ups & ids
    if missing:
        raise WorkflowError(f"workflow dependencies are missing tasks: {sorted(set(missing))}")
    state: dict[str, int] = {}

    def visit(node: str) -> None:
        state[node] = 1
        for up in edges[node]:
            if state.get(up) == 1:
                raise WorkflowError(f"workflow has a dependency cycle through {up!r}")
            if up not in state:
                visit(up)
        state[node] = 2

    for node in edges:
        if node not in state:
            visit(node)
