#!/usr/bin/env python3
"""Koochak on object-storage mounts against the tools people use there, in one run per mount.

On each FUSE mount of tools/local_s3.sh (s3fs, rclone mount; start them first), with the
LocalStore settings `koochak-probe --peer` recommends for it (docs/storage.md):

* copy_objects up (local -> mount) against `cp -r` + `sync -f`, and down (mount -> local)
  against `cp -r` from the mount + `sync -f`; goal >= 0.9x the baseline's throughput on s3fs;
* `read_shards(verify=True)` of a ShardWriter dataset on the mount against `sha256sum` of the
  same shard files;
* `archive` of a tree into a collection on the mount, and `pull` of it back, against `rclone
  copy` of the same tree to and from the bucket (rclone's own S3 client, no mount).

Every pair runs interleaved (A B A B ...), each on fresh target names, and the figure is the
median of --repeat runs; ratios are baseline time / Koochak time (higher is better: 1.0 means as
fast as the baseline). The load average is printed with the figures: the machine may be shared.

    uv run python tools/bench/mounts_bench.py                   # ~128 MiB per copy, 3 runs
    uv run python tools/bench/mounts_bench.py --size 256M --files 2000 --repeat 3 --json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from collection_bench import _generate  # noqa: E402  (the tree generator the pull bench uses)
from koochak.data.archive import archive_tree  # noqa: E402
from koochak.data.pull import pull_collection  # noqa: E402
from koochak.data.shards import ShardWriter, read_shards  # noqa: E402
from koochak.storage.profile import parse_size  # noqa: E402
from koochak.storage.store import LocalStore  # noqa: E402
from koochak.storage.transfer import CopyItem, copy_objects  # noqa: E402

# What koochak-probe --peer recommends on these mounts (tests-integration/object_storage checks
# that it does); "no read-back" drops the cross-client collision check, for comparison.
RECOMMENDED = {
    "publish": "exclusive",
    "fsync": True,
    "verify_readback": True,
    "settle_seconds": 2.0,
    "read_settle_seconds": 5.0,
}
NO_READBACK = {**RECOMMENDED, "verify_readback": False, "settle_seconds": 0.0}


def _env() -> dict[str, str]:
    out = subprocess.run([str(ROOT / "tools" / "local_s3.sh"), "env"], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def _timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)


def _pairs(repeat: int, runs: dict[str, Callable[[int], float]]) -> dict[str, float]:
    """Median seconds of each named run over ``repeat`` interleaved rounds."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(repeat):
        for name, run in runs.items():
            times[name].append(run(i))
    return {name: statistics.median(values) for name, values in times.items()}


