"""Training-loop hooks that turn loop events into workload events for a coordinator.

`make_event_hooks(publish)` returns a hooks dict for `koochak.loop.training_loop(hooks=...)`.
It reads the loop's ``info`` dicts duck-typed (this package imports neither the loop nor the
store): ``info["publication"]`` only needs ``artifact_id``, ``size``, ``sha256`` and
``manifest_key`` attributes.

Failure policy: events are telemetry, so a publisher error warns once and training goes on.
The one exception is a strict checkpoint artifact that the coordinator refused or did not
acknowledge (`ArtifactNotAccepted`): a dependent task may be waiting for exactly that
checkpoint, so the hook re-raises and is marked fail-closed for the loop, which then stops.
"""

from __future__ import annotations

import inspect
import math
import os
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from koochak.events import publication as _publication
from koochak.events.envelope import (
    MAX_ITEMS,
    TRUNCATION_MARKER,
    Event,
    artifact_event_id,
    make_event,
)
from koochak.events.errors import ArtifactNotAccepted
from koochak.events.secrets import mask_secrets, secrets_from_environment

Hook = Callable[[dict[str, Any]], None]

# koochak.loop.hooks.fail_closed sets this attribute; set directly, the loop need not be imported.
_FAIL_CLOSED_ATTR = "__koochak_fail_closed__"
SOURCE = "koochak.loop"


class Publisher(Protocol):
    """Where events go. ``wait`` is optional: a publisher that accepts it is asked to wait for
    the coordinator's acknowledgement of strict artifact events (``wait=True``) and not for any
    other event (``wait=False``). It raises `ArtifactNotAccepted` for a refused or
    unacknowledged artifact; any other exception counts as a (non-fatal) delivery failure."""

    def __call__(self, event: Event, *, wait: bool = False) -> Any: ...


def make_event_hooks(
    publish: Publisher | Callable[..., Any] | None,
    *,
    progress_every_s: float = 30.0,
    clock: Callable[[], float] = time.monotonic,
    job_id: str | None = None,
    source: str = SOURCE,
) -> dict[str, list[Hook]]:
    """Loop hooks that publish phase, progress, milestone and artifact events from rank 0.

    Every ``workload.phase`` event carries ``phase`` and ``status`` as the upstream hook table
    names them, because Scruffy shows a job's ``phase = data.phase`` and ``status =
    data.status`` from its newest one:

    - ``on_train_start``: phase ``training``, status ``started`` (on other ranks every hook
      turns itself off); on an automatic resume also the selected checkpoint's artifact event
      again (same event id, so a coordinator deduplicates it, and a consumer gated on it is
      released even if the first publication was lost) and a ``resume_selected`` milestone;
    - ``on_step_end``: a ``workload.progress`` event at the first completed update, then one at
      the first completed update at least ``progress_every_s`` (by ``clock``) after the previous;
    - ``on_eval_end``: milestone ``eval`` with ``phase: "evaluation"`` and its metrics;
    - ``on_checkpoint``: a strict ``workload.artifact`` event (``data.publication``) for a
      numbered checkpoint with a local absolute path, published with ``wait=True`` except for
      the evacuation checkpoint (the grace period is short); else a milestone ``checkpoint``;
    - ``on_replication`` (tiered checkpoints): milestone ``checkpoint_replicated`` with the
      tier and the lag for a commit in a replica tier; a warning notice for a failed copy
      (retried) or a checkpoint a tier will not get;
    - ``on_train_end``: status ``completed``, or for an evacuation milestone ``evacuation``
      (status ``checkpointed``, with the terminal checkpoint's publication) and status
      ``evacuated``; neither waits;
    - ``on_exception``: status ``failed`` with the error's type and (truncated) message.

    Free text that can hold foreign output (an exception's message, a reason) has the values of
    the run's named secrets masked (`koochak.events.secrets`) before it is published.

    ``publish=None`` returns ``{}``: no hooks, nothing published.
    """
    if publish is None:
        return {}
    if not callable(publish):
        raise TypeError(f"make_event_hooks(publish=...) must be callable or None, got {publish!r}")
    if not (isinstance(progress_every_s, (int, float)) and progress_every_s >= 0):
        raise ValueError(
            f"make_event_hooks(progress_every_s=...) must be a number >= 0, got {progress_every_s!r}"
        )
    emitter = _Emitter(publish, float(progress_every_s), clock, job_id, source)
    on_checkpoint = emitter.on_checkpoint
    hooks: dict[str, list[Hook]] = {
        "on_train_start": [emitter.on_train_start],
        "on_step_end": [emitter.on_step_end],
        "on_log": [emitter.on_log],
        "on_eval_end": [emitter.on_eval_end],
        "on_checkpoint": [_fail_closed(on_checkpoint)],
        "on_replication": [emitter.on_replication],
        "on_train_end": [emitter.on_train_end],
        "on_exception": [emitter.on_exception],
    }
    return hooks


