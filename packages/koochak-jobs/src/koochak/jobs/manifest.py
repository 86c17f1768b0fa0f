"""The launch manifest (``launch.json``): its fields, its canonical bytes and its strict reader.

The manifest pins, in one digest, the resolved environment (secret names only), the argv, the
config's digest and the declared outputs; it holds no timestamps, so equal inputs give equal
bytes and an equal digest. `koochak.jobs.prepare_run` builds it (`build_manifest`,
`encode_manifest`); the runner (`koochak.jobs.runner`) is started with its digest, checks the
bytes against it and reads them with `parse_manifest`. Format: docs/formats.md.

(`PreparedRun` and `prepare_run` lived here until 0.3; they are in `koochak.jobs.prepared`
now, and the old import path still works, with a DeprecationWarning.)
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from koochak.jobs.outputs import DeclaredOutput
from koochak.jobs.profile import CHECKS, RUNTIME_OWNED, is_runtime_owned
from koochak.storage.strict_json import check_fields, loads_strict, require_version

__all__ = [
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "build_manifest",
    "encode_manifest",
    "parse_manifest",
]

MANIFEST_VERSION = 1
MANIFEST_NAME = "launch.json"
_FIELDS = {
    "version",
    "name",
    "cwd",
    "run_dir",
    "argv",
    "environment",
    "config",
    "outputs",
    "preflight_path",
}
_ENV_FIELDS = {
    "profile_id",
    "profile_sha256",
    "python",
    "set",
    "inherit",
    "secrets",
    "create_directories",
    "executables",
    "files",
    "packages",
    "preflight",
}
# Old names of this module -> their new homes; each use warns (see _deprecated.py).
_MOVED = {
    "Artifact": "koochak.jobs.StagedFile",
    "PreparedRun": "koochak.jobs.PreparedRun",
    "prepare_run": "koochak.jobs.prepare_run",
    "CONFIG_NAME": "koochak.jobs.prepared.CONFIG_NAME",
    "PREFLIGHT_NAME": "koochak.jobs.prepared.PREFLIGHT_NAME",
    "RUNNER_MODULE": "koochak.jobs.prepared.RUNNER_MODULE",
}


def build_manifest(
    *,
    name: str,
    cwd: str,
    run_dir: str,
    argv: Sequence[str],
    environment: dict[str, Any],
    config_path: str | None,
    config_sha256: str | None,
    outputs: Sequence[DeclaredOutput],
    preflight_path: str,
) -> dict[str, Any]:
    """The launch manifest document of one run, from values `prepare_run` has checked;
    ``environment`` is the profile's resolved section (`EnvironmentProfile.resolve`)."""
    return {
        "version": MANIFEST_VERSION,
        "name": name,
        "cwd": cwd,
        "run_dir": run_dir,
        "argv": list(argv),
        "environment": environment,
        "config": None if config_path is None else {"path": config_path, "sha256": config_sha256},
        "outputs": [o.to_dict() for o in outputs],
        "preflight_path": preflight_path,
    }


def encode_manifest(doc: dict[str, Any]) -> bytes:
    """Canonical bytes of a launch manifest: 2-space indent, sorted keys, UTF-8, newline."""
    text = json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False)
    return (text + "\n").encode("utf-8")


# -- the reader the runner uses ---------------------------------------------------------------


def parse_manifest(data: bytes, where: str) -> dict[str, Any]:
    """Strictly read launch-manifest bytes (already digest-checked); ValueError naming the field."""
    doc = loads_strict(data, where)
    require_version(doc, where, MANIFEST_VERSION)
    check_fields(doc, where, _FIELDS)
    for key in ("name", "cwd", "run_dir", "preflight_path"):
        if not isinstance(doc[key], str) or not doc[key]:
            raise ValueError(f"{where}: field {key!r} must be a non-empty string")
    for key in ("cwd", "run_dir", "preflight_path"):
        if not os.path.isabs(doc[key]):
            raise ValueError(f"{where}: field {key!r} must be an absolute path")
    argv = doc["argv"]
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) and a for a in argv):
        raise ValueError(f"{where}: field 'argv' must be a non-empty list of strings")
    env = doc["environment"]
    if not isinstance(env, dict):
        raise ValueError(f"{where}: field 'environment' must be an object")
    check_fields(env, where, _ENV_FIELDS, prefix="environment.")
    if argv[0] != env["python"] or not os.path.isabs(env["python"]):
        raise ValueError(f"{where}: field 'argv'[0] must be the profile's absolute python")
    for key in ("set", "packages"):
        if not isinstance(env[key], dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env[key].items()
        ):
            raise ValueError(f"{where}: field 'environment.{key}' must map strings to strings")
    for key in ("inherit", "secrets", "create_directories", "executables", "files", "preflight"):
        if not isinstance(env[key], list) or not all(isinstance(v, str) and v for v in env[key]):
            raise ValueError(f"{where}: field 'environment.{key}' must be a list of strings")
    for key in ("create_directories", "executables", "files"):
        for path in env[key]:
            if not os.path.isabs(path):
                raise ValueError(f"{where}: field 'environment.{key}': {path!r} is not absolute")
    for pattern in env["inherit"]:
        if pattern not in RUNTIME_OWNED:
            raise ValueError(
                f"{where}: field 'environment.inherit': {pattern!r} is not runtime-owned"
            )
    for name in env["secrets"]:
        if name in env["set"] or is_runtime_owned(name):
            raise ValueError(f"{where}: field 'environment.secrets': {name!r} is not a secret name")
    for check in env["preflight"]:
        if check not in CHECKS:
            raise ValueError(f"{where}: field 'environment.preflight': unknown check {check!r}")
    config = doc["config"]
    if config is not None and (
        not isinstance(config, dict)
        or set(config) != {"path", "sha256"}
        or not isinstance(config["path"], str)
        or not os.path.isabs(config["path"])
        or not isinstance(config["sha256"], str)
    ):
        raise ValueError(f"{where}: field 'config' must be null or {{path, sha256}}")
    if not isinstance(doc["outputs"], list):
        raise ValueError(f"{where}: field 'outputs' must be a list")
    outputs = [
        DeclaredOutput.from_dict(o, f"{where}: field 'outputs'[{i}]")
        for i, o in enumerate(doc["outputs"])
    ]
    ids = [o.artifact_id for o in outputs]
    if len(set(ids)) != len(ids) or any(not os.path.isabs(o.path) for o in outputs):
        raise ValueError(f"{where}: field 'outputs': ids must be unique and paths absolute")
    doc["outputs"] = outputs
    return doc


def __getattr__(name: str) -> Any:
    if name in _MOVED:  # not cached: every use warns
        from koochak.jobs._deprecated import moved

        return moved(f"{__name__}.{name}", _MOVED[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
