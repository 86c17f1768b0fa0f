"""Checkpoints in parallel parts: durable saves, verified loads and async saves against floors.

Everything is measured side by side in one run, on fp32 states of each ``--sizes`` (default
1 GiB; ``--sizes 1G,4G`` is the issue's full run) laid out as ``--layouts`` tensors (default 64
and 4), all durable (fsync):

1. on the disk of ``--dir``: Koochak ``save(..., parts=P)`` for each ``--parts`` (1 = today's
   single file); ``torch.save`` + fsync; torch DCP ``dcp.save`` with
   ``FileSystemWriter(thread_count=1 and 2, sync_files=True)``; and the raw floor: the same
   bytes written and fsynced by one stream and by two (no serialization, no hash), and by two
   streams that also hash what they write (the least a verified save does, by hand).
2. the same on a memory filesystem (``--shm-dir``, default /dev/shm; ``--shm-sizes``), where
   the CPU is the limit, against the two-core SHA256 floor (hashing every byte on two threads,
   nothing else): the only work Koochak does that DCP skips.
3. verified loads (``load``/resume reads every part in parallel and checks its SHA256) against
   the read + SHA256 floor with as many streams as parts (one per core used).
4. ``checkpoint_async``: the training thread's blocking time per save against one bare copy of
   the state into warm buffers, and a training step's slowdown while a save persists. The step
   is simulated as a GPU step is seen from the host: some interpreter work (launching kernels)
   and a wait (the GPU computing); a CPU-bound step is also shown, which on a 2-core machine
   competes with the writers for cores, not for the interpreter.

Every figure is a ratio against its floor or baseline from the same run (medians of
``--repeats`` interleaved runs), printed with the load average, since the machine is shared.

    uv run python tools/bench/checkpoint_parts_bench.py [--sizes 1G,4G] [--repeats 3]
        [--dir PATH] [--shm-dir /dev/shm] [--shm-sizes 1G] [--skip disk,shm,load,async] [--json]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from koochak.loop.checkpoint import resolve_auto_resume, save
from koochak.loop.checkpoint.saver import CheckpointSaver
from koochak.storage.profile import parse_size
from koochak.storage.store import LocalStore

NAME = "step000000001.pt"
_PIECE = 8 << 20


# -- states ----------------------------------------------------------------------------------


def make_state(total_bytes: int, tensors: int) -> dict[str, Any]:
    """A checkpoint dict whose model is ``tensors`` fp32 tensors of ``total_bytes`` together."""
    each = total_bytes // 4 // tensors
    cols = 1024
    model = {}
    generator = torch.Generator().manual_seed(0)
    for i in range(tensors):
        model[f"layer{i:03d}.weight"] = torch.empty(each // cols, cols).uniform_(
            generator=generator
        )
    return {"version": 1, "step": 1, "next_step": 2, "reason": "periodic", "model": model}


def state_views(state: dict[str, Any]) -> list[memoryview]:
    return [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in state["model"].values()]


# -- the writers measured --------------------------------------------------------------------


def koochak_save(state: dict[str, Any], root: str, parts: int) -> None:
    save(state, LocalStore(root), parts=parts)


def koochak_load(root: str) -> Any:
    """What resume does: select the checkpoint, verify every byte, load it."""
    found = resolve_auto_resume(root)
    assert found is not None and found.checkpoint["step"] == 1
    return found.checkpoint


def torch_save_fsync(state: dict[str, Any], root: str) -> None:
    with open(os.path.join(root, NAME), "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def dcp_save(state: dict[str, Any], root: str, threads: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(
            state, storage_writer=FileSystemWriter(root, thread_count=threads, sync_files=True)
        )


def raw_write(views: list[memoryview], root: str, streams: int, hash: bool = False) -> None:
    """The floor: the state's bytes written and fsynced by ``streams`` threads, nothing else;
    with ``hash``, each thread also hashes every piece it writes (the least a verified save must
    do, by hand)."""
    total = sum(v.nbytes for v in views)
    cuts = [total * k // streams for k in range(streams + 1)]

    def one(k: int) -> None:
        fd = os.open(os.path.join(root, f"raw{k}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        sha = hashlib.sha256()
        try:
            for piece in _pieces(views, cuts[k], cuts[k + 1]):
                if hash:
                    sha.update(piece)
                _write_all(fd, piece)
            os.fsync(fd)
        finally:
            os.close(fd)
        sha.hexdigest()

    _threads([lambda k=k: one(k) for k in range(streams)])


def sha256_floor(views: list[memoryview], streams: int) -> None:
    """The CPU floor: every byte hashed once, split over ``streams`` threads."""
    total = sum(v.nbytes for v in views)
    cuts = [total * k // streams for k in range(streams + 1)]

    def one(k: int) -> None:
        sha = hashlib.sha256()
        for piece in _pieces(views, cuts[k], cuts[k + 1]):
            sha.update(piece)
        sha.hexdigest()

    _threads([lambda k=k: one(k) for k in range(streams)])


def read_sha_floor(paths: list[str], fresh: bool = False) -> None:
    """The load floor: each file read and hashed by its own thread, into one reused buffer, or
    (``fresh``) into new memory the size of the file, as a load must."""

    def one(path: str) -> None:
        sha = hashlib.sha256()
        with open(path, "rb", buffering=0) as f:
            if fresh:
                whole = memoryview(
                    torch.empty(os.fstat(f.fileno()).st_size, dtype=torch.uint8).numpy()
                )
                for begin in range(0, len(whole), 2 * _PIECE):
                    piece = whole[begin : begin + 2 * _PIECE]
                    n = f.readinto(piece)
                    sha.update(piece[:n])
            else:
                buffer = memoryview(bytearray(_PIECE))
                while n := f.readinto(buffer):
                    sha.update(buffer[:n])
        sha.hexdigest()

    _threads([lambda p=p: one(p) for p in paths])


def _pieces(views: list[memoryview], start: int, stop: int):
    offset = 0
    for view in views:
        end = offset + view.nbytes
        lo, hi = max(start, offset), min(stop, end)
        for begin in range(lo, hi, _PIECE):
            yield view[begin - offset : min(hi, begin + _PIECE) - offset]
        offset = end


def _write_all(fd: int, piece: memoryview) -> None:
    while piece:
        piece = piece[os.write(fd, piece) :]


def _threads(calls: list[Callable[[], None]]) -> None:
    errors: list[BaseException] = []

    def run(call: Callable[[], None]) -> None:
        try:
            call()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


# -- measuring -------------------------------------------------------------------------------


def measure(
    methods: dict[str, Callable[[str], None]], base: str, repeats: int
) -> dict[str, tuple[float, float, list[float]]]:
    """Median (wall, CPU) seconds of each method, and its wall time in each run; interleaved, in
    alternating order (so a drift of the disk's speed during the run cancels out). Each run
    writes into a fresh directory, which is removed (and the disk settled with sync) outside the
    timer. CPU is this process's, all threads, user + system: on a shared machine it shows the
    work each method does, which the wall time follows when the cores are busy with other
    people's work. The per-run walls give per-run ratios (run k of one method against run k of
    another, seconds apart), which show how far a single run can be trusted."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in methods}
    order = list(methods.items())
    for k in range(repeats):
        for name, method in order if k % 2 == 0 else order[::-1]:
            root = tempfile.mkdtemp(prefix="bench-", dir=base)
            os.sync()
            t0, c0 = time.perf_counter(), time.process_time()
            method(root)
            times[name].append((time.perf_counter() - t0, time.process_time() - c0))
            shutil.rmtree(root)
    return {
        name: (
            statistics.median(w for w, _ in v),
            statistics.median(c for _, c in v),
            [w for w, _ in v],
        )
        for name, v in times.items()
    }


