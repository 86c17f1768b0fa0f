"""Checkpoint publication benchmark: what "checkpoints that cannot lie" cost.

Two figures, each a ratio against its baseline measured in the same run on the same disk:

1. synchronous publish (``torch.save`` streamed into a create-only write with SHA256 computed
   while writing, fsync, ready manifest) vs ``torch.save`` to a file + fsync. Target <= 1.10x.
   Wall and CPU time are both printed: on a busy machine the CPU figure explains the wall one.
2. with ``train.checkpoint_async`` on a store throttled to 100 MB/s (an object-storage mount's
   speed): the training thread's stall per checkpoint vs a synchronous publish to that same
   store. Target <= 0.25x. Training between checkpoints is simulated with sleep (GPU time the
   CPU does not spend), long enough for a publication to finish in the background.

Default size is 64 MB so it runs in well under two minutes; ``--mb 256`` is the issue's size
(or KOOCHAK_BENCH_CKPT_MB=256).

    .venv/bin/python tools/bench/checkpoint_bench.py [--mb 256] [--repeats 5] [--dir /path]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time

import torch
from koochak.loop.checkpoint import build_checkpoint, checkpoint_name, save, serialize_checkpoint
from koochak.loop.checkpoint.saver import CheckpointSaver
from koochak.loop.checkpoint.serialization import serialize_checkpoint_chunks
from koochak.storage.artifact import unpublish
from koochak.storage.store import LocalStore


class ThrottledStore(LocalStore):
    """A LocalStore whose writes stream at ``bytes_per_second`` (reads are not throttled)."""

    def __init__(self, root: str, bytes_per_second: float) -> None:
        super().__init__(root)
        self.rate = bytes_per_second

    def put(self, key, data, **expected):
        return super().put(key, self._paced(data), **expected)

    def _paced(self, data):
        if isinstance(data, (bytes, bytearray, memoryview)):
            view = memoryview(data).cast("B")
            data = (view[i : i + (1 << 20)] for i in range(0, len(view), 1 << 20))
        start, sent = time.perf_counter(), 0
        for piece in data:
            sent += len(piece)
            delay = start + sent / self.rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            yield bytes(piece)


def make_checkpoint(megabytes: int, step: int) -> dict:
    # A stack of square linear layers: realistic tensor sizes, roughly `megabytes` of float32.
    width = 1024
    layers = max(1, round(megabytes * (1 << 20) / (4 * width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    return build_checkpoint(step=step, next_step=step + 1, model=model)


def torch_save_fsync(ckpt: dict, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(ckpt, f)
        f.flush()
        os.fsync(f.fileno())


def bench_sync(ckpt: dict, root: str, repeats: int) -> dict[str, tuple[float, float]]:
    """Medians of (wall, CPU) seconds for the baseline and each stage of a synchronous publish.

    ``publish`` does what the baseline does and what makes it trustworthy: a create-only
    durable write with SHA256 computed while writing, the ready manifest and the ``latest.pt``
    link. Like the baseline's file, its result is removed outside the timer. ``publish_prune``
    is the loop's real call with ``keep_last_k=1``: it also deletes the previous checkpoint.
    CPU time is this process's (all threads, user + system): on a machine whose cores are busy
    with other work, wall time follows it, so it shows how much work each path does.
    """
    times: dict[str, list[tuple[float, float]]] = {}

    def timed(name: str, fn, *args) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        fn(*args)
        times.setdefault(name, []).append((time.perf_counter() - wall, time.process_time() - cpu))

    store = LocalStore(os.path.join(root, "sync"))
    pruned = LocalStore(os.path.join(root, "pruned"))
    save(ckpt, pruned, keep_last_k=1)  # so every timed save below has one to prune
    data = serialize_checkpoint(ckpt)  # what the SHA256-alone figure hashes
    for i in range(repeats):  # interleaved, so load changes hit all of them alike
        path = os.path.join(root, f"baseline{i}.pt")
        timed("baseline", torch_save_fsync, ckpt, path)
        os.remove(path)
        timed("put_only", store.put, f"object{i}", serialize_checkpoint_chunks(ckpt))
        store.delete(f"object{i}")
        step = dict(ckpt, step=i + 1, next_step=i + 2)
        timed("publish", save, step, store)
        unpublish(store, checkpoint_name(i + 1))
        timed("publish_prune", save, step, pruned, 1)
        timed("sha256", lambda: hashlib.sha256(data).hexdigest())
    return {
        name: (statistics.median(w for w, _ in pairs), statistics.median(c for _, c in pairs))
        for name, pairs in times.items()
    }


def bench_async(ckpt: dict, root: str, repeats: int, rate: float) -> tuple[float, float]:
    sync_store = ThrottledStore(os.path.join(root, "throttled-sync"), rate)
    sync_times = []
    for i in range(max(2, repeats // 2)):
        t0 = time.perf_counter()
        save(dict(ckpt, step=i, next_step=i + 1), sync_store, keep_last_k=1)
        sync_times.append(time.perf_counter() - t0)
    sync_publish = statistics.median(sync_times)

    async_store = ThrottledStore(os.path.join(root, "throttled-async"), rate)
    saver = CheckpointSaver(async_store, keep_last_k=1, async_publish=True)
    stalls = []
    for i in range(repeats):
        t0 = time.perf_counter()
        saver.poll()
        saver.save(dict(ckpt, step=i, next_step=i + 1))
        stalls.append(time.perf_counter() - t0)
        time.sleep(sync_publish * 1.5)  # the training steps until the next checkpoint
    saver.drain()
    return sync_publish, statistics.median(stalls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=int(os.environ.get("KOOCHAK_BENCH_CKPT_MB", 64)))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rate-mb", type=float, default=100.0, help="throttled store MB/s")
    parser.add_argument(
        "--dir", default=None, help="directory on the disk to measure (default: tmp)"
    )
    args = parser.parse_args()

    ckpt = make_checkpoint(args.mb, 0)
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        size = len(serialize_checkpoint(ckpt))
        sync = bench_sync(ckpt, root, args.repeats)
        sync_slow, stall = bench_async(ckpt, root, args.repeats, args.rate_mb * 1e6)
    (base, base_cpu), (publish, publish_cpu) = sync["baseline"], sync["publish"]
    print(f"checkpoint size: {size / 1e6:.1f} MB, repeats: {args.repeats} (medians)")
    print(f"{'':36s}    wall          CPU")
    for label, key in (
        ("torch.save + fsync", "baseline"),
        ("SHA256 of the bytes alone", "sha256"),
        ("streamed object put (no manifest)", "put_only"),
        ("synchronous publish", "publish"),
        ("publish + prune the previous one", "publish_prune"),
    ):
        wall, cpu = sync[key]
        print(f"{label + ':':36s}{wall:8.3f} s  {cpu:8.3f} s  ({wall / base:.2f}x wall)")
    print(f"  ratio publish / torch.save+fsync: {publish / base:8.2f}x   (target <= 1.10x)")
    print(f"  same ratio in CPU time:           {publish_cpu / base_cpu:8.2f}x")
    print(f"sync publish @ {args.rate_mb:.0f} MB/s store:      {sync_slow:8.3f} s")
    print(f"async training-thread stall:        {stall:8.3f} s")
    print(f"  ratio stall / sync publish:       {stall / sync_slow:8.2f}x   (target <= 0.25x)")


if __name__ == "__main__":
    main()
