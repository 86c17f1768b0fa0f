"""Requirement checks on the node: the interpreter, executables, files and package versions.

Required files may sit on an object-storage mount that answers ``ETIME``/``EIO`` for minutes
after another node closed a file, or a lost connection while its client reconnects: those
errors (``koochak.storage.store.SETTLING_ERRNOS``) are waited out, up to 15 minutes by default.
A missing file or any other error fails at once. Package versions are read by the target
interpreter with the clean environment, i.e. as the workload will see them.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from koochak.events.secrets import mask_secrets
from koochak.jobs.preflight import PreflightError, run_python
from koochak.storage.store import SETTLING_ERRNOS

__all__ = [
    "DEFAULT_FILE_WAIT_S",
    "check_executables",
    "check_interpreter",
    "check_packages",
    "interpreter_flags",
    "wait_for_file",
]

DEFAULT_FILE_WAIT_S = 900.0
# Interpreter options that change what the workload imports; the package check uses the same.
_FLAGS = frozenset({"-I", "-E", "-s", "-S", "-B", "-u", "-O", "-OO", "-b", "-bb", "-q", "-P"})


def interpreter_flags(argv: Sequence[str]) -> list[str]:
    """The leading interpreter options of a workload's argv (after the python itself)."""
    flags = []
    for arg in argv[1:]:
        if arg not in _FLAGS:
            break
        flags.append(arg)
    return flags


def check_interpreter(python: str) -> dict[str, str]:
    """The manifest's python must be an executable file and the one running this runner."""
    if not os.path.isfile(python) or not os.access(python, os.X_OK):
        raise PreflightError("requirements.python", f"python {python} is not an executable file")
    if not _same_interpreter(sys.executable, python):
        raise PreflightError(
            "requirements.python",
            f"runner interpreter differs: the runner runs {sys.executable}, the manifest names "
            f"{python}; start the runner with the profile's python",
        )
    return {"python": python}


def _same_interpreter(running: str, python: str) -> bool:
    """The same path, or a link to the same binary with the same prefix (so another venv's
    python, which links to the same base binary, does not count)."""
    if os.path.normpath(running) == os.path.normpath(python):
        return True
    if os.path.realpath(running) != os.path.realpath(python):
        return False
    venv = os.path.dirname(os.path.dirname(python))
    prefix = venv if os.path.isfile(os.path.join(venv, "pyvenv.cfg")) else sys.base_prefix
    return os.path.realpath(sys.prefix) == os.path.realpath(prefix)


def check_executables(paths: Sequence[str]) -> dict[str, str]:
    observed = {}
    for path in paths:
        if not os.path.isfile(path) or not os.access(path, os.X_OK):
            raise PreflightError(
                "requirements.executables", f"required executable is unavailable: {path}"
            )
        observed[f"executable:{path}"] = "available"
    return observed


def wait_for_file(
    path: str,
    wait_s: float = DEFAULT_FILE_WAIT_S,
    *,
    opener: Callable[[str], int] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Open ``path`` and read one byte, waiting out settling errors for up to ``wait_s``."""
    opener = opener or (lambda p: os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC))
    deadline = clock() + wait_s
    delay = 0.05
    while True:
        try:
            fd = opener(path)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise PreflightError(
                        "requirements.files", f"required file is not a regular file: {path}"
                    )
                os.read(fd, 1)
            finally:
                os.close(fd)
            return
        except OSError as exc:
            remaining = deadline - clock()
            if exc.errno not in SETTLING_ERRNOS or remaining <= 0:
                waited = "" if exc.errno not in SETTLING_ERRNOS else f" after {wait_s:g} s"
                raise PreflightError(
                    "requirements.files",
                    f"required file is unavailable{waited}: {path}: {exc.strerror or exc}",
                ) from None
            sleep(min(delay, remaining))
            delay = min(delay * 2, 5.0)


_PACKAGES = """
import importlib, importlib.metadata, json, sys
result = {}
for name in json.loads(sys.argv[1]):
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing = exc.name or str(exc)
        if missing == name or name.startswith(missing + "."):
            result[name] = {"error": "not importable"}
        else:
            result[name] = {"error": f"is missing a dependency: {missing}"}
        continue
    except Exception as exc:
        result[name] = {"error": f"failed to import: {type(exc).__name__}: {exc}"}
        continue
    version = getattr(module, "__version__", None)
    if not isinstance(version, str):
        try:
            version = importlib.metadata.version(name)
        except Exception:
            version = "unknown"
    result[name] = {"version": str(version)}
print(json.dumps(result))
"""


def _version_matches(pin: str, found: str) -> bool:
    return pin == "*" or found == pin or found.split("+", 1)[0] == pin


def check_packages(
    packages: Mapping[str, str],
    *,
    python: str,
    flags: Sequence[str],
    env: Mapping[str, str],
    cwd: str,
    secrets: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Import every package in the target interpreter; its version must equal the pin (a
    local suffix such as ``+cu132`` may be left out of the pin; ``*`` accepts any).

    What a package says when it fails to import is foreign text: the values of ``secrets``
    (``{name: value}``) are masked in it, and only then is it cut to 300 characters."""
    secrets = secrets or {}
    if not packages:
        return {}
    found = run_python(
        python,
        flags,
        _PACKAGES,
        [json.dumps(sorted(packages))],
        env=env,
        cwd=cwd,
        timeout=600.0,
        check="requirements.packages",
        secrets=secrets,
    )
    observed = {}
    for name, pin in packages.items():
        entry = found.get(name, {"error": "not reported"})
        if "error" in entry:
            error = mask_secrets(str(entry["error"]), secrets)
            error = error if len(error) <= 300 else error[:297] + "..."
            raise PreflightError("requirements.packages", f"required package {name} {error}")
        if not _version_matches(pin, entry["version"]):
            version = mask_secrets(str(entry["version"]), secrets)[:300]
            raise PreflightError(
                "requirements.packages",
                f"required package {name} is version {version}, the profile pins {pin}",
            )
        observed[f"package:{name}"] = entry["version"]
    return observed
