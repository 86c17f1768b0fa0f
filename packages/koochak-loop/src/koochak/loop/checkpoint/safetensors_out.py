"""A state dict as a ``.safetensors`` file, streamed tensor by tensor with bounded memory.

The format (huggingface/safetensors, "Format"): 8 bytes, the little-endian length N of a JSON
header; N bytes of header (``{name: {dtype, shape, data_offsets: [begin, end]}}``, plus a
``__metadata__`` map of strings), padded with spaces to a multiple of 8; then every tensor's
bytes, C order, little-endian, at its offsets in that data section. The header needs only
shapes and dtypes, so it goes first and each tensor follows on its own, as a view of its memory
or cast piece by piece: the writer never holds more than one piece, never the whole state.
The ``safetensors`` package (the ``koochak-loop[safetensors]`` extra) checks what was written.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Iterator, Mapping

import torch
from koochak.loop.checkpoint.parts_tree import byte_view

EXTRA = "koochak-loop[safetensors]"
# Header keys the format keeps for itself: a tensor of that name would replace the metadata map
# and leave a file no safetensors reader opens.
RESERVED = frozenset({"__metadata__"})
# A cast is done in pieces of this many elements (at most 32 MiB at 8 bytes an element).
PIECE_ELEMENTS = 4 << 20

# torch dtype -> the format's dtype name (the ones every safetensors release reads)
DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        DTYPES[getattr(torch, _name)] = _code


def require_safetensors():
    """The ``safetensors`` module, or ModuleNotFoundError in one line naming the extra."""
    try:
        import safetensors
    except ImportError:
        raise ModuleNotFoundError(
            f"--format safetensors needs the safetensors package: pip install '{EXTRA}'"
        ) from None
    return safetensors


def check_names(keys: Iterator[object] | list[object]) -> None:
    """ValueError (one line) for a tensor name the format cannot hold: not a string, or one the
    header reserves (``__metadata__``)."""
    for key in keys:
        if not isinstance(key, str):
            raise ValueError(f"state dict key {key!r} is not a string")
        if key in RESERVED:
            raise ValueError(
                f"tensor {key!r}: the name is reserved by the safetensors format (its header's "
                "metadata map); rename the parameter or export with --format torch"
            )


def safetensors_chunks(
    state: Mapping[str, torch.Tensor],
    *,
    dtype: torch.dtype | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Iterator[bytes | memoryview]:
    """The bytes of ``state`` as a safetensors file: the header, then one tensor at a time.

    ``dtype`` casts the floating-point tensors. Each chunk is a view of a tensor, or of one
    cast piece of it, valid until the next chunk is asked for; nothing else is kept, so the
    extra memory stays under 64 MiB (plus one tensor that must first be made contiguous).
    ValueError naming the tensor for a dtype the format cannot hold, a non-string or reserved
    key (`check_names`), or a sparse tensor; raised before the first chunk.
    """
    if sys.byteorder != "little":  # pragma: no cover - no big-endian host runs the tests
        raise NotImplementedError("safetensors export writes little-endian bytes only")
    check_names(list(state))
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    order = list(state)
    begin = 0
    for key in order:
        tensor = state[key]
        if not isinstance(tensor, torch.Tensor) or tensor.layout is not torch.strided:
            raise ValueError(f"{key}: only dense tensors can be written as safetensors")
        kind = _target_dtype(tensor, dtype)
        if kind not in DTYPES:
            raise ValueError(f"{key}: a {kind} tensor cannot be written as safetensors")
        end = begin + tensor.numel() * torch.empty((), dtype=kind).element_size()
        header[key] = {"dtype": DTYPES[kind], "shape": list(tensor.shape),
                       "data_offsets": [begin, end]}  # fmt: skip
        begin = end
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    text += b" " * (-len(text) % 8)
    yield struct.pack("<Q", len(text)) + text
    for key in order:
        yield from _tensor_bytes(state[key], dtype)


def _tensor_bytes(tensor: torch.Tensor, dtype: torch.dtype | None) -> Iterator[memoryview]:
    """One tensor's bytes: a view of the tensor itself when it is a contiguous CPU tensor of the
    wanted dtype (no copy), else cast in pieces of ``PIECE_ELEMENTS`` (the one piece the writer
    holds, plus the one its consumer still writes: at most 64 MiB). A tensor that is not on the
    CPU or not contiguous is copied whole once first (a state dict's are, on load)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    flat = tensor.contiguous().reshape(-1)
    del tensor
    if flat.numel() == 0:
        return
    target = _target_dtype(flat, dtype)
    if target == flat.dtype:
        yield byte_view(flat)
        return
    for start in range(0, flat.numel(), PIECE_ELEMENTS):
        view = byte_view(flat[start : start + PIECE_ELEMENTS].to(target))
        yield view
        del view  # the consumer asked for the next chunk: it is done with this one


def _target_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def check_written(path: str, keys: list[str]) -> None:
    """Open ``path`` with the safetensors package (its header only) and compare its tensor
    names with ``keys``; ValueError if it does not read back."""
    safetensors = require_safetensors()
    try:
        with safetensors.safe_open(path, framework="pt") as handle:
            found = sorted(handle.keys())
    except Exception as exc:  # the package's own SafetensorError is no ValueError
        raise ValueError(f"{path}: does not read back as safetensors ({exc})") from None
    if found != sorted(keys):
        raise ValueError(f"{path}: safetensors reads {len(found)} tensor(s), {len(keys)} written")
