"""A run's checkpoints as one component: what ``training_loop`` calls, and all it calls here.

The loop talks to checkpoints through a handful of calls, in this order:

1. ``open_checkpoints(cfg, ...)``, once, with the resume request, before anything is built: the
   typed ``CheckpointConfig`` (built here, once per run), the claim on every place the run writes
   (``run_lease.claim_run``: the leases, then the tier markers and the run id; koochak-train's
   earlier claim is taken over, not repeated), the checkpoint to continue from over every tier
   (``resume.resume_checkpoint``) and the checks that it is this run's (the model's shapes, the
   config). A refusal or any failure here releases the claim before it raises.
2. ``restore(parts, ...)``, once the model, optimizer, scheduler, scaler, EMA and the user's
   state exist: puts the resumed training state back into them (everything but the RNG) and
   builds the saver that captures every later checkpoint from those same live objects.
3. ``restore_rng()``: the last thing before the first step, so nothing in between draws from it.
4. per update: ``due(step)`` on the updates a cadence ends, then ``periodic(step, metrics)``;
   ``poller()`` once, for what async saves and replication deliver at step boundaries;
   ``terminal(reason, step, metrics)`` at the end (also an evacuation, a failing GPU). Each
   publish first checks that the run still holds its leases (``_check_held``).
5. ``close()`` on an error path (an in-flight publication finishes, replication stops), and
   ``release()`` whatever happens: the lease goes back at once, so the next run in the same
   place starts without waiting for the lease's deadline.

Selection, restore, the layouts, tiers and replication stay in their own modules; this one
only holds the order they run in and what each step hands the next.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from koochak.loop import ddp
from koochak.loop.checkpoint.restore import restore_rng, restore_training_state
from koochak.loop.checkpoint.resume import resume_checkpoint, resume_publication_path
from koochak.loop.checkpoint.saver import Checkpointer, make_checkpointer
from koochak.loop.checkpoint.settings import CheckpointConfig
from koochak.loop.config import TrainConfig
from koochak.loop.resume_config import (
    check_model_shapes,
    check_resume_config,
    format_change,
    schedule_follows_max_steps,
)
from koochak.loop.run_lease import LeaseLost, claim_run
from koochak.loop.state_dicts import match_state_dict_to_model, unwrap_model

__all__ = ["RunCheckpoints", "open_checkpoints"]


def open_checkpoints(
    cfg: TrainConfig,
    *,
    rank: int,
    world_size: int,
    resume: str | None = None,
    checkpoint_dict: Mapping[str, Any] | None = None,
    auto_resume_path: str | None = None,
    model: torch.nn.Module | None = None,
    config: Mapping[str, Any] | None = None,
    shard_size: int | None = None,
) -> RunCheckpoints:
    """Claim the run's locations and choose what it continues from (every rank calls it).

    ``resume`` is ``"auto"``, ``"none"`` or None; a ``checkpoint_dict`` the caller resolved
    itself (with ``auto_resume_path``) wins. ``model`` and ``config`` (the run's config, as its
    checkpoints record it) are checked against the chosen checkpoint: a shape the model cannot
    take, or a config that makes it another run, is refused here, before anything is built.
    ``shard_size``: under HSDP, the ranks of one shard group (each reads its group's rows).
    Whatever fails after the claim releases it again.
    """
    settings = CheckpointConfig.of(cfg)
    # One owner per location, before anything there is read or written: the lease on every tier
    # and out_dir, then the tier markers; the caller's checkpoint names the run. A run that
    # starts over (no checkpoint to continue) becomes the owner: see tier_marker.claim_tiers.
    fresh = checkpoint_dict is None and resume != "auto"
    lease, run_id = claim_run(cfg, rank, checkpoint_dict, fresh=fresh, tiers=settings.tiers)
    try:
        found = resume_checkpoint(
            resume, list(settings.locations), checkpoint_dict, auto_resume_path,
            sharded=settings.sharded, shard_size=shard_size,
        )  # fmt: skip
        path, resumed = found if found is not None else (None, None)
        if resumed is not None:  # the same run, or refuse before anything is built
            if model is not None:
                _check_resumed_model(resumed, model, path)
            if config is not None:
                _check_resumed_config(resumed, config, cfg, path, rank)
    except BaseException:
        if lease is not None:
            lease.release()
        raise
    return RunCheckpoints(settings, lease, run_id, path, resumed, rank=rank, world_size=world_size)


class RunCheckpoints:
    """One run's checkpoints, opened by ``open_checkpoints``: what it resumed from, and its saves.

    ``resumed`` is the checkpoint the run continues from (None: it starts at step 0) and
    ``resume_path`` where it was read; ``start_step`` its ``next_step``; ``origin`` what
    ``train.init_from`` loaded for the run, as that checkpoint records it; ``stopped_before``: a
    hook stopped the run it continues, so no update runs. ``tiers`` are the locations, first tier
    first; ``run_id`` names the run in every checkpoint. ``due(step)``: whether update ``step``
    (zero-based) ends with a periodic save.
    """

    def __init__(
        self,
        settings: CheckpointConfig,
        lease: Any,
        run_id: str,
        resume_path: str | None,
        resumed: dict[str, Any] | None,
        *,
        rank: int,
        world_size: int,
    ) -> None:
        self.settings = settings
        self.tiers = list(settings.locations)
        self.run_id = run_id
        self.resume_path = resume_path
        self.resumed = resumed
        self.start_step = int(resumed["next_step"]) if resumed is not None else 0
        self.origin = resumed.get("origin") if resumed is not None else None
        # A run a hook stopped is over: resuming it trains no further (like one at max_steps).
        self.stopped_before = resumed is not None and resumed.get("reason") == "stopped"
        self.rank, self.world_size = rank, world_size
        self._lease = lease
        self._saves: Checkpointer | None = None
        # due(step): whether update ``step`` (zero-based) ends with a periodic save. The saver's
        # own bound method once ``restore`` made it, so the loop's check is a single call.
        self.due: Callable[[int], bool] = self._not_started

    def resume_publication_path(self) -> str | None:
        """Where the resumed checkpoint is announced for others to read (its path in the first
        replica tier, once that tier holds the very commit read; see ``resume``)."""
        return resume_publication_path(self.tiers, self.resume_path, self.resumed)

    def restore(
        self,
        parts: Mapping[str, Any],
        *,
        started: float,
        on_checkpoint: Callable[[dict[str, Any]], None] | None = None,
        on_replication: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """Put the resumed training state back into the live objects of ``parts`` (``model``,
        ``optimizer``, ``scheduler``, ``scaler``, ``ema``, ``state``; everything but the RNG,
        which ``restore_rng`` puts back right before the first step), then start saving: every
        later checkpoint is captured from these objects (with ``config``, ``data``, ``run_id``
        and ``origin`` of ``parts``). ``started``: ``perf_counter()`` when this attempt began.
        Every rank calls it at the same point (a sharded async saver makes a process group)."""
        if self.resumed is not None:
            restore_training_state(
                self.resumed, parts["model"], parts["optimizer"], parts["scheduler"],
                parts["scaler"], parts["ema"], parts["state"], self.resume_path or "the checkpoint",
            )  # fmt: skip
        self._saves = make_checkpointer(
            self.settings, parts, rank=self.rank, resumed=self.resumed, started=started,
            on_checkpoint=on_checkpoint, on_replication=on_replication,
        )  # fmt: skip
        self.due = self._saves.due

    def restore_rng(self) -> None:
        """Put this rank's RNG back as the resumed checkpoint left it (nothing when fresh): call
        it last before the first step, so nothing in between draws from it."""
        if self.resumed is not None:
            restore_rng(self.resumed)

    def periodic(self, step: int, metrics: Mapping[str, float]) -> None:
        """Save after update ``step``; the run resumes from it at ``step + 1``. A lost lease
        stops the run here on every rank (``LeaseLost``), never publishing."""
        self._check_held(step + 1)
        self._started.periodic(step, metrics)

    def terminal(
        self, reason: str, step: int, metrics: Mapping[str, float], best_effort: bool = False
    ) -> tuple[str | None, dict[str, Any] | None]:
        """The terminal-kind checkpoint after ``step`` updates, published synchronously; every
        rank learns rank 0's outcome (``saver.Checkpointer.terminal``). Returns ``(path,
        checkpoint)``. The lease is checked first, as for every publish."""
        self._check_held(step)
        return self._started.terminal(reason, step, metrics, best_effort=best_effort)

    def poller(self) -> Callable[[], None] | None:
        """What to call at each step boundary, or None when nothing finishes in the background."""
        return self._started.poller()

    def close(self) -> None:
        """On an error path: let an in-flight publication finish without masking the error being
        raised, and stop replicating."""
        if self._saves is not None:
            self._saves.close()

    def release(self) -> None:
        """Give the run's locations back (its leases); safe to call more than once."""
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.release()

    def _check_held(self, updates: int) -> None:
        """Before a checkpoint publish: ``LeaseLost`` on every rank once a lease of the run is lost.

        Rank 0 holds the run's leases (and each other node's first rank its node-local first
        tier's); with several ranks this is one all-reduce (at publishes only, never per step),
        and an all-gather of the reason once one is lost.
        """
        held = self._lease.held if self._lease is not None else ()
        lost = next((lease for lease in held if lease.lost_reason is not None), None)
        message = None
        if lost is not None:
            message = (
                f"{lost.where}: this run's lease on its checkpoint location is lost "
                f"({lost.lost_reason}); stopped after {updates} updates without publishing their "
                "checkpoint, so that two runs never write one location (resume with --resume "
                "auto once no other run uses it)"
            )
        if self.world_size > 1:
            if not ddp.any_rank(message is not None, ddp.collective_device()):
                return
            message = ddp.first_of_any_rank(message)  # the node whose lease it is may not be rank 0
        if message is not None:
            raise LeaseLost(message)

    @property
    def _started(self) -> Checkpointer:
        if self._saves is None:
            self._not_started()
        assert self._saves is not None
        return self._saves

    def _not_started(self, *args: Any) -> bool:
        raise RuntimeError("RunCheckpoints: call restore(parts, ...) before saving")


