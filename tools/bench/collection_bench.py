#!/usr/bin/env python3
"""koochak-data collection benchmark: archive, pull and verify against tar and sha256sum.

Generates one tree (FILES files of 1-64 KiB in directories of 100, plus BIG_COUNT files of BIG
bytes) in a scratch directory, then times, each pair in the same run on the same disk:

  archive         koochak.data.archive into a LocalStore (every file hashed, packs fsynced)
      vs tar -cf + fsync    GNU tar writing one archive, then fsync of that archive
  archive-nofsync the same into LocalStore(fsync=False)
      vs tar -cf            plain tar (nothing made durable)
  pull            koochak.data.pull of every file (every SHA256 checked, mode + mtime_ns set)
      vs tar -xf            extracting the tar written above
  verify --deep   every byte of the collection read, pack and file SHA256s checked
      vs sha256sum          of every source file (find | xargs sha256sum)

Targets: archive and pull <= 1.5x tar. Figures are wall-time ratios (lower is better) from the
median of --repeat runs; every run starts from a warm page cache, which favours the baselines
least (koochak-data's extra work is hashing, not I/O). The "cpu ratio" column compares CPU
seconds (all threads and child processes): it is what the work costs, and unlike wall time it
barely moves when other processes share the machine.

    python tools/bench/collection_bench.py                              # 2,000 files + 2 x 8 MiB
    python tools/bench/collection_bench.py --files 20000 --big 64M      # the issue's size
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from koochak.data.archive import archive_tree
from koochak.data.pull import pull_collection
from koochak.data.verify import verify_collection
from koochak.storage.profile import parse_size
from koochak.storage.store import LocalStore


def _generate(
    root: Path, files: int, big: int, big_count: int, seed: int, max_size: int = 64 << 10
) -> int:
    rnd = random.Random(seed)
    pool = os.urandom(128 << 10)  # slices of one random block: incompressible and cheap to make
    total = 0
    for i in range(files):
        size = rnd.randint(min(1 << 10, max_size), max_size)
        start = rnd.randint(0, len(pool) - size)
        path = root / f"dir{i // 100:04d}" / f"file{i:06d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pool[start : start + size])
        total += size
    for i in range(big_count):
        path = root / "big" / f"blob{i}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as handle:
            left = big
            while left:
                piece = min(left, len(pool))
                handle.write(pool[:piece] if i == 0 else os.urandom(piece))
                left -= piece
        total += big
    os.sync()
    return total


def _cpu() -> float:
    """CPU seconds used so far by this process (all threads) and its finished children."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN
    )
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


_CPU: dict[int, float] = {}


def _timed(setup: Callable[[], None], run: Callable[[], object]) -> float:
    """Wall seconds of ``run``; its CPU seconds (threads and children included) go to _CPU[0]."""
    setup()
    cpu = _cpu()
    start = time.perf_counter()
    run()
    wall = time.perf_counter() - start
    _CPU[0] = _cpu() - cpu
    return wall


def _sha256_rate() -> float:
    """Bytes per second hashlib.sha256 manages on this core (best of 3 over 64 MiB)."""
    data = os.urandom(64 << 20)
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        hashlib.sha256(data).digest()
        best = min(best, time.process_time() - start)
    return len(data) / max(best, 1e-9)


def _clear(*paths: Path) -> Callable[[], None]:
    def clear() -> None:
        for path in paths:
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        os.sync()  # dirty pages of the previous run must not be flushed on this run's clock

    return clear


