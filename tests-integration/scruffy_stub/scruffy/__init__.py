"""A faithful stand-in for the Scruffy v1 client (``scruffy-gpu`` 0.1.1, or the newer contract
with SCRUFFY_STUB_CONTRACT=newer), written from tests-integration's contract file. Test-only:
put ``tests-integration/scruffy_stub`` on PYTHONPATH; ``python -m scruffy --root ROOT serve``
runs its controller."""

from scruffy._contract import VERSION as __version__
from scruffy.client import (
    cancel_job,
    observe,
    publish_event,
    status,
    submit_job,
    submit_workflow,
    validate_workflow,
    wait_for_job,
)
from scruffy.models import ResourceRequest
from scruffy.storage import ConflictError

__all__ = [
    "ConflictError",
    "ResourceRequest",
    "__version__",
    "cancel_job",
    "observe",
    "publish_event",
    "status",
    "submit_job",
    "submit_workflow",
    "validate_workflow",
    "wait_for_job",
]
