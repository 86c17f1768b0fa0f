"""FSDP2 in the loop: sharding the model, and what sharded parameters change in a training step.

``train.fsdp.enabled`` shards the model with PyTorch's ``fully_shard`` (FSDP2) over all ranks of
the default process group (created from torchrun's environment, as for DDP): every module whose
class is named in ``train.fsdp.shard_modules`` (or, from Python, for which a callable says yes)
gets its own ``fully_shard``, children first, then the root. Its parameters become DTensors whose
local part is a dim-0 slab of the global tensor (``Shard(0)``), and so do their gradients and the
optimizer state built on them. Hence:

- the optimizer must be built after sharding (``training_loop`` takes a factory);
- a gradient norm is the norm of every rank's slab together: ``ShardReduction`` sums the squares
  over the ranks of one shard group (and takes the max for the overflow fallback), so every rank
  clips, skips or raises alike;
- gradient accumulation skips the reduce-scatter of all but the last micro-step
  (``no_gradient_sync``);
- after an evaluation the parameters are resharded (``reshard``), so a swapped-in EMA shadow never
  lingers in gathered parameters that the next forward would reuse.

With ``train.fsdp.hsdp`` the mesh is 2-D, ``(replicate, shard)``: ranks ``g*S .. g*S+S-1`` form
shard group ``g`` (``S = shard_size``, by default the ranks per node), each parameter is
``Replicate()`` over the groups and ``Shard(0)`` within one, so FSDP reduce-scatters gradients
inside a node and all-reduces them across nodes. Every shard group then holds the same
gradient slabs, which is why the statistics above are reduced over one shard group only
(summed over every rank they would count each slab once per group).

State dict helpers (``local``, ``localize``, ``full``) move tensors between the global form a
checkpoint holds and the sharded form of a live model.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from koochak.loop import dist
from koochak.loop.config import ConfigError, FsdpConfig
from koochak.loop.dist import is_dtensor, local_tensor

__all__ = [
    "ShardReduction",
    "full",
    "is_sharded",
    "localize",
    "localize_optimizer",
    "no_gradient_sync",
    "reshard",
    "shard_model",
    "shard_size",
    "sharded_like",
]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def shard_size(cfg: FsdpConfig, world: int, env: Mapping[str, str] | None = None) -> int:
    """The ranks of one shard group: every rank (``world``) unless ``cfg.hsdp``; under HSDP
    ``cfg.shard_size``, else the ranks per node (torchrun's ``LOCAL_WORLD_SIZE``). ConfigError
    naming ``train.fsdp.shard_size`` when ``world`` is not a multiple of it."""
    import os

    if not cfg.hsdp:
        return world
    size = cfg.shard_size
    if size is None:
        local = (os.environ if env is None else env).get("LOCAL_WORLD_SIZE", "")
        if not local.isdigit() or int(local) < 1:
            raise ConfigError(
                "train.fsdp.shard_size: null means the ranks per node, but LOCAL_WORLD_SIZE is "
                f"{local or 'unset'}; launch with torchrun or set train.fsdp.shard_size"
            )
        size = int(local)
    if world % size:
        raise ConfigError(
            f"train.fsdp.shard_size: {size} ranks per shard group, but the world size {world} "
            "is not a multiple of it"
        )
    return size


def shard_model(model: torch.nn.Module, cfg: FsdpConfig, device: torch.device) -> torch.nn.Module:
    """Apply ``fully_shard`` to the modules ``cfg.shard_modules`` selects (children first), then to
    ``model`` itself, over a 1-D mesh of every rank, or under ``cfg.hsdp`` a 2-D mesh
    ``(replicate, shard)`` of ``world / S`` groups of ``S = shard_size(...)`` consecutive ranks.
    Returns ``model`` (sharded in place)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        raise RuntimeError(
            "train.fsdp.enabled needs a process group: launch with torchrun (or call "
            "init_process_group yourself) before training_loop"
        )
    world = dist.get_world_size()
    if cfg.hsdp:
        size = shard_size(cfg, world)
        mesh = init_device_mesh(
            device.type, (world // size, size), mesh_dim_names=("replicate", "shard")
        )
    else:
        mesh = init_device_mesh(device.type, (world,))
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": cfg.reshard_after_forward,
    }
    if cfg.mixed_precision != "none":
        dtype = _DTYPES[cfg.mixed_precision]
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    if cfg.cpu_offload:
        if device.type == "cpu":
            if dist.get_rank() == 0:
                warnings.warn("train.fsdp.cpu_offload has no effect on a CPU device: the "
                              "shards already live in host memory", UserWarning, stacklevel=2)  # fmt: skip
        else:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for module in _selected_modules(model, cfg.shard_modules):
        fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _selected_modules(model: torch.nn.Module, select: Any) -> list[torch.nn.Module]:
    """The submodules (not the root) to shard on their own, deepest first."""
    modules = [m for name, m in model.named_modules() if name]
    if callable(select):
        chosen = [m for m in modules if select(m)]
    else:
        names = set(select or ())
        chosen = [m for m in modules if _class_names(m) & names]
        found = set().union(*(_class_names(m) for m in chosen)) if chosen else set()
        missing = sorted(names - found)
        if missing:
            classes = sorted({type(m).__name__ for m in modules})
            raise ValueError(
                f"train.fsdp.shard_modules: no module of class {missing[0]!r} in the model "
                f"(its classes: {', '.join(classes[:20])})"
            )
    # fully_shard a child before its parent: a parent then leaves the child's parameters to it.
    return chosen[::-1]


def _class_names(module: torch.nn.Module) -> set[str]:
    cls = type(module)
    return {cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}"}


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or what torch.compile wraps) was sharded with ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    model = getattr(model, "_orig_mod", model)
    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def no_gradient_sync(model: torch.nn.Module) -> Iterator[None]:
    """Accumulate gradients locally in the block (no reduce-scatter); the next backward syncs."""
    model = getattr(model, "_orig_mod", model)
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


