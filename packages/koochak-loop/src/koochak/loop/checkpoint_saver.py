"""The loop's side of checkpointing: capture, save (sync or async), resume. One call per concern.

``training_loop`` uses these helpers so its body stays one line per phase:
``resume_checkpoint`` at setup, ``capture_checkpoint`` + ``CheckpointSaver.save`` where it persists,
``CheckpointSaver.poll`` at each step boundary, ``restore_rng`` right before the first step.
Every rank calls ``capture_checkpoint`` (it gathers per-rank RNG states); only rank 0 publishes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from koochak.loop import ddp, dist
from koochak.loop._async_publish import AsyncPublisher
from koochak.loop.checkpoint_format import (
    build_checkpoint,
    checkpoint_name,
    deserialize_checkpoint,
    rng_state_for_rank,
    serialize_checkpoint_buffer,
    serialize_checkpoint_chunks,
)
from koochak.loop.publish import checkpoint_store, publication_path, publish
from koochak.loop.resume import resolve_auto_resume
from koochak.storage import artifact
from koochak.storage.store import Store

log = logging.getLogger("koochak.loop.checkpoint")

RESUME_MODES = ("auto", "none")


def capture_checkpoint(
    *,
    step: int,
    next_step: int,
    reason: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    scaler: Any,
    config: Mapping[str, Any] | None,
    wall_time: float,
    metrics: Mapping[str, Any] | None,
    ema: Any = None,
) -> dict[str, Any]:
    """Build the checkpoint dict; every rank must call it (it gathers per-rank RNG states).

    Rank 0's dict carries every rank's RNG state in ``rng_per_rank`` and is the one published;
    the others get their own state only (what ``training_loop`` returns there).
    """
    from koochak.loop.seed import get_rng_state

    own = get_rng_state()
    states = ddp.gather_rng_states(own)
    world_size = dist.get_world_size()
    return build_checkpoint(
        step=step,
        next_step=next_step,
        reason=reason,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        config=config,
        rng=own,
        rng_per_rank=states if world_size > 1 and states is not None else None,
        world_size=world_size,
        wall_time=wall_time,
        metrics=metrics,
        ema=ema.state_dict() if ema is not None else None,
    )


class CheckpointSaver:
    """Publishes checkpoints to the checkpoint store and announces each one after it commits.

    ``on_checkpoint(info)`` receives ``step``, ``path``, ``checkpoint`` and ``publication``. With
    ``async_publish`` periodic saves go through one background thread; ``sync=True`` saves
    (terminal, evacuation, GPU health) drain it first and publish on the calling thread.
    """

    def __init__(
        self,
        location: str | os.PathLike[str] | Store | None,
        *,
        keep_last_k: int | None = None,
        async_publish: bool = False,
        on_checkpoint: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.location = location
        self.keep_last_k = keep_last_k
        self.async_publish = async_publish
        self.on_checkpoint = on_checkpoint
        self._store: Store | None = None
        self._async: AsyncPublisher | None = None

    @property
    def store(self) -> Store:
        if self._store is None:
            if self.location is None:
                raise ValueError(
                    "cannot save a checkpoint: train.checkpoint_dir and train.out_dir are both "
                    "unset; set one of them"
                )
            self._store = checkpoint_store(self.location)
        return self._store

    def save(self, ckpt: Mapping[str, Any], *, sync: bool = False) -> str | None:
        """Publish ``ckpt`` as ``step{N:09d}.pt``; returns its path (None while still in flight)."""
        name = checkpoint_name(int(ckpt["step"]))
        store = self.store

        def announce(publication: artifact.Publication) -> str:
            path = publication_path(store, publication)
            if self.on_checkpoint is not None:
                self.on_checkpoint(
                    {
                        "step": int(ckpt["step"]),
                        "path": path,
                        "checkpoint": ckpt,
                        "publication": publication,
                    }
                )
            return path

        if self.async_publish and not sync:
            # Serialize now, on this thread: the bytes must describe this step although training
            # moves on (and mutates the tensors) while they are published.
            data = serialize_checkpoint_buffer(ckpt)
            if self._async is None:
                self._async = AsyncPublisher(self._publish)
            self._async.submit(name, data, announce)
            return None
        self.drain()
        # Training waits here, so the tensors cannot change: stream straight into the store.
        return announce(self._publish(name, serialize_checkpoint_chunks(ckpt)))

    def poll(self) -> None:
        """Deliver a finished background publication; raises if it failed."""
        if self._async is not None:
            self._async.poll()

    def drain(self) -> None:
        """Wait for the background publication in flight (if any) and deliver it."""
        if self._async is not None:
            self._async.drain()

    def close(self) -> None:
        """On an error path: let an in-flight publication finish without masking the error."""
        if self._async is not None:
            self._async.close()

    def _publish(self, name: str, data: Any) -> artifact.Publication:
        return publish(self.store, name, data, keep_last_k=self.keep_last_k)


def resume_checkpoint(
    resume: str | None,
    location: str | os.PathLike[str] | Store | None,
    checkpoint_dict: Mapping[str, Any] | None = None,
    auto_resume_path: str | None = None,
) -> tuple[dict[str, Any] | None, str | None]:
    """The checkpoint this run continues from, and its path; ``(None, None)`` to start fresh.

    A ``checkpoint_dict`` the caller already resolved (``resolve_auto_resume`` before building the
    dataset) wins. Otherwise ``resume="auto"`` selects the highest valid published checkpoint:
    rank 0 chooses, every other rank reads and verifies the same object, so all ranks agree.
    """
    if resume is not None and resume not in RESUME_MODES:
        raise ValueError(
            f"training_loop(resume=...): expected 'auto', 'none' or None, got {resume!r}"
        )
    if checkpoint_dict is not None:
        return dict(checkpoint_dict), auto_resume_path
    if resume != "auto":
        return None, None
    if location is None:
        raise ValueError(
            "resume='auto' needs train.checkpoint_dir or train.out_dir to know where to look"
        )
    if not dist.is_initialized() or dist.get_world_size() == 1:
        found = resolve_auto_resume(location)
        return (found[1], found[0]) if found is not None else (None, None)
    found, failure = None, None
    if dist.get_rank() == 0:
        try:
            found = resolve_auto_resume(location)
        except Exception as exc:  # tell the other ranks before raising, or they wait forever
            failure = exc
    chosen = ddp.broadcast_object(
        ("error", f"{type(failure).__name__}: {failure}") if failure is not None
        else (found[0], int(found[1]["step"])) if found is not None else None,
        src=0,
    )  # fmt: skip
    if failure is not None:
        raise failure
    if chosen is None:
        return None, None
    if chosen[0] == "error":
        raise RuntimeError(f"rank 0 could not resolve the checkpoint to resume: {chosen[1]}")
    path, step = chosen
    if found is not None:
        return found[1], path
    store = checkpoint_store(location)
    name = checkpoint_name(step)
    _, data = artifact.read_verified(store, name)
    return deserialize_checkpoint(data, path), path


def restore_rng(ckpt: Mapping[str, Any]) -> None:
    """Put this rank's RNG back as it was when ``ckpt`` was captured (call right before a step).

    A rank the checkpoint holds no state for (resuming on more ranks than it was written with)
    keeps its seeded RNG; rank 0 warns once, because those ranks' randomness will differ.
    """
    from koochak.loop.seed import set_rng_state

    rank = dist.get_rank()
    state = rng_state_for_rank(ckpt, rank)
    if state is not None:
        set_rng_state(state)
    if rank == 0:
        saved = ckpt.get("world_size") or 1
        if saved != dist.get_world_size():
            log.warning(
                "checkpoint was written by %d rank(s), resuming on %d: ranks without a saved RNG "
                "state keep their seeded one",
                saved,
                dist.get_world_size(),
            )
