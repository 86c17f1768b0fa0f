"""koochak.events: bounded workload event envelopes and training-loop event hooks."""

from koochak.events.envelope import (
    Event,
    artifact_event_id,
    make_event,
    parse_event,
    publication_record,
)
from koochak.events.errors import (
    EXIT_CHECKPOINT_ACK_TIMEOUT,
    EXIT_PUBLICATION_REJECTED,
    ArtifactAckTimeout,
    ArtifactNotAccepted,
    ArtifactRejected,
    artifact_failure,
)
from koochak.events.hooks import Publisher, make_event_hooks
from koochak.events.scruffy import ScruffyPublisher, make_scruffy_hooks, make_scruffy_publisher
from koochak.events.secrets import (
    SECRET_NAMES_VARIABLE,
    mask_secrets,
    mask_strings,
    secrets_from_environment,
)

__all__ = [
    "EXIT_CHECKPOINT_ACK_TIMEOUT",
    "EXIT_PUBLICATION_REJECTED",
    "SECRET_NAMES_VARIABLE",
    "ArtifactAckTimeout",
    "ArtifactNotAccepted",
    "ArtifactRejected",
    "Event",
    "Publisher",
    "ScruffyPublisher",
    "artifact_event_id",
    "artifact_failure",
    "make_event",
    "make_event_hooks",
    "make_scruffy_hooks",
    "make_scruffy_publisher",
    "mask_secrets",
    "mask_strings",
    "parse_event",
    "publication_record",
    "secrets_from_environment",
]
