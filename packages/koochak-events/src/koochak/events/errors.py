"""Why a strict checkpoint artifact stopped training, and the exit code each reason maps to.

A job runner (koochak-train, koochak-jobs' runner, a Scruffy deployment) maps these codes:

- `EXIT_CHECKPOINT_ACK_TIMEOUT` (76): the coordinator did not acknowledge the checkpoint in time.
  Retryable: the numbered checkpoint stays published, so a retry with ``resume: auto`` continues
  from it and republishes its artifact event (same event id).
- `EXIT_PUBLICATION_REJECTED` (77): the coordinator rejected the publication or it conflicts
  with an event already accepted under the same id. Not retryable as is: fix the cause.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from koochak.events.secrets import mask_secrets, secrets_from_environment

EXIT_CHECKPOINT_ACK_TIMEOUT = 76
EXIT_PUBLICATION_REJECTED = 77


class ArtifactNotAccepted(RuntimeError):
    """The coordinator did not accept a strict artifact event; training must not go on."""

    reason = "artifact_not_accepted"
    exit_code = EXIT_PUBLICATION_REJECTED
    retryable = False

    def __init__(
        self,
        message: str,
        *,
        checkpoint_path: str | None = None,
        event_id: str | None = None,
        publication: Mapping[str, Any] | None = None,
        detail: str | None = None,
    ) -> None:
        super().__init__(message)
        self.checkpoint_path = checkpoint_path
        self.event_id = event_id
        self.publication = dict(publication) if publication is not None else None
        self.artifact_id = self.publication.get("artifact_id") if self.publication else None
        self.detail = detail

    def exit_record(self) -> dict[str, Any]:
        """The one JSON line a CLI prints before exiting with `exit_code`."""
        return {
            "reason": self.reason,
            "exit_code": self.exit_code,
            "retryable": self.retryable,
            "checkpoint_path": self.checkpoint_path,
            "artifact_id": self.artifact_id,
            "event_id": self.event_id,
            "detail": self.detail,
        }

    def exit_line(self) -> str:
        """`exit_record` as one compact JSON line; ``detail`` (the coordinator's reason or an
        error's text: foreign output) has the run's named secrets masked."""
        record = self.exit_record()
        if isinstance(record["detail"], str):
            record["detail"] = mask_secrets(record["detail"], secrets_from_environment())
        return json.dumps(record, sort_keys=True, separators=(",", ":"))


class ArtifactRejected(ArtifactNotAccepted):
    """The coordinator rejected the artifact event, or its id conflicts with an accepted one."""

    reason = "checkpoint_publication_rejected"


class ArtifactAckTimeout(ArtifactNotAccepted):
    """No acknowledgement arrived in time; the checkpoint stays published for ``resume: auto``."""

    reason = "checkpoint_ack_timeout"
    exit_code = EXIT_CHECKPOINT_ACK_TIMEOUT
    retryable = True


def artifact_failure(exc: BaseException | None) -> ArtifactNotAccepted | None:
    """The `ArtifactNotAccepted` behind ``exc`` (itself or a cause/context), if there is one."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, ArtifactNotAccepted):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
