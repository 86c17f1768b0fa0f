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
from koochak.events.envelope import MAX_ITEMS, Event, artifact_event_id, make_event
from koochak.events.errors import ArtifactNotAccepted

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

    - ``on_train_start``: phase ``starting`` (on other ranks every hook turns itself off); on
      an automatic resume also the selected checkpoint's artifact event again (same event id,
      so a coordinator deduplicates it, and a consumer gated on it is released even if the
      first publication was lost) and a ``resume_selected`` milestone naming it;
    - first ``on_step_end``: phase ``training`` and a ``workload.progress`` event; then one at the
      first completed update at least ``progress_every_s`` (by ``clock``) after the previous one;
    - ``on_eval_end``: milestone ``eval`` with its metrics;
    - ``on_checkpoint``: a strict ``workload.artifact`` event (``data.publication``) for a
      numbered checkpoint with a local absolute path, published with ``wait=True`` except for
      the evacuation checkpoint (the grace period is short); else a milestone ``checkpoint``;
    - ``on_replication`` (tiered checkpoints): milestone ``checkpoint_replicated`` with the
      tier and the lag for a commit in a replica tier; a warning notice for a failed copy
      (retried) or a checkpoint a tier will not get;
    - ``on_train_end``: phase ``finished``, or for an evacuation milestone ``evacuation`` (with
      the terminal checkpoint's publication) and phase ``evacuated``; neither waits;
    - ``on_exception``: phase ``failed`` with the error's type and (truncated) message.

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


def _accepts_wait(publish: Callable[..., Any]) -> bool:
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
        self.wait_ok = _accepts_wait(publish)
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

    # -- loop events

    def on_train_start(self, info: dict[str, Any]) -> None:
        rank = info.get("rank", 0)
        self.active = rank == 0
        if not self.active:
            return
        self.total = _int_or_none(info.get("max_steps"))
        self.last_progress = self.clock()
        payload: dict[str, Any] = {"phase": "starting", "step": _int_or_none(info.get("step"))}
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
        if first:
            self.training = True
            self._send("workload.phase", {"phase": "training", "step": completed})
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
        payload: dict[str, Any] = {"milestone": "eval", "step": _int_or_none(info.get("step"))}
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
        elif status == "failed":
            message = (f"checkpoint replication of {info.get('name')} to {where} failed: "
                       f"{info.get('error')}; retrying in {info.get('retry_in_s')} s")  # fmt: skip
            self._send("workload.notice", {"message": message, "level": "warning"})
        elif status == "dropped":
            message = f"{info.get('name')} will not be replicated to {where}: {info.get('error')}"
            self._send("workload.notice", {"message": message, "level": "warning"})

    def _send_artifact(self, pub: dict[str, Any], step: int, *, wait: bool) -> None:
        payload = {"artifact_type": "checkpoint", "step": step, "publication": pub}
        self._send("workload.artifact", payload, wait=wait)

    def on_train_end(self, info: dict[str, Any]) -> None:
        if not self.active or self.ended:
            return
        step = _int_or_none(info.get("step"))
        if info.get("reason") == "evacuation":
            milestone: dict[str, Any] = {"milestone": "evacuation", "step": step}
            pub = self.last_publication
            if pub is not None:
                milestone.update(
                    artifact_id=pub["artifact_id"],
                    path=pub["path"],
                    publication=pub,
                    artifact_event_id=artifact_event_id(pub["artifact_id"], pub["sha256"]),
                )
            self._send("workload.milestone", milestone)
            self._send("workload.phase", {"phase": "evacuated", "step": step})
        else:
            self._send("workload.phase", {"phase": "finished", "step": step})
        self.ended = True

    def on_exception(self, info: dict[str, Any]) -> None:
        # After an evacuation the loop raises Evacuated through here: already reported.
        if not self.active or self.ended:
            return
        exc = info.get("exception")
        payload: dict[str, Any] = {"phase": "failed", "step": _int_or_none(info.get("step"))}
        if exc is not None:
            payload["reason"] = getattr(exc, "reason", None) or type(exc).__name__
            payload["error"] = f"{type(exc).__name__}: {exc}"
            if not isinstance(payload["reason"], str):
                payload["reason"] = type(exc).__name__
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
            if self.wait_ok:
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
