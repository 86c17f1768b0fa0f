#!/usr/bin/env python3
"""koochak-data packed-read benchmark: read_files of scattered small files vs one get per file.

Archives a tree of FILES small files (1-8 KiB, groups of GROUP files each, by directory) into a
collection, then reads PICK files chosen at random, each way from the same store in the same run:

  read_files   PackedGroups.read_files(store, entries, streams=S): each pack opened once,
               neighbours merged into one range read, every SHA256 checked
      vs get   one store.get(pack, offset, offset + size) per file on S threads (what reading the
               file table naively does), every SHA256 checked

Printed: requests (opens + gets) each way and their ratio, and the wall-time ratio (lower is
better) as the median of --repeat interleaved runs. The local disk answers an open in
microseconds; an object-storage mount takes a second or more and admits only a few per second.
--request-ms adds that cost to every open and get (a sleep), by default in a second pass at 5 ms
next to the bare disk, with at most --mount-slots such requests in flight at once (default 4:
a mount that admits only a few opens at a time; 0 for no limit).

    python tools/bench/packed_bench.py                                  # 20,000 files, 2,000 read
    python tools/bench/packed_bench.py --files 200000 --pick 20000      # a larger collection
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from koochak.data.archive import archive_tree
from koochak.data.collection import FileEntry
from koochak.data.packed import PackedGroups
from koochak.storage.store import LocalStore


class _SlowStore:
    """A LocalStore whose opens and gets cost ``request_s`` more and are counted."""

    def __init__(self, inner: LocalStore, request_s: float, slots: int) -> None:
        self.inner, self.request_s = inner, request_s
        self._slots = threading.BoundedSemaphore(slots) if slots and request_s else None
        self.location = inner.location
        self.requests = 0
        self._lock = threading.Lock()

    def _request(self) -> None:
        with self._lock:
            self.requests += 1
        if self._slots is not None:
            with self._slots:
                time.sleep(self.request_s)

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        self._request()
        return self.inner.get(key, start, end)

    def open(self, key: str) -> Any:
        self._request()
        return self.inner.open(key)

    def put(self, key: str, data: Any, **kw: Any) -> Any:
        return self.inner.put(key, data, **kw)

    def stat(self, key: str) -> Any:
        return self.inner.stat(key)

    def list(self, prefix: str = "") -> Any:
        raise RuntimeError("the benchmark never lists")

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def local_path(self, key: str) -> str | None:
        return None


def _generate(root: Path, files: int, group: int, seed: int) -> None:
    rnd = random.Random(seed)
    pool = os.urandom(64 << 10)
    for i in range(files):
        size = rnd.randint(1 << 10, 8 << 10)
        start = rnd.randint(0, len(pool) - size)
        path = root / f"rec{i // group:06d}" / f"part{i % group}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pool[start : start + size])


def _get_each(store: Any, entries: list[FileEntry], streams: int) -> dict[str, bytes]:
    def one(e: FileEntry) -> tuple[str, bytes]:
        assert e.offset is not None and e.pack is not None
        data = store.get(e.pack, e.offset, e.offset + e.size)
        if hashlib.sha256(data).hexdigest() != e.sha256:
            raise ValueError(f"{e.path}: SHA256 mismatch")
        return e.path, data

    with ThreadPoolExecutor(max_workers=streams) as pool:
        return dict(pool.map(one, entries))


def _measure(store: LocalStore, packed: PackedGroups, entries: list[FileEntry], *, streams: int,
             request_s: float, slots: int, repeat: int) -> dict[str, float]:  # fmt: skip
    times: dict[str, list[float]] = {"read_files": [], "get": []}
    requests: dict[str, int] = {}
    for _ in range(repeat):
        for name in ("read_files", "get"):
            slow = _SlowStore(store, request_s, slots)
            began = time.perf_counter()
            if name == "read_files":
                got = packed.read_files(slow, entries, streams=streams)
            else:
                got = _get_each(slow, entries, streams)
            times[name].append(time.perf_counter() - began)
            assert len(got) == len(entries)
            requests[name] = slow.requests
    fast, base = statistics.median(times["read_files"]), statistics.median(times["get"])
    return {
        "request_ms": request_s * 1000,
        "read_files_s": fast,
        "get_s": base,
        "time_ratio": fast / base,
        "read_files_requests": requests["read_files"],
        "get_requests": requests["get"],
        "request_ratio": requests["read_files"] / requests["get"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=20_000, help="files in the collection")
    parser.add_argument("--group", type=int, default=4, help="files per group (directory)")
    parser.add_argument("--pick", type=int, default=2_000, help="scattered files to read")
    parser.add_argument("--pack-bytes", type=int, default=4 << 20, help="archive pack size")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--request-ms", type=float, nargs="*", default=[0.0, 5.0],
                        help="extra cost per open/get, one pass per value (default: 0 5)")
    parser.add_argument("--mount-slots", type=int, default=4,
                        help="requests in flight at once when --request-ms > 0 (0: no limit)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print raw figures as JSON")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="koochak-packed-bench-") as scratch:
        src, dest = Path(scratch) / "src", Path(scratch) / "coll"
        _generate(src, args.files, args.group, args.seed)
        archive_tree(src, LocalStore(dest, fsync=False), pack_bytes=args.pack_bytes,
                     object_bytes=1 << 30, show_progress=False)  # fmt: skip
        store = LocalStore(dest)
        packed = PackedGroups.load(store)
        rnd = random.Random(args.seed + 1)
        entries = rnd.sample(sorted(packed.files.values(), key=lambda e: e.path),
                             min(args.pick, len(packed.files)))  # fmt: skip
        packs = len({e.pack for e in entries})
        rows = [
            _measure(store, packed, entries, streams=args.streams, request_s=ms / 1000,
                     slots=args.mount_slots, repeat=args.repeat)  # fmt: skip
            for ms in args.request_ms
        ]
    if args.json:
        print(json.dumps({"files": args.files, "pick": len(entries), "packs": packs, "rows": rows},
                         indent=1))  # fmt: skip
        return
    print(f"{len(entries)} scattered files of {args.files} ({len(packed.collection.manifest.packs)} "
          f"packs, {packs} touched), streams={args.streams}, mount slots={args.mount_slots}, "
          f"median of {args.repeat}")  # fmt: skip
    print(f"{'per-request cost':>16} | {'requests (read_files / get)':>28} | {'time ratio':>10}")
    for r in rows:
        print(f"{r['request_ms']:>13.1f} ms | {r['read_files_requests']:>9} / {r['get_requests']:<6}"
              f" = {r['request_ratio']:5.3f}x | {r['time_ratio']:9.3f}x"
              f"   ({r['read_files_s']:.3f} s vs {r['get_s']:.3f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
