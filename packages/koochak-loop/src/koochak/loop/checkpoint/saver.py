"""Saving a run's checkpoints: when, how (sync or async), and which rank does what.

``training_loop`` holds one ``Checkpointer``. Every rank captures each checkpoint
(``capture_checkpoint`` gathers the per-rank RNG states where rank 0 alone writes) and holds one ``CheckpointSaver``, the
same class for every rank and layout: rank 0 is its coordinator (commits, prunes through
``retention``, replicates, announces), the others followers; the layout (``layouts``) decides who
writes (one file or parts: rank 0; sharded, under FSDP: every rank). Periodic saves come every ``train.ckpt_every`` updates; terminal ones (the end, an
evacuation, a GPU-health stop) are synchronous, and every rank learns rank 0's outcome.

With ``train.checkpoint_async`` periodic saves go through ``AsyncPublisher``: the training
thread's only work is to freeze the checkpoint at the step it describes (its non-tensor data into
a small skeleton, its tensors copied into reusable host buffers, ``HostBuffers``) and one
background thread, at a lower CPU priority, writes it from those buffers, at most one
publication in flight. Results come back to the training thread, never the other way round:
``on_checkpoint`` callbacks and failures are delivered by ``poll``/``drain``, which the loop calls
at step boundaries, so hooks never run concurrently with training and a failed publication fails
the next step. ``train.checkpoint_parts`` chooses the layout (1: one file; more, or ``auto``:
parts written in parallel) for both kinds of save.

With ``train.checkpoint_replicas`` the saver commits in the first tier and hands each checkpoint
to a ``Replicator`` (``replication``), which copies it to the durable tiers in the background;
``on_checkpoint`` then names the first replica tier, once the checkpoint commits there, and the
last save of a run waits for a durable commit.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import koochak.loop.checkpoint.retention as retention
import torch
from koochak.loop import ddp, dist
from koochak.loop.checkpoint.background import lower_this_threads_priority
from koochak.loop.checkpoint.commit import publication_path, remove_checkpoints
from koochak.loop.checkpoint.commit import save as save_in_layout
from koochak.loop.checkpoint.format import (
    build_checkpoint,
    checkpoint_name,
    step_of_name,
)
from koochak.loop.checkpoint.host_buffers import HostBuffers, HostCopy
from koochak.loop.checkpoint.layouts import COORDINATOR, FOLLOWER, ROLES, Layout, layout_for
from koochak.loop.checkpoint.publication import checkpoint_store
from koochak.loop.checkpoint.replication import (
    FollowerReplicator,
    ReplicaTier,
    ReplicationEvent,
    Replicator,
    self_replicating_writers,
)
from koochak.loop.checkpoint.settings import CheckpointConfig
from koochak.loop.checkpoint.tiers import ReplicationSettings
from koochak.loop.config import TrainConfig
from koochak.loop.seed import get_rng_state
from koochak.loop.user_state import capture_state
from koochak.storage import artifact
from koochak.storage.store import Store

log = logging.getLogger("koochak.loop.checkpoint")


class CheckpointPublishError(RuntimeError):
    """A background checkpoint publication failed; training stops at its next step."""


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
    data: Callable[[int], Mapping[str, Any]] | None = None,
    run_id: str | None = None,
    state: Mapping[str, Any] | None = None,
    origin: Mapping[str, Any] | None = None,
    world_size: int | None = None,
    sharded: bool | None = None,
) -> dict[str, Any]:
    """Build the checkpoint dict; every rank must call it (it may gather per-rank RNG states).

    Every rank's dict carries its own RNG state in ``rng``. When rank 0 alone writes (DDP, one
    process) it also carries every rank's in ``rng_per_rank`` (gathered here: O(ranks) bytes on
    rank 0, about 16 kB per rank); a sharded model's (FSDP) ranks each write their own state
    into their own part (``sharded.save_sharded``), so nothing is gathered. ``data`` gives
    the elastic data cursor at ``next_step``; ``state`` is the user's open state mapping
    (``training_loop(state=...)``), ``origin`` what ``train.init_from`` loaded. ``world_size``
    and ``sharded`` (whether ``model`` is sharded) are looked up when not given; the loop's
    ``Checkpointer`` knows them once per run, so a one-process save makes no collective call.
    """
    own = get_rng_state()
    if world_size is None:
        world_size = dist.get_world_size()
    if sharded is None:
        sharded = _sharded(model)
    states = ddp.gather_rng_states(own) if world_size > 1 and not sharded else None
    ckpt = build_checkpoint(  # under FSDP its sharded tensors are this rank's DTensors
        step=step,
        next_step=next_step,
        reason=reason,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        config=config,
        rng=own,
        rng_per_rank=states,
        world_size=world_size,
        wall_time=wall_time,
        metrics=metrics,
        ema=ema.state_dict() if ema is not None else None,
        data=data(next_step) if data is not None else None,
        run_id=run_id,
        user_state=capture_state(state) if state else None,
        origin=origin,
    )
    return ckpt


def _sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` is sharded (FSDP: DTensor parameters), so every rank writes its own
    parts and its own RNG state (the same answer on every rank)."""
    from koochak.loop.dist import is_dtensor
    from koochak.loop.state_dicts import unwrap_model

    return any(is_dtensor(p) for p in unwrap_model(model).parameters())


