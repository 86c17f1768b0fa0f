"""Saving sharded (FSDP) state: every rank writes its own shards, rank 0 commits.

The ``Sharded`` layout (``layouts``' contract): parts (docs/formats.md, "Checkpoint parts") with
several writers. In ``write`` (every rank at once, rank 0 holding the name) every rank writes, in parallel with the others, the local shards of the DTensors in the
checkpoint (parameters, optimizer state, EMA shadows) as its own parts ``….part-<rank>-NNNNN``,
rank 0 also the unsharded tensors (buffers, its RNG state, scalars) as its part ``00000`` and the
rest from ``00001``, every other rank its own RNG state as its last part (under HSDP only the
ranks of the first replicate group write slabs: each slab once); each rank reports its parts' keys, sizes and SHA256 and where each shard
lies in its global tensor; rank 0 gathers the reports, only once every rank's parts are durable
(``put`` returned), builds the head, which ``commit.save`` commits. Every rank learns the
outcome (``outcome``); a failure anywhere fails the save on every rank and leaves no committed
checkpoint. ``freeze`` copies a capture into host buffers for a save in the background.

Reading them back: ``read`` whole, or ``open`` lazily for the selection; the slab reads and the
restore are ``sharded_read``'s machinery, the collectives both sides use ``collectives``'.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from koochak.loop import dist
from koochak.loop.checkpoint.collectives import (  # noqa: F401 (ShardedLoadError: its users)
    ShardedLoadError,
    agree_all,
    broadcast_from_rank0,
    error_line,
    local_box,
    map_tree,
)
from koochak.loop.checkpoint.commit import save, unpublish_checkpoint
from koochak.loop.checkpoint.parts_index import (
    PART_INFIX,
    Extent,
    Part,
    PartsIndex,
    Shard,
    TensorEntry,
    part_key,
)
from koochak.loop.checkpoint.parts_io import host_tensor, write_parts
from koochak.loop.checkpoint.parts_plan import resolve_parts
from koochak.loop.checkpoint.parts_tree import dtype_name, skeleton_bytes
from koochak.loop.checkpoint.serialization import encode_index, split_checkpoint
from koochak.loop.dist import is_dtensor, local_tensor, placed_like
from koochak.storage import artifact
from koochak.storage.store import Store

log = logging.getLogger("koochak.loop.checkpoint")


# ----------------------------------------------------------------------------- save


def dtensor_leaves(tree: Any, path: str = "") -> list[tuple[str, Any]]:
    """``(path, dtensor)`` for every DTensor in ``tree``, depth first in insertion order (the
    order ``split_tensors`` walks)."""
    if is_dtensor(tree):
        return [(path, tree)]
    if isinstance(tree, Mapping):
        return [leaf for k, v in tree.items() for leaf in dtensor_leaves(v, f"{path}/{k}")]
    if isinstance(tree, (list, tuple)):
        return [leaf for i, v in enumerate(tree) for leaf in dtensor_leaves(v, f"{path}/{i}")]
    return []


@dataclass(frozen=True)
class _Report:
    """What one rank tells rank 0 once its parts are durable."""

    paths: tuple[str, ...]  # its DTensors, in order: every rank's must be rank 0's
    parts: tuple[tuple[str, int, str], ...]  # (key, size, sha256), in number order
    # (tensor number, offsets, shape, extents as (part, offset, length) in this rank's parts);
    # tensor numbers >= 0 are rank 0's own (unsharded) tensors, -1 - k is its k-th DTensor
    shards: tuple[
        tuple[int, tuple[int, ...], tuple[int, ...], tuple[tuple[int, int, int], ...]], ...
    ]
    error: str | None = None
    # Version 2 (every DTensor a Shard(0) slab over a 1-D mesh of every rank, or HSDP's 2-D one):
    # this rank's index fragment, already durable; ``shards`` is then empty and ``paths`` one digest of them,
    # so rank 0 gathers O(1) per rank.
    fragment: Any = None


def _regular(leaves: Sequence[tuple[str, Any]], world: int) -> int | None:
    """The number of slab writers when every DTensor is FSDP2's ``Shard(0)`` over one 1-D mesh
    of all ``world`` ranks (``world``), or HSDP's ``(Replicate(), Shard(0))`` over one 2-D mesh
    ``(world / S, S)`` of the ranks in order (``S``: the first shard group, ranks ``0..S-1``,
    holds every slab once), so a head can describe the slabs by formula (``index_fragments``);
    None otherwise. The same answer on every rank: it depends only on the (identical) model and
    world."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as TorchShard

    found: set[int] = set()
    for _, dt in leaves:
        mesh = dt.device_mesh
        if mesh.size() != world or dt.dim() == 0:
            return None
        if mesh.ndim == 1 and tuple(dt.placements) == (TorchShard(0),):
            found.add(world)
        elif mesh.ndim == 2 and tuple(dt.placements) == (Replicate(), TorchShard(0)):
            if mesh.mesh.flatten().tolist() != list(range(world)):
                return None
            found.add(mesh.size(1))
        else:
            return None
    return found.pop() if len(found) == 1 else (world if not found else None)


