"""Reading sharded (FSDP) checkpoints: verified slab reads, collective selection, the restore.

- **select** (``selection.resolve_sharded``, every rank at once, through the layouts' ``open``):
  the published checkpoints are walked newest first; for each, every rank reads its manifest
  and index (the head), checks the skeleton and cursor, and reads whole, hashing as it reads, the parts it will restore from (part
  0, the unsharded tensors, and those holding its rows of every sharded tensor under FSDP2's
  dimension-0 split of this world: ``parts_to_read``), keeping their verified bytes. A candidate
  with a damaged or missing part on any rank is skipped on every rank, with the part named, for
  the next older one. No part is stat'ed and none is read twice. The result holds
  ``StoredTensor`` references in place of the large tensors.
- **load** (``materialize``, every rank at once): each reference becomes this rank's slab of its
  global tensor when a live DTensor will take it (a parameter, its optimizer state, an EMA
  shadow), else the whole tensor. Its bytes come from the parts the selection verified; a part
  it did not read (a model sharded otherwise than predicted) is read whole, hashed and checked
  against the index before a byte of it is used; the ranks then agree, so a load that cannot
  complete fails on every rank, naming the part, instead of leaving the others waiting. So each
  byte a rank restores is read and hashed once (issue 36).

Stored shards and wanted slabs are slabs of dimension 0 (FSDP2's ``Shard(0)``), so every wanted
piece is a contiguous byte range of a stored shard: resharding is byte copies, exact by
construction. Writing them is ``sharded``'s job.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from koochak.loop.checkpoint.collectives import agree_all, error_line, local_box, map_tree
from koochak.loop.checkpoint.layouts.payload import checkpoint_of_payload, with_fragment_rng
from koochak.loop.checkpoint.parts_index import Extent, PartsIndex, TensorEntry, itemsize
from koochak.loop.checkpoint.parts_io import PartFiller
from koochak.loop.checkpoint.parts_tree import byte_view, join_tensors, load_skeleton, torch_dtype
from koochak.loop.dist import is_dtensor, local_tensor, placed_like
from koochak.storage.named import open_named
from koochak.storage.store import Store

log = logging.getLogger("koochak.loop.checkpoint")

_PIECE = 8 << 20  # parts are streamed and hashed in pieces of this size
# A part read that completes no piece (_PIECE bytes, or the part's end) for this long has stalled
# (a hung mount or store): the rank reports it naming the part, well within the process group's
# timeout (NCCL's default is 10 minutes), instead of leaving every other rank waiting in the next
# collective.
READ_STALL_SECONDS = 120.0


# ----------------------------------------------------------------------------- read


@dataclass(eq=False)
class Source:
    """A checkpoint in parts being read: its store, parsed index and name for messages, and
    the parts already read whole and verified (by key), whose bytes a slab read takes instead
    of reading them again (the selection fills it, ``materialize`` empties it).

    ``complete``: for an index assembled from only some writers' fragments (version 2, what
    this rank was predicted to restore), how to get the whole one; a slab read that needs rows
    outside the partial index swaps it in (once) rather than read what it does not describe."""

    store: Store
    index: PartsIndex
    where: str
    verified: dict[str, bytearray] = field(default_factory=dict)
    complete: Callable[[], PartsIndex] | None = None


@dataclass(frozen=True, eq=False)
class StoredTensor:
    """Tensor ``number`` of ``source``'s index, not read yet (``materialize`` reads it)."""

    source: Source
    number: int

    @property
    def entry(self) -> TensorEntry:
        return self.source.index.tensors[self.number]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.entry.shape

    def dim(self) -> int:
        return len(self.entry.shape)


