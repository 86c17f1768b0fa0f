"""Background publication for ``train.checkpoint_async``: at most one publication in flight.

The training thread serializes the checkpoint (so the bytes are frozen at the step they describe)
and hands them here; a worker thread writes them through the store. Results come back to the
training thread, never the other way round: ``on_commit`` callbacks (the ``on_checkpoint`` hooks)
and failures are delivered by ``poll``/``drain``, which the loop calls at step boundaries, so hooks
never run concurrently with training and a failed publication fails the next step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("koochak.loop.checkpoint")


class CheckpointPublishError(RuntimeError):
    """A background checkpoint publication failed; training stops at its next step."""


class AsyncPublisher:
    """One background publication at a time; a second ``submit`` waits for the first."""

    def __init__(self, publish: Callable[[str, Any], Any]) -> None:
        self._publish = publish
        self._thread: threading.Thread | None = None
        self._name: str | None = None
        self._on_commit: Callable[[Any], None] | None = None
        self._result: Any = None
        self._error: BaseException | None = None

    @property
    def in_flight(self) -> bool:
        """Whether a publication was handed off and its outcome not yet delivered."""
        return self._thread is not None

    def submit(self, name: str, data: Any, on_commit: Callable[[Any], None]) -> None:
        """Publish ``data`` as ``name`` in the background; waits for the previous one first."""
        self.drain()
        self._name, self._on_commit = name, on_commit
        self._result, self._error = None, None
        self._thread = threading.Thread(
            target=self._run, args=(name, data), name=f"koochak-publish-{name}", daemon=True
        )
        self._thread.start()

    def poll(self) -> None:
        """Deliver a finished publication (run its callback or raise its error); never blocks."""
        if self._thread is not None and not self._thread.is_alive():
            self._deliver()

    def drain(self) -> None:
        """Wait for the publication in flight, then deliver it."""
        if self._thread is not None:
            self._thread.join()
            self._deliver()

    def close(self) -> None:
        """Wait for the thread on an error path without masking the error being raised."""
        if self._thread is not None:
            self._thread.join()
            try:
                self._deliver()
            except Exception as exc:  # the caller is already failing; keep its exception primary
                log.error("checkpoint publication also failed: %s", exc)

    def _run(self, name: str, data: Any) -> None:
        try:
            self._result = self._publish(name, data)
        except BaseException as exc:  # delivered to the training thread by poll/drain
            self._error = exc

    def _deliver(self) -> None:
        name, on_commit, result, error = self._name, self._on_commit, self._result, self._error
        self._thread, self._name, self._on_commit = None, None, None
        self._result, self._error = None, None
        if error is not None:
            raise CheckpointPublishError(
                f"background publication of checkpoint {name} failed: "
                f"{type(error).__name__}: {error}"
            ) from error
        if on_commit is not None:
            on_commit(result)