def first_copy(dt: Any) -> bool:
    """Whether this rank holds the first copy of its slab of DTensor ``dt``: its coordinate is 0
    along every mesh dimension ``dt`` is replicated over (HSDP's replicate groups), so each slab
    is written by one rank only."""
    from torch.distributed.tensor import Replicate

    coordinate = dt.device_mesh.get_coordinate()
    if coordinate is None:
        return False
    return all(c == 0 for c, p in zip(coordinate, dt.placements) if isinstance(p, Replicate))


class Sharded:
    """Every rank writes its own shards (FSDP) and its index fragment; the coordinator the head.
    Collective: every rank calls ``write`` and ``outcome`` at once (``layouts``' call order)."""

    name = "sharded"

    def __init__(self, parts: int | str = 1, workers: int | None = None) -> None:
        self.parts = parts
        self.workers = workers
        self.last_written: tuple[tuple[str, int, str], ...] = ()  # this rank's parts

    def writes(self, role: str) -> bool:
        return True

    def freeze(self, ckpt: Mapping[str, Any], buffers: Any) -> tuple[Any, Any]:
        return freeze(ckpt, buffers)

    def write(
        self,
        store: Store,
        name: str,
        data: Any,
        *,
        intent: Any,
        refused: str | None = None,
        group: Any = None,
    ) -> bytes | None:
        written: list[tuple[str, int, str]] = []
        self.last_written = ()
        head = _write_all(store, name, data, refused, parts=self.parts, workers=self.workers,
                          group=group, written=written)  # fmt: skip
        self.last_written = tuple(written)
        return head

    def outcome(self, result: Any, group: Any = None) -> Any:
        return broadcast_from_rank0(result, group)

    def read(self, store, name, head, source, *, workers=None, parts_reader=None) -> dict[str, Any]:
        from koochak.loop.checkpoint.index_fragments import read_index
        from koochak.loop.checkpoint.layouts.parts import read_indexed

        if store is None:
            raise ValueError(f"{source}: a sharded checkpoint needs the store that holds its parts")
        index = read_index(store, head, source, name)  # every writer's fragment, each verified
        return read_indexed(store, index, source, workers=workers, parts_reader=parts_reader)

    def open(
        self, store, name, head, source, *, rank=0, world=1, shard_size=None
    ) -> dict[str, Any]:
        """Lazily, for rank ``rank`` of ``world``: only the fragments of the writers whose rows
        it restores are read (``writers_for``), then the parts it restores from, verified once
        (``sharded_read.open_lazy``); the whole index is read only if a slab read needs it."""
        from koochak.loop.checkpoint.index_fragments import parse_head, read_index, writers_for
        from koochak.loop.checkpoint.sharded_read import open_lazy

        wanted = writers_for(parse_head(head, source, name), rank, world, shard_size)
        index = read_index(store, head, source, name, writers=wanted)
        complete = None
        if world > 1:

            def complete() -> PartsIndex:
                return read_index(store, head, source, name)

        return open_lazy(store, index, source, rank=rank, world=world, complete=complete,
                         shard_size=shard_size)  # fmt: skip

    def objects(self, name: str, head: Any) -> list[str]:
        from koochak.loop.checkpoint.index_fragments import head_object_keys, parse_head

        return head_object_keys(parse_head(head, name, name))

    def receipts(self, store, name, head, source, remote=()) -> tuple[list, dict]:
        """A writer's fragment names its parts and its digest covers them: a local writer's
        parts and fragment are copied, a remote writer's receipt names just its fragment (no
        remote writer's fragment is read)."""
        from koochak.loop.checkpoint.index_fragments import parse_head, read_index

        parsed = parse_head(head, source, name)
        mine = [w for w in range(parsed.writers) if w not in remote]
        index = read_index(store, head, source, name, writers=mine)
        parts = [*index.parts, *(p for p in index.rng_parts if p is not None)]  # RNG parts too
        local: list[tuple[str, int, str]] = []
        for writer in mine:
            ref = parsed.fragments[writer]
            local += [(p.key, p.size, p.sha256) for p in parts if p.writer == writer]
            local.append((ref.key, ref.size, ref.sha256))
        expected = {}
        for writer in sorted(set(remote) & set(range(parsed.writers))):
            ref = parsed.fragments[writer]
            expected[writer] = [(ref.key, ref.size, ref.sha256)]
        return local, expected

    def verify(self, store: Store, name: str, head: Any, source: str) -> None:
        from koochak.loop.checkpoint.index_fragments import read_index, read_rng_part
        from koochak.loop.checkpoint.layouts.parts import verify_indexed

        # Every fragment is checked against the head as it is read, then every part it names
        # (each writer's RNG part too: it is not among the parts the tensors tile).
        index = read_index(store, head, source, name)
        verify_indexed(store, index, source)
        for part in index.rng_parts:
            if part is not None:
                read_rng_part(store, part, source)


