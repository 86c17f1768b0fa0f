"""Publishing declared outputs as typed ``workload.artifact`` events after a successful run.

All outputs are validated before the first event; each is validated again immediately before
its own event and must still hold the same bytes. Event ids come from
`koochak.events.artifact_event_id` (artifact id and content digest, within the job), so a
runner retried after a partial spool republishes the same ids: the coordinator deduplicates
the events it already accepted and the later outputs continue.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from koochak.jobs.outputs import DeclaredOutput, validate_output

__all__ = ["SOURCE", "artifact_payload", "publish_outputs", "scruffy_publisher"]

SOURCE = "koochak.jobs.runner"
_CHECKPOINT = re.compile(r"checkpoint/step(\d{9})\.pt")


def publish_outputs(
    outputs: Sequence[DeclaredOutput],
    publish: Callable[..., Any],
    *,
    job_id: str | None,
) -> list[str]:
    """Validate every output, then publish one artifact event each (``wait=True``); return the
    ids of the events published. A ValueError names the output that failed validation; the
    publisher's own errors (`koochak.events.ArtifactNotAccepted` ...) propagate."""
    from koochak.events import make_event

    first = [validate_output(output) for output in outputs]
    ids = []
    for output, record in zip(outputs, first):
        now = validate_output(output)
        if now != record:
            raise ValueError(
                f"declared output {output.artifact_id} ({output.path}): changed after it was "
                "validated; nothing later is published"
            )
        event = make_event(
            "workload.artifact", artifact_payload(output, now), job_id=job_id, source=SOURCE
        )
        publish(event, wait=True)
        ids.append(event.id)
    return ids


def artifact_payload(output: DeclaredOutput, record: Mapping[str, Any]) -> dict[str, Any]:
    """The ``workload.artifact`` payload for a validated output. For a numbered checkpoint
    (``checkpoint/step<N>.pt``) it is exactly what koochak.loop publishes for that checkpoint
    (type ``checkpoint``, step N, the same publication record), so the event id and bytes
    match and the coordinator deduplicates the two instead of seeing a conflict."""
    from koochak.events import publication_record

    match = _CHECKPOINT.fullmatch(output.artifact_id)
    step = int(match.group(1)) if match else _step(output)
    publication = publication_record(
        record["artifact_id"],
        record["path"],
        record["size"],
        record["sha256"],
        record["manifest_path"],
    )
    return {
        "artifact_type": output.artifact_id.split("/", 1)[0],
        "step": step,
        "publication": publication,
    }


def _step(output: DeclaredOutput) -> int:
    """The event schema's ``step``: the provenance's ``step`` when it is an int >= 0, else 0."""
    step = (output.provenance or {}).get("step")
    return step if type(step) is int and step >= 0 else 0


def scruffy_publisher(env: Mapping[str, str]) -> Callable[..., Any]:
    """A Scruffy publisher for the job named by SCRUFFY_ROOT/SCRUFFY_JOB_ID in the clean env.

    The client is imported with the profile's ``PYTHONPATH`` entries first on ``sys.path``
    (the runner itself runs under ``python -I``), exactly where the workload finds it, and
    checked as koochak.events checks it for the training loop.
    """
    from koochak.events.scruffy import make_scruffy_publisher

    missing = [name for name in ("SCRUFFY_ROOT", "SCRUFFY_JOB_ID") if not env.get(name)]
    if missing:
        raise RuntimeError(
            f"declared outputs are published to Scruffy, but {' and '.join(missing)} "
            "is not set; run the manifest as a Scruffy job"
        )
    roots = [p for p in env.get("PYTHONPATH", "").split(":") if p]
    saved = list(sys.path)
    sys.path[:0] = roots
    try:
        return make_scruffy_publisher(env=env)
    except ImportError as exc:
        raise RuntimeError(
            f"declared outputs need the Scruffy client: {exc}; put its source root on the "
            "profile's PYTHONPATH and declare scruffy in requirements.packages"
        ) from None
    except ValueError as exc:  # the ack timeout in the environment
        raise RuntimeError(str(exc)) from None
    finally:
        sys.path[:] = saved
