"""The isolated runner: ``koochak-run MANIFEST SHA256`` (or ``python -I -m koochak.jobs.runner``).

What a scheduler starts on the node. In order, and nothing of the workload runs before the end:

1. verify the launch manifest's SHA256 and read it strictly;
2. rebuild the environment: the profile's ``set``, the runtime-owned identity the node provides,
   the named secrets; everything else (PYTHONPATH, NCCL_*, the ambient PATH ...) is dropped;
3. verify the config's digest, create the declared directories;
4. check requirements: the interpreter, executables, files (waiting out ETIME/EIO/lost
   connections), package versions as the target interpreter sees them;
5. run the preflight checks (``c_compiler``, ``cuda``, ``torch_compile``);
6. write ``preflight.json``, then start the workload as a managed child in its own process
   group, forwarding SIGUSR1/SIGTERM/SIGINT to that group only;
7. after a successful exit, validate every declared output and publish its artifact event.

Exit codes: `koochak.jobs.exit_codes`. A failed check prints one JSON line on stderr,
``{"kind": "environment_preflight_failed", "check": ..., "error": ...}``, and exits 78.
"""

from __future__ import annotations

import signal as _signal

# Started as a program: catch evacuation and stop requests from the first instant, before the
# imports below; main() takes them over. (Imported as a library, nothing is installed.)
_EARLY: list[int] = []
if __name__ == "__main__":
    for _signum in (_signal.SIGUSR1, _signal.SIGTERM, _signal.SIGINT):
        _signal.signal(_signum, lambda signum, frame: _EARLY.append(signum))

import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Callable, Mapping  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from typing import Any  # noqa: E402

from koochak.events.secrets import (  # noqa: E402
    SECRET_NAMES_VARIABLE,
    mask_secrets,
    mask_strings,
    secret_names_value,
)
from koochak.jobs.child import (  # noqa: E402
    Signals,
    become_subreaper,
    children_now,
    run_managed,
    terminate_leftovers,
)
from koochak.jobs.environment import build_environment, environment_sha256  # noqa: E402
from koochak.jobs.exit_codes import (  # noqa: E402
    EXIT_CHECKPOINT_ACK_TIMEOUT,
    EXIT_EVACUATED,
    EXIT_OK,
    EXIT_PREFLIGHT_FAILED,
    EXIT_PUBLICATION_REJECTED,
    EXIT_USAGE,
    exit_code_for_signal,
)
from koochak.jobs.manifest import parse_manifest  # noqa: E402
from koochak.jobs.outputs import DeclaredOutput  # noqa: E402
from koochak.jobs.preflight import PreflightError, run_check  # noqa: E402
from koochak.jobs.requirements import (  # noqa: E402
    DEFAULT_FILE_WAIT_S,
    check_executables,
    check_interpreter,
    check_packages,
    interpreter_flags,
    wait_for_file,
)
from koochak.storage.store import TEMP_PREFIX  # noqa: E402

__all__ = ["PREFLIGHT_VERSION", "USAGE", "execute_manifest", "main"]

PREFLIGHT_VERSION = 1
USAGE = "usage: koochak-run [--preflight-only] [--file-wait-seconds S] [--debug] MANIFEST SHA256"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_MAX_MANIFEST = 16 << 20


class _Usage(Exception):
    pass


def _parse_args(argv: list[str]) -> dict[str, Any]:
    options: dict[str, Any] = {
        "preflight_only": False,
        "file_wait_s": DEFAULT_FILE_WAIT_S,
        "debug": False,
    }
    positional = []
    args = iter(argv)
    for arg in args:
        if arg == "--preflight-only":
            options["preflight_only"] = True
        elif arg == "--debug":
            options["debug"] = True
        elif arg == "--file-wait-seconds" or arg.startswith("--file-wait-seconds="):
            raw = arg.partition("=")[2] if "=" in arg else next(args, "")
            try:
                options["file_wait_s"] = float(raw)
            except ValueError:
                raise _Usage(f"--file-wait-seconds {raw!r}: expected a number of seconds") from None
            if not (math.isfinite(options["file_wait_s"]) and options["file_wait_s"] >= 0):
                raise _Usage(f"--file-wait-seconds {raw!r}: expected a finite number >= 0")
        elif arg in ("-h", "--help"):
            options["help"] = True
        elif arg.startswith("--"):
            raise _Usage(f"unknown option {arg}")
        else:
            positional.append(arg)
    if options.get("help"):
        return options
    if len(positional) != 2:
        raise _Usage(f"expected MANIFEST and SHA256, got {len(positional)} argument(s)")
    if not _SHA256.fullmatch(positional[1]):
        raise _Usage(f"SHA256 {positional[1]!r}: expected 64 lower-case hex digits")
    options["manifest"], options["sha256"] = positional
    return options


