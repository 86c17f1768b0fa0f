"""A stand-in of the Pazuzu client (``pazuzu`` 0.1.0) for Koochak's tests.

Same public surface and validation as the real client (see ``docs/jobs.md`` and the Pazuzu
client contract); the only difference is the transport: commands run on this machine through
``bash -c`` instead of over the gateway's SSH master, so ``submit_slurm`` hands the rendered
script to the real local ``sbatch``. Put ``tests-integration/pazuzu_stub`` on ``sys.path`` (or
PYTHONPATH) to import it as ``pazuzu``.
"""

from .client import CommandResult, PazuzuClient
from .slurm import SlurmHandle, SlurmJob, SlurmResources, SlurmStatus

__version__ = "0.1.0"
__all__ = [
    "CommandResult",
    "PazuzuClient",
    "SlurmHandle",
    "SlurmJob",
    "SlurmResources",
    "SlurmStatus",
]