def run_ratios(
    times: dict[str, tuple[float, float, list[float]]], baseline: str, name: str
) -> list[float]:
    """``baseline``'s wall time / ``name``'s, run by run (> 1: ``name`` was faster)."""
    return [b / w for b, w in zip(times[baseline][2], times[name][2])]


def write_methods(state: dict[str, Any], parts: list[int], shm: bool) -> dict[str, Callable]:
    views = state_views(state)
    methods: dict[str, Callable[[str], None]] = {}
    for p in parts:
        methods[f"koochak P={p}"] = lambda root, p=p: koochak_save(state, root, p)
    methods["torch.save+fsync"] = lambda root: torch_save_fsync(state, root)
    methods["dcp threads=1"] = lambda root: dcp_save(state, root, 1)
    methods["dcp threads=2"] = lambda root: dcp_save(state, root, 2)
    methods["raw 1 stream"] = lambda root: raw_write(views, root, 1)
    methods["raw 2 streams"] = lambda root: raw_write(views, root, 2)
    methods["raw+sha256 2 str."] = lambda root: raw_write(views, root, 2, hash=True)
    if shm:
        methods["sha256 2 cores"] = lambda root: sha256_floor(views, 2)
    return methods


def bench_writes(state, parts, base, repeats, shm) -> dict[str, float]:
    return measure(write_methods(state, parts, shm), base, repeats)