class Checkpointer:
    """This run's checkpoints: every rank captures them, rank 0's ``saver`` publishes them.

    ``parts`` are the live objects each capture reads anew (``model``, ``optimizer``,
    ``scheduler``, ``scaler``, ``ema``, ``config``). ``saver`` is None on the other ranks.
    ``resumed`` is the checkpoint this run continues from (its wall time carries on), if any.
    """

    def __init__(
        self,
        parts: Mapping[str, Any],
        saver: CheckpointSaver | None,
        *,
        every: int | None,
        max_steps: int | None,
        resumed: Mapping[str, Any] | None,
        started: float,
        world_size: int | None = None,
        sharded: bool | None = None,
    ) -> None:
        self.parts = parts
        self.world_size, self.sharded = world_size, sharded  # None: looked up at each capture
        self.saver = saver
        self.every = every
        self.max_steps = max_steps
        self.resumed = resumed
        self.prior_wall_time = float(resumed.get("wall_time") or 0.0) if resumed else 0.0
        self.started = started  # perf_counter() when this attempt began

    def due(self, step: int) -> bool:
        """Whether the update with zero-based index ``step`` ends with a periodic save. Not the
        one that reaches ``max_steps``: the terminal save of the same state follows it."""
        return bool(self.every) and (step + 1) % self.every == 0 and step + 1 != self.max_steps

    def capture(self, step: int, next_step: int, reason: str, metrics: Mapping[str, float]) -> Any:
        wall_time = self.prior_wall_time + time.perf_counter() - self.started
        return capture_checkpoint(step=step, next_step=next_step, reason=reason, **self.parts,
                                  wall_time=wall_time, metrics=metrics,
                                  world_size=self.world_size, sharded=self.sharded)  # fmt: skip

    def periodic(self, step: int, metrics: Mapping[str, float]) -> None:
        """Save after update ``step`` (resumes at ``step + 1``); async when the saver is."""
        checkpoint = self.capture(step, step + 1, "periodic", metrics)
        if self.saver is not None:
            self.saver.save(checkpoint)

    def terminal(
        self,
        reason: str,
        step: int,
        metrics: Mapping[str, float],
        best_effort: bool = False,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Capture a terminal-kind checkpoint (``next_step == step``) and publish it synchronously;
        returns ``(path, checkpoint)`` (path None where nothing was published).

        Rank 0 drains any async publication first, then publishes; all ranks wait for its
        outcome, so no rank exits (and no launcher tears rank 0 down) mid-publication, and a
        failed save stops every rank instead of leaving the others waiting. ``best_effort`` (a
        failing GPU): a failed save is logged and the caller still exits. A resumed run that had
        nothing left to do does not publish its terminal checkpoint again: it already is
        published, and re-publishing would only open a window in which it is un-committed.
        """
        path = None
        failure: Exception | None = None
        publish = not (
            reason in ("terminal", "stopped") and is_published_terminal(self.resumed, step)
        )
        try:
            checkpoint = self.capture(step, step, reason, metrics)
            if self.saver is not None and checkpoint is not None and publish:
                path = self.saver.save(checkpoint, sync=True)
            elif self.saver is not None and checkpoint is not None:
                path = self.saver.settle(checkpoint_name(step), reason)  # durable before exit
        except Exception as exc:
            if not best_effort:
                failure = exc  # raised below, once the other ranks know
            else:
                warnings.warn(
                    f"{reason} checkpoint at step {step} could not be saved: {exc}", stacklevel=3
                )
            checkpoint = None
        rank0_failure = ddp.broadcast_object(
            None if failure is None else f"{type(failure).__name__}: {failure}", src=0
        )
        if failure is not None:
            raise failure
        if rank0_failure is not None:
            raise RuntimeError(
                f"rank 0 could not save the {reason} checkpoint at step {step}: {rank0_failure}"
            )
        return path, checkpoint

    def poll(self) -> None:
        """Deliver a finished background publication (call at a step boundary); raises if it
        failed."""
        if self.saver is not None:
            self.saver.poll()

    def poller(self) -> Callable[[], None] | None:
        """What to call at each step boundary (``poll``), or None when nothing can ever finish in
        the background in this run: every save is synchronous and nothing replicates, so a poll
        would never find anything to deliver (the loop then skips it)."""
        if self.saver is None or not self.saver.works_in_background:
            return None
        return self.saver.poll

    def close(self) -> None:
        """On an error path: let an in-flight publication finish without masking the error."""
        if self.saver is not None:
            self.saver.close()


def make_checkpointer(
    cfg: TrainConfig | CheckpointConfig,
    parts: Mapping[str, Any],
    *,
    rank: int,
    resumed: Mapping[str, Any] | None,
    started: float,
    on_checkpoint: Callable[[dict[str, Any]], None] | None,
    on_replication: Callable[[dict[str, Any]], None] | None = None,
) -> Checkpointer:
    """The loop's Checkpointer, from the component's typed config (``CheckpointConfig``, built
    once from the flat ``train.*`` keys): saves every ``train.ckpt_every`` updates to
    ``train.checkpoint_dir`` (else ``out_dir``), keeping ``keep_last_k``, async with
    ``checkpoint_async``, replicated to ``checkpoint_replicas``. Every rank holds a saver (rank 0
    the coordinator, the others followers); the layout decides which of them write: under
    ``train.fsdp`` every rank writes its shards, otherwise rank 0 alone."""
    ck = cfg if isinstance(cfg, CheckpointConfig) else CheckpointConfig.of(cfg)
    saver = CheckpointSaver(
        ck.location,
        node_local=ck.node_local,
        role=COORDINATOR if rank == 0 else FOLLOWER,
        layout=layout_for(sharded=ck.sharded, parts=ck.parts),
        keep_last_k=ck.keep_last_k,
        async_publish=ck.async_publish,
        on_checkpoint=on_checkpoint if rank == 0 else None,
        keep_best=ck.keep_best,
        replication=ck.replication,
        on_replication=on_replication if rank == 0 else None,
        resumed=checkpoint_name(int(resumed["step"])) if resumed else None,
    )
    return Checkpointer(parts, saver, every=ck.every, max_steps=ck.max_steps, resumed=resumed,
                        started=started, world_size=dist.get_world_size(),
                        sharded=ck.sharded)  # fmt: skip


def is_published_terminal(resumed: Mapping[str, Any] | None, step: int) -> bool:
    """Whether ``resumed`` already is the terminal checkpoint of ``step`` completed updates."""
    return (
        resumed is not None
        and step == int(resumed["next_step"])
        and resumed.get("step") == step
        and resumed.get("reason") in ("terminal", "stopped")
    )


class CheckpointSaver:
    """One rank's saver, for every layout: publishes checkpoints, prunes them, replicates them
    and announces each one after it commits.

    ``role`` is ``"coordinator"`` (rank 0: commits, prunes, replicates, announces) or
    ``"follower"``; ``layout`` (``layouts.layout_for``: one file by default, parts for
    ``parts`` above 1, or sharded) decides who writes: a follower of a one-writer layout writes nothing
    and every call returns at once; under ``Sharded`` every rank's ``save`` is collective.

    ``on_checkpoint(info)`` receives ``step``, ``path``, ``checkpoint`` and ``publication``. With
    ``async_publish`` periodic saves go through one background thread; ``sync=True`` saves
    (terminal, evacuation, GPU health) drain it first and publish on the calling thread. An
    async save copies the checkpoint's tensors into host buffers that this saver keeps and
    reuses (pinned for CUDA tensors), so its extra host memory is one checkpoint's tensors,
    however many saves it makes. A sharded async save's collectives run on a gloo group of its
    own (created here, so every rank must build its saver at the same point).

    With ``replication`` (``train.checkpoint_replicas``) ``location`` is the first tier: each
    commit there is replicated in the background, ``on_checkpoint`` fires (with ``tier`` and
    ``location`` added) once the checkpoint commits in the first replica tier, and
    ``on_replication(info)`` hears of every commit, failure and drop in every replica tier. A
    ``sync`` save waits for a durable commit. ``resumed`` names the checkpoint the run continues
    from: pulled back into the first tier if only a replica holds it.
    """

    def __init__(
        self,
        location: str | os.PathLike[str] | Store | None,
        *,
        role: str = COORDINATOR,
        layout: Layout | None = None,
        keep_last_k: int | None = None,
        async_publish: bool = False,
        parts: int | str = 1,
        on_checkpoint: Callable[[dict[str, Any]], None] | None = None,
        keep_best: tuple[int, str, str] | None = None,
        replication: ReplicationSettings | None = None,
        on_replication: Callable[[dict[str, Any]], None] | None = None,
        resumed: str | None = None,
        node_local: bool = False,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"CheckpointSaver(role={role!r}): expected one of {ROLES}")
        self.location = location
        self.node_local = node_local  # location is this node's directory ({node})
        self.role = role
        self.layout: Layout = (
            layout if layout is not None else layout_for(sharded=False, parts=parts)
        )
        self.parts = self.layout.parts
        self.writes = self.layout.writes(role)
        self.keep_last_k = keep_last_k
        self.keep_best = keep_best  # (k, metric, "min"|"max"): the k best are never pruned
        self._tracker = retention.best_of(keep_best)
        self.async_publish = async_publish
        self.on_checkpoint = on_checkpoint
        self.on_replication = on_replication
        self._pruned: deque[str] = deque()  # removed by _prune, not yet reported
        self._store: Store | None = None
        self._async: AsyncPublisher | None = None
        self._buffers = HostBuffers()
        self._replicator: Replicator | None = None
        self._follower: Any = None  # a follower's share of replication (node-local tiers)
        self._held: dict[str, Mapping[str, Any]] = {}  # saved, not yet announced
        self._group: Any = None
        collective = self.layout.writes(FOLLOWER)
        if collective and async_publish and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = torch.distributed.new_group(backend="gloo")
        if replication is not None:
            self._start_replication(replication, resumed)

    def _start_replication(self, replication: ReplicationSettings, resumed: str | None) -> None:
        replicas = [
            ReplicaTier(tier.index, checkpoint_store(tier.location), tier.keep_last_k)
            for tier in replication.replicas
        ]
        # Under a layout where every rank writes, each rank replicates its own parts (from its
        # node's directory or the shared first tier) and the coordinator commits each replica
        # from their receipts: no process reads or copies another's bytes.
        remote: frozenset[int] = frozenset()
        if self.layout.writes(FOLLOWER) and dist.get_world_size() > 1:
            remote = self_replicating_writers(dist.get_world_size())
        rank = dist.get_rank()
        if self.role != COORDINATOR:
            if rank in remote:
                self._follower = FollowerReplicator(
                    self.store, replicas, rank=rank, keep_last_k=self.keep_last_k,
                    retry_s=replication.retry_s, prune=self.node_local,
                )  # fmt: skip
            return
        self._replicator = Replicator(
            self.store,
            replicas,
            first_keep_last_k=self.keep_last_k,
            max_lag=replication.max_lag,
            retry_s=replication.retry_s,
            prune_unreplicated=replication.prune_unreplicated,
            pull=resumed,
            spare=self._best if self._tracker is not None else None,
            remote_writers=remote,
            bandwidth_mb_s=replication.bandwidth_mb_s,
        )

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
        """Publish ``ckpt`` as ``step{N:09d}.pt``; returns its path (None while still in flight,
        and on a rank that writes nothing).

        Replicated: a ``sync`` save returns once a durable tier holds it, and the path there.
        """
        if not self.writes:
            return None
        name = checkpoint_name(int(ckpt["step"]))
        store = self.store
        if self._tracker is not None:
            self._tracker.note(name, ckpt.get("metrics"))
        replicator = self._replicator
        if replicator is not None:
            replicator.wait_for_room()  # the lag bound: the run slows rather than piling up
            self._hold(name, ckpt)

        def announce(publication: artifact.Publication) -> str:
            path = publication_path(store, publication)
            if self.on_checkpoint is not None and replicator is None:
                self.on_checkpoint(
                    {
                        "step": int(ckpt["step"]),
                        "path": path,
                        "checkpoint": ckpt,
                        "publication": publication,
                    }
                )
            self._report_pruned()
            return path

        if self.async_publish and not sync:
            if self._async is None:
                self._async = AsyncPublisher(self._publish_copy)
            # Freeze now, on this thread: what is published must describe this step although
            # training moves on (and mutates the tensors) while it is written. The previous save
            # must be done first: its writers may still read the host buffers.
            self._async.drain()
            self._async.submit(name, self.layout.freeze(ckpt, self._buffers), announce)
            return None
        self.drain()
        # Training waits here, so the tensors cannot change: write straight from them.
        path = announce(self._publish(name, ckpt))
        if sync and (replicator is not None or self._follower is not None):
            return self.settle(name, str(ckpt.get("reason", "terminal")))
        return path

    def settle(self, name: str, reason: str) -> str | None:
        """At the end of a run: wait until ``name`` is committed in a durable tier (for a
        ``terminal`` or ``stopped`` save in every replica tier that does not give up), deliver
        what happened, stop replicating; return its path in the first replica tier holding it.
        Raises CheckpointReplicationError when none does. Without replicas, or on a follower:
        None.
        """
        if self._follower is not None:
            self._follower.settle()
            self._follower.close()
        replicator = self._replicator
        if replicator is None:
            return None
        try:
            # A run that ends normally waits for every tier; one that must leave (evacuation,
            # a bad GPU) only for the tier on_checkpoint names.
            held = replicator.settle(name, everywhere=reason in ("terminal", "stopped"))
        finally:
            self.poll()
        replicator.close()
        where = held[0].store
        local = where.local_path(name)
        return local if local is not None else f"{where.location.rstrip('/')}/{name}"

    @property
    def works_in_background(self) -> bool:
        """Whether anything can finish off this thread, for ``poll`` to deliver: async publishing
        (its publisher is made at the first save) or replication (started with the saver)."""
        return self.async_publish or self._replicator is not None

    def poll(self) -> None:
        """Deliver a finished background publication (raises if it failed) and what replication
        did since the last call."""
        if self._async is not None:
            self._async.poll()
        if self._replicator is not None:
            for event in self._replicator.take_events():
                self._deliver(event)

    def drain(self) -> None:
        """Wait for the background publication in flight (if any) and deliver it."""
        if self._async is not None:
            self._async.drain()

    def close(self) -> None:
        """On an error path: let an in-flight publication finish without masking the error;
        stop replicating after the copies in flight."""
        if self._async is not None:
            self._async.close()
        if self._replicator is not None:
            self._replicator.close()
            try:  # what the copies in flight did: the run history records every commit
                for event in self._replicator.take_events():
                    self._deliver(event)
            except Exception as exc:  # the caller is already failing; keep its exception primary
                log.error("reporting the last replications also failed: %s", exc)
        if self._follower is not None:
            self._follower.close()

    def _publish(self, name: str, data: Any, group: Any = None) -> artifact.Publication:
        """Write ``name`` in this layout, then (the coordinator) replicate or prune."""
        replicator = self._replicator
        coordinator = self.role == COORDINATOR
        if replicator is not None:
            replicator.before_publish(name)
        publication = save_in_layout(self.layout, self.store, name, data,
                                     coordinator=coordinator, group=group)  # fmt: skip
        if self._follower is not None:
            self._follower.submit(name, self.layout.last_written)
        if not coordinator:
            return publication
        if replicator is not None:
            # The first tier prunes through the replicator: never a checkpoint no replica holds
            # yet, never one of the best.
            replicator.submit(name)
        else:
            self._prune()
        return publication

    def _publish_copy(self, name: str, frozen: tuple[Any, HostCopy]) -> artifact.Publication:
        """The background half of an async save: publish from the host copy, then free it."""
        data, copy = frozen
        try:
            return self._publish(name, data, self._group)
        finally:
            copy.release()

    def _prune(self) -> None:
        """Keep the newest ``keep_last_k`` and the ``k`` best by the metric; unpublish the rest
        (manifest first, then the object, then any parts)."""
        if self.keep_last_k is None:
            return
        names = retention.committed_names(self.store)
        best = self._best(self.store, names)
        for name in remove_checkpoints(
            self.store, retention.to_drop(names, keep_last_k=self.keep_last_k, best=best)
        ):
            if self._tracker is not None:
                self._tracker.forget(name)
            self._pruned.append(name)  # reported with the commit that caused it (announce)

    def _report_pruned(self) -> None:
        """Tell ``on_replication`` (status ``pruned``, tier 0) what the first tier's retention
        removed, on the training thread, without replicas (with them the replicator does)."""
        while self._pruned:
            name = self._pruned.popleft()
            if self.on_replication is not None:
                self.on_replication({"status": "pruned", "step": step_of_name(name), "name": name,
                                     "tier": 0, "location": self.store.location, "path": None,
                                     "publication": None, "seconds": 0.0, "bytes": 0, "lag": 0,
                                     "behind_s": None, "error": None,
                                     "retry_in_s": None})  # fmt: skip

    def _best(self, store: Store, names: list[str]) -> set[str]:
        """The ``keep_best_k`` best of ``names`` (committed in ``store``): what no tier's
        retention removes."""
        return self._tracker.best(store, names) if self._tracker is not None else set()

    def _hold(self, name: str, ckpt: Mapping[str, Any]) -> None:
        """Keep the dict for ``on_checkpoint`` until the first replica commits it (the newest
        few only: one that is never replicated there is not announced)."""
        self._held[name] = ckpt
        while len(self._held) > _HELD_CHECKPOINTS:
            del self._held[next(iter(self._held))]

    def _deliver(self, event: ReplicationEvent) -> None:
        info = {
            "status": event.status,
            "step": event.step,
            "name": event.name,
            "tier": event.tier,
            "location": event.location,
            "path": event.path,
            "publication": event.publication,
            "seconds": event.seconds,
            "bytes": event.bytes_copied,
            "lag": event.lag,
            "behind_s": event.behind_s,
            "error": event.error,
            "retry_in_s": event.retry_in_s,
            "at": event.at,
        }
        if self.on_replication is not None:
            self.on_replication(info)
        # One tier is named for every checkpoint, so its artifact event always carries the same
        # path: the first replica, where a consumer on another node can read it.
        if event.status == "committed" and event.tier == 1 and self.on_checkpoint is not None:
            self.on_checkpoint(
                {
                    "step": event.step,
                    "path": event.path,
                    "checkpoint": self._held.pop(event.name, None),
                    "publication": event.publication,
                    "tier": event.tier,
                    "location": event.location,
                }
            )


# Checkpoint dicts kept for their on_checkpoint (a checkpoint's tensors are the live ones).
_HELD_CHECKPOINTS = 8


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
        # Yield the cores to the training thread; the writers this thread starts inherit it.
        lower_this_threads_priority()
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
