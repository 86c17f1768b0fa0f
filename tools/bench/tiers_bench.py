"""Tiered checkpoints benchmark: what replication costs training, and what the fast tier buys.

Two figures, each a ratio against its baseline measured in the same run:

1. **Step-time slowdown while a checkpoint replicates.** The median step time of a compute-bound
   training step (matmuls on one torch thread, as a GPU job's host thread would leave the other
   cores to background work) while ``Replicator`` copies a ``--size`` checkpoint from the first
   tier to a durable tier, against the same steps with nothing replicating; rounds interleaved.
   Two durable tiers: a ``ThrottledStore`` at ``--rate-mb`` (an object store's speed), and an
   unthrottled directory (the copy as fast as the disk and SHA256 allow: the most CPU it can
   take). Target: <= 1.05x.
2. **Recovery time**, process start -> first resumed step (``koochak-train``'s path: resolve over
   the tiers, load, restore, one update), from the first tier against the same checkpoint on a
   ``--rate-mb`` durable store (the first tier gone, as after a requeue onto another node).
   Target: the first tier >= 5x faster. With the steps lost per failure: a process failure on
   the same node loses the steps since the last checkpoint; a node failure also loses those the
   durable tier was still behind (the replication time of one checkpoint, in steps).

Default size 256 MiB, so it runs in a few minutes on a small machine; ``--size 1G`` is the
issue's size. ``--parts N`` (or ``auto``) saves the checkpoint in N parts (issue 22's layout), so
the copies move N parts side by side and recovery reads them in parallel; ``--skip slowdown`` or
``--skip recovery`` measures one figure only.

    .venv/bin/python tools/bench/tiers_bench.py [--size 1G] [--rounds 3] [--rate-mb 100] \
        [--parts 1] [--skip slowdown|recovery]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

LAYER = 2048  # square linear layers of 2048 x 2048 float32: 16 MiB each


def make_model(size: int, device: str = "cpu") -> torch.nn.Module:
    layers = max(1, size // (LAYER * LAYER * 4))
    return torch.nn.Sequential(*[torch.nn.Linear(LAYER, LAYER, bias=False) for _ in range(layers)])


# ----------------------------------------------------------------------------- 1. slowdown


def _step_loop(
    a: torch.Tensor, b: torch.Tensor, *, until: threading.Event | None = None, steps: int = 5
) -> list[tuple[float, float]]:
    """Run ``steps`` steps, and on until ``until`` is set; return each step's (wall, CPU) time,
    CPU being the training thread's own (what it got of a core, not what it waited for)."""
    times: list[tuple[float, float]] = []
    while len(times) < steps or (until is not None and not until.is_set()):
        t0, c0 = time.perf_counter(), time.thread_time()
        c = a
        for _ in range(4):
            c = torch.tanh(c @ b)
        float(c[0, 0])
        times.append((time.perf_counter() - t0, time.thread_time() - c0))
    return times


