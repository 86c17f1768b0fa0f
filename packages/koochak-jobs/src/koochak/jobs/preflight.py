"""The built-in preflight checks, run by the runner before any user code starts.

* ``c_compiler``: compile and run a tiny C program with ``$CC`` (Triton and Inductor build C
  helpers at run time; a missing or broken compiler fails here, not mid-training).
* ``cuda``: in the target interpreter, torch sees a device and a synchronised kernel gives the
  right answer.
* ``torch_compile``: in the target interpreter, a small function compiled with Inductor gives
  the same result as eager mode, on CUDA when the profile also checks ``cuda``, else on CPU.

torch is only ever imported by these subprocesses, never by the runner itself. Every failure
is a `PreflightError` naming the check, with the tail of what the check printed: foreign output,
so the values of the profile's secrets (``secrets=``) are masked in it before it is cut.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from koochak.events.secrets import mask_secrets

__all__ = ["CHECK_TIMEOUT_S", "PreflightError", "run_check", "run_python"]

CHECK_TIMEOUT_S = {"c_compiler": 120.0, "cuda": 300.0, "torch_compile": 900.0}
_TAIL = 2000


class PreflightError(RuntimeError):
    """A preflight or contract check failed; ``check`` names it (``manifest``, ``secrets``,
    ``requirements.files``, ``c_compiler`` ...)."""

    def __init__(self, check: str, message: str) -> None:
        super().__init__(message)
        self.check = check


def _tail(text: str, secrets: Mapping[str, str] | None) -> str:
    # Masked first: a cut through a secret's value would leave part of it unmasked.
    text = mask_secrets(text.strip(), secrets or {})
    return text if len(text) <= _TAIL else "..." + text[-_TAIL:]


def run_python(
    python: str,
    flags: Sequence[str],
    code: str,
    args: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: str,
    timeout: float,
    check: str,
    secrets: Mapping[str, str] | None = None,
) -> Any:
    """Run ``code`` in the target interpreter; return the JSON its last stdout line holds.
    ``secrets`` (``{name: value}``) are masked in the output a failure quotes."""
    argv = [python, *flags, "-c", code, *args]
    try:
        done = subprocess.run(
            argv,
            env=dict(env),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise PreflightError(check, f"{check} check did not finish within {timeout:g} s") from None
    except OSError as exc:
        raise PreflightError(check, f"{check} check could not start {python}: {exc}") from None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        output = _tail(done.stderr or done.stdout, secrets)
        raise PreflightError(check, f"{check} check failed (exit {done.returncode}): {output}")
    try:
        return json.loads(lines[-1])
    except ValueError:
        raise PreflightError(
            check, f"{check} check printed no result: {_tail(done.stdout, secrets)}"
        ) from None


def _c_compiler(
    python: str,
    env: Mapping[str, str],
    cwd: str,
    flags: Sequence[str],
    preflight: Sequence[str],
    secrets: Mapping[str, str],
) -> dict[str, Any]:
    cc = env.get("CC", "")
    if not os.path.isabs(cc) or not os.access(cc, os.X_OK) or not os.path.isfile(cc):
        raise PreflightError("c_compiler", f"CC={cc!r} is not an executable file")
    timeout = CHECK_TIMEOUT_S["c_compiler"]
    with tempfile.TemporaryDirectory(prefix="koochak-cc-") as work:
        source = os.path.join(work, "check.c")
        program = os.path.join(work, "check")
        with open(source, "w", encoding="ascii") as f:
            f.write(
                '#include <stdio.h>\nint main(void) { printf("koochak-cc %d\\n", 6 * 7); '
                "return 0; }\n"
            )
        for argv, what in (([cc, "-o", program, source], "compiling"), ([program], "running")):
            try:
                done = subprocess.run(
                    argv,
                    env=dict(env),
                    cwd=work,
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                    stdin=subprocess.DEVNULL,
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise PreflightError(
                    "c_compiler", f"{what} a C program with {cc}: {_tail(str(exc), secrets)}"
                ) from None
            if done.returncode != 0:
                raise PreflightError(
                    "c_compiler",
                    f"{what} a C program with {cc} failed (exit {done.returncode}): "
                    f"{_tail(done.stderr + done.stdout, secrets)}",
                )
        if done.stdout.strip() != "koochak-cc 42":
            printed = _tail(repr(done.stdout), secrets)
            raise PreflightError("c_compiler", f"the program {cc} built printed {printed}")
    return {"cc": cc}


_CUDA = """
import json, torch
if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
    raise SystemExit("torch " + torch.__version__ + " sees no CUDA device")
x = torch.arange(1024, device="cuda", dtype=torch.float32)
total = float((x * 2).sum())
torch.cuda.synchronize()
if total != 1047552.0:
    raise SystemExit(f"a CUDA kernel returned {total}, expected 1047552.0")
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                  "devices": torch.cuda.device_count(),
                  "device_name": torch.cuda.get_device_name(0)}))
"""


def _cuda(
    python: str,
    env: Mapping[str, str],
    cwd: str,
    flags: Sequence[str],
    preflight: Sequence[str],
    secrets: Mapping[str, str],
) -> dict[str, Any]:
    return run_python(
        python,
        flags,
        _CUDA,
        [],
        env=env,
        cwd=cwd,
        timeout=CHECK_TIMEOUT_S["cuda"],
        check="cuda",
        secrets=secrets,
    )


_TORCH_COMPILE = """
import json, sys, torch
device = sys.argv[1]
def f(x, y):
    return torch.sin(x) * y + torch.cos(y) * 2
compiled = torch.compile(f, backend="inductor", fullgraph=True)
x = torch.linspace(-2.0, 2.0, 4099, device=device)
y = torch.linspace(1.0, 3.0, 4099, device=device)
out = compiled(x, y)
if device == "cuda":
    torch.cuda.synchronize()
if not torch.allclose(out, f(x, y), rtol=1e-5, atol=1e-5):
    raise SystemExit("torch.compile (inductor) result differs from eager")
print(json.dumps({"torch": torch.__version__, "device": device, "backend": "inductor"}))
"""


def _torch_compile(
    python: str,
    env: Mapping[str, str],
    cwd: str,
    flags: Sequence[str],
    preflight: Sequence[str],
    secrets: Mapping[str, str],
) -> dict[str, Any]:
    device = "cuda" if "cuda" in preflight else "cpu"
    return run_python(
        python,
        flags,
        _TORCH_COMPILE,
        [device],
        env=env,
        cwd=cwd,
        timeout=CHECK_TIMEOUT_S["torch_compile"],
        check="torch_compile",
        secrets=secrets,
    )


_CHECKS: dict[str, Callable[..., dict[str, Any]]] = {
    "c_compiler": _c_compiler,
    "cuda": _cuda,
    "torch_compile": _torch_compile,
}


def run_check(
    name: str,
    *,
    python: str,
    env: Mapping[str, str],
    cwd: str,
    flags: Sequence[str],
    preflight: Sequence[str],
    secrets: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Run one built-in check; return what it observed. A failure's message quotes the check's
    output with the values of ``secrets`` (``{name: value}``) masked."""
    return _CHECKS[name](python, env, cwd, flags, preflight, dict(secrets or {}))