def _with_defaults(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` over every default key, so keys a newer version added compare equal."""
    from koochak.loop.config import defaults

    def merge(base: Any, over: Any) -> Any:
        if isinstance(base, Mapping) and isinstance(over, Mapping):
            return {**base, **{k: merge(base.get(k), v) for k, v in over.items()}}
        return over

    return merge(defaults(), config)


def _check_resumed_model(
    checkpoint: Mapping[str, Any], model: torch.nn.Module, where: str | None
) -> None:
    """Refuse, before anything is built, a checkpoint whose weights this model cannot take."""
    target = unwrap_model(model)
    saved = checkpoint.get("model")
    if isinstance(saved, Mapping):
        live = target.state_dict()
        check_model_shapes(match_state_dict_to_model(target, saved), live, where or "")


def _check_resumed_config(
    checkpoint: Mapping[str, Any],
    config: Mapping[str, Any],
    cfg: TrainConfig,
    where: str | None,
    rank: int,
) -> None:
    """Refuse a resume whose config makes it a different run; say once what else changed."""
    # stacklevel 4: the warning points at the caller of training_loop (the user's script).
    if not checkpoint.get("config"):  # built by user code or an older tool: nothing to compare
        if rank == 0:
            warnings.warn(
                f"resume from {where or 'the checkpoint'}: the checkpoint recorded no config, so "
                "this run's config cannot be compared with it; resuming it as the same run",
                UserWarning,
                stacklevel=4,
            )
        return
    old, new = _with_defaults(checkpoint["config"]), _with_defaults(config)
    drift = check_resume_config(old, new, cfg.resume_allow_changes, where or "")
    if drift.harmless and rank == 0:
        note = ""
        if drift.max_steps_extended and schedule_follows_max_steps(new):
            note = (" train.max_steps grew: a cosine whose length is train.max_steps continues from "
                    "the LR the checkpoint reached down to eta_min at the new max_steps when the "
                    "scheduler is built with the checkpoint (build_scheduler(..., checkpoint=); "
                    "koochak-train does).")  # fmt: skip
        warnings.warn(
            f"resume from {where or 'the checkpoint'}: config changed since it was saved (the run "
            f"stays the same run): {'; '.join(map(format_change, drift.harmless))}.{note}",
            UserWarning,
            stacklevel=4,
        )
