"""GroupStream: an owner's packs, fetched whole in a background thread, verified, and yielded as
groups shuffled within windows of packs, pass after pass."""

from __future__ import annotations

import hashlib
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from koochak.data._pack_unit import PackUnit
from koochak.data._packed_fetch import PackCache, fetch_object, fetch_pack
from koochak.data.collection import FileEntry

__all__ = ["Group", "GroupStream", "seeded_key"]

# How often a blocked producer looks whether the stream was closed.
_POLL_SECONDS = 0.1


class _GroupsOf(Protocol):
    """What a stream needs of ``koochak.data.packed.PackedGroups``: each group's files in storage
    order, and where they live (for messages)."""

    groups: dict[str, tuple[FileEntry, ...]]
    location: str


@dataclass(frozen=True)
class Group:
    """One group: its name and its files' bytes by original path."""

    name: str
    files: dict[str, bytes]


def seeded_key(seed: int, *parts: object) -> bytes:
    """A sort key that is the same on every process and Python version (no hash randomization)."""
    text = "\x1f".join(str(p) for p in (seed, *parts))
    return hashlib.sha256(text.encode("utf-8")).digest()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Window:
    """Sent after a window's last unit: the window's group order and how many to skip."""

    def __init__(self, names: list[str], skip: int) -> None:
        self.names = names
        self.skip = skip


def _whole(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"GroupStream {name}={value!r}: expected a whole number >= {minimum}")
    return value


