"""koochak.jobs: environment profiles, prepared runs, launch manifests and the isolated runner.

Torch-free: the ``cuda`` and ``torch_compile`` checks run in the target interpreter as
subprocesses of the runner.
"""

from koochak.jobs.config import ConfigPatch, materialize_config
from koochak.jobs.exit_codes import (
    EXIT_CHECKPOINT_ACK_TIMEOUT,
    EXIT_EVACUATED,
    EXIT_OK,
    EXIT_PREFLIGHT_FAILED,
    EXIT_PUBLICATION_REJECTED,
    EXIT_USAGE,
)
from koochak.jobs.manifest import Artifact, PreparedRun, prepare_run
from koochak.jobs.outputs import DeclaredOutput, validate_output
from koochak.jobs.profile import EnvironmentProfile, load_environment_profile
from koochak.jobs.staging import stage_run

__all__ = [
    "EXIT_CHECKPOINT_ACK_TIMEOUT",
    "EXIT_EVACUATED",
    "EXIT_OK",
    "EXIT_PREFLIGHT_FAILED",
    "EXIT_PUBLICATION_REJECTED",
    "EXIT_USAGE",
    "Artifact",
    "ConfigPatch",
    "DeclaredOutput",
    "EnvironmentProfile",
    "PreparedRun",
    "load_environment_profile",
    "materialize_config",
    "prepare_run",
    "stage_run",
    "validate_output",
]
