"""Declared outputs: files or directories a consumer may wait for, published by the workload.

The workload creates the output and publishes ``<output>.ready.json`` with
``koochak.storage.artifact.write_ready_manifest(path, artifact_id=...)``. After the workload
exits 0 the runner checks every declared output against its ready manifest (`validate_output`)
before publishing any event, and again just before each output's event.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from koochak.storage.artifact import READY_SUFFIX, InvalidArtifact, verify_ready

__all__ = ["DeclaredOutput", "OUTPUT_KINDS", "validate_output"]

OUTPUT_KINDS = ("file", "directory")
_ARTIFACT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*/[^\s/][^\s]{0,250}")
_FIELDS = {"artifact_id", "path", "kind", "provenance"}


@dataclass(frozen=True)
class DeclaredOutput:
    """An output of the run: ``artifact_id`` (``"<kind>/<name>"``, what consumers wait for),
    ``path`` (absolute, or starting with ``{run_dir}``/``{cwd}``), ``kind`` (``"file"`` or
    ``"directory"``) and optional ``provenance`` the ready manifest must carry exactly."""

    artifact_id: str
    path: str
    kind: str = "file"
    provenance: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        where = f"DeclaredOutput({self.artifact_id!r})"
        if not isinstance(self.artifact_id, str) or not _ARTIFACT_ID.fullmatch(self.artifact_id):
            raise ValueError(
                f"{where}: artifact_id must look like '<kind>/<name>' (printable, no spaces, at "
                "most 256 characters), e.g. 'dataset/tokens'"
            )
        if not isinstance(self.path, str) or not self.path or "\0" in self.path:
            raise ValueError(f"{where}: path={self.path!r}; expected an absolute path")
        if not (os.path.isabs(self.path) or self.path.startswith(("{run_dir}", "{cwd}"))):
            raise ValueError(
                f"{where}: path={self.path!r}; expected an absolute path or one starting with "
                "{run_dir} or {cwd}"
            )
        if self.path.endswith(READY_SUFFIX):
            raise ValueError(f"{where}: path names the ready manifest; name the output itself")
        if self.kind not in OUTPUT_KINDS:
            raise ValueError(f"{where}: kind={self.kind!r}; expected 'file' or 'directory'")
        if self.provenance is not None and not isinstance(self.provenance, Mapping):
            raise ValueError(f"{where}: provenance must be a mapping or None")
        if self.provenance is not None:
            object.__setattr__(self, "provenance", dict(self.provenance))

    @property
    def ready_manifest_path(self) -> str:
        """``<path>.ready.json``, the ready manifest the workload publishes for this output
        (not the launch manifest, which is `PreparedRun.manifest_path`)."""
        return self.path + READY_SUFFIX

    @property
    def manifest_path(self) -> str:
        """Deprecated name of `ready_manifest_path` (removed in koochak-jobs 0.4)."""
        warnings.warn(
            "DeclaredOutput.manifest_path is deprecated; use DeclaredOutput.ready_manifest_path "
            "(the same path). DeclaredOutput.manifest_path will be removed in koochak-jobs 0.4.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.ready_manifest_path

    def to_dict(self) -> dict[str, Any]:
        return {
            "artifact_id": self.artifact_id,
            "path": self.path,
            "kind": self.kind,
            "provenance": None if self.provenance is None else dict(self.provenance),
        }

    @classmethod
    def from_dict(cls, doc: Any, where: str = "output") -> DeclaredOutput:
        if not isinstance(doc, dict) or set(doc) != _FIELDS:
            raise ValueError(
                f"{where}: expected an object with exactly {', '.join(sorted(_FIELDS))}"
            )
        return cls(doc["artifact_id"], doc["path"], kind=doc["kind"], provenance=doc["provenance"])


def validate_output(output: DeclaredOutput) -> dict[str, Any]:
    """Check ``output`` against its ready manifest byte for byte; return the publication record
    ``{artifact_id, path, size, sha256, manifest_path}``. A missing, symlinked, changed or
    unpublished output, or a manifest for another artifact, kind or provenance, is a
    ValueError naming the output."""
    where = f"declared output {output.artifact_id} ({output.path})"
    if not os.path.isabs(output.path):
        raise ValueError(f"{where}: path is not absolute; prepare_run resolves placeholders")
    if not os.path.lexists(output.path):
        raise ValueError(f"{where}: missing; the workload did not create it")
    if os.path.islink(output.path):
        raise ValueError(f"{where}: is a symlink; outputs must be a regular file or directory")
    try:
        doc = verify_ready(output.path)
    except FileNotFoundError:
        raise ValueError(
            f"{where}: not published: {os.path.basename(output.ready_manifest_path)} is missing "
            "(publish it with koochak.storage.artifact.write_ready_manifest)"
        ) from None
    except InvalidArtifact as exc:
        raise ValueError(f"{where}: {exc}") from None
    if doc["artifact_id"] != output.artifact_id:
        raise ValueError(
            f"{where}: its ready manifest names artifact {doc['artifact_id']!r}; pass "
            f"artifact_id={output.artifact_id!r} to write_ready_manifest"
        )
    if doc["type"] != output.kind:
        raise ValueError(f"{where}: is a {doc['type']}, declared as a {output.kind}")
    if output.provenance is not None and doc["provenance"] != output.provenance:
        raise ValueError(f"{where}: ready manifest provenance differs from the declared one")
    return {
        "artifact_id": output.artifact_id,
        "path": output.path,
        "size": doc["size"],
        "sha256": doc["sha256"],
        "manifest_path": output.ready_manifest_path,  # the publication record's key
    }