class GroupStream:
    """Endless iterator of :class:`Group` over the units of one owner's plan.

    Each pass puts the units in a new seeded order and cuts it into windows of ``window`` units;
    a window's groups come out in a seeded shuffle once all its packs are in. A background
    thread fetches each pack with one ``store.get``, checks its size and SHA256 against the
    manifest (retrying a failed or corrupt fetch ``retries`` times, then raising OSError naming
    the pack) and stays up to ``prefetch`` units ahead. ``cache`` (a shared :class:`PackCache`)
    keeps verified packs across passes. ``start=n`` begins at the n-th group of this sequence
    without fetching the packs of windows it skips whole. Files stored as objects are read with
    one ``get`` each and checked the same way. ``close()`` (or leaving a ``with`` block) stops
    the thread.
    """

    def __init__(
        self,
        store: Any,
        packed: _GroupsOf,
        units: Sequence[PackUnit],
        *,
        seed: int = 0,
        window: int = 2,
        prefetch: int = 2,
        cache: PackCache | None = None,
        retries: int = 3,
        start: int = 0,
    ) -> None:
        from koochak.storage.store import open_store

        self.store = open_store(store)
        self.packed = packed
        self.units = tuple(units)
        if not self.units:
            raise ValueError("GroupStream: no units to stream (an empty plan entry)")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"GroupStream seed={seed!r}: expected an integer")
        self.seed = seed
        self.window = _whole("window", window, 1)
        self.prefetch = _whole("prefetch", prefetch, 1)
        self.retries = _whole("retries", retries, 0)
        self.start = _whole("start", start, 0)
        if cache is not None and not isinstance(cache, PackCache):
            raise TypeError(f"GroupStream cache: expected a PackCache, got {type(cache).__name__}")
        self.cache = cache
        for unit in self.units:
            for name in unit.groups:
                if name not in packed.groups:
                    raise ValueError(f"GroupStream: group {name!r} is not in {packed.location}")
        self.groups_per_pass = sum(len(u.groups) for u in self.units)
        # The thread holds the feed, never the stream, so a stream dropped without close()
        # is collected and its __del__ stops the thread.
        self._feed = _Feed(self)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=self.prefetch)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready: list[Group] = []
        self._error: BaseException | None = None

    def windows(self, pass_index: int) -> list[list[PackUnit]]:
        """Pass ``pass_index``'s units in their seeded order, cut into windows."""
        return self._feed.windows(pass_index)

    # -- iteration ---------------------------------------------------------------------------

    def __iter__(self) -> GroupStream:
        return self

    def __next__(self) -> Group:
        if self._error is not None:
            raise self._error
        if self._stop.is_set():
            raise StopIteration
        if self._thread is None:
            self._thread = threading.Thread(target=self._feed.produce, args=(self._queue, self._stop),
                                            name="koochak-group-stream", daemon=True)  # fmt: skip
            self._thread.start()
        while not self._ready:
            loaded: dict[str, Group] = {}
            while True:
                item = self._queue.get()
                if isinstance(item, _Failed):
                    self._error = item.error
                    self.close()
                    raise item.error
                if isinstance(item, _Window):
                    break
                loaded.update(item)
            self._ready = [loaded[n] for n in item.names[item.skip :]]
            self._ready.reverse()  # pop() from the end
        return self._ready.pop()

    def close(self) -> None:
        """Stop the background thread; the stream yields nothing more."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5 * _POLL_SECONDS + 1)

    def __enter__(self) -> GroupStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)  # absent when __init__ raised
        if stop is not None:
            stop.set()


class _Feed:
    """The stream's schedule and loading, run by its background thread."""

    def __init__(self, stream: GroupStream) -> None:
        self.store, self.packed, self.units = stream.store, stream.packed, stream.units
        self.seed, self.window, self.start = stream.seed, stream.window, stream.start
        self.retries, self.cache = stream.retries, stream.cache
        self.groups_per_pass = stream.groups_per_pass

    # -- the schedule (pure; the same on every process) --------------------------------------

    def windows(self, pass_index: int) -> list[list[PackUnit]]:
        """Pass ``pass_index``'s units in their seeded order, cut into windows."""
        order = sorted(range(len(self.units)),
                       key=lambda i: (seeded_key(self.seed, "pass", pass_index, self.units[i].key), i))  # fmt: skip
        units = [self.units[i] for i in order]
        return [units[i : i + self.window] for i in range(0, len(units), self.window)]

    def window_order(self, pass_index: int, window_index: int, units: Sequence[PackUnit]) -> list[str]:
        """The order in which a window's groups are yielded."""
        names = [g for u in units for g in u.groups]
        return sorted(names, key=lambda g: seeded_key(self.seed, "window", pass_index, window_index, g))

    def _schedule(self) -> Iterator[tuple[int, int, list[PackUnit], int]]:
        """(pass, window index, units, groups to skip) from ``start`` on, endlessly."""
        pass_index, skip = divmod(self.start, self.groups_per_pass)
        while True:
            for w, units in enumerate(self.windows(pass_index)):
                count = sum(len(u.groups) for u in units)
                if skip >= count:  # skipped whole: its packs are never fetched
                    skip -= count
                    continue
                yield pass_index, w, units, skip
                skip = 0
            pass_index += 1

    # -- the background thread ---------------------------------------------------------------

    def _load(self, unit: PackUnit) -> dict[str, Group]:
        packs = {
            p.key: memoryview(fetch_pack(self.store, p, retries=self.retries, cache=self.cache))
            for p in unit.packs
        }
        loaded: dict[str, Group] = {}
        for name in unit.groups:
            files: dict[str, bytes] = {}
            for e in self.packed.groups[name]:
                if e.pack is None:
                    files[e.path] = fetch_object(self.store, e, retries=self.retries)
                else:
                    assert e.offset is not None
                    files[e.path] = bytes(packs[e.pack][e.offset : e.offset + e.size])
            loaded[name] = Group(name, files)
        return loaded

    def produce(self, out: queue.Queue[Any], stop: threading.Event) -> None:
        def send(item: Any) -> bool:
            while not stop.is_set():
                try:
                    out.put(item, timeout=_POLL_SECONDS)
                    return True
                except queue.Full:
                    continue
            return False

        try:
            for p, w, units, skip in self._schedule():
                for unit in units:
                    if stop.is_set() or not send(self._load(unit)):
                        return
                if not send(_Window(self.window_order(p, w, units), skip)):
                    return
        except BaseException as exc:  # handed to the consumer, raised from __next__
            send(_Failed(exc))