SHARDED = Sharded()


def save_sharded(
    store: Store,
    name: str,
    ckpt: Mapping[str, Any],
    *,
    parts: int | str = 1,
    workers: int | None = None,
    group: Any = None,
    written: list[tuple[str, int, str]] | None = None,
) -> artifact.Publication:
    """Publish ``ckpt``, whose sharded tensors are DTensors, as checkpoint ``name``: every rank
    must call it at once, with its own capture of the same step. Returns the Publication (on
    every rank) once the ready manifest has committed; raises on every rank otherwise.

    ``parts`` is the number of parts each rank cuts its shards into (``"auto"``: as
    ``resolve_parts`` decides for its bytes). ``group`` is the process group (of every rank)
    its few object collectives use: a background save passes a gloo group of its own, so they
    never meet the training thread's collectives. ``written`` receives this rank's parts as
    ``(key, size, sha256)`` (what it replicates from a node-local tier). The ``Sharded``
    layout saved by ``commit.save``.
    """
    layout = Sharded(parts, workers)
    try:
        return save(layout, store, name, ckpt, coordinator=dist.get_rank() == 0, group=group)
    finally:
        if written is not None:
            written.extend(layout.last_written)


def _write_all(
    store: Store,
    name: str,
    ckpt: Mapping[str, Any],
    refused: str | None,
    *,
    parts: int | str,
    workers: int | None,
    group: Any,
    written: list[tuple[str, int, str]],
) -> bytes | None:
    """The sharded write on every rank at once, rank 0 holding the name (or ``refused``: why
    not): every rank writes its parts and fragment, rank 0 builds the head from the reports and
    returns it (None elsewhere). Raises on every rank if any rank failed."""
    rank = dist.get_rank()
    error = refused
    if rank != 0 and error is None:
        # Its own leftovers, in a directory of its node's (a node-local tier): rank 0 cannot
        # see them there to clear them. Parts are create-only: a retry starts clean.
        try:
            for info in store.list(f"{name}{PART_INFIX}{rank:05d}-"):
                try:
                    store.delete(info.key)
                except FileNotFoundError:  # rank 0 cleared it (the tier is shared)
                    pass
        except Exception as exc:
            error = error_line(exc)
    agree_all(error, f"saving {name}", group)

    split, numbers = None, {}
    leaves = dtensor_leaves(ckpt)  # the same on every rank (the same model and world)
    slab_writers = _regular(leaves, dist.get_world_size())
    regular = slab_writers is not None
    source = ckpt
    if not regular:  # one index of every rank's shards: rank 0's skeleton holds every RNG state
        source = _with_rng_per_rank(ckpt, group)
    try:
        if regular and rank == 0 and ckpt.get("rng_per_rank") is not None:
            # Each rank's RNG state is its own part: the head carries rank 0's alone (``rng``).
            source = {**ckpt, "rng_per_rank": None}
        split, numbers = _split_rank0(source, leaves) if rank == 0 else (None, {})
        report = _write_mine(store, name, split, numbers, leaves, parts, workers)
        if regular:
            own = ckpt.get("rng") if dist.get_world_size() > 1 and rank > 0 else None
            report = _write_fragment(store, name, report, own)
    except Exception as exc:
        report = _Report((), (), (), error_line(exc))
    written.extend(report.parts)
    if report.fragment is not None:
        written.append((report.fragment.key, report.fragment.size, report.fragment.sha256))
    reports = _gather(report, group)

    head, failed = None, None
    if rank == 0:
        try:
            assert reports is not None and split is not None
            if all(rep.fragment is not None for rep in reports):
                head = _build_head(name, split, numbers, leaves, reports, slab_writers)
            else:
                head = encode_index(_build_index(name, split, numbers, leaves, reports))
        except Exception as exc:
            _remove_quietly(store, name)
            failed = error_line(exc)
    failed = broadcast_from_rank0(failed, group)
    if failed is not None:
        raise RuntimeError(f"checkpoint {name} was not saved: {failed}")
    return head