def save_for_loads(state, parts, base) -> dict[int, tuple[str, list[str]]]:
    """The state saved once per P: P -> (directory, the files the floor reads)."""
    saved = {}
    for p in parts:
        root = tempfile.mkdtemp(prefix="bench-load-", dir=base)
        koochak_save(state, root, p)
        files = sorted(
            os.path.join(root, n)
            for n in os.listdir(root)
            if ".part-" in n or (p == 1 and n == NAME)
        )
        saved[p] = (root, files)
    return saved


def bench_loads(saved, repeats) -> dict[str, tuple[float, float, float]]:
    """(koochak verified load, read+SHA256 floor into a reused buffer, the same into new
    memory) seconds per P, the floors with one stream per part (one per core used)."""
    out = {}
    for p, (root, files) in saved.items():
        ours, floor, fresh = [], [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            loaded = koochak_load(root)
            ours.append(time.perf_counter() - t0)
            del loaded
            gc.collect()
            t0 = time.perf_counter()
            read_sha_floor(files)
            floor.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            read_sha_floor(files, fresh=True)
            fresh.append(time.perf_counter() - t0)
            gc.collect()
        shutil.rmtree(root)
        out[f"P={p}"] = tuple(statistics.median(v) for v in (ours, floor, fresh))
    return out


def bench_async(state, parts: int, base: str, repeats: int) -> dict[str, float]:
    """Blocking time of an async save vs one bare copy; step slowdown while a save persists."""
    tensors = list(state["model"].values())
    warm = [torch.empty_like(t) for t in tensors]
    bare = []
    for i in range(repeats + 1):  # the first copy touches the buffers' pages; not counted
        t0 = time.perf_counter()
        for target, source in zip(warm, tensors):
            target.copy_(source)
        if i:
            bare.append(time.perf_counter() - t0)
    del warm
    gc.collect()

    root = tempfile.mkdtemp(prefix="bench-async-", dir=base)
    saver = CheckpointSaver(LocalStore(root), async_publish=True, parts=parts, keep_last_k=1)
    blocking, persist = [], []
    for i in range(repeats + 1):  # the first save allocates the host buffers; not counted
        ckpt = dict(state, step=i, next_step=i + 1)
        t0 = time.perf_counter()
        saver.save(ckpt)
        took = time.perf_counter() - t0
        saver.drain()
        persist.append(time.perf_counter() - t0)
        if i:
            blocking.append(took)

    result = {
        "bare copy": statistics.median(bare),
        "async blocking": statistics.median(blocking),
        "persist": statistics.median(persist),
    }
    step_gpu = lambda: _step(python_ms=1.0, wait_ms=9.0)  # noqa: E731
    for label, step in (("gpu-like step", step_gpu), ("cpu step", _cpu_step)):
        quiet = _steps_for(step, result["persist"] / 2)
        busy = []
        saver.save(dict(state, step=100, next_step=101))
        while saver._async is not None and saver._async._thread.is_alive():
            t0 = time.perf_counter()
            step()
            busy.append(time.perf_counter() - t0)
        saver.drain()
        quiet += _steps_for(step, result["persist"] / 2)  # before and after the save
        result[f"{label} quiet"] = statistics.median(quiet)
        result[f"{label} during save"] = statistics.median(busy) if busy else float("nan")
        result[f"{label} steps during save"] = len(busy)
    shutil.rmtree(root)
    return result


def _step(python_ms: float, wait_ms: float) -> None:
    end = time.perf_counter() + python_ms / 1000
    x = 0
    while time.perf_counter() < end:  # interpreter work: what launching kernels costs
        x += 1
    time.sleep(wait_ms / 1000)  # the GPU computing; the host waits


_A = torch.randn(384, 384)


def _cpu_step() -> None:
    torch.mm(_A, _A)


def _steps_for(step: Callable[[], None], seconds: float) -> list[float]:
    times = []
    end = time.perf_counter() + max(seconds, 0.5)
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


# -- report ----------------------------------------------------------------------------------


def _rate(size: int, seconds: float) -> str:
    return f"{size / seconds / (1 << 30):6.2f} GiB/s"


def report_writes(
    title: str, size: int, times: dict[str, tuple[float, float, list[float]]], shm: bool
) -> list[str]:
    lines = [title, f"  {'':18s} {'wall':>8s}    {'speed':>11s}   {'CPU':>7s}"]
    for name, (wall, cpu, _) in times.items():
        lines.append(f"  {name:18s} {wall:8.3f} s  {_rate(size, wall)}  {cpu:6.3f} s")
    floor = min(times["raw 1 stream"][0], times["raw 2 streams"][0])
    for name in [n for n in times if n.startswith("koochak")]:
        wall = times[name][0]
        parts = [
            f"{floor / wall:.2f}x raw floor",
            f"{times['dcp threads=2'][0] / wall:.2f}x dcp(2)",
            f"{times['torch.save+fsync'][0] / wall:.2f}x torch.save",
        ]
        if shm:
            parts.append(f"{times['sha256 2 cores'][0] / wall:.2f}x sha256(2 cores)")
        parts.append(f"{times['raw+sha256 2 str.'][0] / wall:.2f}x raw+sha256(2)")
        lines.append(f"  {name} speed: " + ", ".join(parts))
        per_run = run_ratios(times, "raw+sha256 2 str.", name)
        lines.append("    per run vs raw+sha256(2): " + " ".join(f"{r:.2f}x" for r in per_run))
    # How far the floor itself moves between runs: its two-stream form against itself without
    # the hash, run by run. On a virtual disk this spread bounds what one run can show.
    spread = run_ratios(times, "raw+sha256 2 str.", "raw 2 streams")
    lines.append("  raw 2 streams per run vs raw+sha256(2) (the disk's own spread): "
                 + " ".join(f"{r:.2f}x" for r in spread))  # fmt: skip
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1G", help="state sizes, e.g. 1G,4G")
    parser.add_argument("--layouts", default="64,4", help="tensor counts per state")
    parser.add_argument("--parts", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="a directory on the disk to measure")
    parser.add_argument("--shm-dir", default="/dev/shm")
    parser.add_argument("--shm-sizes", default="1G", help="sizes also run on --shm-dir")
    parser.add_argument("--skip", default="", help="any of disk,shm,load,async")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    shm_sizes = {parse_size(s) for s in args.shm_sizes.split(",") if s}
    layouts = [int(n) for n in args.layouts.split(",")]
    parts = [int(p) for p in args.parts.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    base = tempfile.mkdtemp(prefix="koochak-parts-bench-", dir=args.dir)
    shm_base = tempfile.mkdtemp(prefix="koochak-parts-bench-", dir=args.shm_dir)
    results: dict[str, Any] = {"load_average_start": os.getloadavg()}
    lines = [f"load average at start: {os.getloadavg()[0]:.2f}, cores: {os.cpu_count()}"]
    try:
        for size in sizes:
            for layout in layouts:
                state = make_state(size, layout)
                real = sum(v.nbytes for v in state_views(state))
                tag = f"{real / (1 << 30):.2f} GiB as {layout} tensors"
                if "disk" not in skip:
                    times = bench_writes(state, parts, base, args.repeats, shm=False)
                    results[f"disk {tag}"] = times
                    lines += report_writes(
                        f"disk, {tag} (load {os.getloadavg()[0]:.2f})", real, times, False
                    )
                if "shm" not in skip and size in shm_sizes:
                    times = bench_writes(state, parts, shm_base, args.repeats, shm=True)
                    results[f"shm {tag}"] = times
                    lines += report_writes(
                        f"/dev/shm, {tag} (load {os.getloadavg()[0]:.2f})", real, times, True
                    )
                if "async" not in skip and size == min(sizes):
                    figures = bench_async(state, max(parts), base, args.repeats)
                    results[f"async {tag}"] = figures
                    lines.append(f"async, {tag}, P={max(parts)} (load {os.getloadavg()[0]:.2f})")
                    lines.append(
                        f"  blocking {figures['async blocking']:.3f} s vs bare copy "
                        f"{figures['bare copy']:.3f} s: "
                        f"{figures['async blocking'] / figures['bare copy']:.2f}x"
                    )
                    for label in ("gpu-like step", "cpu step"):
                        quiet, busy = figures[f"{label} quiet"], figures[f"{label} during save"]
                        lines.append(
                            f"  {label}: {busy * 1e3:.2f} ms during a save vs {quiet * 1e3:.2f} ms "
                            f"without: {busy / quiet:.3f}x"
                        )
                if "load" not in skip:
                    saved = save_for_loads(state, parts, base)
                    del state  # at most one state in memory: each load makes another
                    gc.collect()
                    loads = bench_loads(saved, args.repeats)
                    results[f"load {tag}"] = loads
                    lines.append(f"verified load, {tag} (load {os.getloadavg()[0]:.2f})")
                    for name, (ours, floor, fresh) in loads.items():
                        lines.append(
                            f"  {name}: {ours:.3f} s; read+sha256 floor {floor:.3f} s "
                            f"({floor / ours:.2f}x its speed), into new memory {fresh:.3f} s "
                            f"({fresh / ours:.2f}x)"
                        )
                else:
                    del state
                gc.collect()
                print("\n".join(lines), flush=True)
                lines = []
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm_base, ignore_errors=True)
    results["load_average_end"] = os.getloadavg()
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        print()


if __name__ == "__main__":
    main()