def read_slabs(
    source: Source, wanted: Sequence[tuple[int, int, int]], *, workers: int | None = None
) -> list[torch.Tensor]:
    """Rows ``[start, start + rows)`` of dimension 0 of each tensor ``(number, start, rows)``
    (a 0-dim tensor is one row), read from the parts that hold them.

    Each part read is read whole and hashed; it must match its size and SHA256 in the index
    before any of its bytes is used (ValueError naming ``source`` and the part otherwise).
    """
    if not _covered(source.index, wanted):
        if source.complete is None:
            raise ValueError(f"{source.where}: the index read does not describe every row asked")
        source.index, source.complete = source.complete(), None
    index = source.index
    out: list[torch.Tensor] = []
    targets: dict[int, list[tuple[int, int, memoryview]]] = {}
    for number, start, rows in wanted:
        entry = index.tensors[number]
        shape = entry.shape
        dest = torch.empty((rows, *shape[1:]) if shape else (), dtype=torch_dtype(entry.dtype))
        out.append(dest)
        if dest.numel() == 0:
            continue
        row_bytes = dest.element_size() * _numel(shape[1:])
        view = byte_view(dest)
        for shard in entry.shards:
            if shape and (
                shard.offsets[1:] != (0,) * (len(shape) - 1) or shard.shape[1:] != shape[1:]
            ):
                raise ValueError(f"{source.where}: tensor {number} is not stored as slabs of "
                                 "dimension 0; read it whole with load()")  # fmt: skip
            first = shard.offsets[0] if shape else 0
            count = shard.shape[0] if shape else 1
            lo, hi = max(start, first), min(start + rows, first + count)
            if lo >= hi:
                continue
            _add_range(targets, shard.extents, (lo - first) * row_bytes, (hi - lo) * row_bytes,
                       view[(lo - start) * row_bytes : (hi - start) * row_bytes])  # fmt: skip
    for number in [p for p in targets if index.parts[p].key in source.verified]:
        kept = source.verified[index.parts[number].key]
        for at, length, dest in targets.pop(number):
            dest[:] = memoryview(kept)[at : at + length]
    _in_parallel(source, [(p, lambda tick, p=p, t=t: _read_part(source, p, t, tick))
                          for p, t in sorted(targets.items())], workers)  # fmt: skip
    return out


def _covered(index: PartsIndex, wanted: Sequence[tuple[int, int, int]]) -> bool:
    """Whether ``index``'s shards hold every row ``wanted`` asks for (a partial index may not)."""
    for number, start, rows in wanted:
        entry = index.tensors[number]
        if not entry.shape or _numel(entry.shape) == 0:
            if not entry.shards:
                return False
            continue
        held = 0
        for shard in entry.shards:
            lo = max(start, shard.offsets[0])
            hi = min(start + rows, shard.offsets[0] + shard.shape[0])
            held += max(0, hi - lo)
        if held < rows:
            return False
    return True


def _add_range(
    targets: dict[int, list[tuple[int, int, memoryview]]],
    extents: Sequence[Extent],
    begin: int,
    length: int,
    dest: memoryview,
) -> None:
    """Map bytes ``[begin, begin + length)`` of a shard onto its extents' part ranges."""
    cursor = 0
    for extent in extents:
        lo, hi = max(begin, cursor), min(begin + length, cursor + extent.length)
        if lo < hi:
            at = extent.offset + lo - cursor
            targets.setdefault(extent.part, []).append((at, hi - lo, dest[lo - begin : hi - begin]))
        cursor += extent.length