def main(argv: list[str] | None = None) -> int:
    """The CLI; returns the exit code (see the module docstring)."""
    signals = Signals()
    signals.install()  # first of all: an evacuation request from now on is never lost
    signals.pending.extend(_EARLY)  # and one that came while this module was loading
    _EARLY.clear()
    try:
        try:
            options = _parse_args(list(sys.argv[1:] if argv is None else argv))
        except _Usage as exc:
            print(f"koochak-run: {exc}; {USAGE}", file=sys.stderr)
            return EXIT_USAGE
        if options.get("help"):
            print(f"{USAGE}\n\n{__doc__}")
            return EXIT_OK
        return execute_manifest(
            options["manifest"],
            options["sha256"],
            preflight_only=options["preflight_only"],
            file_wait_s=options["file_wait_s"],
            signals=signals,
            debug=options["debug"],
        )
    finally:
        signals.restore()


# -- the steps ------------------------------------------------------------------------------


class _Record:
    """``preflight.json``: rewritten atomically as the run moves from check to outcome.

    Also what the runner knows of the profile's secrets (``{name: value}``, never written): the
    fields that hold foreign output (``error``, ``observed``) are masked with them on every
    write, and so is every line the runner prints.
    """

    def __init__(self) -> None:
        self.path: str | None = None
        self.doc: dict[str, Any] = {}
        self.secrets: dict[str, str] = {}

    def mask(self, text: str) -> str:
        return mask_secrets(text, self.secrets)

    def start(self, path: str, **fields: Any) -> None:
        self.path = path
        self.doc = {
            "version": PREFLIGHT_VERSION,
            "state": "checking",
            "preflight_only": False,
            "environment_sha256": None,
            "checks": [],
            "observed": {},
            **fields,
        }

    def write(self, state: str, **fields: Any) -> None:
        if self.path is None:  # the manifest was not trusted: nowhere safe to write
            return
        self.doc.update(fields, state=state)
        for key in ("error", "observed"):
            if key in self.doc:
                self.doc[key] = mask_strings(self.doc[key], self.secrets)
        self.doc["recorded_at"] = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        _replace_file(self.path, (json.dumps(self.doc, indent=2, sort_keys=True) + "\n").encode())


def _replace_file(path: str, content: bytes) -> None:
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    temp = os.path.join(parent, f"{TEMP_PREFIX}{uuid.uuid4().hex}-{os.path.basename(path)}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
    try:
        try:
            view = memoryview(content)
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, 0o444)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)  # the one job file that is replaced: it records a state
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise
    dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _read_verified(path: str, expected: str) -> dict[str, Any]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise PreflightError(
            "manifest", f"cannot read launch manifest {path}: {exc.strerror}"
        ) from None
    try:
        parts, size = [], 0
        while size <= _MAX_MANIFEST and (block := os.read(fd, 1 << 20)):
            parts.append(block)
            size += len(block)
    finally:
        os.close(fd)
    data = b"".join(parts)
    digest = hashlib.sha256(data).hexdigest()
    if digest != expected:
        raise PreflightError(
            "manifest",
            f"launch manifest digest differs: expected {expected}, got {digest} ({path})",
        )
    try:
        return parse_manifest(data, path)
    except ValueError as exc:
        raise PreflightError("manifest", str(exc)) from None


