"""Send prepared runs somewhere: into a Scruffy queue, or as a standalone Slurm job via Pazuzu.

Every adapter stages first and submits second, and a failure while staging submits nothing:

- ``submit_scruffy`` / ``submit_scruffy_workflow`` write each run's staged files write-once on
  the shared filesystem, then make exactly one strict Scruffy call (``submit_job`` or
  ``submit_workflow``). Gates and recovery fields are passed as given: a Scruffy that does not
  know one raises its own error, which surfaces. Repeated request ids pass unchanged, which is
  how Scruffy deduplicates a resubmission.
- ``submit_pazuzu`` (async) stages each file through ``client.run(..., stdin=bytes)`` (the
  bytes travel only on stdin, at most 4 MiB per call) into a write-once file on the remote
  side, then makes one ``client.submit_slurm(SlurmJob(...))`` call.

The scheduler gets the prepared runner argv and an empty environment: the real environment
travels inside the hashed launch manifest and the runner rebuilds it. ``scruffy`` and
``pazuzu`` are optional clients, imported only inside the function that needs one.
"""

from __future__ import annotations

import hashlib
import importlib
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .slurm_nodes import distributed_argv
from .staging import StagedFile, stage_run, stage_write_once, staging_program
from .workflow import PreparedWorkflow, SubmittableRun, _needs_wire, _wait_for_wire

__all__ = [
    "stage_remote",
    "stage_write_once",
    "submit_pazuzu",
    "submit_scruffy",
    "submit_scruffy_workflow",
]

PAZUZU_STDIN_LIMIT = 4 * 1024 * 1024  # bytes per client.run call (the client refuses more)
_STAGE_TIMEOUT_S = 60.0


def _checked_files(prepared: SubmittableRun, limit: int | None = None) -> list[StagedFile]:
    """The run's staged files (``artifacts``) after checking each one's bytes against its
    digest (and size)."""
    files = list(prepared.artifacts)
    for staged in files:
        if not isinstance(staged.content, bytes):
            raise TypeError(
                f"{staged.path}: artifact content must be bytes, got {type(staged.content).__name__}"
            )
        actual = hashlib.sha256(staged.content).hexdigest()
        if actual != staged.sha256:
            raise ValueError(
                f"{staged.path}: artifact digest differs: expected {staged.sha256}, got {actual}"
            )
        if limit is not None and len(staged.content) > limit:
            raise ValueError(
                f"{staged.path}: artifact is {len(staged.content)} bytes; Pazuzu stages at most {limit} bytes per call"
            )
    return files


def _stage_local(runs: Sequence[SubmittableRun]) -> None:
    """Check every staged file of every run, then write them all write-once, in order."""
    for run in runs:
        _checked_files(run)
    for run in runs:
        stage_run(run)


_CALLER = {"submit_job": "submit_scruffy", "submit_workflow": "submit_scruffy_workflow"}


def _scruffy(name: str) -> Any:
    """``scruffy.<name>``, or a RuntimeError that says what to install."""
    try:
        module = importlib.import_module("scruffy")
    except ModuleNotFoundError as exc:
        if exc.name == "scruffy":
            raise RuntimeError(
                f"koochak.jobs.{_CALLER[name]} requires the optional Scruffy client: install the 'scruffy-gpu' package"
            ) from None
        raise RuntimeError(
            f"the Scruffy client has a missing dependency: {exc.name}; reinstall or upgrade it"
        ) from None
    except ImportError as exc:
        raise RuntimeError(
            f"the Scruffy client is incompatible with this Python: {exc}; upgrade it"
        ) from None
    try:
        return getattr(module, name)
    except AttributeError:
        raise RuntimeError(f"the installed Scruffy client has no {name}(); upgrade it") from None


def submit_scruffy(
    prepared: SubmittableRun,
    *,
    root: str | Path,
    resources: Any,
    request_id: str | None,
    project_id: str,
    workflow_id: str | None = None,
    task_id: str | None = None,
    needs: Sequence[Any] | None = None,
    wait_for: Sequence[Any] | None = None,
) -> dict[str, Any]:
    """Stage ``prepared`` on the shared filesystem, then one ``scruffy.submit_job`` call.

    ``resources`` (a ``scruffy.ResourceRequest``) and ``request_id`` pass through unchanged;
    ``needs``/``wait_for`` are validated (errors name the field) and sent as plain lists.
    Returns Scruffy's receipt unchanged (``job_id``, ``deduplicated``, ...).
    """
    submit_job = _scruffy("submit_job")
    needs_list = None if needs is None else _needs_wire(needs)
    wait_list = None if wait_for is None else _wait_for_wire(wait_for)
    _stage_local([prepared])
    return submit_job(
        Path(root),
        argv=list(prepared.runner_argv),
        name=prepared.name,
        cwd=Path(prepared.cwd),
        environment={},
        request=resources,
        request_id=request_id,
        project_id=project_id,
        workflow_id=workflow_id,
        task_id=task_id,
        needs=needs_list,
        wait_for=wait_list,
    )


