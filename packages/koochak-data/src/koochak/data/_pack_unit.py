"""PackUnit: what a packed-groups plan deals out whole.

Its own module, below ``packed`` (which builds the units) and ``_packed_stream`` (which fetches
them), so neither of those imports the other back.
"""

from __future__ import annotations

from dataclasses import dataclass

from koochak.data.collection import PackInfo

__all__ = ["PackUnit"]


@dataclass(frozen=True)
class PackUnit:
    """What a plan deals out whole: packs that are read together (one pack, unless a group
    larger than a pack spills over several) and the names of the groups they hold, in storage
    order. A group made only of objects is a unit without packs."""

    packs: tuple[PackInfo, ...]
    groups: tuple[str, ...]

    @property
    def key(self) -> str:
        """A name for the unit: its first pack's key, or ``group:<name>`` for an object group."""
        return self.packs[0].key if self.packs else f"group:{self.groups[0]}"

    @property
    def bytes(self) -> int:
        return sum(p.size for p in self.packs)