def _medians(times: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(w for w, _ in times), statistics.median(c for _, c in times)


def bench_slowdown(
    root: str,
    size: int,
    rate: float,
    rounds: int,
    parts: int | str = 1,
    bandwidth_mb_s: float | None = None,
) -> dict[str, float]:
    from koochak.loop.checkpoint import build_checkpoint, checkpoint_name, save
    from koochak.loop.checkpoint.commit import unpublish_checkpoint
    from koochak.loop.checkpoint.replication import ReplicaTier, Replicator
    from koochak.storage.store import LocalStore
    from koochak.storage.testing import ThrottledStore

    torch.set_num_threads(1)
    first = LocalStore(os.path.join(root, "first"))
    ckpt = build_checkpoint(step=0, next_step=1, model=make_model(size))
    save(ckpt, first, parts=parts)
    name = checkpoint_name(0)
    a, b = torch.randn(256, 1024), torch.randn(1024, 1024) / 32
    results: dict[str, list[float]] = {}

    def record(label: str, times: list[tuple[float, float]]) -> None:
        wall, cpu = _medians(times)
        results.setdefault(label, []).append(wall)
        results.setdefault(f"{label}_cpu", []).append(cpu)

    for r in range(rounds):
        for label in ("throttled", "unthrottled"):
            record("baseline", _step_loop(a, b, steps=20))  # nothing replicating, before...
            target_root = os.path.join(root, f"{label}{r}")
            target = LocalStore(target_root)
            if label == "throttled":
                target = ThrottledStore(target, rate)
            replicator = Replicator(
                first, [ReplicaTier(1, target, None)], first_keep_last_k=None,
                bandwidth_mb_s=bandwidth_mb_s,
            )  # fmt: skip
            started = time.perf_counter()
            replicator.submit(name)
            done = _settle_in_background(replicator, name)
            during = _step_loop(a, b, until=done)
            copy_s = time.perf_counter() - started
            replicator.close()
            record(label, during)
            results.setdefault(f"{label}_copy_s", []).append(copy_s)
            record("baseline", _step_loop(a, b, steps=20))  # ...and after
            unpublish_checkpoint(LocalStore(target_root), name)
            shutil.rmtree(target_root, ignore_errors=True)
    return {key: statistics.median(values) for key, values in results.items()}


def _settle_in_background(replicator, name: str) -> threading.Event:
    done = threading.Event()

    def wait() -> None:
        replicator.settle(name, everywhere=True)
        done.set()

    threading.Thread(target=wait, daemon=True).start()
    return done


# ----------------------------------------------------------------------------- 2. recovery


def child(args: argparse.Namespace) -> None:
    """One recovery: resolve over the tiers, load, restore, one update, then say so and exit."""
    imported = time.perf_counter()  # torch is imported at module level: interpreter start is over
    from koochak.loop import training_loop
    from koochak.loop.checkpoint import resolve_auto_resume
    from koochak.storage.store import LocalStore, register_store
    from koochak.storage.testing import ThrottledStore

    register_store(
        "slowtier",
        lambda rest: ThrottledStore(LocalStore(os.path.join(args.root, rest)), args.rate_mb * 1e6),
    )
    tiers = [args.first, "slowtier://durable"]
    point = resolve_auto_resume(tiers)
    assert point is not None, "no checkpoint found"
    with torch.device("meta"):
        model = make_model(args.size)
    model = model.to_empty(device="cpu")  # a resumed run needs no initialisation

    def batches():
        while True:
            yield torch.randn(8, LAYER)

    def step(model, batch, ctx):
        return {"loss": model(batch).square().mean()}

    def first_step(info):
        usage = resource.getrusage(resource.RUSAGE_SELF)  # this process's CPU, all threads
        cpu = usage.ru_utime + usage.ru_stime
        print(f"FIRST_STEP {time.perf_counter() - imported:.3f} {cpu:.3f} {point.path}",
              flush=True)  # fmt: skip
        os._exit(0)

    training_loop(
        model=model, dataset=batches(), step_fn=step,
        optimizer=torch.optim.SGD(model.parameters(), lr=1e-6),
        train_cfg={"max_steps": point.checkpoint["next_step"] + 1, "log_every": 1000,
                   "device": "cpu", "out_dir": args.first, "progress_bar": False,
                   "checkpoint_replicas": tiers[1:], "run_id": "tiers-bench"},  # one run, any node
        resume="auto", checkpoint_dict=point.checkpoint, auto_resume_path=point.path,
        hooks={"on_step_end": [first_step]},
    )  # fmt: skip


def _recover(root: str, first: str, size: int, rate_mb: float) -> tuple[float, float, float, str]:
    command = [sys.executable, __file__, "--child", "--root", root, "--first", first,
               "--size", str(size), "--rate-mb", str(rate_mb)]  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, check=False, timeout=1800)
    elapsed = time.perf_counter() - started
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("FIRST_STEP")), None)
    if line is None:
        raise RuntimeError(f"recovery child failed: {proc.stderr[-2000:]}")
    _, resume_s, cpu_s, path = line.split(" ", 3)
    return elapsed, float(resume_s), float(cpu_s), path


def bench_recovery(
    root: str, size: int, rate_mb: float, rounds: int, parts: int | str = 1
) -> dict[str, float]:
    from koochak.loop.checkpoint import build_checkpoint, checkpoint_name, save
    from koochak.loop.checkpoint.tiers import replicate_checkpoint
    from koochak.storage.store import LocalStore

    fast = os.path.join(root, "fast")
    model = make_model(size)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)  # stateless: the weights dominate
    ckpt = build_checkpoint(step=9, next_step=10, model=model, optimizer=optimizer)
    save(ckpt, fast, parts=parts)
    del ckpt, model, optimizer
    replicate_checkpoint(LocalStore(fast), LocalStore(os.path.join(root, "durable")),
                         checkpoint_name(9))  # fmt: skip
    times: dict[str, list[float]] = {}
    for r in range(rounds):
        gone = os.path.join(root, f"gone{r}")  # a first tier on another node: empty here
        for label, first in (("first", fast), ("durable", gone)):
            elapsed, resume_s, cpu_s, path = _recover(root, first, size, rate_mb)
            assert ("durable" in path) == (label == "durable"), path
            times.setdefault(label, []).append(elapsed)
            times.setdefault(f"{label}_resume", []).append(resume_s)
            times.setdefault(f"{label}_cpu", []).append(cpu_s)
        shutil.rmtree(gone, ignore_errors=True)
    return {key: statistics.median(values) for key, values in times.items()}


