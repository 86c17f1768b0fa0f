"""A state as two things: its tensors, and a skeleton that says where each one goes.

``split_tensors`` walks dicts, lists and tuples and replaces every tensor by the reference
``("__koochak_tensor__", i)``; ``join_tensors`` puts tensor ``i`` back. The skeleton holds only
plain data, so it is stored with ``torch.save`` and read with ``torch.load(weights_only=True)``:
nothing in it can run code. Identical tensors (tied weights: two views of the same memory with
the same shape, strides and dtype) are stored once and come back as one tensor.
"""

from __future__ import annotations

import io
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from koochak.loop.checkpoint.parts_index import DTYPE_NAMES
from koochak.storage.artifact import InvalidArtifact

TENSOR_TAG = "__koochak_tensor__"
_DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES if hasattr(torch, name)}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The index's name for a dtype; ValueError for one parts cannot hold."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(
            f"a {dtype} tensor cannot be stored in parts; supported: {sorted(_NAMES)}"
        ) from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of an index dtype name (names come from a fixed table only)."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not available in this torch") from None


def split_tensors(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """``(skeleton, tensors)``: ``state`` with each tensor replaced by a numbered reference.

    Containers are dicts (an ``OrderedDict`` keeps its type and a state dict's ``_metadata``),
    lists and tuples; anything else is a leaf and stays in the skeleton as is. Tensors must be
    dense (strided) and of a dtype parts can hold; they are returned as they are (any device,
    any strides). A skeleton that already holds a reference tuple is refused: it would be
    mistaken for a tensor on load.
    """
    tensors: list[torch.Tensor] = []
    seen: dict[tuple[Any, ...], int] = {}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            return (TENSOR_TAG, number_of(value, path))
        if isinstance(value, Mapping):
            if isinstance(value, OrderedDict):
                out: dict[Any, Any] = OrderedDict()
                metadata = getattr(value, "_metadata", None)
                if metadata is not None:
                    out._metadata = metadata  # type: ignore[attr-defined]
            else:
                out = {}
            for key, item in value.items():
                out[key] = walk(item, f"{path}[{key!r}]")
            return out
        if isinstance(value, list):
            return [walk(item, f"{path}[{i}]") for i, item in enumerate(value)]
        if isinstance(value, tuple):
            if _is_reference(value):
                raise ValueError(
                    f"{path}: the tuple {value!r} is reserved for tensor references in parts"
                )
            return tuple(walk(item, f"{path}[{i}]") for i, item in enumerate(value))
        return value

    def number_of(tensor: torch.Tensor, path: str) -> int:
        if tensor.layout is not torch.strided or tensor.is_quantized:
            raise ValueError(f"{path}: a {tensor.layout} tensor cannot be stored in parts")
        if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
            raise ValueError(
                f"{path}: a {type(tensor).__name__} cannot be stored in parts (plain tensors only)"
            )
        if tensor.device.type == "meta":
            raise ValueError(f"{path}: a meta tensor has no values to store")
        dtype_name(tensor.dtype)
        identity = (
            tensor.device,
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
            tensor.dtype,
        )
        if identity not in seen:
            seen[identity] = len(tensors)
            tensors.append(tensor.detach())
        return seen[identity]

    return walk(state, "state"), tensors


# How deep containers may nest in a checkpoint read back. A real one nests a few levels (an
# optimizer's state: dict, dict, dict); everything that walks a checkpoint after the read (format
# checks, RNG decoding, load_state_dict) may recurse, so deeper ones are refused at the read.
MAX_DEPTH = 100


def join_tensors(skeleton: Any, tensors: Sequence[Any], source: str) -> Any:
    """``skeleton`` with every reference replaced by its tensor; InvalidArtifact (a ValueError)
    naming ``source`` for a reference to a tensor that does not exist, a tensor nothing refers
    to, or containers nested deeper than ``MAX_DEPTH``. Walked iteratively (no recursion), so
    any skeleton is refused or joined, never a RecursionError. ``tensors`` may be any objects
    standing for the tensors (the sharded reader's references)."""
    used = [False] * len(tensors)

    def leaf(value: Any) -> Any:
        number = value[1]
        if type(number) is not int or not 0 <= number < len(tensors):
            raise InvalidArtifact(
                f"{source}: skeleton refers to tensor {number!r}; the index has {len(tensors)}"
            )
        used[number] = True
        return tensors[number]

    state = rebuild(
        skeleton, lambda v: leaf(v) if isinstance(v, tuple) and _is_reference(v) else v, source
    )
    if not all(used):
        raise InvalidArtifact(
            f"{source}: the index lists tensor {used.index(False)}, which the skeleton never uses"
        )
    return state


def rebuild(tree: Any, replace: Any, source: str, max_depth: int = MAX_DEPTH) -> Any:
    """A copy of ``tree``'s dicts (``OrderedDict`` and a state dict's ``_metadata`` kept),
    lists and tuples with every other value passed through ``replace``; a tuple is offered to
    ``replace`` first and kept as returned when that is something else (a reference). Iterative:
    an explicit stack, no recursion; InvalidArtifact naming ``source`` past ``max_depth``."""
    root: list[Any] = []
    # Frames: [original container, iterator over its items, rebuilt items, key in its parent]
    stack: list[list[Any]] = [[None, iter([tree]), root, None]]
    while stack:
        frame = stack[-1]
        container, items, out = frame[0], frame[1], frame[2]
        item = next(items, _END)
        if item is _END:
            stack.pop()
            if stack:
                _attach(stack[-1], _finish(container, out), frame[3])
            continue
        key, value = item if isinstance(container, Mapping) else (None, item)
        if isinstance(value, tuple):
            replaced = replace(value)
            if replaced is not value:
                _attach(frame, replaced, key)
                continue
        if isinstance(value, (Mapping, list, tuple)):
            if len(stack) > max_depth:
                raise InvalidArtifact(f"{source}: containers nested deeper than {max_depth} levels")
            children = iter(list(value.items())) if isinstance(value, Mapping) else iter(value)
            stack.append([value, children, [], key])
            continue
        _attach(frame, replace(value), key)
    return root[0]


_END = object()


def _attach(frame: list[Any], value: Any, key: Any) -> None:
    frame[2].append((key, value) if isinstance(frame[0], Mapping) else value)


def _finish(container: Any, out: list[Any]) -> Any:
    if isinstance(container, Mapping):
        made: dict[Any, Any] = OrderedDict() if isinstance(container, OrderedDict) else {}
        metadata = getattr(container, "_metadata", None)
        if metadata is not None:
            made._metadata = metadata  # type: ignore[attr-defined]
        made.update(out)
        return made
    if isinstance(container, list):
        return out
    return tuple(out)


def check_depth(tree: Any, source: str, max_depth: int = MAX_DEPTH) -> None:
    """InvalidArtifact naming ``source`` when ``tree``'s containers nest deeper than
    ``max_depth`` (an explicit stack: any depth is measured without recursion)."""
    stack = [(tree, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (Mapping, list, tuple)):
            if depth >= max_depth:
                raise InvalidArtifact(f"{source}: containers nested deeper than {max_depth} levels")
            children = value.values() if isinstance(value, Mapping) else value
            stack.extend((child, depth + 1) for child in children)


def _is_reference(value: tuple[Any, ...]) -> bool:
    return len(value) == 2 and isinstance(value[0], str) and value[0] == TENSOR_TAG


def skeleton_bytes(skeleton: Any) -> bytes:
    """The skeleton as ``torch.save`` bytes (it holds no tensors, so they are small)."""
    buffer = io.BytesIO()
    torch.save(skeleton, buffer)
    return buffer.getvalue()


def load_skeleton(data: bytes, source: str) -> Any:
    """Read a skeleton weights-only; ValueError naming ``source`` if it does not load."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (MemoryError, OSError):
        raise
    except Exception as exc:  # torch raises many types for hostile bytes; all mean "not loadable"
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        raise InvalidArtifact(
            f"{source}: skeleton is not loadable weights-only ({first})"
        ) from exc


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a flat memoryview, without copying.

    Writable when the tensor is; it keeps the tensor alive for as long as it exists.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    if tensor.numel() == 0:
        return memoryview(b"")
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")
