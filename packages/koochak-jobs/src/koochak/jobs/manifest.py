"""Prepared runs and immutable launch manifests.

`prepare_run` is pure: it reads the base config, computes everything a run needs and writes
nothing. `PreparedRun.stage()` then writes the planned files write-once (config first, manifest
last). The launch manifest pins, in one digest, the resolved environment (secret names only),
the argv, the config's digest and the declared outputs; it holds no timestamps, so equal inputs
give equal bytes and an equal digest. The runner (`koochak.jobs.runner`) is started with that
digest and refuses a manifest or config that differs.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from koochak.jobs.config import ConfigPatch, materialize_config
from koochak.jobs.outputs import DeclaredOutput
from koochak.jobs.profile import (
    CHECKS,
    RUNTIME_OWNED,
    EnvironmentProfile,
    is_runtime_owned,
    substitute,
)
from koochak.jobs.staging import StagedFile, stage_run
from koochak.storage.strict_json import loads_strict, require_version

__all__ = [
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "PreparedRun",
    "encode_manifest",
    "parse_manifest",
    "prepare_run",
]

MANIFEST_VERSION = 1
MANIFEST_NAME = "launch.json"
CONFIG_NAME = "config.yaml"
PREFLIGHT_NAME = "preflight.json"
RUNNER_MODULE = "koochak.jobs.runner"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
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


@dataclass(frozen=True, slots=True)
class PreparedRun:
    """Everything needed to submit a run, computed without touching the filesystem.

    ``runner_argv`` is what a scheduler executes on the node:
    ``(python, "-I", "-m", "koochak.jobs.runner", manifest_path, manifest_sha256)``.
    ``artifacts`` are the files `stage` writes, the manifest always last.
    """

    name: str
    cwd: str
    run_dir: str
    python: str
    profile: EnvironmentProfile
    argv: tuple[str, ...]
    manifest_path: str
    manifest_sha256: str
    config_path: str | None
    config_sha256: str | None
    preflight_path: str
    outputs: tuple[DeclaredOutput, ...]
    artifacts: tuple[StagedFile, ...]
    runner_argv: tuple[str, ...]

    @property
    def manifest(self) -> dict[str, Any]:
        """The launch manifest document (a fresh copy)."""
        return json.loads(self.artifacts[-1].content)

    def stage(self) -> list[str]:
        """Write the artifacts write-once; return the paths newly written (see `stage_run`)."""
        return stage_run(self)


def encode_manifest(doc: dict[str, Any]) -> bytes:
    """Canonical bytes of a launch manifest: 2-space indent, sorted keys, UTF-8, newline."""
    text = json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False)
    return (text + "\n").encode("utf-8")


def _absolute(value: Any, name: str) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"prepare_run {name}={value!r}; expected an absolute path")
    text = os.fspath(value)
    if not os.path.isabs(text) or "\0" in text:
        raise ValueError(f"prepare_run {name}={text!r}; expected an absolute path")
    return os.path.normpath(text)


def prepare_run(
    *,
    name: str,
    profile: EnvironmentProfile,
    python_args: Sequence[str],
    cwd: str | os.PathLike[str],
    run_dir: str | os.PathLike[str],
    base_config: str | os.PathLike[str] | None = None,
    patches: Sequence[ConfigPatch] = (),
    out_dir_config_key: str | None = "train.out_dir",
    outputs: Sequence[DeclaredOutput] = (),
    launch_dir: str | os.PathLike[str] | None = None,
) -> PreparedRun:
    """Compile a config and a profile into a `PreparedRun`; nothing is written.

    ``python_args`` follow the profile's python; ``{config}``, ``{cwd}`` and ``{run_dir}`` in
    them are replaced (``{config}`` needs ``base_config``). The config is materialised with
    ``out_dir_config_key`` pinned to ``run_dir``. ``launch.json``, ``config.yaml`` and
    ``preflight.json`` go in ``launch_dir`` (default ``run_dir``).
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"prepare_run name={name!r}; expected letters, digits, '_', '.', '-' (at most 128)"
        )
    if not isinstance(profile, EnvironmentProfile):
        raise ValueError("prepare_run profile=: expected an EnvironmentProfile")
    cwd = _absolute(cwd, "cwd")
    run_dir = _absolute(run_dir, "run_dir")
    launch_dir = run_dir if launch_dir is None else _absolute(launch_dir, "launch_dir")
    if isinstance(python_args, (str, bytes)) or not isinstance(python_args, Sequence):
        raise ValueError("prepare_run python_args=: expected a list of strings, not one string")
    if not python_args:
        raise ValueError("prepare_run python_args=: expected at least one argument")
    for arg in python_args:
        if not isinstance(arg, str) or not arg or "\0" in arg:
            raise ValueError(f"prepare_run python_args=: {arg!r} is not a non-empty string")

    manifest_path = os.path.join(launch_dir, MANIFEST_NAME)
    preflight_path = os.path.join(launch_dir, PREFLIGHT_NAME)
    artifacts = []
    config_path = config_sha256 = None
    if base_config is not None:
        text = materialize_config(
            base_config, run_dir=run_dir, patches=patches, out_dir_config_key=out_dir_config_key
        )
        content = text.encode("utf-8")
        config_path = os.path.join(launch_dir, CONFIG_NAME)
        config_sha256 = hashlib.sha256(content).hexdigest()
        artifacts.append(StagedFile(config_path, content, config_sha256))
    elif patches:
        raise ValueError("prepare_run patches= need base_config=")

    args = []
    for arg in python_args:
        if "{config}" in arg and config_path is None:
            raise ValueError("prepare_run python_args: {config} requires base_config")
        arg = arg.replace("{cwd}", cwd).replace("{run_dir}", run_dir)
        args.append(arg.replace("{config}", config_path) if config_path else arg)
    argv = (profile.python, *args)

    declared = []
    for output in outputs:
        if not isinstance(output, DeclaredOutput):
            raise ValueError(f"prepare_run outputs=: {output!r} is not a DeclaredOutput")
        path = substitute(
            output.path,
            {"cwd": cwd, "run_dir": run_dir},
            f"DeclaredOutput({output.artifact_id!r}) path",
        )
        declared.append(
            DeclaredOutput(
                output.artifact_id,
                os.path.normpath(path),
                kind=output.kind,
                provenance=output.provenance,
            )
        )
    ids = [o.artifact_id for o in declared]
    if len(set(ids)) != len(ids):
        raise ValueError(f"prepare_run outputs=: artifact ids repeat: {sorted(ids)}")

    doc = {
        "version": MANIFEST_VERSION,
        "name": name,
        "cwd": cwd,
        "run_dir": run_dir,
        "argv": list(argv),
        "environment": profile.resolve(cwd=cwd, run_dir=run_dir),
        "config": None if config_path is None else {"path": config_path, "sha256": config_sha256},
        "outputs": [o.to_dict() for o in declared],
        "preflight_path": preflight_path,
    }
    content = encode_manifest(doc)
    manifest_sha256 = hashlib.sha256(content).hexdigest()
    artifacts.append(StagedFile(manifest_path, content, manifest_sha256))
    return PreparedRun(
        name=name,
        cwd=cwd,
        run_dir=run_dir,
        python=profile.python,
        profile=profile,
        argv=argv,
        manifest_path=manifest_path,
        manifest_sha256=manifest_sha256,
        config_path=config_path,
        config_sha256=config_sha256,
        preflight_path=preflight_path,
        outputs=tuple(declared),
        artifacts=tuple(artifacts),
        runner_argv=(profile.python, "-I", "-m", RUNNER_MODULE, manifest_path, manifest_sha256),
    )


# -- the reader the runner uses ---------------------------------------------------------------


def parse_manifest(data: bytes, where: str) -> dict[str, Any]:
    """Strictly read launch-manifest bytes (already digest-checked); ValueError naming the field."""
    doc = loads_strict(data, where)
    require_version(doc, where, MANIFEST_VERSION)
    _exact(doc, _FIELDS, where, "")
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
    _exact(env, _ENV_FIELDS, where, "environment.")
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


def _exact(doc: dict[str, Any], fields: set[str], where: str, prefix: str) -> None:
    unknown = sorted(set(doc) - fields)
    if unknown:
        raise ValueError(f"{where}: unknown field '{prefix}{unknown[0]}'")
    missing = sorted(fields - set(doc))
    if missing:
        raise ValueError(f"{where}: missing field '{prefix}{missing[0]}'")


def __getattr__(name: str) -> Any:
    if name == "Artifact":
        from koochak.jobs._deprecated import moved

        return moved(f"{__name__}.{name}", "koochak.jobs.StagedFile")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