def main() -> None:
    from koochak.storage.profile import parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="256M", help="checkpoint size (256M, 1G, ...)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate-mb", type=float, default=100.0, help="durable store MB/s")
    parser.add_argument("--ckpt-every", type=int, default=100, help="steps between checkpoints")
    parser.add_argument("--dir", default=None, help="directory on the disk to measure")
    parser.add_argument("--parts", default="1", help="checkpoint parts: 1 (one file), N or auto")
    parser.add_argument("--bandwidth-mb", default="default",
                        help="train.checkpoint_replication_bandwidth_mb_s for the copies: a "
                        "number, 'none' (unlimited), or 'default' (the TrainConfig default)")  # fmt: skip
    parser.add_argument("--skip", choices=("slowdown", "recovery"), default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--first", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.size = parse_size(str(args.size))
    args.parts = args.parts if args.parts == "auto" else int(args.parts)
    if args.bandwidth_mb == "default":
        from koochak.loop.config import TrainConfig

        args.bandwidth_mb = TrainConfig().checkpoint_replication_bandwidth_mb_s
    elif args.bandwidth_mb == "none":
        args.bandwidth_mb = None
    else:
        args.bandwidth_mb = float(args.bandwidth_mb)
    if args.child:
        child(args)
        return
    slow = recovery = None
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        if args.skip != "slowdown":
            slow = bench_slowdown(os.path.join(root, "slowdown"), args.size, args.rate_mb * 1e6,
                                  args.rounds, args.parts, args.bandwidth_mb)  # fmt: skip
        if args.skip != "recovery":
            recovery = bench_recovery(os.path.join(root, "recovery"), args.size, args.rate_mb,
                                      args.rounds, args.parts)  # fmt: skip
    print(f"checkpoint {args.size / 2**20:.0f} MiB in parts={args.parts}, {args.rounds} rounds "
          f"(medians), durable store {args.rate_mb:.0f} MB/s, replication budget "
          f"{'unlimited' if args.bandwidth_mb is None else f'{args.bandwidth_mb:g} MB/s'}, "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    if slow is not None:
        _report_slowdown(slow, args.ckpt_every)
    if recovery is not None:
        _report_recovery(recovery, args.rate_mb)


def _report_slowdown(slow: dict[str, float], every: int) -> None:
    base, base_cpu = slow["baseline"], slow["baseline_cpu"]
    print(f"step time, nothing replicating:          {base * 1e3:8.1f} ms  "
          f"(training thread's CPU {base_cpu * 1e3:.1f} ms)")  # fmt: skip
    for label in ("throttled", "unthrottled"):
        ratio = slow[label] / base
        print(f"step time while replicating ({label + '):':13s} {slow[label] * 1e3:8.1f} ms  "
              f"{ratio:5.3f}x  (CPU {slow[label + '_cpu'] * 1e3:.1f} ms, "
              f"{slow[label + '_cpu'] / base_cpu:5.3f}x; copy {slow[label + '_copy_s']:.1f} s; "
              "target <= 1.05x)")  # fmt: skip
    behind = slow["throttled_copy_s"] / base  # steps the durable tier trails by, at this step time
    print(f"steps lost per failure (checkpoint every {every} steps, {base * 1e3:.0f} ms/step): "
          f"process failure ~{every / 2:.0f} on average, at most {every}; node failure (first "
          f"tier lost) ~{every / 2 + behind:.0f} on average, at most {every + behind:.0f} "
          f"(the durable tier trails by {behind:.0f} steps)")  # fmt: skip


def _report_recovery(recovery: dict[str, float], rate_mb: float) -> None:
    first, durable = recovery["first"], recovery["durable"]
    print(f"recovery, process start -> first resumed step, first tier: {first:7.1f} s  "
          f"(after imports: {recovery['first_resume']:.1f} s; CPU {recovery['first_cpu']:.1f} s)")  # fmt: skip
    print(f"recovery from the durable store ({rate_mb:.0f} MB/s):          {durable:7.1f} s  "
          f"(after imports: {recovery['durable_resume']:.1f} s; CPU {recovery['durable_cpu']:.1f} s)")  # fmt: skip
    print(f"  -> first tier {durable / first:4.1f}x faster from process start, "
          f"{recovery['durable_resume'] / recovery['first_resume']:4.1f}x after imports "
          "(target >= 5x)")  # fmt: skip


if __name__ == "__main__":
    main()