def _read_part(
    source: Source,
    number: int,
    targets: Sequence[tuple[int, int, memoryview]],
    tick: Callable[[], None] = lambda: None,
    *,
    keep: bool = False,
) -> None:
    """Stream part ``number`` whole, hash it, copy the byte ranges ``targets`` asks for; the
    digest must match before this returns (the copies are used only then). ``tick`` is called
    after every piece read (the stall watch). ``keep``: read it into one buffer of its size,
    kept in ``source.verified`` once the digest matched (the one read of it)."""
    part = source.index.parts[number]
    pending = sorted(targets, key=lambda t: t[0])
    sha = hashlib.sha256()
    whole = bytearray(part.size) if keep else None
    buffer = whole if whole is not None else bytearray(min(_PIECE, max(part.size, 1)))
    view = memoryview(buffer)
    pos = 0
    try:
        stream = open_named(source.store, part.key, named_by=source.where)
    except FileNotFoundError:  # still missing after the store's read_settle_seconds
        raise ValueError(f"{source.where}: part {part.key} is missing") from None
    with stream:
        filler = PartFiller(stream)
        while pos < part.size:
            size = min(_PIECE, part.size - pos)
            piece = view[pos : pos + size] if whole is not None else view[:size]
            got = filler.fill(piece)
            if got == 0:
                raise ValueError(f"{source.where}: part {part.key} ends after {pos} bytes; the "
                                 f"index says {part.size}")  # fmt: skip
            tick()
            sha.update(piece[:got])
            end = pos + got
            for at, length, dest in pending:
                lo, hi = max(at, pos), min(at + length, end)
                if lo < hi:
                    dest[lo - at : hi - at] = piece[lo - pos : hi - pos]
            pos = end
        if stream.read(1):
            raise ValueError(f"{source.where}: part {part.key} is longer than the {part.size} "
                             "bytes the index says")  # fmt: skip
    if sha.hexdigest() != part.sha256:
        raise ValueError(f"{source.where}: part {part.key} has SHA256 {sha.hexdigest()}; the "
                         f"index says {part.sha256}")  # fmt: skip
    if whole is not None:
        source.verified[part.key] = whole


def verify_parts(
    source: Source, numbers: Sequence[int], *, workers: int | None = None, keep: bool = False
) -> None:
    """Hash parts ``numbers`` whole against the index (ValueError naming the first bad one);
    ``keep``: and keep their bytes in ``source.verified`` for the slab reads that follow."""
    reads = [(p, lambda tick, p=p: _read_part(source, p, (), tick, keep=keep)) for p in numbers]
    _in_parallel(source, reads, workers)


