"""Prepared runs: everything a run needs, computed before anything is written.

`prepare_run` is pure: it reads the base config, computes the run's argv, its materialised
config and its launch manifest (`koochak.jobs.manifest`), and writes nothing.
`PreparedRun.stage()` then writes the planned files write-once (config first, manifest last,
see `koochak.jobs.staging`); a backend (`koochak.jobs.backends`) stages and submits it.
Equal inputs give an equal `PreparedRun`, byte for byte and digest for digest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Sequence
from typing import Any

from koochak.jobs.config import ConfigPatch, materialize_config
from koochak.jobs.manifest import MANIFEST_NAME, build_manifest, encode_manifest
from koochak.jobs.outputs import DeclaredOutput
from koochak.jobs.profile import EnvironmentProfile, substitute
from koochak.jobs.staging import StagedFile, stage_run

__all__ = ["PreparedRun", "prepare_run"]

CONFIG_NAME = "config.yaml"
PREFLIGHT_NAME = "preflight.json"
RUNNER_MODULE = "koochak.jobs.runner"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


@dataclasses.dataclass(frozen=True, slots=True)
class PreparedRun:
    """Everything needed to submit a run, computed without touching the filesystem.

    ``runner_argv`` is what a scheduler executes on the node:
    ``(python, "-I", "-m", "koochak.jobs.runner", manifest_path, manifest_sha256)``.
    ``artifacts`` are the `StagedFile` records `stage` writes, the manifest always last.
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
        """Write ``artifacts`` write-once; return the paths newly written (see `stage_run`)."""
        return stage_run(self)


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
    run_id: str | None = None,
) -> PreparedRun:
    """Compile a config and a profile into a `PreparedRun`; nothing is written.

    ``python_args`` follow the profile's python; ``{config}``, ``{cwd}`` and ``{run_dir}`` in
    them are replaced (``{config}`` needs ``base_config``). The config is materialised with
    ``out_dir_config_key`` pinned to ``run_dir``. ``launch.json``, ``config.yaml`` and
    ``preflight.json`` go in ``launch_dir`` (default ``run_dir``).

    The run's identity (``run_id``, default ``name``) is recorded in a koochak-train config
    (``out_dir_config_key`` ``train.out_dir``) as ``train.run_id`` unless the config names one:
    every attempt of the prepared run (a requeue, a retry, a resubmission on other nodes that
    logs to another ``run_dir``) is then the same run to its checkpoint tiers.
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
    if run_id is not None and (not isinstance(run_id, str) or not _NAME.fullmatch(run_id)):
        raise ValueError(
            f"prepare_run run_id={run_id!r}; expected letters, digits, '_', '.', '-' (at most 128)"
        )
    if isinstance(python_args, (str, bytes)) or not isinstance(python_args, Sequence):
        raise ValueError("prepare_run python_args=: expected a list of strings, not one string")
    if not python_args:
        raise ValueError("prepare_run python_args=: expected at least one argument")
    for arg in python_args:
        if not isinstance(arg, str) or not arg or "\0" in arg:
            raise ValueError(f"prepare_run python_args=: {arg!r} is not a non-empty string")

    manifest_path = os.path.join(launch_dir, MANIFEST_NAME)
    preflight_path = os.path.join(launch_dir, PREFLIGHT_NAME)
    staged = []  # the files stage() writes, the manifest last
    config_path = config_sha256 = None
    if base_config is not None:
        identity = (run_id or name) if out_dir_config_key == "train.out_dir" else None
        text = materialize_config(base_config, run_dir=run_dir, patches=patches,
                                  out_dir_config_key=out_dir_config_key, run_id=identity)  # fmt: skip
        content = text.encode("utf-8")
        config_path = os.path.join(launch_dir, CONFIG_NAME)
        config_sha256 = hashlib.sha256(content).hexdigest()
        staged.append(StagedFile(config_path, content, config_sha256))
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
        declared.append(dataclasses.replace(output, path=os.path.normpath(path)))
    ids = [o.artifact_id for o in declared]
    if len(set(ids)) != len(ids):
        raise ValueError(f"prepare_run outputs=: artifact ids repeat: {sorted(ids)}")

    doc = build_manifest(
        name=name,
        cwd=cwd,
        run_dir=run_dir,
        argv=argv,
        environment=profile.resolve(cwd=cwd, run_dir=run_dir),
        config_path=config_path,
        config_sha256=config_sha256,
        outputs=declared,
        preflight_path=preflight_path,
    )
    content = encode_manifest(doc)
    manifest_sha256 = hashlib.sha256(content).hexdigest()
    staged.append(StagedFile(manifest_path, content, manifest_sha256))
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
        artifacts=tuple(staged),
        runner_argv=(profile.python, "-I", "-m", RUNNER_MODULE, manifest_path, manifest_sha256),
    )
