"""One live run per checkpoint location: the run's lease (docs/checkpoints.md, "the lease").

`hold_location` takes `koochak.storage.lease` on rank 0 and tells every rank the outcome with
one broadcast at start, so under DDP/FSDP every rank leaves with the refusal (exit 2, the holder
named) instead of waiting in its first collective for rank 0, which left. koochak-train calls it
before building the model (``early=True``); `training_loop` then finds that lease here instead of
taking it again. `check_held`, called before each checkpoint publish, stops the run with
`LeaseLost` (exit 2) on every rank once rank 0's lease is lost: taken over by another run, or
not renewed for its ``ttl_seconds``, after which another run may take it over.
"""

from __future__ import annotations

from typing import Any

from koochak.loop import ddp, dist
from koochak.loop.config import ConfigError, TrainConfig

__all__ = ["LeaseLost", "check_held", "hold_location", "release_unclaimed"]

# location -> the lease koochak-train took for it before building the run (None on ranks > 0)
_TAKEN: dict[str, Any] = {}


class LeaseLost(ConfigError):
    """This run's lease on its checkpoint location is lost: it stopped before publishing."""


def _key(cfg: TrainConfig) -> str:
    return "train.checkpoint_dir" if cfg.checkpoint_dir else "train.out_dir"


def hold_location(location: Any, cfg: TrainConfig, *, early: bool = False) -> Any:
    """The run's lease on ``location`` (rank 0; None on other ranks), renewed while it lives.

    Another live run there is a ConfigError naming it, raised on every rank of the process group
    (one broadcast). ``early``: koochak-train's call before the model is built; the loop's later
    call returns that lease without taking it again (and without a collective).
    """
    if str(location) in _TAKEN:
        return _TAKEN.pop(str(location))
    from koochak.loop.checkpoint.publication import checkpoint_store
    from koochak.storage import lease as leases

    held, failure, refusal = None, None, None
    if dist.get_rank() == 0:
        try:
            held = leases.acquire_lease(
                checkpoint_store(location),
                ttl_seconds=leases.TTL_SECONDS,
                renew_seconds=leases.RENEW_SECONDS,
                purpose=f"koochak run in {cfg.out_dir}",
            )
        except leases.LeaseHeld as exc:
            refusal = f"{_key(cfg)}: {exc}"
        except Exception as exc:  # the others must not wait for a rank 0 that leaves
            failure, refusal = exc, f"{_key(cfg)}: rank 0 could not take the run's lease: {exc}"
    if dist.get_world_size() > 1:
        refusal = ddp.broadcast_object(refusal)  # the one collective: every rank learns it now
    if failure is not None:
        raise failure
    if refusal is not None:
        raise ConfigError(refusal)
    lease = held.keep_renewed() if held is not None else None
    if early:
        _TAKEN[str(location)] = lease
    return lease


def release_unclaimed() -> None:
    """Release a lease koochak-train took for a run that never reached the loop."""
    while _TAKEN:
        _, lease = _TAKEN.popitem()
        if lease is not None:
            lease.release()


def check_held(lease: Any, world_size: int, updates: int) -> None:
    """Before a checkpoint publish: `LeaseLost` on every rank once rank 0's lease is lost.

    Only rank 0 holds the lease; with several ranks this is one all-reduce (at checkpoint
    publishes only, never per step), and a broadcast of the reason once it is lost.
    """
    reason = lease.lost_reason if lease is not None else None
    message = None
    if reason is not None:
        message = (
            f"{lease.where}: this run's lease on its checkpoint location is lost ({reason}); "
            f"stopped after {updates} updates without publishing their checkpoint, so that two "
            "runs never write one location (resume with --resume auto once no other run uses it)"
        )
    if world_size > 1:
        if not ddp.any_rank(message is not None, ddp.collective_device()):
            return
        message = ddp.broadcast_object(message)
    if message is not None:
        raise LeaseLost(message)
