"""koochak.events: bounded workload event envelopes and training-loop event hooks."""

from koochak.events.envelope import Event, artifact_event_id, make_event, parse_event
from koochak.events.hooks import (
    ArtifactAckTimeout,
    ArtifactNotAccepted,
    ArtifactRejected,
    Publisher,
    make_event_hooks,
)
from koochak.events.scruffy import ScruffyEventClient, make_scruffy_hooks

__all__ = [
    "ArtifactAckTimeout",
    "ArtifactNotAccepted",
    "ArtifactRejected",
    "Event",
    "Publisher",
    "ScruffyEventClient",
    "artifact_event_id",
    "make_event",
    "make_event_hooks",
    "make_scruffy_hooks",
    "parse_event",
]