def _bench_copy(mount: Path, scratch: Path, size: int, count: int, repeat: int) -> dict:
    src = scratch / "copy-src"
    local = LocalStore(src)
    items = []
    for i in range(count):
        data = os.urandom(size // count)
        local.put(f"f{i:03d}.bin", data)
        items.append(CopyItem(f"f{i:03d}.bin", len(data), hashlib.sha256(data).hexdigest()))
    tag = uuid.uuid4().hex[:8]

    def up(settings: dict) -> Callable[[int], float]:
        return lambda i: _timed(
            lambda: copy_objects(
                local, LocalStore(mount / f"b-{tag}-up{i}-{id(settings)}", **settings), items
            )  # fmt: skip
        )

    def cp_up(i: int) -> float:
        dest = mount / f"b-{tag}-cp{i}"
        return _timed(lambda: (_sh("cp", "-r", str(src), str(dest)), _sh("sync", "-f", str(dest))))

    up_times = _pairs(repeat, {"cp + sync": cp_up, "copy_objects": up(RECOMMENDED),
                               "copy_objects, no read-back": up(NO_READBACK)})  # fmt: skip
    source = LocalStore(mount / f"b-{tag}-cp0", **NO_READBACK)

    def down(i: int) -> float:
        return _timed(lambda: copy_objects(source, LocalStore(scratch / f"down{i}"), items))

    def cp_down(i: int) -> float:
        dest = scratch / f"cpdown{i}"
        return _timed(
            lambda: (
                _sh("cp", "-r", str(mount / f"b-{tag}-cp0"), str(dest)),
                _sh("sync", "-f", str(dest)),
            )  # fmt: skip
        )

    down_times = _pairs(repeat, {"cp + sync": cp_down, "copy_objects": down})
    return {"bytes": size, "objects": count, "up": up_times, "down": down_times}


def _bench_shards(mount: Path, scratch: Path, size: int, repeat: int) -> dict:
    prefix = f"b-{uuid.uuid4().hex[:8]}-shards"
    store = LocalStore(mount / prefix, **NO_READBACK)
    record = os.urandom(256 << 10)
    with ShardWriter(store, "", target_bytes=max(1 << 20, size // 8)) as writer:
        for i in range(size // len(record)):
            writer.write({"__key__": f"r{i:06d}", "bin": record})
    index = writer.close()
    files = [str(mount / prefix / shard.key) for shard in index.shards]
    runs = {
        "sha256sum": lambda i: _timed(lambda: _sh("sha256sum", *files)),
        "read_shards(verify)": lambda i: _timed(
            lambda: sum(1 for _ in read_shards(store, index, verify=True))
        ),
    }
    return {"bytes": sum(s.size for s in index.shards), "times": _pairs(repeat, runs)}


def _bench_collection(
    mount: Path, scratch: Path, files: int, rclone: list[str], remote: str, repeat: int
) -> dict:
    tree = scratch / "tree"
    total = _generate(tree, files, 8 << 20, 2, seed=1, max_size=16 << 10)
    tag = uuid.uuid4().hex[:8]

    def archive(i: int) -> float:
        return _timed(lambda: archive_tree(tree, LocalStore(mount / f"b-{tag}-coll{i}",
                                                            **RECOMMENDED), show_progress=False))  # fmt: skip

    def rclone_up(i: int) -> float:
        return _timed(lambda: _sh(*rclone, "copy", str(tree), f"{remote}/b-{tag}-rc{i}"))

    up = _pairs(repeat, {"rclone copy": rclone_up, "archive": archive})

    def pull(i: int) -> float:
        source = LocalStore(mount / f"b-{tag}-coll0", **NO_READBACK)
        return _timed(lambda: pull_collection(source, scratch / f"pull{i}", show_progress=False))

    def rclone_down(i: int) -> float:
        return _timed(
            lambda: _sh(*rclone, "copy", f"{remote}/b-{tag}-rc0", str(scratch / f"rc{i}"))
        )

    down = _pairs(repeat, {"rclone copy": rclone_down, "pull": pull})
    return {"bytes": total, "files": files + 2, "archive": up, "pull": down}


def _ratio(times: dict[str, float], baseline: str, ours: str) -> float:
    return times[baseline] / times[ours]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="128M", help="bytes per copy and per dataset")
    parser.add_argument("--objects", type=int, default=4, help="objects per copy")
    parser.add_argument("--files", type=int, default=1000, help="small files in the tree")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--mounts", default="s3fs,rclone")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    env = _env()
    mounts = {"s3fs": Path(env["KOOCHAK_S3FS_MOUNT"]), "rclone": Path(env["KOOCHAK_RCLONE_MOUNT"])}
    rclone = [env["KOOCHAK_S3_RCLONE"], "--config", env["KOOCHAK_S3_RCLONE_CONFIG"]]
    remote = f"moto:{env['KOOCHAK_S3_MOUNT_BUCKET']}"
    size = parse_size(args.size)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"mounts_bench: medians of {args.repeat} interleaved runs; load {load}")
    results = {}
    for name in args.mounts.split(","):
        scratch = Path(tempfile.mkdtemp(prefix="koochak-mounts-bench-"))
        try:
            copy = _bench_copy(mounts[name], scratch, size, args.objects, args.repeat)
            shards = _bench_shards(mounts[name], scratch, size, args.repeat)
            coll = _bench_collection(mounts[name], scratch, args.files, rclone, remote, args.repeat)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        results[name] = {"copy": copy, "shards": shards, "collection": coll}
        mib = size / 2**20
        print(f"{name}:")
        for label, times in (("up", copy["up"]), ("down", copy["down"])):
            for ours in [k for k in times if k.startswith("copy_objects")]:
                print(f"  copy_objects {label} {mib:.0f} MiB in {args.objects}{'':<2}"
                      f"{times[ours]:7.2f} s  cp + sync {times['cp + sync']:6.2f} s  "
                      f"{_ratio(times, 'cp + sync', ours):5.2f}x  ({ours})")  # fmt: skip
        t = shards["times"]
        print(f"  read_shards(verify) {shards['bytes'] / 2**20:.0f} MiB  {t['read_shards(verify)']:7.2f} s"
              f"  sha256sum {t['sha256sum']:6.2f} s  {_ratio(t, 'sha256sum', 'read_shards(verify)'):5.2f}x")  # fmt: skip
        for step, ours in (("archive", "archive"), ("pull", "pull")):
            t = coll[step]
            print(f"  {step} {coll['files']} files ({coll['bytes'] / 2**20:.0f} MiB)  {t[ours]:7.2f} s"
                  f"  rclone copy {t['rclone copy']:6.2f} s  {_ratio(t, 'rclone copy', ours):5.2f}x")  # fmt: skip
    print(f"load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
