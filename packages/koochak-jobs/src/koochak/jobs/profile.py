"""Execution-environment profiles: strict, reusable YAML describing where a job runs.

A profile names an absolute Python, the exact environment variables the workload gets (a
deterministic ``PATH``, explicit compilers), the names of secrets inherited at run time (never
their values), directories to create, requirements to check and built-in preflight checks.
Nothing is inherited by accident: the runner starts from ``environment.set``, adds the
runtime-owned identity the scheduler provides (``RUNTIME_OWNED``) and the named secrets, and
drops everything else.

``{cwd}`` and ``{run_dir}`` are the only placeholders (``{{``/``}}`` for literal braces); they are
substituted by `EnvironmentProfile.resolve` when a run is prepared. OmegaConf interpolation
(``${...}``) is refused anywhere in the file: a profile must mean the same on every node.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from koochak.storage.strict_json import is_exact_int

__all__ = [
    "CHECKS",
    "PROFILE_VERSION",
    "RUNTIME_OWNED",
    "EnvironmentProfile",
    "load_environment_profile",
    "substitute",
]

PROFILE_VERSION = 1
CHECKS = ("c_compiler", "cuda", "torch_compile")
# Identity the scheduler or the user session owns: inherited from the node at run time, so a
# profile may not set it. A trailing * is a prefix match.
RUNTIME_OWNED = (
    "HOME",
    "USER",
    "LOGNAME",
    "LANG",
    "LC_*",
    "TMPDIR",
    "XDG_RUNTIME_DIR",
    "SLURM_*",
    "SCRUFFY_*",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "GPU_DEVICE_ORDINAL",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    # torch's launcher (koochak.loop.launch, torchrun): its ranks reach the launcher's own
    # rendezvous store through TORCHELASTIC_USE_AGENT_STORE; without it rank 0 binds the port
    # the launcher already holds (EADDRINUSE). GROUP_* are the node's rank and count.
    "TORCHELASTIC_*",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
)
PLACEHOLDERS = ("cwd", "run_dir")

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PACKAGE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_TOP = {"version", "id", "python", "environment", "requirements", "preflight"}
_TOP_REQUIRED = {"version", "id", "python"}
_ENVIRONMENT = {"set", "secrets", "create_directories"}
_REQUIREMENTS = {"executables", "files", "packages"}


def is_runtime_owned(name: str, patterns: Sequence[str] = RUNTIME_OWNED) -> bool:
    """True when ``name`` matches one of ``patterns`` (exactly, or by prefix for ``X*``)."""
    for pattern in patterns:
        if pattern.endswith("*"):
            if name.startswith(pattern[:-1]):
                return True
        elif name == pattern:
            return True
    return False


def substitute(template: str, values: Mapping[str, str], where: str) -> str:
    """Replace ``{cwd}``/``{run_dir}`` in ``template``; any other placeholder is a ValueError."""
    parts = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(
            f"{where}: {exc} in {template!r}; write literal braces as {{{{ }}}}"
        ) from None
    for literal, name, spec, conversion in parsed:
        parts.append(literal)
        if name is None:
            continue
        if name not in PLACEHOLDERS or spec or conversion:
            raise ValueError(
                f"{where}: unsupported placeholder {{{name}}} in {template!r}; only {{cwd}} and "
                "{run_dir} are substituted"
            )
        parts.append(values[name])
    return "".join(parts)


def _check_template(template: str, where: str) -> None:
    substitute(template, {"cwd": "/", "run_dir": "/"}, where)


def _check_absolute_template(template: str, where: str) -> None:
    if not substitute(template, {"cwd": "/c", "run_dir": "/r"}, where).startswith("/"):
        raise ValueError(
            f"{where}: {template!r} is not an absolute path; start it with '/', {{cwd}} or "
            "{run_dir}"
        )


@dataclass(frozen=True)
class EnvironmentProfile:
    """A checked profile. Build it with `load_environment_profile`; direct construction runs the
    same checks (``source`` is only used to name the profile in errors)."""

    profile_id: str
    python: str
    variables: Mapping[str, str]
    secrets: tuple[str, ...] = ()
    create_directories: tuple[str, ...] = ()
    executables: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    packages: Mapping[str, str] = field(default_factory=dict)
    preflight: tuple[str, ...] = ()
    source: str = field(default="<profile>", compare=False)

    def __post_init__(self) -> None:
        where = self.source
        set_ = object.__setattr__
        if not isinstance(self.profile_id, str) or not _ID.fullmatch(self.profile_id):
            raise ValueError(
                f"{where}: field 'id'={self.profile_id!r}; expected letters, digits, '_', '.', "
                "'-' (at most 128, starting with a letter or digit)"
            )
        if not isinstance(self.python, str) or not os.path.isabs(self.python):
            raise ValueError(f"{where}: field 'python'={self.python!r}; expected an absolute path")
        variables = _string_map(self.variables, f"{where}: field 'environment.set'")
        for name, value in variables.items():
            here = f"{where}: field 'environment.set.{name}'"
            if not _ENV_NAME.fullmatch(name):
                raise ValueError(f"{here}: not a valid environment variable name")
            if "\0" in value:
                raise ValueError(f"{here}: value contains a NUL byte")
            if is_runtime_owned(name):
                raise ValueError(
                    f"{here}: cannot override runtime-owned {name}; the scheduler or session "
                    "provides it and the runner inherits it"
                )
            _check_template(value, here)
        if "PATH" not in variables:
            raise ValueError(
                f"{where}: field 'environment.set.PATH' is required; list absolute directories "
                "so every node finds the same programs"
            )
        entries = variables["PATH"].split(":")
        for entry in entries:
            if not substitute(entry, {"cwd": "/c", "run_dir": "/r"}, where).startswith("/"):
                raise ValueError(
                    f"{where}: field 'environment.set.PATH': entry {entry!r} is not absolute "
                    "(an empty entry means the current directory)"
                )
        for name in ("CC", "CXX"):
            if name in variables and not os.path.isabs(variables[name]):
                raise ValueError(
                    f"{where}: field 'environment.set.{name}'={variables[name]!r}; a compiler "
                    "must be an absolute path"
                )
        secrets = _string_tuple(self.secrets, f"{where}: field 'environment.secrets'")
        for name in secrets:
            here = f"{where}: field 'environment.secrets'"
            if not _ENV_NAME.fullmatch(name):
                raise ValueError(f"{here}: {name!r} is not an exact environment variable name")
            if is_runtime_owned(name):
                raise ValueError(f"{here}: secrets cannot override runtime-owned {name}")
            if name in variables:
                raise ValueError(
                    f"{here}: {name} is also in environment.set; a secret's value must come "
                    "from the node, never from the profile"
                )
        _no_repeats(secrets, f"{where}: field 'environment.secrets'")
        directories = _string_tuple(
            self.create_directories, f"{where}: field 'environment.create_directories'"
        )
        for entry in directories:
            _check_absolute_template(entry, f"{where}: field 'environment.create_directories'")
        executables = _string_tuple(self.executables, f"{where}: field 'requirements.executables'")
        for entry in executables:
            if not os.path.isabs(entry):
                raise ValueError(
                    f"{where}: field 'requirements.executables': {entry!r} is not an absolute path"
                )
        files = _string_tuple(self.files, f"{where}: field 'requirements.files'")
        for entry in files:
            _check_absolute_template(entry, f"{where}: field 'requirements.files'")
        packages = _string_map(self.packages, f"{where}: field 'requirements.packages'")
        for name, version in packages.items():
            here = f"{where}: field 'requirements.packages.{name}'"
            if not _PACKAGE.fullmatch(name):
                raise ValueError(f"{here}: not an importable module name")
            if not version.strip():
                raise ValueError(f'{here}: expected a version string such as "2.8.0", or "*"')
        preflight = _string_tuple(self.preflight, f"{where}: field 'preflight'")
        for check in preflight:
            if check not in CHECKS:
                raise ValueError(
                    f"{where}: field 'preflight': unknown check {check!r}; expected some of "
                    f"{', '.join(CHECKS)}"
                )
        _no_repeats(preflight, f"{where}: field 'preflight'")
        if "c_compiler" in preflight and "CC" not in variables:
            raise ValueError(
                f"{where}: field 'preflight': c_compiler requires an explicit CC in environment.set"
            )
        if "torch_compile" in preflight and not {"CC", "CXX"} <= set(variables):
            raise ValueError(
                f"{where}: field 'preflight': torch_compile requires explicit CC and CXX in "
                "environment.set"
            )
        set_(self, "variables", MappingProxyType(dict(sorted(variables.items()))))
        set_(self, "packages", MappingProxyType(dict(sorted(packages.items()))))
        set_(self, "secrets", secrets)
        set_(self, "create_directories", directories)
        set_(self, "executables", executables)
        set_(self, "files", files)
        set_(self, "preflight", preflight)

    def to_dict(self) -> dict[str, Any]:
        """The profile as a plain, canonical document (what its digest covers)."""
        return {
            "version": PROFILE_VERSION,
            "id": self.profile_id,
            "python": self.python,
            "environment": {
                "set": dict(self.variables),
                "secrets": list(self.secrets),
                "create_directories": list(self.create_directories),
            },
            "requirements": {
                "executables": list(self.executables),
                "files": list(self.files),
                "packages": dict(self.packages),
            },
            "preflight": list(self.preflight),
        }

    @property
    def sha256(self) -> str:
        """Stable digest: SHA256 of the canonical JSON of `to_dict` (not of the file's bytes, so
        comments, key order and quoting do not change it)."""
        return canonical_sha256(self.to_dict())

    def resolve(self, *, cwd: str, run_dir: str) -> dict[str, Any]:
        """The launch manifest's ``environment`` section for one run: placeholders substituted,
        secret names only (their values are read by the runner on the node)."""
        for name, value in (("cwd", cwd), ("run_dir", run_dir)):
            if not isinstance(value, str) or not os.path.isabs(value):
                raise ValueError(
                    f"{self.source}: resolve({name}={value!r}): expected an absolute path"
                )
        values = {"cwd": cwd, "run_dir": run_dir}

        def sub(text: str, where: str) -> str:
            return substitute(text, values, f"{self.source}: field {where!r}")

        return {
            "profile_id": self.profile_id,
            "profile_sha256": self.sha256,
            "python": self.python,
            "set": {k: sub(v, f"environment.set.{k}") for k, v in self.variables.items()},
            "inherit": list(RUNTIME_OWNED),
            "secrets": list(self.secrets),
            "create_directories": [
                sub(d, "environment.create_directories") for d in self.create_directories
            ],
            "executables": list(self.executables),
            "files": [sub(f, "requirements.files") for f in self.files],
            "packages": dict(self.packages),
            "preflight": list(self.preflight),
        }


def canonical_sha256(doc: Any) -> str:
    """SHA256 of ``doc`` as compact, key-sorted UTF-8 JSON."""
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def load_environment_profile(path: str | os.PathLike[str]) -> EnvironmentProfile:
    """Read and check a profile file; every refusal is one ValueError naming the file and field."""
    from koochak.storage.strict_yaml import load_yaml_file  # the runner never parses YAML

    where = os.fspath(path)
    try:
        doc = load_yaml_file(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{where}: environment profile not found") from None
    _no_interpolation(doc, where, "")
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: an environment profile must be a YAML mapping")
    _exact_keys(doc, _TOP, _TOP_REQUIRED, where, "the profile")
    version = doc["version"]
    if not is_exact_int(version) or version != PROFILE_VERSION:
        raise ValueError(
            f"{where}: field 'version'={version!r}; this Koochak reads profile version "
            f"{PROFILE_VERSION}"
        )
    environment = _section(doc, "environment", _ENVIRONMENT, where)
    requirements = _section(doc, "requirements", _REQUIREMENTS, where)
    return EnvironmentProfile(
        profile_id=doc["id"],
        python=doc["python"],
        variables=environment.get("set", {}),
        secrets=environment.get("secrets", []),
        create_directories=environment.get("create_directories", []),
        executables=requirements.get("executables", []),
        files=requirements.get("files", []),
        packages=requirements.get("packages", {}),
        preflight=doc.get("preflight", []),
        source=where,
    )


def _section(doc: dict[str, Any], name: str, keys: set[str], where: str) -> dict[str, Any]:
    section = doc.get(name)
    if section is None:
        if name in doc:
            raise ValueError(f"{where}: field {name!r} is empty; give a mapping or leave it out")
        return {}
    if not isinstance(section, dict):
        raise ValueError(f"{where}: field {name!r} must be a mapping")
    _exact_keys(section, keys, set(), where, f"field {name!r}")
    return section


def _exact_keys(
    doc: dict[Any, Any], allowed: set[str], required: set[str], where: str, what: str
) -> None:
    for key in doc:
        if not isinstance(key, str):
            raise ValueError(f"{where}: {what} has a non-string key {key!r}")
    unexpected = sorted(set(doc) - allowed)
    if unexpected:
        prefix = "" if what == "the profile" else what.split("'")[1] + "."
        raise ValueError(
            f"{where}: field '{prefix}{unexpected[0]}' is not part of the profile schema; "
            f"{what} takes {', '.join(sorted(allowed))}"
        )
    missing = sorted(required - set(doc))
    if missing:
        raise ValueError(f"{where}: field {missing[0]!r} is required")


def _no_interpolation(value: Any, where: str, at: str) -> None:
    if isinstance(value, str) and "${" in value:
        raise ValueError(
            f"{where}: field {at or '(top)'!r}: OmegaConf interpolation ${{...}} is not allowed in "
            "a profile; write the value out, or use {cwd}/{run_dir}"
        )
    if isinstance(value, dict):
        for key, item in value.items():
            _no_interpolation(key, where, at)
            _no_interpolation(item, where, f"{at}.{key}" if at else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _no_interpolation(item, where, f"{at}[{index}]")


def _string_tuple(value: Any, where: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"{where}: expected a list of strings, got {type(value).__name__}")
    for item in value:
        if not isinstance(item, str) or not item:
            raise ValueError(f"{where}: expected non-empty strings, got {item!r}")
    return tuple(value)


def _string_map(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: expected a mapping of names to strings")
    out = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise ValueError(f"{where}: key {key!r} is not a string")
        if not isinstance(item, str):
            raise ValueError(
                f"{where} key {key!r}: expected a string, got {type(item).__name__} {item!r}; "
                'quote it in YAML ("2.8.0", "1", "true")'
            )
        out[key] = item
    return out


def _no_repeats(items: tuple[str, ...], where: str) -> None:
    seen: set[str] = set()
    for item in items:
        if item in seen:
            raise ValueError(f"{where}: {item!r} appears twice")
        seen.add(item)
