"""Packed group streaming: plans, GroupStream, PackCache and read_files on real collections."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from koochak.data import _packed_fetch
from koochak.data.archive import archive_tree
from koochak.data.packed import GroupStream, PackCache, PackedGroups, PackUnit, combine_plans
from koochak.storage.store import LocalStore


class CountingStore:
    """A LocalStore that counts gets and opens per key and the bytes read; list() is forbidden."""

    def __init__(self, root: Path, corrupt: dict[str, int] | None = None) -> None:
        self.inner = LocalStore(root)
        self.location = self.inner.location
        self.gets: Counter[str] = Counter()
        self.opens: Counter[str] = Counter()
        self.bytes_read = 0
        self.reads = 0  # read() calls on opened handles
        self.corrupt = dict(corrupt or {})  # key -> number of corrupt answers still to give
        self._lock = threading.Lock()

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        data = self.inner.get(key, start, end)
        with self._lock:
            self.gets[key] += 1
            self.bytes_read += len(data)
            if self.corrupt.get(key):
                self.corrupt[key] -= 1
                data = bytes([data[0] ^ 1]) + data[1:]
        return data

    def open(self, key: str) -> Any:
        with self._lock:
            self.opens[key] += 1
        return _CountingReader(self, self.inner.open(key))

    def put(self, key: str, data: Any, **kw: Any) -> Any:
        return self.inner.put(key, data, **kw)

    def stat(self, key: str) -> Any:
        return self.inner.stat(key)

    def list(self, prefix: str = "") -> Any:
        raise AssertionError(f"list({prefix!r}) called: storage must never be listed")

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def local_path(self, key: str) -> str | None:
        return None


class _CountingReader:
    def __init__(self, store: CountingStore, handle: Any) -> None:
        self.store, self.handle = store, handle

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.handle.seek(offset, whence)

    def read(self, n: int = -1) -> bytes:
        data = self.handle.read(n)
        with self.store._lock:
            self.store.reads += 1
            self.store.bytes_read += len(data)
        return data

    def __enter__(self) -> _CountingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.close()


def _payload(name: str, size: int) -> bytes:
    seed = sum(name.encode())
    return bytes((seed + i * 7) % 251 for i in range(size))


@pytest.fixture(autouse=True)
def _no_retry_wait(monkeypatch) -> None:
    monkeypatch.setattr(_packed_fetch, "_RETRY_WAIT", 0.0)


@pytest.fixture
def coll(tmp_path) -> tuple[Path, dict[str, dict[str, bytes]]]:
    """24 groups of three files (one spills over two packs, one is a single object) in ~10 packs,
    files of a group scattered over directories so only the groups table keeps them together."""
    src = tmp_path / "src"
    groups: dict[str, dict[str, bytes]] = {}
    rows = ["path,group,order"]
    for g in range(24):
        name = f"rec{g:03d}"
        files = {}
        sizes = (300 + 37 * g, 150, 500) if g != 5 else (3000, 3000, 3000)
        for i, (kind, size) in enumerate(zip(("img", "meta", "label"), sizes)):
            path = f"{kind}/{name}.{kind}"
            files[path] = _payload(path, size)
            rows.append(f"{path},{name},{i}")
        groups[name] = files
    groups["big"] = {"blobs/big.bin": _payload("big", 30_000)}
    rows.append("blobs/big.bin,big,0")
    for files in groups.values():
        for path, data in files.items():
            (src / path).parent.mkdir(parents=True, exist_ok=True)
            (src / path).write_bytes(data)
    table = tmp_path / "groups.csv"
    table.write_text("\n".join(rows) + "\n")
    dest = tmp_path / "coll"
    archive_tree(src, dest, groups=table, pack_bytes=4096, object_bytes=20_000)
    return dest, groups


def _drain(stream: GroupStream, n: int) -> list:
    with stream:
        return [next(stream) for _ in range(n)]


# ----------------------------------------------------------------------------- load and plan


def test_load_reads_two_objects_and_never_lists(coll) -> None:
    dest, groups = coll
    store = CountingStore(dest)
    packed = PackedGroups.load(store)
    assert set(store.gets) == {"manifest.json", "files.jsonl.gz"} and not store.opens
    assert set(packed.groups) == set(groups)
    assert sorted(g for u in packed.units for g in u.groups) == sorted(groups)
    spilled = [u for u in packed.units if "rec005" in u.groups][0]
    assert len(spilled.packs) >= 2  # the spilled group's packs travel together
    assert [u for u in packed.units if u.groups == ("big",)][0].packs == ()


@pytest.mark.parametrize("owners", [1, 3, 7])
def test_plan_deals_every_unit_to_one_owner_balanced(coll, owners) -> None:
    packed = PackedGroups.load(coll[0])
    plan = packed.plan(owners, seed=4)
    assert plan == packed.plan(owners, seed=4)
    keys = [u.key for units in plan for u in units]
    assert sorted(keys) == sorted(u.key for u in packed.units)
    counts = [sum(len(u.groups) for u in units) for units in plan]
    biggest = max(len(u.groups) for u in packed.units)
    assert all(counts) and max(counts) - min(counts) <= biggest


def test_plan_raises_alike_when_an_owner_would_get_nothing(coll) -> None:
    packed = PackedGroups.load(coll[0])
    with pytest.raises(ValueError, match="would get nothing") as first:
        packed.plan(len(packed.units) + 1)
    with pytest.raises(ValueError) as second:
        packed.plan(len(packed.units) + 1)
    assert str(first.value) == str(second.value)
    with pytest.raises(ValueError, match="num_owners"):
        packed.plan(0)


def test_plans_for_disjoint_selections_combine(coll) -> None:
    packed = PackedGroups.load(coll[0])
    even = {f"rec{g:03d}" for g in range(0, 24, 2)}
    a = packed.plan(2, seed=1, select=even)
    b = packed.plan(2, seed=1, select=lambda name: name not in even)
    both = combine_plans(a, b)
    names = [g for units in both for u in units for g in u.groups]
    assert sorted(names) == sorted(packed.groups)
    for plan in (a, b):
        counts = [sum(len(u.groups) for u in units) for units in plan]
        assert max(counts) - min(counts) <= 3
    with pytest.raises(ValueError, match="not in"):
        packed.plan(2, select={"nope"})
    with pytest.raises(ValueError, match="keeps no group"):
        packed.plan(2, select=lambda name: False)
    with pytest.raises(ValueError, match="owner counts"):
        combine_plans(a, packed.plan(3))


# ----------------------------------------------------------------------------- streaming


def test_every_group_once_per_pass_across_owners_with_exact_bytes(coll) -> None:
    dest, groups = coll
    packed = PackedGroups.load(dest)
    plan = packed.plan(3, seed=0)
    for epoch_seed in (0, 1):
        seen = []
        for units in plan:
            per_pass = sum(len(u.groups) for u in units)
            stream = GroupStream(dest, packed, units, seed=epoch_seed, window=2, prefetch=1)
            got = _drain(stream, 2 * per_pass)
            first, second = got[:per_pass], got[per_pass:]
            assert sorted(g.name for g in first) == sorted(g.name for g in second)
            assert len({g.name for g in first}) == per_pass
            seen += first
        assert sorted(g.name for g in seen) == sorted(groups)
        for group in seen:
            assert group.files == groups[group.name]


def test_stream_is_deterministic_and_reshuffles_each_pass(coll) -> None:
    dest, _ = coll
    packed = PackedGroups.load(dest)
    units = packed.plan(1)[0]
    n = len(packed.groups)
    a = [g.name for g in _drain(GroupStream(dest, packed, units, seed=3), 3 * n)]
    b = [g.name for g in _drain(GroupStream(dest, packed, units, seed=3), 3 * n)]
    c = [g.name for g in _drain(GroupStream(dest, packed, units, seed=4), n)]
    assert a == b
    assert a[:n] != a[n : 2 * n] and a[:n] != c


def test_start_skips_groups_without_reading_skipped_packs(coll) -> None:
    dest, _ = coll
    packed = PackedGroups.load(dest)
    units = packed.plan(1)[0]
    n = len(packed.groups)
    full = [g.name for g in _drain(GroupStream(dest, packed, units, seed=9, window=2), 2 * n)]
    stream = GroupStream(dest, packed, units, seed=9, window=2)
    windows = stream.windows(0)
    skip_windows = len(windows) // 2
    start = sum(len(u.groups) for w in windows[:skip_windows] for u in w) + 1
    for s in (0, 1, start, n, n + 3):
        store = CountingStore(dest)
        resumed = GroupStream(store, packed, units, seed=9, window=2, prefetch=1, start=s)
        got = [g.name for g in _drain(resumed, 5)]
        assert got == full[s : s + 5]
    # Resume inside the window after `skip_windows` whole windows: their packs are never read.
    store = CountingStore(dest)
    resumed = GroupStream(store, packed, units, seed=9, window=2, prefetch=1, start=start)
    _drain(resumed, 1)
    skipped = {p.key for w in windows[:skip_windows] for u in w for p in u.packs}
    assert skipped and not skipped & set(store.gets)


def test_corrupt_pack_is_retried_then_raises_naming_it(coll) -> None:
    dest, groups = coll
    packed = PackedGroups.load(dest)
    units = [u for u in packed.units if u.packs][:1]
    key = units[0].packs[0].key
    store = CountingStore(dest, corrupt={key: 2})
    got = _drain(GroupStream(store, packed, units, retries=3), 1)
    # Two corrupt answers, then a good one (the thread may already be on the next pass).
    assert got[0].files == groups[got[0].name]
    assert store.corrupt[key] == 0 and store.gets[key] >= 3

    store = CountingStore(dest, corrupt={key: 100})
    stream = GroupStream(store, packed, units, retries=2)
    with pytest.raises(OSError, match=key) as info:
        next(stream)
    assert "SHA256" in str(info.value) and store.gets[key] == 3
    with pytest.raises(OSError):  # the stream stays failed
        next(stream)


def test_cache_hits_skip_fetches_across_passes(coll) -> None:
    dest, _ = coll
    packed = PackedGroups.load(dest)
    units = packed.plan(1)[0]
    n = len(packed.groups)
    cache = PackCache(1 << 20)
    store = CountingStore(dest)
    _drain(GroupStream(store, packed, units, cache=cache), 3 * n)
    pack_gets = {k: c for k, c in store.gets.items() if k.startswith("packs/")}
    assert pack_gets and set(pack_gets.values()) == {1}
    assert cache.hits >= len(pack_gets) and len(cache) == len(pack_gets)

    tiny = PackCache(5000)  # holds one pack at a time: LRU eviction keeps it under the bound
    _drain(GroupStream(dest, packed, units, cache=tiny), n)
    assert tiny.bytes <= 5000 and len(tiny) <= 1


def test_stream_arguments_are_checked(coll) -> None:
    dest, _ = coll
    packed = PackedGroups.load(dest)
    units = packed.plan(1)[0]
    for kwargs in ({"window": 0}, {"prefetch": 0}, {"retries": -1}, {"start": -1}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            GroupStream(dest, packed, units, **kwargs)
    with pytest.raises(ValueError, match="no units"):
        GroupStream(dest, packed, [])
    with pytest.raises(ValueError, match="ghost"):
        GroupStream(dest, packed, [PackUnit((), ("ghost",))])


# ----------------------------------------------------------------------------- read_files


def test_read_files_reads_only_requested_bytes_one_open_per_pack(coll) -> None:
    dest, groups = coll
    packed = PackedGroups.load(dest)
    wanted = [f"meta/rec{g:03d}.meta" for g in range(0, 24, 3)] + ["blobs/big.bin"]
    wanted.append("label/rec000.label")  # a neighbour of a file already wanted
    store = CountingStore(dest)
    got = packed.read_files(store, wanted, streams=4, gap_bytes=0)
    expect = {p: data for files in groups.values() for p, data in files.items() if p in wanted}
    assert got == expect
    assert store.bytes_read == sum(len(d) for d in expect.values())
    packs = {packed.files[p].pack for p in wanted} - {None}
    assert set(store.opens) == packs and set(store.opens.values()) == {1}
    assert store.gets == Counter({"objects/blobs/big.bin": 1})


def test_read_files_merges_neighbours_and_checks_sha(coll, tmp_path) -> None:
    dest, groups = coll
    packed = PackedGroups.load(dest)
    files = list(groups["rec001"])
    store = CountingStore(dest)
    got = packed.read_files(store, [packed.files[p] for p in files])
    # A group's files are neighbours: by default one open and one range read cover them.
    assert got == groups["rec001"] and sum(store.opens.values()) == 1 and store.reads == 1
    with pytest.raises(KeyError, match="missing.txt"):
        packed.read_files(dest, ["missing.txt"])
    # Damage one byte of a member inside its pack: the file's own SHA256 check catches it.
    entry = packed.files[files[0]]
    pack = dest / entry.pack
    data = bytearray(pack.read_bytes())
    data[entry.offset] ^= 1
    pack.chmod(0o644)
    pack.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=files[0]):
        packed.read_files(dest, [files[0]])


def test_pack_cache_is_a_bounded_lru() -> None:
    cache = PackCache(10)
    cache.put(("s", "a", "1"), b"aaaa")
    cache.put(("s", "b", "2"), b"bbbb")
    assert cache.get(("s", "a", "1")) == b"aaaa"  # a is now the most recent
    cache.put(("s", "c", "3"), b"cccc")  # evicts b, the least recently used
    assert cache.get(("s", "b", "2")) is None and cache.get(("s", "c", "3")) == b"cccc"
    cache.put(("s", "huge", "4"), b"x" * 11)  # larger than the cache: never held
    assert cache.get(("s", "huge", "4")) is None and cache.bytes == 8
    assert (cache.hits, cache.misses) == (2, 2)
    with pytest.raises(ValueError, match="max_bytes"):
        PackCache(-1)


def test_close_stops_the_background_thread(coll) -> None:
    dest, _ = coll
    packed = PackedGroups.load(dest)
    stream = GroupStream(dest, packed, packed.plan(1)[0], prefetch=1)
    next(stream)
    thread = stream._thread
    assert thread is not None and thread.is_alive()
    stream.close()
    assert not thread.is_alive()
    with pytest.raises(StopIteration):
        next(stream)


def test_a_dropped_stream_stops_its_thread(coll) -> None:
    import gc

    dest, _ = coll
    packed = PackedGroups.load(dest)
    stream = GroupStream(dest, packed, packed.plan(1)[0], prefetch=1)
    next(stream)
    thread = stream._thread
    del stream
    gc.collect()
    assert thread is not None
    thread.join(timeout=10)
    assert not thread.is_alive()