def _split_rank0(
    ckpt: Mapping[str, Any], leaves: list[tuple[str, Any]]
) -> tuple[Any, dict[int, int]]:
    """Rank 0's skeleton and tensor list, each DTensor stood in for by a one-element sentinel;
    returns the split and ``{tensor number: DTensor ordinal}`` for the sentinels (found by their
    memory, which the split keeps)."""
    order = {id(dt): k for k, (_, dt) in enumerate(leaves)}
    sentinels: dict[int, int] = {}
    keep: list[torch.Tensor] = []  # alive until split: their addresses must stay distinct

    def swap(dt: Any) -> torch.Tensor:
        stand_in = torch.empty(1)
        keep.append(stand_in)
        sentinels[stand_in.data_ptr()] = order[id(dt)]
        return stand_in

    split = split_checkpoint(map_tree(ckpt, lambda v: swap(v) if is_dtensor(v) else v))
    numbers = {
        i: sentinels[t.data_ptr()] for i, t in enumerate(split.tensors) if t.data_ptr() in sentinels
    }
    if len(numbers) != len(leaves):
        raise RuntimeError(f"{len(leaves)} sharded tensors but {len(numbers)} found in the split")
    return split, numbers


def _write_mine(
    store: Store,
    name: str,
    split: Any,
    numbers: dict[int, int],
    leaves: list[tuple[str, Any]],
    parts: int | str,
    workers: int | None,
) -> _Report:
    rank = dist.get_rank()
    out_parts: list[tuple[str, int, str]] = []
    shards: list[Any] = []
    first = 0
    if split is not None:  # rank 0: the unsharded tensors, one part of their own
        plain = [(i, host_tensor(t)) for i, t in enumerate(split.tensors) if i not in numbers]
        index = write_parts(store, name, [t for _, t in plain], b"", 1, writer=0, workers=workers)
        out_parts += [(p.key, p.size, p.sha256) for p in index.parts]
        for (i, t), entry in zip(plain, index.tensors):
            extents = tuple((e.part, e.offset, e.length) for e in entry.shards[0].extents)
            shards.append((i, (0,) * t.dim(), tuple(t.shape), extents))
        first = len(index.parts)
    mine = []
    for k, (_, dt) in enumerate(leaves):
        if not first_copy(dt):  # another replicate group's rank writes this slab
            continue
        offsets, shape = local_box(dt)
        local = local_tensor(dt)
        if local.numel():
            mine.append((k, offsets, shape, host_tensor(local)))
    if mine:
        nbytes = sum(t.numel() * t.element_size() for *_, t in mine)
        count = resolve_parts(parts, nbytes, store)
        index = write_parts(store, name, [t for *_, t in mine], b"", count, writer=rank,
                            workers=workers, first_number=first)  # fmt: skip
        for (k, offsets, shape, _), entry in zip(mine, index.tensors):
            extents = tuple((e.part + first, e.offset, e.length) for e in entry.shards[0].extents)
            shards.append((-1 - k, offsets, shape, extents))
        out_parts += [(p.key, p.size, p.sha256) for p in index.parts]
    return _Report(tuple(path for path, _ in leaves), tuple(out_parts), tuple(shards))


