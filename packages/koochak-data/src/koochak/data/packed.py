"""Packed group streaming: train straight from a collection archived with ``--groups``.

A *group* is every file one training record needs; ``archive --groups`` stores each group
contiguously in one tar pack. :class:`PackedGroups` reads the manifest and file table (never a
listing), :meth:`PackedGroups.plan` deals whole packs to data-loading owners balanced by group
count, :class:`GroupStream` fetches an owner's packs whole in a background thread, verifies them
and yields their groups shuffled within windows of packs, and :meth:`PackedGroups.read_files`
reads scattered single files with one open per pack::

    packed = PackedGroups.load(store)
    plan = packed.plan(num_owners=world_size * workers_per_rank, seed=0)
    for group in GroupStream(store, packed, plan[owner], seed=epoch_seed, cache=PackCache(4 << 30)):
        payload = group.files["some/original/path.npz"]
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Union

from koochak.data._pack_unit import PackUnit
from koochak.data._packed_fetch import PackCache, as_entries
from koochak.data._packed_fetch import read_files as _read_files
from koochak.data._packed_stream import Group, GroupStream, seeded_key
from koochak.data.collection import Collection, FileEntry, PackInfo, load_collection

__all__ = ["Group", "GroupStream", "PackCache", "PackUnit", "PackedGroups", "combine_plans"]

Select = Union[Callable[[str], bool], Iterable[str], None]


class PackedGroups:
    """The groups and packs of a committed collection, from its manifest and file table only."""

    def __init__(self, collection: Collection, location: str) -> None:
        self.collection = collection
        self.location = location
        self.files: dict[str, FileEntry] = collection.by_path()
        packs = {p.key: p for p in collection.manifest.packs}
        order = {p.key: i for i, p in enumerate(collection.manifest.packs)}
        members: dict[str, list[FileEntry]] = {}
        for e in collection.entries:
            members.setdefault(e.group, []).append(e)
        # Files of a group in storage order: packs as the manifest lists them, then offsets.
        self.groups: dict[str, tuple[FileEntry, ...]] = {
            name: tuple(sorted(es, key=lambda e: (e.pack is None, order.get(e.pack or "", 0),
                                                  e.offset or 0, e.path)))  # fmt: skip
            for name, es in members.items()
        }
        self.units: tuple[PackUnit, ...] = self._units(packs, order)

    def _units(self, packs: dict[str, PackInfo], order: dict[str, int]) -> tuple[PackUnit, ...]:
        # Packs joined by a spilled group must go to one owner: union-find over the packs.
        parent = {key: key for key in packs}

        def root(key: str) -> str:
            while parent[key] != key:
                parent[key] = parent[parent[key]]
                key = parent[key]
            return key

        for entries in self.groups.values():
            keys = sorted({e.pack for e in entries if e.pack is not None}, key=order.__getitem__)
            for other in keys[1:]:
                a, b = root(keys[0]), root(other)
                if a != b:
                    parent[max(a, b, key=order.__getitem__)] = min(a, b, key=order.__getitem__)
        unit_packs: dict[str, list[str]] = {}
        for key in sorted(packs, key=order.__getitem__):
            unit_packs.setdefault(root(key), []).append(key)
        unit_groups: dict[str, list[tuple[tuple[int, int], str]]] = {r: [] for r in unit_packs}
        object_groups: list[str] = []
        for name, entries in self.groups.items():
            first = next((e for e in entries if e.pack is not None), None)
            if first is None:
                object_groups.append(name)
            else:
                assert first.pack is not None and first.offset is not None
                unit_groups[root(first.pack)].append(((order[first.pack], first.offset), name))
        units = [
            PackUnit(tuple(packs[k] for k in keys), tuple(n for _, n in sorted(unit_groups[r])))
            for r, keys in unit_packs.items()
            if unit_groups[r]
        ]
        units += [PackUnit((), (name,)) for name in sorted(object_groups)]
        return tuple(units)

    @classmethod
    def load(cls, store: Any) -> PackedGroups:
        """Read and check the collection at ``store`` (a Store, path or ``scheme://``): two gets,
        ``manifest.json`` and ``files.jsonl.gz``; storage is never listed."""
        from koochak.storage.store import open_store

        store = open_store(store)
        return cls(load_collection(store), store.location)

    def __repr__(self) -> str:
        return (f"PackedGroups({self.location!r}, groups={len(self.groups)}, "
                f"units={len(self.units)})")  # fmt: skip

    # -- planning ----------------------------------------------------------------------------

    def selected(self, select: Select = None) -> list[PackUnit]:
        """The units holding groups ``select`` keeps (a predicate on the group name, or a
        collection of names), each trimmed to those groups."""
        if select is None:
            keep: Callable[[str], bool] = lambda name: True  # noqa: E731
        elif callable(select):
            keep = select
        else:
            if isinstance(select, str):
                raise TypeError("select: expected a predicate or a collection of group names, "
                                f"got the string {select!r}")  # fmt: skip
            names = set(select)
            unknown = sorted(names - self.groups.keys())
            if unknown:
                raise ValueError(
                    f"select names {len(unknown)} group(s) not in {self.location}, "
                    f"e.g. {unknown[0]!r}"
                )
            keep = names.__contains__
        units = []
        for unit in self.units:
            groups = tuple(g for g in unit.groups if keep(g))
            if groups:
                units.append(unit if len(groups) == len(unit.groups) else PackUnit(unit.packs, groups))
        return units

    def plan(self, num_owners: int, *, seed: int = 0, select: Select = None) -> list[list[PackUnit]]:
        """Deal whole units to ``num_owners`` owners (every DDP rank x DataLoader worker),
        balanced by group count; each unit to exactly one owner, identical on every process for
        the same ``seed``. Raises ValueError (the same on every owner) when an owner would get
        nothing or ``select`` keeps no group.
        """
        if isinstance(num_owners, bool) or not isinstance(num_owners, int) or num_owners < 1:
            raise ValueError(f"plan num_owners={num_owners!r}: expected a whole number >= 1")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"plan seed={seed!r}: expected an integer")
        units = self.selected(select)
        if not units:
            raise ValueError(f"plan: select={select!r} keeps no group of {self.location}")
        if len(units) < num_owners:
            raise ValueError(
                f"plan: {self.location} has {len(units)} pack unit(s) "
                f"({sum(len(u.groups) for u in units)} groups) for {num_owners} owners, so "
                f"owners {len(units)}..{num_owners - 1} would get nothing; use fewer owners "
                "(ranks x workers) or archive with a smaller --pack-bytes"
            )
        # Largest first, ties in a seeded order, each to the owner with the fewest groups so far
        # (then the lowest index): within one unit of an even share, and deterministic.
        ordered = sorted(units, key=lambda u: (-len(u.groups), seeded_key(seed, "plan", u.key)))
        heap = [(0, owner) for owner in range(num_owners)]
        plan: list[list[PackUnit]] = [[] for _ in range(num_owners)]
        for unit in ordered:
            count, owner = heapq.heappop(heap)
            plan[owner].append(unit)
            heapq.heappush(heap, (count + len(unit.groups), owner))
        return plan

    # -- single files ------------------------------------------------------------------------

    def read_files(
        self,
        store: Any,
        entries: Iterable[FileEntry | str],
        *,
        streams: int = 32,
        gap_bytes: int | None = None,
        max_range_bytes: int | None = None,
    ) -> dict[str, bytes]:
        """``{path: bytes}`` for scattered files (FileEntry records or paths): only their bytes,
        each pack opened once, neighbours in a pack sharing one range read, ``streams`` packs
        at a time, every file's SHA256 checked. An unknown path raises KeyError naming it."""
        from koochak.storage.store import open_store

        chosen = as_entries(self.files, entries)
        kwargs = {} if max_range_bytes is None else {"max_range_bytes": max_range_bytes}
        return _read_files(open_store(store), chosen, streams=streams, gap_bytes=gap_bytes, **kwargs)


def combine_plans(*plans: Sequence[Sequence[PackUnit]]) -> list[list[PackUnit]]:
    """Owner ``i`` of the result gets owner ``i``'s units of every plan: plans of disjoint
    selections, each balanced on its own, served by the same owners."""
    if not plans:
        raise ValueError("combine_plans: expected at least one plan")
    sizes = {len(p) for p in plans}
    if len(sizes) != 1:
        raise ValueError(f"combine_plans: plans have different owner counts {sorted(sizes)}")
    return [[u for p in plans for u in p[owner]] for owner in range(len(plans[0]))]
