"""A checkpoint dict as stored objects, and back, in either layout.

Everything that turns a checkpoint into what a Store holds (and back into a dict) is here:

- one file: ``torch.save`` out (streamed for synchronous saves), weights-only ``torch.load`` in;
- parts (docs/formats.md, "Checkpoint parts"): ``split_checkpoint`` freezes the non-tensor data
  into a small weights-only skeleton and lists the tensors; ``write_checkpoint_parts`` writes
  them as parts in parallel and returns the index. Reading is each layout's (``layouts.read``).

The payload is loaded with ``torch.load(weights_only=True)`` (the whole file, or the parts'
skeleton; parts themselves are raw tensor bytes), so an untrusted checkpoint cannot run code: it
holds only tensors, containers and primitive values. Anything that is not (NumPy arrays inside RNG
states) is encoded into that vocabulary here and decoded on the way back.
"""

from __future__ import annotations

import io
import queue
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from koochak.loop.checkpoint.format import check_checkpoint_format, tag_ndarrays
from koochak.loop.checkpoint.layouts.payload import (  # the read side lives there; kept importable
    checkpoint_of_payload,
    deserialize_checkpoint,  # noqa: F401
    load_checkpoint_file,  # noqa: F401
)
from koochak.loop.checkpoint.parts_index import encode_index
from koochak.loop.checkpoint.parts_io import host_tensor, write_parts
from koochak.loop.checkpoint.parts_tree import (
    join_tensors,
    load_skeleton,
    skeleton_bytes,
    split_tensors,
)
from koochak.storage.store import Store


def serialize_checkpoint(ckpt: Mapping[str, Any]) -> bytes:
    """The checkpoint as ``torch.save`` bytes, with RNG states encoded for weights-only loading."""
    return bytes(serialize_checkpoint_buffer(ckpt))


def serialize_checkpoint_buffer(ckpt: Mapping[str, Any]) -> memoryview:
    """Like ``serialize_checkpoint`` without the final copy: a view of the serialized buffer."""
    buffer = io.BytesIO()
    with _no_zip_crc():
        torch.save(_payload(ckpt), buffer)
    return buffer.getbuffer()


def _no_zip_crc() -> Any:
    # Every published byte is covered by the manifest's SHA256, checked on every resume read;
    # the zip container's own CRC32 would cost about a third of serialization time on top.
    # torch.load reads files without it. (The switch is process-wide while a save runs.)
    from torch.utils.serialization import config

    return config.patch({"save.compute_crc32": False})


def serialize_checkpoint_chunks(ckpt: Mapping[str, Any]) -> Iterator[bytes | memoryview]:
    """The same bytes as ``serialize_checkpoint``, streamed while ``torch.save`` produces them.

    ``torch.save`` runs on a helper thread; large writes (tensor storages) are handed over as
    views without copying, and the helper waits until the consumer asks for the next chunk, which
    a Store does only once it has written and hashed the previous one. Small writes (headers,
    the pickle) are batched into copies. So the payload is never held whole in memory and tensor
    bytes are never copied on the way to the store. Each chunk is valid only until the next one is
    requested (copy it to keep it). Use it only while nothing mutates the tensors (a synchronous
    save); stopping early (a failed write) cancels the serialization.
    """
    payload = _payload(ckpt)  # format errors surface here, on the caller's thread
    return _stream(payload)


def stream_torch_save(obj: Any) -> Iterator[bytes | memoryview]:
    """``torch.save(obj)``'s bytes, streamed as ``serialize_checkpoint_chunks`` streams a
    checkpoint (tensor storages as views, never held whole); for any object, no format check."""
    return _stream(obj)


# Writes at least this large go over as views; smaller ones are copied into batches this large.
_ZERO_COPY_BYTES = 1 << 20


