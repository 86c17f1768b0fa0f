"""Putting a checkpoint back: weights, optimizer, scheduler, scaler and EMA, then RNG last.

``restore_training_state`` loads everything but the RNG; ``restore_rng`` puts this rank's RNG
back right before the first resumed step, so nothing in between can draw from it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from koochak.loop import dist, fsdp
from koochak.loop.checkpoint.sharded_read import is_lazy, materialize
from koochak.loop.dist import is_dtensor
from koochak.loop.ema import ModelEma, restore_ema
from koochak.loop.seed import rng_world_note, set_rng_state
from koochak.loop.state_dicts import match_state_dict_to_model, unwrap_model
from koochak.loop.user_state import restore_state

log = logging.getLogger("koochak.loop.checkpoint")


def restore_training_state(
    ckpt: Mapping[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    scaler: Any = None,
    ema: ModelEma | None = None,
    state: Mapping[str, Any] | None = None,
    where: str = "the checkpoint",
) -> int:
    """Load weights, optimizer, scheduler, scaler, EMA and the user's ``state`` entries from
    ``ckpt``; return ``next_step``. ``state`` (``training_loop(state=...)``) must name exactly the
    entries the checkpoint holds (`koochak.loop.user_state.restore_state`); None skips it.

    The model may be wrapped (DDP, compile) or not, or sharded with FSDP: then the global tensors
    of the checkpoint are cut into this rank's shards (the optimizer state too), so a checkpoint
    of any world size loads. The optimizer moves its state onto the parameters' devices itself.
    RNG is restored separately (``restore_rng``) right before the next step, so nothing between
    here and there can consume it.
    """
    if is_lazy(ckpt):  # chosen by resolve_sharded: read this rank's slabs (every rank at once)
        ckpt = materialize(ckpt, model, optimizer, ema, state)
    target = unwrap_model(model)
    weights = match_state_dict_to_model(target, ckpt["model"])
    sharded = any(is_dtensor(p) for p in target.parameters())
    if sharded:
        weights = fsdp.localize(weights, target.state_dict())
    target.load_state_dict(weights)
    if optimizer is not None:
        if ckpt.get("optimizer") is None:
            raise ValueError("checkpoint has no 'optimizer' state but an optimizer was given")
        saved = ckpt["optimizer"]
        optimizer.load_state_dict(fsdp.localize_optimizer(saved, optimizer) if sharded else saved)
    if scheduler is not None and ckpt.get("scheduler") is not None:
        scheduler.load_state_dict(ckpt["scheduler"])
    if scaler is not None and ckpt.get("scaler") is not None and hasattr(scaler, "load_state_dict"):
        scaler.load_state_dict(ckpt["scaler"])
    restore_ema(ema, ckpt)  # the shadows continue, or (none saved) start from these weights
    if state is not None:
        restore_state(ckpt.get("user_state"), state, where)
    return int(ckpt["next_step"])


def rng_state_for_rank(ckpt: Mapping[str, Any], rank: int) -> Any | None:
    """The RNG state this rank should restore, or None when the checkpoint holds none for it.

    Checkpoints written under DDP keep every rank's state in ``rng_per_rank`` (gathered by rank
    0); a single-process checkpoint keeps one in ``rng``, which belongs to rank 0.
    """
    per_rank = ckpt.get("rng_per_rank")
    if per_rank is not None:
        return per_rank[rank] if rank < len(per_rank) else None
    return ckpt.get("rng") if rank == 0 else None


def restore_rng(ckpt: Mapping[str, Any]) -> None:
    """Put this rank's RNG back as it was when ``ckpt`` was captured (call right before a step).

    A rank the checkpoint holds no state for (resuming on more ranks than it was written with)
    keeps its seeded RNG; on fewer ranks the streams of the ranks gone end. Either way rank 0
    says so once (`koochak.loop.seed.rng_world_note`).
    """
    rank = dist.get_rank()
    state = rng_state_for_rank(ckpt, rank)
    if state is not None:
        set_rng_state(state)
    note = rng_world_note(int(ckpt.get("world_size") or 1), dist.get_world_size())
    if rank == 0 and note is not None:
        log.warning("%s", note)