def _write_fragment(store: Store, name: str, report: _Report, rng: Any = None) -> _Report:
    """Put this rank's RNG state ``rng`` (if any) as its own last part, raw ``torch.save``
    bytes, then its index fragment (its parts, and where its bytes of each tensor lie when not
    by the head's formula) and return the compact report that names it instead."""
    import hashlib

    from koochak.loop.checkpoint.index_fragments import FragmentRef, encode_fragment, fragment_key

    rank = dist.get_rank()
    whole = [(n, ext) for n, _, _, ext in report.shards if n >= 0]
    slabs = [(-1 - n, ext) for n, _, _, ext in report.shards if n < 0]
    parts = list(report.parts)
    rng_part = None
    if rng is not None:
        state = skeleton_bytes(rng)
        rng_part = len(parts)
        key = part_key(name, rank, rng_part)
        info = store.put(key, state)
        parts.append((key, len(state), info.sha256 or hashlib.sha256(state).hexdigest()))
    raw = encode_fragment(name, rank, parts, whole, slabs, rng_part)
    key = fragment_key(name, rank)
    info = store.put(key, raw)
    sha = info.sha256 or hashlib.sha256(raw).hexdigest()
    ref = FragmentRef(key, rank, len(raw), sha, len(parts))
    digest = hashlib.sha256("\n".join(report.paths).encode()).hexdigest()
    return _Report((digest,), tuple(parts), (), fragment=ref)


def _with_rng_per_rank(ckpt: Mapping[str, Any], group: Any) -> Mapping[str, Any]:
    """Rank 0's ``ckpt`` with every rank's RNG state in ``rng_per_rank`` (gathered here when the
    capture did not), for a save whose one index rank 0 writes (collective)."""
    if dist.get_world_size() == 1:
        return ckpt
    states = _gather(ckpt.get("rng"), group)
    if dist.get_rank() != 0 or ckpt.get("rng_per_rank") is not None:
        return ckpt
    return {**ckpt, "rng_per_rank": states}


def _build_head(
    name: str,
    split: Any,
    numbers: dict[int, int],
    leaves: list[tuple[str, Any]],
    reports: Sequence[_Report],
    slab_writers: int | None = None,
) -> bytes:
    """Rank 0: the version-2 head from every rank's fragment (one reference per rank);
    ``slab_writers``: the first ranks, which hold the slabs (fewer than the ranks under HSDP)."""
    from koochak.loop.checkpoint.index_fragments import encode_head

    failed = [f"rank {r}: {rep.error}" for r, rep in enumerate(reports) if rep.error]
    if failed:
        raise RuntimeError("; ".join(failed))
    for r, rep in enumerate(reports[1:], start=1):
        if rep.paths != reports[0].paths:
            raise ValueError(f"rank {r} holds other sharded tensors than rank 0")
    tensors = []
    for i, tensor in enumerate(split.tensors):
        k = numbers.get(i)
        if k is None:
            tensors.append((dtype_name(tensor.dtype), tuple(tensor.shape), "whole"))
        else:
            dt = leaves[k][1]
            tensors.append((dtype_name(dt.dtype), tuple(dt.shape), "rows"))
    fragments = [rep.fragment for rep in reports]
    return encode_head(name, len(reports), tensors, fragments, split.skeleton,
                       slab_writers=slab_writers)  # fmt: skip


