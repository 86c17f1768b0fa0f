"""Writing a state's tensors as parts, and reading them back, in parallel through any Store.

Only the ``Store`` protocol is used (``put``, ``stat``, ``open``, ``delete``), so parts work on
every store. Each part is written by its own worker thread with one ``put``; the store hashes
while it writes, and both hashing (``hashlib`` on large buffers) and file writes release the
interpreter lock, so the parts really run side by side. Tensor bytes go to the store as views of
the tensors' memory, never copied (small tensors are batched into one copy of at most 1 MiB).

Reading checks the sizes of all parts first (so a hostile index cannot make us allocate more
than the store holds), then reads every part in its own worker straight into the tensors'
memory, hashing as it reads, and only returns once every part has matched its size and SHA256.
"""

from __future__ import annotations

import hashlib
import io
import logging
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any

import torch
from koochak.loop.checkpoint.parts_index import (
    Extent,
    Part,
    PartsIndex,
    Shard,
    TensorEntry,
    part_key,
)
from koochak.loop.checkpoint.parts_plan import plan_parts
from koochak.loop.checkpoint.parts_tree import byte_view, dtype_name, torch_dtype
from koochak.storage.named import open_named, stat_named
from koochak.storage.store import Store

log = logging.getLogger("koochak.loop.checkpoint")

# Tensor runs at least this long go to the store as views; shorter ones are copied into one
# batch of about this size, so a state of many small tensors is not many tiny writes.
_BATCH_BYTES = 1 << 20
# Reads and hashes go in pieces of this size: larger than a buffered stream's buffer (LocalStore
# opens with 8 MiB), so a BufferedReader reads straight into the tensor instead of through its
# own buffer (one copy fewer), and large enough that per-call costs vanish.
_READ_PIECE = 16 << 20
# Threads one call reads or writes parts on unless told (``workers``): a pool, not one thread
# per part (a checkpoint of 8,000 ranks' parts read by one process would start 8,000).
MAX_PART_THREADS = 16


def host_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a contiguous CPU tensor whose bytes can be viewed (copied only if needed)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    return tensor.contiguous()


def write_parts(
    store: Store,
    name: str,
    tensors: Sequence[torch.Tensor],
    skeleton: bytes,
    parts: int,
    *,
    writer: int = 0,
    workers: int | None = None,
    first_number: int = 0,
) -> PartsIndex:
    """Write ``tensors`` (contiguous, on the CPU) as ``parts`` parts of checkpoint ``name``.

    Returns the index describing them (the caller publishes it as ``name``). A part that
    fails stops the others from starting; the parts already written are deleted, and the first
    error is raised. The tensors must not change until this returns. ``writer`` and
    ``first_number`` name the parts (``part-WWWWW-NNNNN``, numbers counting from
    ``first_number``), so one writer can write its parts in several calls.
    """
    _little_endian_only()
    views = [byte_view(t) for t in tensors]
    plan = plan_parts([v.nbytes for v in views], parts)
    keys = [part_key(name, writer, first_number + n) for n in range(len(plan.part_sizes))]
    runs: list[list[tuple[memoryview, int, int]]] = [[] for _ in keys]
    for view, extents in zip(views, plan.extents):
        start = 0
        for extent in extents:
            runs[extent.part].append((view, start, extent.length))
            start += extent.length
    infos = _run_parallel(
        [
            (lambda key=key, size=size, pieces=pieces: _put_part(store, key, size, pieces))
            for key, size, pieces in zip(keys, plan.part_sizes, runs)
        ],
        workers,
        cleanup=lambda done: _delete_quietly(store, [keys[i] for i in done]),
    )
    entries = tuple(
        TensorEntry(
            dtype=dtype_name(t.dtype),
            shape=tuple(t.shape),
            shards=(Shard((0,) * t.dim(), tuple(t.shape), extents),),
        )
        for t, extents in zip(tensors, plan.extents)
    )
    parts_out = tuple(
        Part(key, writer, size, digest) for key, size, digest in zip(keys, plan.part_sizes, infos)
    )
    return PartsIndex(name, 1, parts_out, entries, skeleton)


