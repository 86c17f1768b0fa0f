#!/usr/bin/env python3
"""koochak-data shard benchmark: verified shard reads against a raw sequential read.

Builds a dataset of SIZE bytes (records of 1-64 KiB random bytes by default, as in the issue's
benchmark tree; --record-bytes to change; ~SHARD_BYTES shards) with
ShardWriter in a scratch directory, then reads every shard, variants interleaved:

  raw         each shard file read whole with open().read(), one after another (the baseline)
  sha256      hashlib.sha256 of the same bytes already in memory: what the hash alone costs
              (no reader that checks SHA256 on one core can beat it)
  raw_sha256  raw, then hashlib.sha256 of each file: checking by hand, THE FLOOR the goals are
              stated against (a verified read on one core)
  verified    read_shard(verify=True) shard after shard: size + SHA256 checked (hashing overlaps
              the read), tar parsed, every sample cut out before the first is handed over
                                          goal >= 0.9x the floor's throughput, <= 1.3x its CPU
  stream      read_shards(verify=True, prefetch=0): the same on one thread, reusing the buffers
              of shards whose samples are gone (no fresh memory to page-fault per shard)
  prefetch    read_shards(verify=True, prefetch=P): P shards read and verified ahead in
              background threads, hashing on P cores             goal >= 1.5x the floor (P=2)
  unverified  read_shard(verify=False): no SHA256, to show what hashing costs
  webdataset  the webdataset library's own tar reader over the same shard files (no
              verification; `webdataset` is in the root pyproject's bench group)

Two cache states: "cold" evicts the shard files from the page cache before every run
(posix_fadvise DONTNEED, no root needed; --drop-caches drops the whole cache through
/proc/sys/vm/drop_caches instead, as root), so bytes come from the disk as they would from a
parallel filesystem or object store; "warm" reads them from memory, the hardest case for
hashing to hide behind I/O. Figures are throughput ratios against raw and against the floor
(raw_sha256) in the same cache state (higher is better), medians of --repeat runs. CPU s/GiB
(all threads) shows the cost apart from contention on a shared machine.

    python tools/bench/shards_bench.py                     # 256 MiB in 32 MiB shards: ~1 minute
    python tools/bench/shards_bench.py --size 4G --shard-bytes 256M   # larger
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from koochak.data.shards import ShardIndex, ShardWriter, read_shard, read_shards
from koochak.storage.profile import parse_size
from koochak.storage.store import LocalStore


def _build(
    store: LocalStore, size: int, shard_bytes: int, record_bytes: tuple[int, int], seed: int
) -> ShardIndex:
    rnd = random.Random(seed)
    # Slices of one random block: incompressible, cheap to make.
    pool = os.urandom(record_bytes[1])
    written = 0
    with ShardWriter(store, "bench", target_bytes=shard_bytes) as writer:
        i = 0
        while written < size:
            n = rnd.randint(*record_bytes)
            writer.write({"__key__": f"r{i:08d}", "bin": pool[:n], "cls": str(i % 10).encode()})
            written += n
            i += 1
    return writer.close()


def _raw(paths: list[str]) -> int:
    total = 0
    for path in paths:
        with open(path, "rb") as f:
            total += len(f.read())
    return total


def _raw_sha256(paths: list[str]) -> int:
    total = 0
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        hashlib.sha256(data).hexdigest()
        total += len(data)
    return total


def _sha256_only(paths: list[str]) -> Callable[[], int]:
    blobs = [Path(path).read_bytes() for path in paths]  # read once, outside the timer

    def run() -> int:
        for blob in blobs:
            hashlib.sha256(blob).hexdigest()
        return sum(len(blob) for blob in blobs)

    return run


def _webdataset(paths: list[str]) -> int:
    try:
        import webdataset as wds
    except ImportError:
        return -1
    return sum(len(s["bin"]) for s in wds.WebDataset(paths, shardshuffle=False))


def _shards(store: LocalStore, index: ShardIndex, verify: bool) -> int:
    total = 0
    for shard in index.shards:
        for sample in read_shard(store, index, shard, verify=verify):
            total += len(sample["bin"])
    return total


def _prefetched(store: LocalStore, index: ShardIndex, prefetch: int) -> int:
    return sum(len(s["bin"]) for s in read_shards(store, index, verify=True, prefetch=prefetch))


def _evict(paths: list[str], drop_caches: bool = False) -> None:
    if drop_caches:
        # The whole page cache, as root: what a fresh node sees. (posix_fadvise below already
        # leaves none of the shard files' pages resident, as `fincore` confirms on Linux.)
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as control:
            control.write("1\n")
        return
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="256M", help="dataset bytes (default 256M)")
    parser.add_argument("--shard-bytes", default="32M", help="target shard size (default 32M)")
    parser.add_argument(
        "--record-bytes", default="1K-64K", help="record size range MIN-MAX (default 1K-64K)"
    )
    parser.add_argument("--repeat", type=int, default=5, help="runs per variant (default 5)")
    parser.add_argument("--prefetch", type=int, default=2, help="read_shards prefetch (default 2)")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument(
        "--drop-caches",
        action="store_true",
        help="cold runs drop the whole page cache (root; affects every process on the machine) "
        "instead of evicting only the shard files",
    )
    args = parser.parse_args(argv)
    size, shard_bytes = parse_size(args.size), parse_size(args.shard_bytes)
    low, _, high = args.record_bytes.partition("-")
    record_bytes = (parse_size(low), parse_size(high or low))
    if not 0 < record_bytes[0] <= record_bytes[1]:
        parser.error(
            f"--record-bytes must be MIN-MAX with 0 < MIN <= MAX, got {args.record_bytes!r}"
        )

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="koochak-shards-bench-") as scratch:
        store = LocalStore(Path(scratch) / "store", fsync=False)
        started = time.perf_counter()
        index = _build(store, size, shard_bytes, record_bytes, seed=0)
        build_seconds = time.perf_counter() - started
        paths = [store.local_path(index.key_of(s)) for s in index.shards]

        variants: dict[str, Callable[[], int]] = {
            "raw": lambda: _raw(paths),
            "sha256": _sha256_only(paths),
            "raw_sha256": lambda: _raw_sha256(paths),
            "verified": lambda: _shards(store, index, verify=True),
            "stream": lambda: _prefetched(store, index, 0),
            "prefetch": lambda: _prefetched(store, index, args.prefetch),
            "unverified": lambda: _shards(store, index, verify=False),
        }
        try:
            import webdataset  # noqa: F401

            variants["webdataset"] = lambda: _webdataset(paths)
        except ImportError:
            print("webdataset is not installed (uv sync --group bench): its row is left out")
        times = {(cache, name): [] for cache in ("cold", "warm") for name in variants}
        cpu_times = {key: [] for key in times}  # all threads of this process
        for _ in range(args.repeat):
            for cache in ("cold", "warm"):
                for name, run in variants.items():
                    if cache == "cold":
                        _evict(paths, args.drop_caches)
                    else:
                        _raw(paths)
                    start, cpu = time.perf_counter(), time.process_time()
                    run()
                    times[cache, name].append(time.perf_counter() - start)
                    cpu_times[cache, name].append(time.process_time() - cpu)

    median = {key: statistics.median(values) for key, values in times.items()}
    figures: dict[str, object] = {
        "dataset_bytes": index.size,
        "shards": len(index.shards),
        "records": index.records,
        "prefetch": args.prefetch,
        "build_seconds": round(build_seconds, 3),
        "goal_verified_vs_floor": 0.9,
        "goal_verified_cpu_vs_floor": 1.3,
        "goal_prefetch_vs_floor": 1.5,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    for (cache, name), seconds in sorted(median.items()):
        figures[f"{cache}_{name}_gib_per_s"] = round(index.size / seconds / 2**30, 3)
        cpu = statistics.median(cpu_times[cache, name])
        figures[f"{cache}_{name}_cpu_s_per_gib"] = round(cpu / (index.size / 2**30), 3)
        if name != "raw":
            figures[f"{cache}_{name}_vs_raw"] = round(median[cache, "raw"] / seconds, 3)
        floor_cpu = statistics.median(cpu_times[cache, "raw_sha256"])
        figures[f"{cache}_{name}_vs_floor"] = round(median[cache, "raw_sha256"] / seconds, 3)
        figures[f"{cache}_{name}_cpu_vs_floor"] = round(cpu / floor_cpu, 3)
    if args.json:
        print(json.dumps(figures, indent=1))
        return 0
    print(
        f"dataset: {index.size / 2**20:.0f} MiB in {len(index.shards)} shards, "
        f"{index.records} records of {args.record_bytes} (built in {build_seconds:.1f} s); "
        f"medians of {args.repeat} runs; load average "
        + ", ".join(f"{x:.1f}" for x in os.getloadavg())
    )
    labels = {
        "raw": "raw sequential read",
        "sha256": "hashlib alone (in memory)",
        "raw_sha256": "FLOOR: raw read + hashlib",
        "verified": "read_shard verify=True",
        "stream": "read_shards prefetch=0",
        "prefetch": f"read_shards prefetch={args.prefetch}",
        "unverified": "read_shard verify=False",
        "webdataset": "webdataset (no verify)",
    }
    goals = {
        "verified": (0.9, 1.3),
        "stream": (0.9, 1.3),
        "prefetch": (1.5 if args.prefetch == 2 else None, None),
    }
    for cache in ("cold", "warm"):
        print(
            f"{cache} page cache:            throughput    CPU      vs raw   vs floor  CPU vs floor"
        )
        for name, label in labels.items():
            if (cache, name) not in median:
                continue
            rate = figures[f"{cache}_{name}_gib_per_s"]
            ratio = "    1.00x" if name == "raw" else f"{figures[f'{cache}_{name}_vs_raw']:8.2f}x"
            cpu = figures[f"{cache}_{name}_cpu_s_per_gib"]
            floor = figures[f"{cache}_{name}_vs_floor"]
            cpu_floor = figures[f"{cache}_{name}_cpu_vs_floor"]
            goal_rate, goal_cpu = goals.get(name, (None, None))
            verdict = ""
            if goal_rate is not None:
                verdict = f"  goal >= {goal_rate}x {'ok' if floor >= goal_rate else 'MISSED'}"
            if goal_cpu is not None:
                verdict += f", CPU <= {goal_cpu}x {'ok' if cpu_floor <= goal_cpu else 'MISSED'}"
            print(
                f"  {label:<26} {rate:6.2f} GiB/s {cpu:5.2f} s/GiB {ratio} {floor:8.2f}x"
                f" {cpu_floor:8.2f}x{verdict}"
            )
    print(
        "floors: a verified read cannot beat 'hashlib alone' on one core; with P shards hashed"
        " on P free cores, about P times that"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
