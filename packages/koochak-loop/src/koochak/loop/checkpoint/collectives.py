"""The few collectives and tree helpers the sharded layout's write and read share.

Every one of them is called on every rank at once (or is a pure helper): ``agree_all`` makes a
failure on any rank a failure on every rank, naming it, so no rank is left waiting in the next
collective.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from koochak.loop import dist


class ShardedLoadError(RuntimeError):
    """A sharded checkpoint could not be read on some rank; raised on every rank."""


# ----------------------------------------------------------------------------- agreement


def agree_all(error: str | None, what: str, group: Any = None) -> None:
    """Every rank's outcome of ``what``; raises on every rank if any rank failed (naming it)."""
    errors: list[Any] = [error]
    if dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        torch.distributed.all_gather_object(errors, error, group=group)
    failed = [f"rank {rank}: {e}" for rank, e in enumerate(errors) if e is not None]
    if failed:
        raise ShardedLoadError(f"{what}: {'; '.join(failed)}")


def error_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def map_tree(tree: Any, leaf: Callable[[Any], Any]) -> Any:
    """``tree`` rebuilt with ``leaf(value)`` in place of every value ``leaf`` replaces (returns
    another object for); dicts (an OrderedDict keeps its type and a state dict's ``_metadata``),
    lists and tuples are walked, anything else is kept."""
    replaced = leaf(tree)
    if replaced is not tree:
        return replaced
    if isinstance(tree, Mapping):
        out: dict[Any, Any] = OrderedDict() if isinstance(tree, OrderedDict) else {}
        for key, value in tree.items():
            out[key] = map_tree(value, leaf)
        if hasattr(tree, "_metadata"):
            out._metadata = tree._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(tree, list):
        return [map_tree(v, leaf) for v in tree]
    if isinstance(tree, tuple):
        return tuple(map_tree(v, leaf) for v in tree)
    return tree


def local_box(tensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, shape)`` of this rank's shard of DTensor ``tensor`` in its global shape."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offsets = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    return tuple(offsets), tuple(shape)


def broadcast_from_rank0(value: Any, group: Any = None) -> Any:
    if dist.get_world_size() == 1:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0, group=group)
    return box[0]
