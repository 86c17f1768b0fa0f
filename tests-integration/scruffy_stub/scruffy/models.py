"""ResourceRequest and project ids (contract section 2)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_PROJECT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_RESOURCE_KEYS = ("nodes", "gpus_per_node", "cpus_per_node", "memory_gb_per_node")


class ModelError(ValueError):
    """Invalid resource request, project id or inventory."""


@dataclass(frozen=True)
class ResourceRequest:
    nodes: int
    gpus_per_node: int
    cpus_per_node: int
    memory_gb_per_node: int
    time_limit_seconds: int | None = None

    def __post_init__(self) -> None:
        for name in ("nodes", "cpus_per_node", "memory_gb_per_node"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ModelError(f"{name} must be a positive integer")
        if type(self.gpus_per_node) is not int or self.gpus_per_node < 0:
            raise ModelError("gpus_per_node must be a non-negative integer")
        limit = self.time_limit_seconds
        if limit is not None and (type(limit) is not int or limit <= 0):
            raise ModelError("time_limit_seconds must be a positive integer or None")

    def to_wire(self) -> dict[str, int]:
        wire = {k: getattr(self, k) for k in _RESOURCE_KEYS}
        if self.time_limit_seconds is not None:
            wire["time_limit_seconds"] = self.time_limit_seconds
        return wire

    @classmethod
    def from_wire(cls, value: Any) -> ResourceRequest:
        if not isinstance(value, Mapping):
            raise ModelError("resources must be an object")
        allowed = set(_RESOURCE_KEYS) | {"time_limit_seconds"}
        extra = sorted(set(value) - allowed)
        missing = [k for k in _RESOURCE_KEYS if k not in value]
        if extra or missing:
            raise ModelError(f"resources have unexpected or missing fields: {extra or missing}")
        return cls(**dict(value))


def check_project_id(project_id: Any) -> str:
    if not isinstance(project_id, str) or not _PROJECT.fullmatch(project_id):
        raise ModelError(f"invalid project_id: {project_id!r}")
    return project_id