def submit_scruffy_workflow(workflow: PreparedWorkflow, *, root: str | Path) -> dict[str, Any]:
    """Stage every task's run, then one ``scruffy.submit_workflow`` call: all or none.

    If any staged file fails its check or its write, Scruffy is never called (files already
    staged stay: they are write-once and identical on the next try).
    """
    if not isinstance(workflow, PreparedWorkflow):
        raise TypeError(
            f"submit_scruffy_workflow expects a PreparedWorkflow, got {type(workflow).__name__}"
        )
    submit_workflow = _scruffy("submit_workflow")
    tasks = workflow.scruffy_tasks()
    _stage_local([task.run for task in workflow.tasks])
    return submit_workflow(
        Path(root),
        request_id=workflow.request_id,
        workflow_id=workflow.workflow_id,
        project_id=workflow.project_id,
        tasks=tasks,
    )


async def stage_remote(client: Any, prepared: SubmittableRun) -> None:
    """Stage every file of ``prepared`` on the far side of a Pazuzu ``client``, in order.

    All files (``prepared.artifacts``) are checked locally first (digest, at most 4 MiB each:
    one ``client.run`` call per file, bytes on stdin only). Each call runs the write-once
    staging program (`staging_program`) with the run's own Python (``runner_argv[0]``) under
    ``-I``; a non-zero ``exit_code`` raises ``RuntimeError("failed to stage <path>: <remote
    error>")`` and stages nothing further.
    Staging the same run again is a no-op. ``submit_pazuzu`` calls this before submitting; on
    its own it prepares a run for a job script of your own (the multi-node DDP recipe).
    """
    python = prepared.runner_argv[0]
    for staged in _checked_files(prepared, limit=PAZUZU_STDIN_LIMIT):
        command = shlex.join(
            [python, "-I", "-c", staging_program(), str(staged.path), staged.sha256]
        )
        result = await client.run(command, stdin=staged.content, timeout=_STAGE_TIMEOUT_S)
        if result.exit_code != 0:  # Pazuzu's CommandResult has exit_code, not returncode
            detail = result.stderr.strip() or result.stdout.strip() or f"exit {result.exit_code}"
            raise RuntimeError(f"failed to stage {staged.path}: {detail}")


async def submit_pazuzu(
    client: Any,
    prepared: SubmittableRun,
    *,
    resources: Any,
    log_dir: str,
    distributed: bool | None = None,
) -> Any:
    """Stage ``prepared`` through ``client.run`` and submit it with ``client.submit_slurm``.

    ``resources`` is a ``pazuzu.SlurmResources``, passed through unchanged; logs land at
    ``<log_dir>/<name>-<jobid>.out|.err``. The job is built (and so validated) before anything
    is staged; then ``stage_remote`` stages every file, and any failed stage raises
    without submitting. Returns the ``SlurmHandle``.

    ``distributed`` (default: ``resources.nodes > 1``): the batch script runs
    ``srun ... python -m koochak.loop.launch`` once per node, which starts
    ``resources.tasks_per_node`` ranks there, each the runner argv (``koochak.jobs.slurm_nodes``);
    otherwise it ``exec``s the runner argv, one process. ``distributed=True`` on one node gives
    a run of ``tasks_per_node`` ranks (a DDP config resumed on fewer nodes).
    """
    try:
        from pazuzu import SlurmJob
    except ImportError as exc:
        raise RuntimeError(
            f"koochak.jobs.submit_pazuzu requires the optional pazuzu client: {exc}"
        ) from None
    if distributed is None:
        distributed = getattr(resources, "nodes", 1) > 1
    argv = list(prepared.runner_argv)
    if distributed:
        argv = distributed_argv(argv, getattr(resources, "tasks_per_node", 1))
    job = SlurmJob(
        name=prepared.name,
        argv=argv,
        cwd=str(prepared.cwd),
        log_dir=log_dir,
        resources=resources,
        environment={},
    )
    await stage_remote(client, prepared)
    return await client.submit_slurm(job)
