"""The Scruffy publisher: workload events from a job that runs under a Scruffy allocation.

The ``scruffy`` client module is imported only here, when the hooks are built (before training
starts), and checked against the small contract below; koochak-events itself needs nothing but
the standard library. Install the client with the ``koochak-events[scruffy]`` extra or put the
Scruffy source root on ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from koochak.events.envelope import Event
from koochak.events.hooks import (
    ArtifactAckTimeout,
    ArtifactRejected,
    Hook,
    make_event_hooks,
)

DEFAULT_ARTIFACT_ACK_TIMEOUT_S = 300.0
TIMEOUT_ENV = "KOOCHAK_SCRUFFY_ARTIFACT_ACK_TIMEOUT_SECONDS"
_ACCEPTED = frozenset({"accepted", "duplicate"})  # "duplicate": this event id was accepted before


class ScruffyEventClient(Protocol):
    """What koochak-events needs from the ``scruffy`` module (the v1 event client).

    ``publish_event(root, job_id, event, *, wait, timeout)`` spools ``event`` (the envelope as a
    JSON-ready dict) for job ``job_id`` under the Scruffy root ``root``. With ``wait=False`` it
    returns once spooled (the return value is ignored). With ``wait=True`` it returns the
    coordinator's acknowledgement status, a string: ``"accepted"``, ``"duplicate"`` (an event
    with this id was already accepted: the idempotent retry) or anything else for a refusal
    (``"rejected"``, ``"conflict"``); it raises ``TimeoutError`` when no acknowledgement came
    within ``timeout`` seconds.

    Optional: ``artifact_accepted(root, job_id, event_id) -> bool`` answers from Scruffy's
    durable receipt whether an event was accepted; after a timeout it is asked once instead of
    publishing a second event.
    """

    def publish_event(
        self,
        root: str,
        job_id: str,
        event: Mapping[str, Any],
        *,
        wait: bool,
        timeout: float | None,
    ) -> Any: ...


def make_scruffy_hooks(
    *,
    artifact_ack_timeout_s: float | None = None,
    progress_every_s: float = 30.0,
    clock: Callable[[], float] = time.monotonic,
    env: Mapping[str, str] | None = None,
) -> dict[str, list[Hook]]:
    """`make_event_hooks` publishing to Scruffy for the job named by SCRUFFY_ROOT/SCRUFFY_JOB_ID.

    Strict checkpoint artifacts wait up to ``artifact_ack_timeout_s`` for Scruffy's
    acknowledgement (default 300 s, or KOOCHAK_SCRUFFY_ARTIFACT_ACK_TIMEOUT_SECONDS; the argument
    wins). Everything else is published without waiting.
    """
    env = os.environ if env is None else env
    root = _required(env, "SCRUFFY_ROOT")
    job_id = _required(env, "SCRUFFY_JOB_ID")
    timeout = _ack_timeout(artifact_ack_timeout_s, env)
    client = _import_client()
    return make_event_hooks(
        ScruffyPublisher(client, root, job_id, timeout),
        progress_every_s=progress_every_s,
        clock=clock,
        job_id=job_id,
    )


class ScruffyPublisher:
    """A `Publisher` over a `ScruffyEventClient` for one job."""

    def __init__(self, client: Any, root: str, job_id: str, ack_timeout_s: float) -> None:
        self.client = client
        self.root = root
        self.job_id = job_id
        self.ack_timeout_s = ack_timeout_s

    def __call__(self, event: Event, *, wait: bool = False) -> None:
        doc = event.to_dict()
        if not wait:
            self.client.publish_event(self.root, self.job_id, doc, wait=False, timeout=None)
            return
        try:
            status = self.client.publish_event(
                self.root, self.job_id, doc, wait=True, timeout=self.ack_timeout_s
            )
        except TimeoutError:
            # Perhaps accepted after all: ask the durable receipt; never publish a second time.
            if self._accepted_on_record(event.id):
                return
            raise ArtifactAckTimeout(
                f"Scruffy did not acknowledge {event.kind} {event.id} "
                f"({event.payload.get('artifact_id')}) within {self.ack_timeout_s:g} s "
                f"(job {self.job_id}); the checkpoint stays published for resume"
            ) from None
        if status not in _ACCEPTED:
            raise ArtifactRejected(
                f"Scruffy answered {status!r} to {event.kind} {event.id} "
                f"({event.payload.get('artifact_id')}, job {self.job_id}); expected 'accepted'"
            )

    def _accepted_on_record(self, event_id: str) -> bool:
        check = getattr(self.client, "artifact_accepted", None)
        if not callable(check):
            return False
        return check(self.root, self.job_id, event_id) is True


def _required(env: Mapping[str, str], name: str) -> str:
    value = env.get(name, "")
    if not value:
        raise RuntimeError(
            f"make_scruffy_hooks: environment variable {name} is not set; Scruffy sets "
            "SCRUFFY_ROOT and SCRUFFY_JOB_ID for the jobs it runs"
        )
    return value


def _ack_timeout(explicit: float | None, env: Mapping[str, str]) -> float:
    if explicit is not None:
        where, value = "artifact_ack_timeout_s", explicit
    elif env.get(TIMEOUT_ENV, "") != "":
        where, raw = TIMEOUT_ENV, env[TIMEOUT_ENV]
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{where}={raw!r}: expected a number of seconds > 0") from None
    else:
        return DEFAULT_ARTIFACT_ACK_TIMEOUT_S
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        math.isfinite(value) and value > 0
    ):
        raise ValueError(f"{where}={value!r}: expected a finite number of seconds > 0")
    return float(value)


def _import_client() -> Any:
    try:
        client = importlib.import_module("scruffy")
    except ImportError as exc:
        raise ImportError(
            f"make_scruffy_hooks needs the Scruffy client ({exc}); install "
            "koochak-events[scruffy] or put the Scruffy source root on PYTHONPATH"
        ) from None
    if not callable(getattr(client, "publish_event", None)):
        where = getattr(client, "__file__", None) or "scruffy"
        raise ImportError(
            f"the scruffy module at {where} has no publish_event(root, job_id, event, *, wait, "
            "timeout); koochak-events needs a Scruffy client with the v1 event API"
        )
    return client