def _stream(payload: dict[str, Any]) -> Iterator[bytes | memoryview]:
    handoff: queue.Queue[Any] = queue.Queue()
    done = object()
    state: dict[str, Any] = {"error": None, "cancel": False}

    class _Writer:
        def __init__(self) -> None:
            self.pending = bytearray()

        def write(self, data: Any) -> int:
            if state["cancel"]:
                raise _SerializationCancelled
            view = memoryview(data).cast("B")
            if view.nbytes < _ZERO_COPY_BYTES:
                self.pending += view
                if len(self.pending) >= _ZERO_COPY_BYTES:
                    self.flush()
                return view.nbytes
            self.flush()
            consumed = threading.Event()
            handoff.put((view, consumed))
            consumed.wait()  # torch may free or reuse the buffer once write() returns
            if state["cancel"]:
                raise _SerializationCancelled
            return view.nbytes

        def flush(self) -> None:
            if self.pending:
                handoff.put((bytes(self.pending), None))
                self.pending.clear()

    def produce() -> None:
        try:
            writer = _Writer()
            with _no_zip_crc():
                torch.save(payload, writer)
            writer.flush()
        except _SerializationCancelled:
            pass
        except BaseException as exc:  # re-raised on the consuming thread
            state["error"] = exc
        finally:
            handoff.put(done)

    thread = threading.Thread(target=produce, name="koochak-serialize", daemon=True)
    thread.start()
    finished = False
    try:
        while True:
            item = handoff.get()
            if item is done:
                finished = True
                break
            chunk, consumed = item
            try:
                yield chunk
            finally:  # resumed (or closed): the consumer is done with this chunk
                if consumed is not None:
                    consumed.set()
    finally:
        if not finished:  # the consumer stopped early: release and stop the producer
            state["cancel"] = True
            while True:
                item = handoff.get()
                if item is done:
                    break
                if item[1] is not None:
                    item[1].set()
        thread.join()
    if state["error"] is not None:
        raise state["error"]


class _SerializationCancelled(Exception):
    pass


def _payload(ckpt: Mapping[str, Any]) -> dict[str, Any]:
    check_checkpoint_format(ckpt, "checkpoint to save")
    payload = dict(ckpt)
    for key in ("rng", "rng_per_rank"):
        if payload.get(key) is not None:
            payload[key] = tag_ndarrays(payload[key])
    return payload


_checkpoint_of_payload = checkpoint_of_payload  # the name sharded_read used before


# -- the parts layout -------------------------------------------------------------------------


@dataclass(frozen=True)
class SplitCheckpoint:
    """A checkpoint as its non-tensor data, frozen (``skeleton``: weights-only ``torch.save``
    bytes where tensor ``i`` is referenced by number), and its ``tensors``.

    The skeleton cannot change once made; the tensors are whatever was given (the live ones, or
    an async save's host copies: ``with_tensors``).
    """

    skeleton: bytes
    tensors: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def with_tensors(self, tensors: Sequence[torch.Tensor]) -> SplitCheckpoint:
        """The same checkpoint with each tensor replaced (by a copy of the same dtype and shape)."""
        return SplitCheckpoint(self.skeleton, tuple(tensors))


def split_checkpoint(ckpt: Mapping[str, Any]) -> SplitCheckpoint:
    """Check ``ckpt``, freeze its non-tensor data and list its tensors (not copied).

    Identical tensors (tied weights) are listed once. Errors name the field that parts cannot
    store (a sparse or meta tensor, an unsupported dtype).
    """
    skeleton, tensors = split_tensors(_payload(ckpt))
    return SplitCheckpoint(skeleton_bytes(skeleton), tuple(tensors))


def split_checkpoint_chunks(split: SplitCheckpoint) -> Iterator[bytes | memoryview]:
    """The one-file (``torch.save``) bytes of a split checkpoint, streamed like
    ``serialize_checkpoint_chunks``; tensor bytes go out as views of ``split.tensors``."""
    payload = join_tensors(load_skeleton(split.skeleton, "checkpoint to save"), split.tensors,
                           "checkpoint to save")  # fmt: skip
    return _stream(payload)


def write_checkpoint_parts(
    store: Store, name: str, split: SplitCheckpoint, parts: int, *, workers: int | None = None
) -> bytes:
    """Write ``split``'s tensors as ``parts`` parts of checkpoint ``name`` (in parallel) and
    return the index to publish as ``name``. The tensors must not change until this returns;
    CUDA tensors are copied to the host first."""
    index = write_parts(
        store, name, [host_tensor(t) for t in split.tensors], split.skeleton, parts,
        workers=workers,
    )  # fmt: skip
    return encode_index(index)