def parts_to_read(
    index: PartsIndex, rank: int, world: int, shard_size: int | None = None
) -> list[int]:
    """The parts rank ``rank`` of ``world`` restores from, by number: part 0 (writer 0's
    unsharded tensors, which every rank restores whole) and every part holding some of its rows
    of another tensor, FSDP2's dimension-0 split (``ceil(rows / world)`` rows per rank, in rank
    order; under HSDP with groups of ``shard_size`` ranks, the split within its group). Every
    part on one process. A model sharded otherwise reads what this misses at load.
    """
    if world <= 1:
        return list(range(len(index.parts)))
    if shard_size:
        rank, world = rank % shard_size, shard_size
    wanted = {0}
    for entry in index.tensors:
        if all(e.part == 0 for shard in entry.shards for e in shard.extents):
            continue
        if not entry.shape:
            wanted.update(e.part for shard in entry.shards for e in shard.extents)
            continue
        chunk = -(-entry.shape[0] // world)
        lo, hi = rank * chunk, min(entry.shape[0], (rank + 1) * chunk)
        row_bytes = itemsize(entry.dtype) * _numel(entry.shape[1:])
        for shard in entry.shards:
            first = shard.offsets[0]
            a, b = max(lo, first), min(hi, first + shard.shape[0])
            if a >= b:
                continue
            begin, end, cursor = (a - first) * row_bytes, (b - first) * row_bytes, 0
            for extent in shard.extents:
                if max(begin, cursor) < min(end, cursor + extent.length):
                    wanted.add(extent.part)
                cursor += extent.length
    return sorted(wanted)


def _in_parallel(
    source: Source,
    reads: Sequence[tuple[int, Callable[[Callable[[], None]], None]]],
    workers: int | None,
) -> None:
    """Run part reads ``(part number, read(tick))`` on up to ``workers`` daemon threads and
    raise the first error; a read that has not ticked for ``READ_STALL_SECONDS`` fails the
    call with TimeoutError naming its part. Its thread is left behind: a read blocked in the
    kernel cannot be interrupted, and a daemon thread does not hold up the process's exit."""
    if not reads:
        return
    lock = threading.Lock()
    queue = list(reads)[::-1]
    active: dict[int, float] = {}  # part number -> when it last made progress
    errors: list[BaseException] = []

    def work() -> None:
        while True:
            with lock:
                if not queue or errors:
                    return
                number, read = queue.pop()
                active[number] = time.monotonic()

            def tick(number: int = number) -> None:
                active[number] = time.monotonic()  # one dict store: atomic under the GIL

            try:
                read(tick)
            except BaseException as exc:
                with lock:
                    errors.append(exc)
            finally:
                with lock:
                    active.pop(number, None)

    threads = [
        threading.Thread(target=work, name="koochak-shard-read", daemon=True)
        for _ in range(min(len(reads), workers or 8))
    ]
    for thread in threads:
        thread.start()
    stall = READ_STALL_SECONDS
    while True:
        for thread in threads:
            thread.join(timeout=min(1.0, stall / 4))
            with lock:
                if errors:
                    raise errors[0]
                late = [n for n, t in active.items() if time.monotonic() - t > stall]
            if late:
                key = source.index.parts[min(late)].key
                raise TimeoutError(f"{source.where}: part {key} made no progress for "
                                   f"{stall:g} s (a stalled store or mount)")  # fmt: skip
        if not any(thread.is_alive() for thread in threads):
            with lock:
                if errors:
                    raise errors[0]
            return


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


# ----------------------------------------------------------------------------- select


def open_lazy(
    store: Store,
    index: PartsIndex,
    path: str,
    *,
    rank: int = 0,
    world: int = 1,
    complete: Callable[[], PartsIndex] | None = None,
    shard_size: int | None = None,
) -> dict[str, Any]:
    """The checkpoint of a parsed ``index`` with ``StoredTensor`` references for its tensors:
    the parts rank ``rank`` of ``world`` restores from (``parts_to_read``) read whole, hashed
    as they are read and kept (waiting the store's read_settle_seconds for one not visible
    yet; ValueError naming a missing, short, long or damaged one), the skeleton joined, the RNG
    states read (resume must be able to restore them) and the format checked: the parts layout
    read lazily. No part is stat'ed: a part nobody reads here is checked when it is read."""
    source = Source(store, index, path, complete=complete)
    verify_parts(source, parts_to_read(index, rank, world, shard_size), keep=True)
    refs = [StoredTensor(source, i) for i in range(len(index.tensors))]
    payload = with_fragment_rng(_join(load_skeleton(index.skeleton, path), refs, path), index, path,
                                store, {rank})  # fmt: skip
    for key in ("rng", "rng_per_rank"):  # small, and resume must be able to restore them
        if payload.get(key) is not None:
            payload[key] = _read_all(payload[key])
    return checkpoint_of_payload(payload, path)


def _join(skeleton: Any, refs: Sequence[StoredTensor], source: str) -> Any:
    """The skeleton with each ``(TENSOR_TAG, i)`` reference replaced by ``refs[i]``: walked
    iteratively, InvalidArtifact naming ``source`` for a bad reference or a skeleton nested too
    deeply (``parts_tree.join_tensors``)."""
    return join_tensors(skeleton, refs, source)


def _refs(tree: Any) -> list[StoredTensor]:
    if isinstance(tree, StoredTensor):
        return [tree]
    if isinstance(tree, Mapping):
        return [r for v in tree.values() for r in _refs(v)]
    if isinstance(tree, (list, tuple)):
        return [r for v in tree for r in _refs(v)]
    return []


# ----------------------------------------------------------------------------- load


def _read_all(tree: Any, likes: Mapping[int, Any] | None = None) -> Any:
    """``tree`` with every StoredTensor read: this rank's slab where ``likes`` maps it to a live
    DTensor (returned as a DTensor placed like it), else the whole tensor."""
    refs = _refs(tree)
    if not refs:
        return tree
    likes = likes or {}
    by_source: dict[int, list[StoredTensor]] = {}
    for ref in refs:
        by_source.setdefault(id(ref.source), []).append(ref)
    read: dict[int, Any] = {}
    for group in by_source.values():
        wanted = []
        for ref in group:
            like = likes.get(id(ref))
            if like is not None:
                offsets, shape = local_box(like)
                wanted.append((ref.number, offsets[0], shape[0]))
            else:
                wanted.append((ref.number, 0, ref.shape[0] if ref.shape else 1))
        for ref, tensor in zip(group, read_slabs(group[0].source, wanted)):
            like = likes.get(id(ref))
            read[id(ref)] = (
                tensor if like is None else placed_like(tensor.to(local_tensor(like).device), like)
            )
    return map_tree(tree, lambda v: read[id(v)] if isinstance(v, StoredTensor) else v)


def is_lazy(ckpt: Mapping[str, Any]) -> bool:
    """Whether ``ckpt`` still holds StoredTensor references (from ``resolve_sharded``)."""
    return bool(_refs(ckpt))


def materialize(
    ckpt: Mapping[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    ema: Any = None,
    state: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``ckpt`` with its StoredTensors read for this rank: the slab of each parameter, its
    optimizer state and its EMA shadows that the live (sharded) model holds, and likewise for
    the user's ``state`` entries (an optimizer over sharded parameters, or anything whose
    ``state_dict`` holds DTensors); every other tensor whole. Every rank must call it at once:
    if any rank cannot read its tensors, all raise ShardedLoadError naming the rank and the part."""
    from koochak.loop.state_dicts import unwrap_model

    likes: dict[int, Any] = {}
    live = unwrap_model(model).state_dict()
    _match_state(ckpt.get("model"), live, likes)
    for shadow in (ckpt.get("ema") or {}).get("shadows") or []:
        saved_shadow = shadow.get("state_dict") if isinstance(shadow, Mapping) else None
        _match_state(saved_shadow, live, likes)
    if optimizer is not None:
        _match_optimizer(ckpt.get("optimizer"), optimizer, likes)
    saved = ckpt.get("user_state")
    entries = saved.get("entries") if isinstance(saved, Mapping) else None
    for name, obj in (state or {}).items() if isinstance(entries, Mapping) else ():
        if isinstance(obj, torch.optim.Optimizer):
            _match_optimizer(entries.get(name), obj, likes)
        elif hasattr(obj, "state_dict"):
            _match_state(entries.get(name), obj.state_dict(), likes)
    error, result = None, None
    try:
        result = _read_all(dict(ckpt), likes)
    except Exception as exc:
        error = error_line(exc)
    finally:
        for ref in _refs(ckpt):  # the selection's verified bytes are copied out now
            ref.source.verified.clear()
    agree_all(error, "loading the sharded checkpoint")
    return result


def _match_state(saved: Any, live: Mapping[str, Any], likes: dict[int, Any]) -> None:
    """Map each StoredTensor of ``saved`` (a state dict) to the live DTensor of the same key and
    global shape, so only this rank's rows of it are read."""
    if not isinstance(saved, Mapping):
        return
    for key, value in saved.items():
        target = live.get(str(key).removeprefix("module."))
        if (
            isinstance(value, StoredTensor)
            and is_dtensor(target)
            and value.shape == tuple(target.shape)
        ):
            likes[id(value)] = target


def _match_optimizer(saved: Any, optimizer: torch.optim.Optimizer, likes: dict[int, Any]) -> None:
    """Map each per-parameter StoredTensor of ``saved`` (an optimizer's state dict) with the
    global shape of its sharded parameter to that parameter (the optimizer's own order)."""
    if not isinstance(saved, Mapping):
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for key, entry in (saved.get("state") or {}).items():
        param = params[key] if isinstance(key, int) and 0 <= key < len(params) else None
        if is_dtensor(param) and isinstance(entry, Mapping):
            for value in entry.values():
                if (
                    isinstance(value, StoredTensor)
                    and value.dim()
                    and value.shape == tuple(param.shape)
                ):
                    likes[id(value)] = param
