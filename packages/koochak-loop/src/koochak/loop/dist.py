"""Small torch.distributed helpers that also work when no process group exists.

Everything here answers for the single-process case (rank 0 of 1) when torch.distributed is
unavailable or not initialised, so callers never branch on "am I distributed?".
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as torch_dist


def is_initialized() -> bool:
    return torch_dist.is_available() and torch_dist.is_initialized()


def get_rank() -> int:
    return torch_dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    return torch_dist.get_world_size() if is_initialized() else 1


def get_local_rank() -> int:
    """LOCAL_RANK as set by torchrun (0 when absent)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_dtensor(value: object) -> bool:
    """Whether ``value`` is a DTensor (an FSDP2 parameter, gradient or optimizer state), without
    importing torch.distributed.tensor: until something has, no DTensor can exist."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a DTensor's local shard (a view), any other tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def placed_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` as the shard of a DTensor placed like ``like`` when ``like`` is one (no copy, no
    communication), else ``local`` itself."""
    if not is_dtensor(like):
        return local
    return type(like).from_local(  # type: ignore[attr-defined]
        local, like.device_mesh, like.placements, run_check=False,  # type: ignore[attr-defined]
        shape=like.shape, stride=like.stride(),
    )  # fmt: skip


def is_rank0() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if is_initialized():
        torch_dist.barrier()


def exit_distributed_process(code: int) -> NoReturn:
    """End a process that ran torch.distributed with ``code``, without interpreter finalisation.

    The default group is destroyed first. A DistributedDataParallel reducer keeps its group's
    gloo threads alive even after ``destroy_process_group``; when the interpreter is torn down
    they free their pending work without a live interpreter and, now and then, abort the process
    ("terminate called without an active exception", SIGABRT) instead of letting it exit with
    its code (75 after an evacuation, 0 after training). So, with stdio flushed, the process
    leaves through ``os._exit``. Call it only at the end of a launcher's main, after every log
    and checkpoint is closed: ``atexit`` handlers do not run.
    """
    if is_initialized():
        torch_dist.destroy_process_group()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing more can be said
            pass
    os._exit(code)


def check_launch_environment(key: str = "train.ddp") -> None:
    """RuntimeError unless a process group exists or torchrun's variables are set, so
    ``train.ddp: true`` (or ``train.fsdp.enabled``: pass it as ``key``) can be refused before
    anything is built (the CLI calls it early). The message names both ways out: the launcher,
    or ``key=false`` for one process (a DDP or FSDP run resumes on one process that way)."""
    if is_initialized():
        return
    missing = [
        k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
    if missing:
        raise RuntimeError(
            f"{key} is true but no process group exists (the environment lacks "
            f"{', '.join(missing)}): to run on this one process (resuming a run of several ranks "
            f"on one included), set {key}=false; to run several ranks, launch them with "
            "python -m koochak.loop.launch --nproc-per-node=N (or torchrun), or call "
            "init_process_group yourself"
        )


def init_process_group(
    backend: str | None = None, timeout_s: float | None = None, key: str = "train.ddp"
) -> bool:
    """Initialise the default process group from the torchrun environment if none exists.

    Returns True when this call created the group, False when one already existed (the caller
    initialised it manually, which the loop respects). The backend defaults to NCCL when CUDA is
    available and gloo otherwise. Without ``timeout_s``, ``KOOCHAK_COLLECTIVE_TIMEOUT_S`` (seconds)
    bounds every collective of the group when set (torch's default: 30 minutes for gloo), so a
    rank hung on another node ends its peers in that time (docs/jobs.md, "Multi-node on Slurm").
    """
    if is_initialized():
        return False
    check_launch_environment(key)
    if timeout_s is None and os.environ.get("KOOCHAK_COLLECTIVE_TIMEOUT_S"):
        timeout_s = float(os.environ["KOOCHAK_COLLECTIVE_TIMEOUT_S"])
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    torch_dist.init_process_group(backend=backend, **kwargs)
    return True


def all_gather_floats(values: list[float], device: torch.device | None = None) -> list[list[float]]:
    """Every rank's ``values`` (rank order); the single-process answer is ``[values]``.

    Used for per-rank step timing on logging steps, so it may synchronise.
    """
    if not is_initialized() or get_world_size() == 1:
        return [list(values)]
    local = torch.tensor(values, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(local) for _ in range(get_world_size())]
    torch_dist.all_gather(gathered, local)
    return [t.tolist() for t in gathered]
