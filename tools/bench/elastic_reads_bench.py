#!/usr/bin/env python3
"""Per-rank bytes read per epoch: the exact elastic cursor (ElasticBatches over ShardRecords in
shard order) against ShardDataset (a shard deal per rank, no cross-world-size cursor).

Writes a dataset of ``--size`` bytes in ``--shard-bytes`` shards with ShardWriter, then for each
world size W in ``--worlds`` plays every rank of one epoch, rank after rank in this process, and
counts the bytes each rank reads (``rchar`` of /proc/self/io around the rank's epoch: every byte
read through a system call, SHA256-verified reads included). Rows:

  ShardDataset          each rank reads the shards plan_shards deals it: the D/W baseline
  ElasticBatches main   main's own elastic.py (``git show main:...``), when git has it: every
                        rank takes a slice of every global batch, so it reads every shard
  ElasticBatches        this tree's, without lanes (the same order as main)
  ElasticBatches lanes  this tree's with ``lanes=--lanes``: rank r reads its 1/W of the epoch

Figures are MB per rank (the largest rank) and that as a multiple of D/W, beside the issue's
bound (1.5 x D/W + two shards). Counters, not times: the numbers do not depend on the machine.

    python tools/bench/elastic_reads_bench.py                 # 16 MiB in 256 KiB shards, W 1-8
    python tools/bench/elastic_reads_bench.py --size 64M --shard-bytes 1M --worlds 1 2 4 8 16
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ELASTIC = "packages/koochak-loop/src/koochak/loop/elastic.py"


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def write_dataset(root: str, size: int, shard_bytes: int, record_bytes: int) -> Any:
    from koochak.data.shards import ShardWriter, load_index
    from koochak.storage.store import LocalStore

    store = LocalStore(root)
    with ShardWriter(store, "ds", target_bytes=shard_bytes) as writer:
        for i in range(size // (record_bytes + 512)):
            writer.write({"__key__": f"r{i:08d}", "bin": os.urandom(record_bytes)})
    return store, load_index(store, "ds")


def main_elastic() -> Any:
    """main's ElasticBatches, loaded from ``git show main:...`` (None without git or main)."""
    try:
        source = subprocess.run(["git", "show", f"main:{ELASTIC}"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    path = os.path.join(tempfile.mkdtemp(prefix="elastic-main-"), "elastic_main.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("elastic_main", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.ElasticBatches


def epoch_reads(read_rank: Callable[[int, int], None], world: int) -> list[int]:
    """Bytes each rank reads in one epoch."""
    reads = []
    for rank in range(world):
        before = rchar()
        read_rank(rank, world)
        reads.append(rchar() - before)
    return reads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="16M", help="dataset bytes (default 16M)")
    parser.add_argument("--shard-bytes", default="256K", help="shard target (default 256K)")
    parser.add_argument("--record-bytes", type=int, default=3584)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--lanes", type=int, default=8)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = parser.parse_args()

    from koochak.data.records import ShardRecords
    from koochak.data.shards import ShardDataset
    from koochak.loop.elastic import ElasticBatches

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="elastic-reads-") as root:
        store, index = write_dataset(root, _size(args.size), _size(args.shard_bytes),
                                     args.record_bytes)  # fmt: skip
        records_total, data_bytes = index.records, index.size
        shard = max(s.size for s in index.shards)
        batches = records_total // args.global_batch  # one epoch (the remainder goes unread)

        def elastic(cls: Any, **settings: Any) -> Callable[[int, int], None]:
            def read(rank: int, world: int) -> None:
                lanes = settings.get("lanes", 1)
                records = ShardRecords(store, "ds", cached_shards=2 * max(1, lanes // world) + 1)
                data = cls(records, global_batch=args.global_batch, collate=len, rank=rank,
                           world_size=world, order=records.shard_order(seed=1), **settings)  # fmt: skip
                for _ in itertools.islice(iter(data), batches):
                    pass

            return read

        def shard_dataset(rank: int, world: int) -> None:
            for _ in ShardDataset(store, "ds", rank=rank, world_size=world, seed=1):
                pass

        rows: list[tuple[str, Callable[[int, int], None]]] = [("ShardDataset", shard_dataset)]
        before = main_elastic()
        if before is not None:
            rows.append(("ElasticBatches main", elastic(before)))
        rows.append(("ElasticBatches", elastic(ElasticBatches)))
        rows.append(
            (f"ElasticBatches lanes={args.lanes}", elastic(ElasticBatches, lanes=args.lanes))
        )

        print(f"dataset: {data_bytes / 1e6:.1f} MB in {len(index.shards)} shards of <= "
              f"{shard / 1e6:.2f} MB, {records_total} records; global batch {args.global_batch}; "
              "one epoch per rank; MB read by the busiest rank (x D/W)")  # fmt: skip
        header = f"{'':28}" + "".join(f"{'W=' + str(w):>18}" for w in args.worlds)
        print(header)
        for name, read in rows:
            cells = []
            for world in args.worlds:
                if args.global_batch % world:
                    cells.append(f"{'-':>18}")
                    continue
                most = max(epoch_reads(read, world))
                cells.append(f"{most / 1e6:>9.2f} ({most / (data_bytes / world):4.2f}x)")
            print(f"{name:28}" + "".join(cells))
        bound = "".join(
            f"{(1.5 * data_bytes / w + 2 * shard) / 1e6:>9.2f} ({(1.5 + 2 * shard * w / data_bytes):4.2f}x)"
            for w in args.worlds
        )
        print(f"{'bound 1.5 D/W + 2 shards':28}" + bound)


if __name__ == "__main__":
    sys.exit(main())
