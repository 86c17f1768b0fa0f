"""Recovery at the floor: process start -> first resumed step, against a hand-written floor.

Each round runs, interleaved, one fresh process per row (the page cache warm for all of them):

* **floor**: ``python -c`` that imports torch, reads + SHA256s the checkpoint's bytes on every
  core (one thread per part, or the one file cut into one run per core), ``torch.load(...,
  mmap=True)`` of the same state from a plain ``torch.save`` file, ``load_state_dict`` into the
  model and one training step;
* **one file** and **parts=2**: Koochak's resume, ``training_loop(resume="auto")`` on the first
  tier (resolve, verified read, restore, RNG) up to the end of its first update.

Each time is the parent's wall clock from spawning the process to the child's exit right after
its first step, and the child's CPU time (user + system, all threads): on a loaded machine the
wall clock mostly measures the wait for a core, and the CPU time is what the work cost. Ratios are against the floor measured in the same round (median over rounds).
The machine's load average is printed, because on a shared machine every figure moves with it.

    .venv/bin/python tools/bench/recovery_bench.py [--size 512M] [--rounds 5] [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

LAYER = 2048  # square linear layers of 2048 x 2048 float32: 16 MiB each
THREADS: int | None = None  # --torch-threads

MODEL = f"""
import torch
def make_model(size):
    layers = max(1, size // ({LAYER} * {LAYER} * 4))
    with torch.device("meta"):
        model = torch.nn.Sequential(
            *[torch.nn.Linear({LAYER}, {LAYER}, bias=False) for _ in range(layers)])
    return model.to_empty(device="cpu")  # a resumed run needs no initialisation
"""

FLOOR = MODEL + f"""
import hashlib, os, sys, threading
size, plain, files = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
runs = []  # (path, start, length): one per part file, or the one file cut into one per core
cores = os.cpu_count() or 1
for path in files:
    n = os.path.getsize(path)
    cut = 1 if len(files) > 1 else cores
    step = -(-n // cut)
    runs += [(path, s, min(step, n - s)) for s in range(0, n, step)]
def digest(path, start, length):
    sha, buf = hashlib.sha256(), bytearray(16 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        while length > 0:
            got = f.readinto(view[: min(len(buf), length)])
            sha.update(view[:got])
            length -= got
    return sha.hexdigest()
threads = [threading.Thread(target=digest, args=run) for run in runs]
for t in threads: t.start()
for t in threads: t.join()
model = make_model(size)
model.load_state_dict(torch.load(plain, mmap=True, weights_only=True))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
model(torch.randn(8, {LAYER})).square().mean().backward()
optimizer.step()
optimizer.zero_grad()
"""

KOOCHAK = MODEL + f"""
import os, sys
from koochak.loop import training_loop
size, first = int(sys.argv[1]), sys.argv[2]
model = make_model(size)
def batches():
    while True:
        yield torch.randn(8, {LAYER})
def step(model, batch, ctx):
    return {{"loss": model(batch).square().mean()}}
def first_step(info):
    assert info["step"] == 10, info
    os._exit(0)
training_loop(
    model=model, dataset=batches(), step_fn=step,
    optimizer=torch.optim.SGD(model.parameters(), lr=1e-6),
    train_cfg={{"max_steps": 11, "log_every": 1000, "device": "cpu", "out_dir": first,
               "progress_bar": False}},
    resume="auto", hooks={{"on_step_end": [first_step]}},
)
raise SystemExit("no resumed step ran")
"""


def _run(script: str, args: list[str], tree: str | None = None) -> tuple[float, float]:
    """(wall, CPU) seconds of one child, CPU being its user + system time, all threads.
    ``tree``: a checkout whose packages the child imports instead of the installed ones."""
    env = dict(os.environ)
    if THREADS is not None:
        env["OMP_NUM_THREADS"] = str(THREADS)  # torch's intra-op threads, in every row alike
    if tree is not None:
        packages = os.path.join(tree, "packages")
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.join(packages, p, "src") for p in sorted(os.listdir(packages))]
            + [env.get("PYTHONPATH", "")])  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          check=False, timeout=1800, env=env)  # fmt: skip
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}): {proc.stderr[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return elapsed, cpu


def prepare(root: str, size: int, parts_list: list[int]) -> tuple[str, dict[int, str]]:
    import torch
    from koochak.loop.checkpoint import build_checkpoint, save

    exec(MODEL, namespace := {})  # noqa: S102 - our own string
    model = namespace["make_model"](size)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)  # stateless: the weights dominate
    ckpt = build_checkpoint(step=9, next_step=10, model=model, optimizer=optimizer)
    firsts = {}
    for parts in parts_list:
        firsts[parts] = os.path.join(root, f"parts{parts}")
        save(ckpt, firsts[parts], parts=parts)
    plain = os.path.join(root, "plain.pt")
    torch.save(model.state_dict(), plain)
    return plain, firsts


def _checkpoint_files(first: str) -> list[str]:
    """The checkpoint's objects (the one file, or the index and its parts)."""
    names = sorted(os.listdir(first))
    return [os.path.join(first, n) for n in names
            if n.startswith("step") and not n.endswith(".json") and not n.endswith(".tmp")]  # fmt: skip


def main() -> None:
    from koochak.storage.profile import parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="512M", help="checkpoint size (512M, 1G, ...)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--parts", default="1,2", help="layouts to measure: 1 = one file")
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                        help="directory for the checkpoints (default /dev/shm)")  # fmt: skip
    parser.add_argument("--tree", default=None,
                        help="a checkout whose code the 'koochak' row runs (default: the installed "
                        "packages); with a snapshot, editing the tree does not change a run")  # fmt: skip
    parser.add_argument("--before", default=None,
                        help="a checkout of the code before a change (git archive): measured too, "
                        "interleaved, as the 'before' row")  # fmt: skip
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="OMP_NUM_THREADS for every child (1 on a loaded machine: idle "
                        "OpenMP threads spin, which counts as CPU time)")  # fmt: skip
    args = parser.parse_args()
    global THREADS
    THREADS = args.torch_threads
    size = parse_size(str(args.size))
    parts_list = [int(p) for p in args.parts.split(",")]
    loads = [os.getloadavg()[0]]
    times: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="koochak-recovery-") as root:
        plain, firsts = prepare(root, size, parts_list)
        for _ in range(args.rounds):
            for parts in parts_list:
                files = _checkpoint_files(firsts[parts])
                floor = _run(FLOOR, [str(size), plain, *files])
                ours = _run(KOOCHAK, [str(size), firsts[parts]], args.tree)
                rows = [("floor", floor), ("koochak", ours)]
                if args.before:
                    old = _run(KOOCHAK, [str(size), firsts[parts]], args.before)
                    rows.append(("before", old))
                    ratios.setdefault(f"{parts}_before", []).append(old[0] / floor[0])
                    ratios.setdefault(f"{parts}_before_cpu", []).append(old[1] / floor[1])
                loads.append(os.getloadavg()[0])
                for kind, pair in rows:
                    times.setdefault(f"{kind}{parts}", []).append(pair[0])
                    times.setdefault(f"{kind}{parts}_cpu", []).append(pair[1])
                ratios.setdefault(str(parts), []).append(ours[0] / floor[0])
                ratios.setdefault(f"{parts}_cpu", []).append(ours[1] / floor[1])
    print(f"recovery, {size / 2**20:.0f} MiB, {args.rounds} rounds (medians), dir {args.dir}, "
          f"load average {min(loads):.1f}-{max(loads):.1f}, {os.cpu_count()} cores, "
          f"torch threads {THREADS or 'default'}")  # fmt: skip
    for parts in parts_list:
        label = "one file" if parts == 1 else f"parts={parts}"
        floor = statistics.median(times[f"floor{parts}"])
        ours = statistics.median(times[f"koochak{parts}"])
        floor_cpu = statistics.median(times[f"floor{parts}_cpu"])
        ours_cpu = statistics.median(times[f"koochak{parts}_cpu"])
        rs, cs = ratios[str(parts)], ratios[f"{parts}_cpu"]
        print(f"  {label:9s} wall: floor {floor:6.2f} s  koochak {ours:6.2f} s  "
              f"ratio {statistics.median(rs):.2f}x (rounds {', '.join(f'{r:.2f}' for r in rs)}; "
              "goal <= 1.25x, quiet <= 1.10x)")  # fmt: skip
        print(f"  {'':9s} CPU:  floor {floor_cpu:6.2f} s  koochak {ours_cpu:6.2f} s  "
              f"ratio {statistics.median(cs):.2f}x (rounds {', '.join(f'{r:.2f}' for r in cs)})")  # fmt: skip
        if args.before:
            for unit, suffix in (("wall", ""), ("CPU ", "_cpu")):
                old = statistics.median(times[f"before{parts}{suffix}"])
                bs = ratios[f"{parts}_before{suffix}"]
                print(f"  {'':9s} {unit}: before {old:6.2f} s  ratio "
                      f"{statistics.median(bs):.2f}x (rounds {', '.join(f'{r:.2f}' for r in bs)})")  # fmt: skip


if __name__ == "__main__":
    main()
