"""koochak.jobs: environment profiles, prepared runs, launch manifests, the isolated runner,
Scruffy workflows and the Scruffy/Pazuzu submission backends.

Torch-free: the ``cuda`` and ``torch_compile`` checks run in the target interpreter as
subprocesses of the runner. Names are imported on first use (PEP 562), so ``koochak-run``
can re-execute itself under ``python -I`` before anything from an ambient PYTHONPATH loads,
and the runner imports only what it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from koochak.storage.lazy_exports import lazy_exports

_EXPORTS = {
    "ConfigPatch": "config",
    "materialize_config": "config",
    "EXIT_CHECKPOINT_ACK_TIMEOUT": "exit_codes",
    "EXIT_EVACUATED": "exit_codes",
    "EXIT_OK": "exit_codes",
    "EXIT_PREFLIGHT_FAILED": "exit_codes",
    "EXIT_PUBLICATION_REJECTED": "exit_codes",
    "EXIT_USAGE": "exit_codes",
    "PreparedRun": "prepared",
    "prepare_run": "prepared",
    "DeclaredOutput": "outputs",
    "validate_output": "outputs",
    "EnvironmentProfile": "profile",
    "load_environment_profile": "profile",
    "StagedFile": "staging",
    "stage_run": "staging",
    "stage_write_once": "staging",
    "PreparedTask": "workflow",
    "PreparedWorkflow": "workflow",
    "stage_remote": "backends",
    "submit_pazuzu": "backends",
    "submit_scruffy": "backends",
    "submit_scruffy_workflow": "backends",
}
# Old name -> new home; each use warns (see _deprecated.py).
_DEPRECATED = {"Artifact": "koochak.jobs.StagedFile"}
__all__ = [
    "ConfigPatch",
    "DeclaredOutput",
    "EXIT_CHECKPOINT_ACK_TIMEOUT",
    "EXIT_EVACUATED",
    "EXIT_OK",
    "EXIT_PREFLIGHT_FAILED",
    "EXIT_PUBLICATION_REJECTED",
    "EXIT_USAGE",
    "EnvironmentProfile",
    "PreparedRun",
    "PreparedTask",
    "PreparedWorkflow",
    "StagedFile",
    "load_environment_profile",
    "materialize_config",
    "prepare_run",
    "stage_remote",
    "stage_run",
    "stage_write_once",
    "submit_pazuzu",
    "submit_scruffy",
    "submit_scruffy_workflow",
    "validate_output",
]

if TYPE_CHECKING:
    from koochak.jobs.backends import (
        stage_remote,
        submit_pazuzu,
        submit_scruffy,
        submit_scruffy_workflow,
    )
    from koochak.jobs.config import ConfigPatch, materialize_config
    from koochak.jobs.exit_codes import (
        EXIT_CHECKPOINT_ACK_TIMEOUT,
        EXIT_EVACUATED,
        EXIT_OK,
        EXIT_PREFLIGHT_FAILED,
        EXIT_PUBLICATION_REJECTED,
        EXIT_USAGE,
    )
    from koochak.jobs.outputs import DeclaredOutput, validate_output
    from koochak.jobs.prepared import PreparedRun, prepare_run
    from koochak.jobs.profile import EnvironmentProfile, load_environment_profile
    from koochak.jobs.staging import StagedFile, stage_run, stage_write_once
    from koochak.jobs.workflow import PreparedTask, PreparedWorkflow


_exported, __dir__ = lazy_exports(__name__, _EXPORTS, globals())


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:  # not cached: every use warns
        from koochak.jobs._deprecated import moved

        return moved(f"koochak.jobs.{name}", _DEPRECATED[name])
    return _exported(name)
