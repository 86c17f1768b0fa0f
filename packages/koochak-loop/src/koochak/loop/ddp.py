"""DDP setup for the loop: process group, device pinning, wrapping, explicit sharding, RNG gather.

``train.ddp: true`` initializes the default process group when none exists (gloo on CPU, NCCL on
CUDA; an existing group is respected), pins the CUDA device from LOCAL_RANK, and wraps the model in
DistributedDataParallel. Sharding is never implicit: ``train.shard_dataset`` (and
``shard_eval_dataset``) opt in, and rank 0 warns when DDP trains on unsharded data unless
``train.warn_unsharded: false`` (an unsharded eval set is correct, only slower: no warning).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from koochak.loop import dist
from koochak.loop.config import TrainConfig, as_train_config
from koochak.loop.elastic import find_elastic


@dataclass(frozen=True)
class DdpSetup:
    """What ``setup_ddp`` decided: this process's place and whether it created the group."""

    enabled: bool
    rank: int
    world_size: int
    local_rank: int
    created_group: bool
    device: torch.device


def setup_ddp(train_cfg: TrainConfig | Mapping[str, Any], device: torch.device) -> DdpSetup:
    """Initialize the process group if ``train.ddp`` (or ``train.fsdp.enabled``) asks for it;
    returns where this rank runs.

    ``train_cfg`` is the train section (a TrainConfig, or a mapping checked into one). On CUDA, a
    device without an index (``cuda``) becomes ``cuda:<LOCAL_RANK>`` and is made the current
    device, so NCCL collectives and ``.cuda()`` calls land on this rank's GPU.
    """
    cfg = as_train_config(train_cfg)
    if not (cfg.ddp or cfg.fsdp.enabled):
        return DdpSetup(False, dist.get_rank(), dist.get_world_size(), 0, False, device)
    local_rank = dist.get_local_rank()
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    key = "train.fsdp.enabled" if cfg.fsdp.enabled else "train.ddp"
    created = dist.init_process_group(backend=backend, key=key)
    return DdpSetup(True, dist.get_rank(), dist.get_world_size(), local_rank, created, device)


def release_after_failure(setup: DdpSetup) -> None:
    """End the process group ``setup_ddp`` created, when the loop leaves by an exception.

    The process is about to exit (evacuation 75, a failure): a gloo or NCCL group still alive at
    interpreter exit can abort it from a C++ destructor ("terminate called without an active
    exception", exit 134) instead of letting it exit with the loop's code. A group the caller
    created, and the group after a normal return, stay for the caller.
    """
    if setup.created_group and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def wrap_model(
    model: torch.nn.Module, setup: DdpSetup, train_cfg: TrainConfig | Mapping[str, Any]
) -> torch.nn.Module:
    """Wrap in DistributedDataParallel (``train.find_unused_parameters`` passed through).

    A single-rank "DDP" run is left unwrapped: there is nothing to all-reduce; so is an FSDP run.
    """
    cfg = as_train_config(train_cfg)
    if not setup.enabled or setup.world_size == 1 or cfg.fsdp.enabled:
        return model
    kwargs: dict[str, Any] = {"find_unused_parameters": cfg.find_unused_parameters}
    if setup.device.type == "cuda":
        kwargs["device_ids"] = [setup.device.index]
        kwargs["output_device"] = setup.device.index
    return torch.nn.parallel.DistributedDataParallel(model, **kwargs)


def shard_datasets(
    dataset: Iterable[Any],
    eval_dataset: Iterable[Any] | None,
    train_cfg: TrainConfig | Mapping[str, Any],
    setup: DdpSetup,
) -> tuple[Iterable[Any], Iterable[Any] | None]:
    """Apply the opt-in sharding; rank 0 warns about whatever DDP runs unsharded."""
    # Keyed on the world size, not train.ddp: a process group started by hand shards on request too.
    if setup.world_size == 1:
        return dataset, eval_dataset
    cfg = as_train_config(train_cfg)
    unsharded: list[str] = []
    if find_elastic(dataset) is not None:
        pass  # elastic data deals each rank its slice of every global batch itself
    elif cfg.shard_dataset:
        dataset = _shard(dataset, cfg.shard_dataset_mode, setup)
    else:
        unsharded.append("train.shard_dataset")
    # An unsharded eval set is never warned about: every rank evaluating all of it gives the
    # same metrics on every rank, only slower, and under FSDP (every rank must run the same
    # forward passes) it is what docs/fsdp.md recommends.
    if eval_dataset is not None and cfg.shard_eval_dataset:
        eval_dataset = _shard(eval_dataset, cfg.shard_eval_dataset_mode, setup)
    if unsharded and setup.rank == 0 and cfg.warn_unsharded:
        warnings.warn(
            f"{'FSDP' if cfg.fsdp.enabled else 'DDP'} with {setup.world_size} ranks but "
            f"{' and '.join(unsharded)} is false: every "
            "rank sees the same data unless your dataset shards itself. Set it to true, or "
            "train.warn_unsharded: false to silence this.",
            RuntimeWarning,
            stacklevel=3,
        )
    return dataset, eval_dataset


def gather_rng_states(state: Any) -> list[Any] | None:
    """Every rank's RNG state on rank 0 (rank order), None on the others.

    All ranks must call this at the same point; it is how a DDP checkpoint written by rank 0 can
    put each rank's randomness back on resume.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [state]
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    torch.distributed.gather_object(state, gathered, dst=0)
    return gathered


def collective_device() -> torch.device:
    """Where this process group's collectives take their tensors: the current CUDA device under
    NCCL (which reduces only CUDA tensors), else the CPU (gloo)."""
    if dist.is_initialized() and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def first_of_any_rank(message: str | None) -> str | None:
    """The first rank's non-None ``message``, on every rank (one all-gather of small objects)."""
    found: list[str | None] = [None] * dist.get_world_size()
    torch.distributed.all_gather_object(found, message)
    return next((m for m in found if m is not None), None)


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if ``flag`` is true on any (one all-reduce MAX)."""
    if not dist.is_initialized():
        return flag
    tensor = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return bool(tensor.item())


def broadcast_object(value: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``value`` on every rank (identity without a process group)."""
    if not dist.is_initialized():
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=src)
    return box[0]


def _shard(dataset: Iterable[Any], mode: str, setup: DdpSetup) -> Iterable[Any]:
    from koochak.loop import sharding

    return sharding.shard_dataset(dataset, mode=mode, rank=setup.rank, world_size=setup.world_size)