def reshard(model: torch.nn.Module) -> None:
    """Free every gathered (unsharded) parameter, so the next forward gathers the shards anew."""
    from torch.distributed.fsdp import FSDPModule

    for module in getattr(model, "_orig_mod", model).modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class ShardReduction:
    """Collectives over one shard group that make a sharded gradient's statistics global.

    Every rank must call each method at the same point (they are all-reduces). ``device`` is
    where the collective runs (the training device: NCCL reduces only CUDA tensors); a value on
    another device (a CPU-offloaded shard's norm) goes there and its result comes back.
    ``group``: the ranks whose slabs together make each gradient once (None: the default group,
    right for a 1-D mesh); ``for_model`` finds it from a sharded model's mesh.
    """

    def __init__(self, device: torch.device | None = None, group: Any = None) -> None:
        self.device = device
        self.group = group

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, device: torch.device | None = None
    ) -> ShardReduction:
        """The reduction over ``model``'s shard group: under HSDP the mesh's ``shard`` dimension
        (the replicate groups hold copies of the same slabs), else every rank."""
        mesh = next((p.device_mesh for p in model.parameters() if is_dtensor(p)), None)
        if mesh is None or mesh.ndim == 1:
            return cls(device)
        return cls(device, mesh.get_group(mesh.ndim - 1))

    def _all_reduce(self, value: torch.Tensor, op: Any) -> torch.Tensor:
        out = value.detach().to(self.device or value.device, copy=True)
        torch.distributed.all_reduce(out, op=op, group=self.group)
        return out.to(value.device)

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(value, torch.distributed.ReduceOp.SUM)

    def max(self, value: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(value, torch.distributed.ReduceOp.MAX)

    def any(self, flag: bool, device: torch.device) -> bool:
        return bool(self.max(torch.tensor([int(flag)], dtype=torch.int32, device=device)).item())


# ----------------------------------------------------------------------------- state dicts


def sharded_like(value: torch.Tensor, like: Any) -> Any:
    """``value`` (the global tensor, on any device) as a DTensor placed like ``like``: this rank
    keeps a copy of its own slab only. Shapes must agree."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if tuple(value.shape) != tuple(like.shape):
        raise ValueError(f"shape {tuple(value.shape)} does not match the sharded parameter's "
                         f"{tuple(like.shape)}")  # fmt: skip
    shape, offset = compute_local_shape_and_global_offset(
        like.shape, like.device_mesh, like.placements
    )
    slab = value
    for dim, (start, length) in enumerate(zip(offset, shape)):
        slab = slab.narrow(dim, start, length)
    mine = slab.to(device=local_tensor(like).device, dtype=like.dtype).clone()
    return DTensor.from_local(mine, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())  # fmt: skip


def localize(saved: Any, live: Mapping[str, Any]) -> Any:
    """A state dict ``saved`` (global tensors) made loadable into a sharded module: every entry
    whose live counterpart is a DTensor becomes one placed like it; the rest stays as it is."""
    out = dict(saved)
    for key, value in saved.items():
        target = live.get(key)
        if is_dtensor(target) and isinstance(value, torch.Tensor) and not is_dtensor(value):
            out[key] = _named(sharded_like, value, target, key)
    return out


def localize_optimizer(
    saved: Mapping[str, Any], optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """An optimizer state dict ``saved`` (global tensors, keyed by parameter position as
    ``Optimizer.state_dict`` keys it) made loadable into ``optimizer`` over sharded parameters:
    each state tensor shaped like its parameter becomes a DTensor placed like it; scalars such as
    Adam's ``step`` stay as they are."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for key, entry in saved["state"].items():
        param = params[key] if isinstance(key, int) and 0 <= key < len(params) else None
        if not is_dtensor(param) or not isinstance(entry, Mapping):
            state[key] = entry
            continue
        state[key] = {
            name: _named(sharded_like, value, param, f"optimizer state {key}.{name}")
            if isinstance(value, torch.Tensor) and not is_dtensor(value)
            and tuple(value.shape) == tuple(param.shape) and value.dim() > 0
            else value
            for name, value in entry.items()
        }  # fmt: skip
    return {**saved, "state": state}


def _named(fn: Callable[..., Any], value: Any, like: Any, key: str) -> Any:
    try:
        return fn(value, like)
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None


def full(tree: Any) -> Any:
    """``tree`` with every DTensor gathered into its global tensor (a collective: every rank must
    call it on trees of the same structure, in the same order). State-dict OrderedDicts keep
    their type and ``_metadata``."""
    if is_dtensor(tree):
        return tree.full_tensor()
    if isinstance(tree, Mapping):
        out: dict[Any, Any] = OrderedDict() if isinstance(tree, OrderedDict) else {}
        for key, value in tree.items():
            out[key] = full(value)
        if hasattr(tree, "_metadata"):
            out._metadata = tree._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(tree, list):
        return [full(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(full(v) for v in tree)
    return tree


def has_dtensor(tree: Any) -> bool:
    """Whether any leaf of ``tree`` is a DTensor."""
    if is_dtensor(tree):
        return True
    if isinstance(tree, Mapping):
        return any(has_dtensor(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(has_dtensor(v) for v in tree)
    return False