def _build_index(
    name: str,
    split: Any,
    numbers: dict[int, int],
    leaves: list[tuple[str, Any]],
    reports: Sequence[_Report],
) -> PartsIndex:
    """Rank 0: one index from every rank's report (parts by writer, then number)."""
    failed = [f"rank {r}: {rep.error}" for r, rep in enumerate(reports) if rep.error]
    if failed:
        raise RuntimeError("; ".join(failed))
    for r, rep in enumerate(reports[1:], start=1):
        if rep.paths != reports[0].paths:
            raise ValueError(
                f"rank {r} holds other sharded tensors than rank 0 "
                f"({len(rep.paths)} vs {len(reports[0].paths)}, first difference at "
                f"{next((a for a, b in zip(rep.paths, reports[0].paths) if a != b), '-')!r})"
            )
    parts: list[Part] = []
    boxes: dict[int, list[Shard]] = {}
    for r, rep in enumerate(reports):
        base = len(parts)
        parts += [Part(key, r, size, sha) for key, size, sha in rep.parts]
        for number, offsets, shape, extents in rep.shards:
            runs = tuple(Extent(base + p, off, n) for p, off, n in extents)
            boxes.setdefault(number, []).append(Shard(tuple(offsets), tuple(shape), runs))
    entries = []
    for i, tensor in enumerate(split.tensors):
        k = numbers.get(i)
        if k is None:
            entries.append(
                TensorEntry(dtype_name(tensor.dtype), tuple(tensor.shape), tuple(boxes[i]))
            )
            continue
        dt = leaves[k][1]
        shape = tuple(dt.shape)
        found = tuple(sorted(boxes.get(-1 - k, ()), key=lambda s: s.offsets))
        empty = (Shard((0,) * len(shape), shape, ()),)  # a tensor of no elements at all
        entries.append(TensorEntry(dtype_name(dt.dtype), shape, found or empty))
    return PartsIndex(name, len(reports), tuple(parts), tuple(entries), split.skeleton)


def _remove_quietly(store: Store, name: str) -> None:
    try:
        unpublish_checkpoint(store, name)
    except OSError as exc:
        log.warning("could not remove the parts of failed checkpoint %s: %s", name, exc)


def _gather(value: Any, group: Any = None) -> list[Any] | None:
    if dist.get_world_size() == 1:
        return [value]
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    torch.distributed.gather_object(value, out, dst=0, group=group)
    return out


def freeze(ckpt: Mapping[str, Any], buffers: Any) -> tuple[dict[str, Any], Any]:
    """``(frozen, copy)``: ``ckpt`` with every tensor (a DTensor's local shard included) copied
    into ``buffers`` (``host_buffers.HostBuffers``), DTensors rebuilt around their copies, so a
    background ``save_sharded`` writes this step's values while training goes on. Release
    ``copy`` once the save is done."""
    sources: list[torch.Tensor] = []

    def collect(tree: Any) -> None:
        if isinstance(tree, torch.Tensor):
            sources.append(local_tensor(tree))
        elif isinstance(tree, Mapping):
            for value in tree.values():
                collect(value)
        elif isinstance(tree, (list, tuple)):
            for value in tree:
                collect(value)

    collect(ckpt)
    copy = buffers.copy(sources)

    copies = iter(copy.tensors)
    frozen = map_tree(
        ckpt, lambda v: placed_like(next(copies), v) if isinstance(v, torch.Tensor) else v
    )
    return frozen, copy