def _check_config(config: Mapping[str, str] | None) -> None:
    if config is None:
        return
    try:
        fd = os.open(config["path"], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            sha = hashlib.sha256()
            while block := os.read(fd, 1 << 20):
                sha.update(block)
        finally:
            os.close(fd)
    except OSError as exc:
        raise PreflightError(
            "config", f"cannot read config {config['path']}: {exc.strerror}"
        ) from None
    if sha.hexdigest() != config["sha256"]:
        raise PreflightError(
            "config",
            f"config digest differs: {config['path']} has {sha.hexdigest()}, the manifest pins "
            f"{config['sha256']}",
        )


def _create_directories(paths: list[str]) -> None:
    for path in paths:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise PreflightError(
                "directories", f"cannot create {path}: {exc.strerror or exc}"
            ) from None


def _fail(record: _Record, check: str, error: str) -> int:
    _say(record, {"kind": "environment_preflight_failed", "check": check, "error": error})
    return EXIT_PREFLIGHT_FAILED


def _say(record: _Record, line: dict[str, Any]) -> None:
    """One JSON line on stderr, its text masked first (then encoded: no escaped leftovers)."""
    print(
        json.dumps(mask_strings(line, record.secrets), ensure_ascii=True),
        file=sys.stderr,
        flush=True,
    )


def _stopped_by(signals: Signals) -> int | None:
    """Exit code for a signal that arrived before the workload started, if one did."""
    import signal

    if not signals.pending:
        return None
    for signum in signals.pending:
        if signum != signal.SIGUSR1:
            return exit_code_for_signal(signum)
    return EXIT_EVACUATED


def execute_manifest(
    manifest_path: str,
    expected_sha256: str,
    *,
    preflight_only: bool = False,
    file_wait_s: float = DEFAULT_FILE_WAIT_S,
    signals: Signals | None = None,
    ambient: Mapping[str, str] | None = None,
    publisher: Callable[[Mapping[str, str]], Callable[..., Any]] | None = None,
    debug: bool = False,
) -> int:
    """Run the manifest's checks and workload; return the runner's exit code."""
    signals = signals if signals is not None else Signals()
    ambient = os.environ if ambient is None else ambient
    record = _Record()
    try:
        return _execute(
            manifest_path,
            expected_sha256,
            preflight_only,
            file_wait_s,
            signals,
            ambient,
            publisher,
            record,
        )
    except PreflightError as exc:
        stopped = _stopped_by(signals)
        if stopped is not None:  # a check killed by the same signal is not the check's fault
            _safe_write(record, "evacuated" if stopped == EXIT_EVACUATED else "stopped")
            return stopped
        _safe_write(record, "failed", check=exc.check, error=str(exc))
        return _fail(record, exc.check, str(exc))
    except Exception as exc:  # a bug or an unreadable run directory: still one line, fail closed
        if debug:
            print(record.mask(traceback.format_exc()), file=sys.stderr, end="", flush=True)
        error = f"{type(exc).__name__}: {exc}"
        _safe_write(record, "failed", check="runner", error=error)
        return _fail(record, "runner", error)


def _safe_write(record: _Record, state: str, **fields: Any) -> None:
    try:
        record.write(state, **fields)
    except OSError:
        pass  # the stderr line still says what happened


def _execute(
    manifest_path: str,
    expected_sha256: str,
    preflight_only: bool,
    file_wait_s: float,
    signals: Signals,
    ambient: Mapping[str, str],
    publisher: Callable[[Mapping[str, str]], Callable[..., Any]] | None,
    record: _Record,
) -> int:
    doc = _read_verified(manifest_path, expected_sha256)
    env_section = doc["environment"]
    record.start(
        doc["preflight_path"],
        manifest_path=os.path.abspath(manifest_path),
        manifest_sha256=expected_sha256,
        profile_id=env_section["profile_id"],
        profile_sha256=env_section["profile_sha256"],
        preflight_only=preflight_only,
    )
    clean = build_environment(env_section, ambient)
    record.secrets = {name: clean[name] for name in env_section["secrets"]}
    record.doc["environment_sha256"] = environment_sha256(
        clean, env_section["secrets"], env_section["inherit"]
    )
    _check_config(doc["config"])
    _create_directories(env_section["create_directories"])
    python, argv, cwd = env_section["python"], doc["argv"], doc["cwd"]
    flags = interpreter_flags(argv)
    # From here on foreign code runs (checks, then the workload): whatever it leaves running,
    # also a daemon that double-forked out of its group, is reparented to the runner.
    become_subreaper()
    known = children_now()
    observed = record.doc["observed"]
    try:
        observed.update(check_interpreter(python))
        observed.update(check_executables(env_section["executables"]))
        for path in env_section["files"]:
            wait_for_file(path, file_wait_s)
            observed[f"file:{path}"] = "available"
        if not os.path.isdir(cwd):
            raise PreflightError("requirements.cwd", f"working directory {cwd} does not exist")
        observed.update(
            check_packages(
                env_section["packages"],
                python=python,
                flags=flags,
                env=clean,
                cwd=cwd,
                secrets=record.secrets,
            )
        )
        _no_leftovers("requirements.packages", known)
        for check in env_section["preflight"]:
            if signals.pending:
                break
            observed[check] = run_check(
                check,
                python=python,
                env=clean,
                cwd=cwd,
                flags=flags,
                preflight=env_section["preflight"],
                secrets=record.secrets,
            )
            _no_leftovers(check, known)
            record.doc["checks"].append(check)
    except BaseException:
        terminate_leftovers(None, known)  # what a failed or interrupted check left running
        raise

    publish = None
    if doc["outputs"]:  # can they be published? Find out now, not after hours of training
        publish = _publisher(publisher, clean)
        observed["outputs"] = "publisher ready"

    stopped = _stopped_by(signals)
    if stopped is not None:
        record.write("evacuated" if stopped == EXIT_EVACUATED else "stopped")
        return stopped
    record.write("passed")
    if preflight_only:  # say so: a silent exit 0 reads like nothing was checked
        checks = ", ".join(["manifest", "config", "requirements", *record.doc["checks"]])
        print(f"koochak-run: preflight passed ({checks}); recorded in {record.path}", flush=True)
        return EXIT_OK

    # The workload masks what it writes with the same values: it learns the names, never more.
    workload_env = {k: v for k, v in clean.items() if k != SECRET_NAMES_VARIABLE}
    if record.secrets:
        workload_env[SECRET_NAMES_VARIABLE] = secret_names_value(record.secrets)
    returncode, left_behind = run_managed(argv, cwd=cwd, env=workload_env, signals=signals)
    code = exit_code_for_signal(-returncode) if returncode < 0 else returncode
    record.doc["child_returncode"] = code
    if left_behind:
        message = (
            f"managed workload left background descendants ({_pids(left_behind)}: in its "
            "process group, or orphans that left it, e.g. a daemon after setsid(), reparented "
            f"to the runner); they were terminated (workload exit {code})"
        )
        if code == 0:
            raise PreflightError("descendants", message)
        _say(record, {"kind": "managed_workload_notice", "error": message})
    if code != 0:
        record.write("failed", child_returncode=code)
        return code
    if publish is not None:
        return _publish(doc["outputs"], clean, publish, record)
    record.write("completed", child_returncode=0, outputs=[])
    return EXIT_OK


def _no_leftovers(check: str, known: frozenset[int]) -> None:
    """A check's subprocess must not leave anything running (a compiler wrapper or an imported
    package that starts a daemon): end it and fail closed, naming the check."""
    left = terminate_leftovers(None, known)
    if left:
        raise PreflightError(
            check,
            f"the {check} check left background processes running ({_pids(left)}); they were "
            "terminated",
        )


def _pids(pids: list[int]) -> str:
    shown = ", ".join(str(p) for p in pids[:8])
    return f"{len(pids)} process(es): {shown}{' ...' if len(pids) > 8 else ''}"


def _publisher(
    factory: Callable[[Mapping[str, str]], Callable[..., Any]] | None, clean: Mapping[str, str]
) -> Callable[..., Any]:
    from koochak.jobs.publish import scruffy_publisher

    try:
        return (factory or scruffy_publisher)(clean)
    except (ImportError, ValueError, RuntimeError) as exc:
        raise PreflightError("outputs", str(exc)) from None


def _publish(
    outputs: list[DeclaredOutput],
    clean: Mapping[str, str],
    publish: Callable[..., Any],
    record: _Record,
) -> int:
    from koochak.events import ArtifactAckTimeout, ArtifactNotAccepted
    from koochak.jobs.publish import publish_outputs

    try:
        event_ids = publish_outputs(outputs, publish, job_id=clean.get("SCRUFFY_JOB_ID"))
    except ArtifactAckTimeout as exc:
        record.write("failed", child_returncode=0, check="outputs", error=str(exc))
        _fail(record, "outputs", str(exc))
        return EXIT_CHECKPOINT_ACK_TIMEOUT
    except ArtifactNotAccepted as exc:
        record.write("failed", child_returncode=0, check="outputs", error=str(exc))
        _fail(record, "outputs", str(exc))
        return EXIT_PUBLICATION_REJECTED
    except (ValueError, RuntimeError) as exc:
        raise PreflightError("outputs", str(exc)) from None
    record.write(
        "completed",
        child_returncode=0,
        outputs=[o.artifact_id for o in outputs],
        event_ids=event_ids,
    )
    return EXIT_OK


if __name__ == "__main__":
    if not sys.flags.isolated:  # started without -I: start again isolated, before any work
        os.execv(sys.executable, [sys.executable, "-I", "-m", "koochak.jobs.runner", *sys.argv[1:]])
    sys.exit(main())