def _fail_closed(fn: Hook) -> Hook:
    def on_checkpoint(info: dict[str, Any]) -> None:
        fn(info)

    setattr(on_checkpoint, _FAIL_CLOSED_ATTR, True)
    return on_checkpoint


def _publisher_takes_wait(publish: Callable[..., Any]) -> bool:
    """True when the hooks' ``publish`` callable can be passed ``wait=`` (a keyword ``wait`` or
    ``**kwargs``): checkpoint events then ask it to wait for the acknowledgement."""
    try:
        params = inspect.signature(publish).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature: call them plainly
        return False
    return any(
        p.kind is p.VAR_KEYWORD
        or (p.name == "wait" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
        for p in params
    )


class _Emitter:
    """The state the hooks share: rank, phase, progress timer, the warn-once flag."""

    def __init__(
        self,
        publish: Callable[..., Any],
        progress_every_s: float,
        clock: Callable[[], float],
        job_id: str | None,
        source: str,
    ) -> None:
        self.publish = publish
        self.publisher_takes_wait = _publisher_takes_wait(publish)
        self.progress_every_s = progress_every_s
        self.clock = clock
        self.job_id = job_id
        self.source = source
        # Until on_train_start says otherwise, trust torchrun's RANK (0 without one).
        self.active = _env_rank() == 0
        self.training = False
        self.ended = False
        self.total: int | None = None
        self.last_progress = 0.0
        self.metrics: Mapping[str, Any] | None = None
        self.last_publication: dict[str, Any] | None = None
        self.warned = False
        # Named by the runner that started this process (koochak-jobs), values from the env.
        self.secrets = secrets_from_environment()

    # -- loop events

    def on_train_start(self, info: dict[str, Any]) -> None:
        rank = info.get("rank", 0)
        self.active = rank == 0
        if not self.active:
            return
        self.total = _int_or_none(info.get("max_steps"))
        self.last_progress = self.clock()
        payload: dict[str, Any] = {"phase": "training", "status": "started"}
        payload["step"] = _int_or_none(info.get("step"))
        payload["max_steps"] = self.total
        if isinstance(info.get("world_size"), int):
            payload["world_size"] = info["world_size"]
        if isinstance(info.get("resumed"), bool):
            payload["resumed"] = info["resumed"]
        self._send("workload.phase", payload)
        resume_path = info.get("resume_path")
        if info.get("resumed") is True and isinstance(resume_path, str):
            # Tiered checkpoints name the tier others read (the first replica), which may not
            # hold it yet (None): replication announces it once it does.
            announced = info.get("resume_publication_path", resume_path)
            self._republish_resumed(resume_path, announced, _int_or_none(info.get("step")))

    def _republish_resumed(self, path: str, announced: Any, next_step: int | None) -> None:
        milestone: dict[str, Any] = {"milestone": "resume_selected", "step": next_step}
        milestone["path"] = path
        pub = _publication.from_ready_manifest(announced) if isinstance(announced, str) else None
        if pub is not None:
            # The very event the first attempt sent (same data, same id): deduplicated where it
            # arrived, and it releases gated consumers where it did not (or came from an older
            # attempt of the task, which Scruffy's gates ignore).
            step = _step_of(pub["artifact_id"])
            self._send_artifact(pub, step, wait=True)
            milestone.update(
                artifact_id=pub["artifact_id"],
                publication=pub,
                artifact_event_id=artifact_event_id(pub["artifact_id"], pub["sha256"]),
            )
        self._send("workload.milestone", milestone)

    def on_step_end(self, info: dict[str, Any]) -> None:
        if not self.active or self.ended:
            return
        completed = int(info["step"]) + 1
        first = not self.training
        self.training = True
        now = self.clock()
        # The first completed update always reports (an observer sees progress at once), then
        # one event per interval.
        if first or now - self.last_progress >= self.progress_every_s:
            self.last_progress = now
            payload: dict[str, Any] = {"completed_steps": completed, "total_steps": self.total}
            if self.metrics:
                payload["metrics"] = self.metrics
            self._send("workload.progress", payload)

    def on_log(self, info: dict[str, Any]) -> None:
        if self.active:
            self.metrics = _scalars(info.get("metrics"))  # rides along with the next progress

    def on_eval_end(self, info: dict[str, Any]) -> None:
        if not self.active or self.ended:
            return
        payload: dict[str, Any] = {"milestone": "eval", "phase": "evaluation"}
        payload["step"] = _int_or_none(info.get("step"))
        payload["metrics"] = _scalars(info.get("metrics")) or {}
        self._send("workload.milestone", payload)

    def on_checkpoint(self, info: dict[str, Any]) -> None:
        if not self.active:
            return
        step = _int_or_none(info.get("step"))
        pub = _publication.from_checkpoint_info(info) if step is not None else None
        if pub is None:
            # A store without local paths, or an unnumbered file: a reference, not a gate.
            artifact_id = getattr(info.get("publication"), "artifact_id", None)
            payload = {"milestone": "checkpoint", "step": step, "path": info.get("path")}
            if isinstance(artifact_id, str):
                payload["artifact_id"] = artifact_id
            self._send("workload.milestone", payload)
            return
        assert step is not None
        self.last_publication = pub
        # The evacuation checkpoint does not wait: the grace period before the kill is short,
        # and the retried attempt republishes it at resume anyway.
        evacuating = _reason_of(info.get("checkpoint")) == "evacuation"
        self._send_artifact(pub, step, wait=not evacuating)

    def on_replication(self, info: dict[str, Any]) -> None:
        if not self.active or self.ended:
            return
        status, tier = info.get("status"), info.get("tier")
        where = f"tier {tier} ({info.get('location')})"
        if status == "committed":
            metrics = {"tier": tier, "lag_checkpoints": info.get("lag"),
                       "seconds": info.get("seconds"), "behind_seconds": info.get("behind_s"),
                       "bytes": info.get("bytes")}  # fmt: skip
            payload: dict[str, Any] = {
                "milestone": "checkpoint_replicated",
                "step": _int_or_none(info.get("step")),
                "path": info.get("path"),
                "metrics": _scalars({k: v for k, v in metrics.items() if v is not None}) or {},
            }
            artifact_id = getattr(info.get("publication"), "artifact_id", None)
            if isinstance(artifact_id, str):
                payload["artifact_id"] = artifact_id
            self._send("workload.milestone", payload)
        elif status in ("failed", "dropped"):
            if status == "failed":
                message = (f"checkpoint replication of {info.get('name')} to {where} failed: "
                           f"{info.get('error')}; retrying in {info.get('retry_in_s')} s")  # fmt: skip
            else:
                message = (
                    f"{info.get('name')} will not be replicated to {where}: {info.get('error')}"
                )
            # A store's error text is foreign output: the run's named secrets never leave.
            message = mask_secrets(message, self.secrets)
            self._send("workload.notice", {"message": message, "level": "warning"})

    def _send_artifact(self, pub: dict[str, Any], step: int, *, wait: bool) -> None:
        payload = {"artifact_type": "checkpoint", "step": step, "publication": pub}
        self._send("workload.artifact", payload, wait=wait)

    def on_train_end(self, info: dict[str, Any]) -> None:
        if not self.active or self.ended:
            return
        step = _int_or_none(info.get("step"))
        if info.get("reason") == "evacuation":
            milestone: dict[str, Any] = {"milestone": "evacuation", "phase": "training"}
            milestone.update(status="checkpointed", step=step)
            pub = self.last_publication
            if pub is not None:
                milestone.update(
                    artifact_id=pub["artifact_id"],
                    path=pub["path"],
                    publication=pub,
                    artifact_event_id=artifact_event_id(pub["artifact_id"], pub["sha256"]),
                )
            self._send("workload.milestone", milestone)
            self._send("workload.phase", {"phase": "training", "status": "evacuated", "step": step})
        else:
            self._send("workload.phase", {"phase": "training", "status": "completed", "step": step})
        self.ended = True

    def on_exception(self, info: dict[str, Any]) -> None:
        # After an evacuation the loop raises Evacuated through here: already reported.
        if not self.active or self.ended:
            return
        exc = info.get("exception")
        payload: dict[str, Any] = {"phase": "training", "status": "failed"}
        payload["step"] = _int_or_none(info.get("step"))
        if exc is not None:
            # Masked before anything is cut, so no part of a secret survives a truncation.
            name = type(exc).__name__
            message = mask_secrets(str(exc), self.secrets)
            reason = getattr(exc, "reason", None)
            reason = reason if isinstance(reason, str) and reason else name
            payload["reason"] = mask_secrets(reason, self.secrets)
            payload["error"] = f"{name}: {message}"
            # The upstream hook table's two fields, with its bounds.
            payload["error_type"] = _cut(name, 128)
            payload["message"] = _cut(message, 512)
        self._send("workload.phase", payload)
        self.ended = True

    # -- delivery

    def _send(self, kind: str, payload: dict[str, Any], *, wait: bool = False) -> None:
        try:
            event = make_event(kind, payload, job_id=self.job_id, source=self.source)
        except ValueError as exc:
            if kind == "workload.artifact":
                raise  # a malformed publication record cannot gate anything: stop, say why
            self._warn(f"could not build a {kind} event: {exc}")
            return
        try:
            if self.publisher_takes_wait:
                self.publish(event, wait=wait)
            else:
                self.publish(event)
        except ArtifactNotAccepted as exc:
            if kind == "workload.artifact":
                raise
            self._warn(f"publishing a {kind} event failed: {type(exc).__name__}: {exc}")
        except Exception as exc:
            self._warn(f"publishing a {kind} event failed: {type(exc).__name__}: {exc}")

    def _warn(self, message: str) -> None:
        if not self.warned:
            self.warned = True
            message = mask_secrets(message, self.secrets)
            warnings.warn(
                f"koochak.events: {message}; events are not fatal, training continues "
                "(further event errors are not reported)",
                RuntimeWarning,
                stacklevel=3,
            )


def _env_rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _int_or_none(value: Any) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _reason_of(checkpoint: Any) -> Any:
    # One key of the checkpoint mapping, never its contents.
    return checkpoint.get("reason") if isinstance(checkpoint, Mapping) else None


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[: limit - len(TRUNCATION_MARKER)] + TRUNCATION_MARKER


def _step_of(artifact_id: str) -> int:
    return int(artifact_id[len("checkpoint/step") : -len(".pt")])


def _scalars(metrics: Any) -> dict[str, Any] | None:
    """Finite numbers as floats, non-finite ones as "nan"/"inf" strings, at most MAX_ITEMS keys."""
    if not isinstance(metrics, Mapping):
        return None
    out: dict[str, Any] = {}
    for key in sorted(metrics, key=str)[:MAX_ITEMS]:
        try:
            value = float(metrics[key])
        except (TypeError, ValueError):
            continue
        out[str(key)] = value if math.isfinite(value) else str(value)
    return out