def _put_part(store: Store, key: str, size: int, pieces: list[tuple[memoryview, int, int]]) -> str:
    info = store.put(key, _chunks(pieces), expected_size=size)
    if info.sha256 is not None:
        return info.sha256
    return _sha256_of(store, key)  # a store whose put reports no digest: hash what it holds


def _chunks(pieces: list[tuple[memoryview, int, int]]) -> Iterator[bytes | memoryview]:
    batch = bytearray()
    for view, start, length in pieces:
        if length >= _BATCH_BYTES:
            if batch:
                yield bytes(batch)
                batch.clear()
            yield view[start : start + length]
        else:
            batch += view[start : start + length]
            if len(batch) >= _BATCH_BYTES:
                yield bytes(batch)
                batch.clear()
    if batch:
        yield bytes(batch)


def _sha256_of(store: Store, key: str) -> str:
    sha = hashlib.sha256()
    with store.open(key) as stream:
        while block := stream.read(_READ_PIECE):
            sha.update(block)
    return sha.hexdigest()


def delete_parts(store: Store, name: str, *, also_object: bool = False) -> list[str]:
    """Delete every part object of checkpoint ``name`` (found by listing); return the keys
    deleted. ``also_object`` deletes the object under ``name`` itself first (an uncommitted
    index).

    Call only once the checkpoint's manifest is gone (or was never written), and only while
    holding the name (its intent record, ``artifact.claimed``) or pruning a committed
    checkpoint: parts are found by their name's prefix, so they may be anyone's.
    """
    from koochak.loop.checkpoint.parts_index import parts_prefix

    keys = ([name] if also_object else []) + [info.key for info in store.list(parts_prefix(name))]
    deleted = []
    for key in keys:
        try:
            store.delete(key)
        except FileNotFoundError:
            continue  # someone else pruned it first, or (the object) there was none
        deleted.append(key)
    return deleted


def _delete_quietly(store: Store, keys: Sequence[str]) -> None:
    for key in keys:
        try:
            store.delete(key)
        except OSError as exc:  # the save's own error is what matters; an orphan is harmless
            log.warning("could not remove part %s of a failed save: %s", key, exc)


def read_parts(
    store: Store, index: PartsIndex, source: str, *, workers: int | None = None
) -> list[torch.Tensor]:
    """The index's tensors on the CPU, from parts read in parallel and each verified.

    ValueError naming ``source`` and the part when a part is missing or its size or SHA256
    differs from the index (the checkpoint is not valid); any other OSError propagates.
    """
    _little_endian_only()
    sizes = _run_parallel(
        [(lambda p=p: _stat_size(store, p, source)) for p in index.parts], workers
    )
    for part, size in zip(index.parts, sizes):
        if size != part.size:
            raise ValueError(
                f"{source}: part {part.key} has {size} bytes; the index says {part.size}"
            )
    tensors: list[torch.Tensor] = []
    shard_buffers: list[list[torch.Tensor]] = []
    # targets[p]: (offset in part, destination bytes) for every extent stored in part p
    targets: list[list[tuple[int, memoryview]]] = [[] for _ in index.parts]
    for entry in index.tensors:
        tensor = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
        tensors.append(tensor)
        whole = len(entry.shards) == 1 and entry.shards[0].shape == entry.shape
        buffers = (
            [tensor] if whole else [torch.empty(s.shape, dtype=tensor.dtype) for s in entry.shards]
        )
        shard_buffers.append(buffers)
        for shard, buffer in zip(entry.shards, buffers):
            _add_targets(targets, shard.extents, byte_view(buffer))
    _run_parallel(
        [(lambda p=p, t=t: _read_part(store, p, t, source)) for p, t in zip(index.parts, targets)],
        workers,
    )
    for entry, tensor, buffers in zip(index.tensors, tensors, shard_buffers):
        if buffers[0] is not tensor:
            for shard, buffer in zip(entry.shards, buffers):
                box = tuple(slice(o, o + n) for o, n in zip(shard.offsets, shard.shape))
                tensor[box] = buffer
    return tensors