def _tar_create(src: Path, out: Path, fsync: bool) -> None:
    subprocess.run(["tar", "-cf", str(out), "-C", str(src), "."], check=True)
    if fsync:
        fd = os.open(out, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int,
                        default=int(os.environ.get("KOOCHAK_BENCH_COLLECTION_FILES", 2000)))
    parser.add_argument("--big", default=os.environ.get("KOOCHAK_BENCH_COLLECTION_BIG", "8M"),
                        help="size of each big file (default 8M; the issue uses 64M)")
    parser.add_argument("--big-count", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args(argv)
    big = parse_size(args.big)

    scratch = Path(tempfile.mkdtemp(prefix="koochak-collection-bench-", dir=args.dir))
    try:
        src = scratch / "src"
        total = _generate(src, args.files, big, args.big_count, seed=0)
        print(f"tree: {args.files} files of 1-64 KiB + {args.big_count} x {big >> 20} MiB = "
              f"{total / 2**20:.1f} MiB in {scratch}", flush=True)
        tar_file, untar = scratch / "tree.tar", scratch / "untar"
        coll, coll_nofsync, pulled = scratch / "coll", scratch / "coll-nofsync", scratch / "pulled"
        times: dict[str, list[float]] = {}

        cpu: dict[str, list[float]] = {}

        def record(name: str, seconds: float) -> None:
            times.setdefault(name, []).append(seconds)
            cpu.setdefault(name, []).append(_CPU[0])

        for _ in range(args.repeat):
            # Interleaved, so a noisy neighbour slows both sides of a pair alike.
            record("tar -cf + fsync", _timed(_clear(tar_file), lambda: _tar_create(src, tar_file, True)))
            record("archive", _timed(_clear(coll), lambda: archive_tree(src, coll, show_progress=False)))
            record("tar -cf", _timed(_clear(tar_file), lambda: _tar_create(src, tar_file, False)))
            record("archive (fsync=False)", _timed(
                _clear(coll_nofsync),
                lambda: archive_tree(src, LocalStore(coll_nofsync, fsync=False), show_progress=False),
            ))

            def untar_setup() -> None:
                _clear(untar)()
                untar.mkdir()

            record("tar -xf", _timed(untar_setup, lambda: subprocess.run(
                ["tar", "-xf", str(tar_file), "-C", str(untar)], check=True)))
            record("pull", _timed(_clear(pulled), lambda: pull_collection(coll, pulled, show_progress=False)))
            record("sha256sum", _timed(lambda: None, lambda: subprocess.run(
                f"find {src} -type f -print0 | xargs -0 sha256sum > /dev/null",
                shell=True, check=True)))
            record("verify --deep", _timed(
                lambda: None, lambda: verify_collection(coll, deep=True, show_progress=False)
            ))
        medians = {name: statistics.median(values) for name, values in times.items()}
        cpu_medians = {name: statistics.median(values) for name, values in cpu.items()}
        pairs = [
            ("archive", "tar -cf + fsync", 1.5),
            ("archive (fsync=False)", "tar -cf", 1.5),
            ("pull", "tar -xf", 1.5),
            ("verify --deep", "sha256sum", None),
        ]
        print(f"{'measured':<24}{'seconds':>9}  {'baseline':<18}{'seconds':>9}  {'ratio':>6}  "
              f"{'target':<15}{'cpu ratio':>9}")
        results = []
        for name, base, target in pairs:
            ratio = medians[name] / medians[base]
            cpu_ratio = cpu_medians[name] / max(cpu_medians[base], 1e-9)
            verdict = "-" if target is None else ("ok" if ratio <= target else "MISSED")
            goal = "" if target is None else f"<= {target}x "
            print(f"{name:<24}{medians[name]:>9.3f}  {base:<18}{medians[base]:>9.3f}  "
                  f"{ratio:>5.2f}x  {goal + verdict:<15}{cpu_ratio:>8.2f}x")
            results.append({"measured": name, "baseline": base, "seconds": medians[name],
                            "baseline_seconds": medians[base], "ratio": ratio, "target": target,
                            "cpu_seconds": cpu_medians[name],
                            "baseline_cpu_seconds": cpu_medians[base], "cpu_ratio": cpu_ratio})
        # The format needs every archived byte hashed twice (file digests for files.jsonl.gz,
        # pack and object digests for the manifest). On one core that alone costs:
        hash_seconds = 2 * total / _sha256_rate()
        floor = cpu_medians["tar -cf"] + hash_seconds
        print(f"one-core floor for archive: tar -cf's CPU {cpu_medians['tar -cf']:.3f} s + two "
              f"SHA256 passes {hash_seconds:.3f} s = {floor:.3f} s, "
              f"{floor / medians['tar -cf']:.2f}x tar -cf without free cores to overlap them")
        if args.json:
            print(json.dumps({"files": args.files, "big": big, "big_count": args.big_count,
                              "bytes": total, "results": results,
                              "archive_one_core_floor_seconds": floor}, indent=1))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