def _little_endian_only() -> None:
    if sys.byteorder != "little":  # parts hold little-endian bytes; no host converts them yet
        raise NotImplementedError("checkpoint parts are little-endian; this host is big-endian")


def _add_targets(
    targets: list[list[tuple[int, memoryview]]], extents: Sequence[Extent], dest: memoryview
) -> None:
    start = 0
    for extent in extents:
        targets[extent.part].append((extent.offset, dest[start : start + extent.length]))
        start += extent.length


def _stat_size(store: Store, part: Part, source: str) -> int:
    # A part the index names is late, not absent (another client's, through a mount): waited
    # for up to the store's read_settle_seconds, then FileNotFoundError naming the index, so
    # resume never skips back past a checkpoint this client does not see whole yet.
    return stat_named(store, part.key, named_by=source).size


def _read_part(
    store: Store, part: Part, targets: list[tuple[int, memoryview]], source: str
) -> None:
    sha = hashlib.sha256()
    got = 0
    with open_named(store, part.key, named_by=source) as stream:
        filler = PartFiller(stream)
        for _, dest in sorted(targets, key=lambda item: item[0]):
            # The index tiles each part, so the extents follow one another with no gaps.
            for begin in range(0, len(dest), _READ_PIECE):
                piece = dest[begin : begin + _READ_PIECE]
                filled = filler.fill(piece)
                sha.update(piece[:filled])
                got += filled
                if filled < len(piece):
                    raise ValueError(
                        f"{source}: part {part.key} ends after {got} bytes; the index says "
                        f"{part.size}"
                    )
        if stream.read(1):
            raise ValueError(
                f"{source}: part {part.key} is longer than the {part.size} bytes the index says"
            )
    digest = sha.hexdigest()
    if digest != part.sha256:
        raise ValueError(
            f"{source}: part {part.key} has SHA256 {digest}; the index says {part.sha256}"
        )


class PartFiller:
    """Reads a stream into given buffers: ``readinto`` where the stream has a working one."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.readinto = getattr(stream, "readinto", None)

    def fill(self, piece: memoryview) -> int:
        """Read into ``piece`` until it is full or the stream ends; return the bytes read."""
        filled = 0
        while filled < len(piece):
            n = None
            if self.readinto is not None:
                try:
                    n = self.readinto(piece[filled:])
                except (NotImplementedError, io.UnsupportedOperation):
                    self.readinto = None  # the base class's stub: it read nothing
            if n is None:
                block = self.stream.read(len(piece) - filled)
                n = len(block)
                piece[filled : filled + n] = block
            if not n:
                break
            filled += n
        return filled


def _run_parallel(calls: Sequence[Any], workers: int | None, cleanup: Any = None) -> list[Any]:
    """Run ``calls`` on up to ``workers`` threads (default ``MAX_PART_THREADS``); results in
    order.

    The first failure cancels calls not yet started and is raised once the running ones end;
    ``cleanup(done)`` then gets the positions of the calls that succeeded.
    """
    if len(calls) == 1:
        try:
            return [calls[0]()]
        except BaseException:
            if cleanup is not None:
                cleanup([])
            raise
    count = max(1, min(len(calls), workers or MAX_PART_THREADS))
    with ThreadPoolExecutor(max_workers=count, thread_name_prefix="koochak-part") as pool:
        futures: list[Future[Any]] = [pool.submit(call) for call in calls]
        wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in futures if f.done() and f.exception() is not None), None)
        if failed is None:
            return [f.result() for f in futures]
        for future in futures:
            future.cancel()
        wait(futures)
    if cleanup is not None:
        cleanup([i for i, f in enumerate(futures) if not f.cancelled() and f.exception() is None])
    error = failed.exception()
    assert error is not None
    raise error
