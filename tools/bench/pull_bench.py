#!/usr/bin/env python3
"""koochak-data pull and verify --deep as whole commands, against tar -xf and sha256sum.

What a user types is a command, so this times commands: `koochak-data pull --no-progress
COLL DEST` (every SHA256 checked, mode and exact mtime_ns restored, temp name + rename per
file) against `tar -xf TREE.tar -C DEST`, and `koochak-data verify --deep COLL` against
`find SRC -type f -print0 | xargs -0 sha256sum`, each pair on the same tree, interleaved
(A B A B ...) so a noisy neighbour slows both alike, a fresh DEST per run and `sync` (untimed)
between runs; the outputs are deleted only once a tree is done (about 2 x (repeat + 1) copies
of it on disk at the end). Wall and CPU seconds (user + system of the child, from wait4) are medians of
--repeat runs; the ratio is of the medians (lower is better).

Two trees by default: the collection benchmark's (2,000 files of 1-64 KiB in directories of
100, plus 2 x 8 MiB) and 4,000 files of 1-64 KiB. Goals: pull <= 1.5x tar -xf; verify --deep
at least 2x as fast as sha256sum (ratio <= 0.5x).

The floor printed below each tree is what any Python command pays before its first file: the
interpreter's start and the imports a pull runs (`koochak.data.cli`, `koochak.data.pull` and the
store modules it opens a collection with), timed the same way (a whole command that does
nothing else). tar pays none of it.

Python commands run with their bytecode cached, as an installed package has it (pip compiles it
at install; otherwise the first run writes `__pycache__`): the children get a bytecode cache
in the scratch directory (`PYTHONPYCACHEPREFIX`) that the uncounted first round fills, even where
`PYTHONDONTWRITEBYTECODE` is set. `--no-bytecode-cache` keeps that setting as it is, so a
workspace without written bytecode compiles every koochak module from source in every run.

    python tools/bench/pull_bench.py                       # both trees, 5 runs each: ~1 minute
    python tools/bench/pull_bench.py --files 20000 --big 64M --repeat 3   # one larger tree
    python tools/bench/pull_bench.py --files 20000 --max-file 8K --repeat 3   # issue 20's tree
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from collection_bench import _generate  # noqa: E402  (the same tree generator)
from koochak.data.archive import archive_tree  # noqa: E402
from koochak.storage.profile import parse_size  # noqa: E402

# What `koochak-data pull` imports before its first file (the CLI imports the rest lazily).
_PULL_IMPORTS = (
    "import koochak.data.cli, koochak.data.pull, koochak.data._progress, koochak.storage.store, "
    "koochak.storage.profile"
)


def _koochak_data() -> list[str]:
    script = Path(sys.executable).with_name("koochak-data")
    return [str(script)] if script.exists() else [sys.executable, "-m", "koochak.data"]


def _run(
    argv: list[str], *, shell: bool = False, env: dict[str, str] | None = None
) -> tuple[float, float]:
    """Wall and CPU seconds (user + system) of one command, measured from outside it."""
    with tempfile.TemporaryFile() as errors:
        start = time.perf_counter()
        proc = subprocess.Popen(
            argv, shell=shell, stdout=subprocess.DEVNULL, stderr=errors, env=env
        )
        # wait4's usage covers the child and every descendant it reaped (a pipeline's tools).
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            errors.seek(0)
            message = errors.read().decode(errors="replace").strip()
            raise SystemExit(f"pull_bench: {argv!r} failed ({proc.returncode}): {message}")
    return wall, usage.ru_utime + usage.ru_stime


def _python_env(scratch: Path, bytecode_cache: bool) -> dict[str, str] | None:
    """The environment of the Python commands: with a bytecode cache of their own (see above)."""
    if not bytecode_cache:
        return None
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(scratch / "pycache")
    return env


def _bench_tree(
    scratch: Path, files: int, big: int, big_count: int, repeat: int, max_file: int = 64 << 10,
    bytecode_cache: bool = True,
) -> dict[str, object]:
    src, coll, tar_file = scratch / "src", scratch / "coll", scratch / "tree.tar"
    total = _generate(src, files, big, big_count, seed=0, max_size=max_file)
    archive_tree(src, coll, show_progress=False)
    subprocess.run(["tar", "-cf", str(tar_file), "-C", str(src), "."], check=True)
    tool = _koochak_data()
    commands = {
        "pull": lambda dest: tool + ["pull", "--no-progress", str(coll), str(dest)],
        "tar -xf": lambda dest: ["tar", "-xf", str(tar_file), "-C", str(dest)],
        "verify --deep": lambda dest: tool + ["verify", "--deep", "--no-progress", str(coll)],
        "sha256sum": lambda dest: (f"find {src} -type f -print0 | xargs -0 sha256sum > /dev/null",),
        "startup + import": lambda dest: [sys.executable, "-c", _PULL_IMPORTS],
    }
    python_env = _python_env(scratch, bytecode_cache)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    for i in range(repeat + 1):  # the first round warms caches and is not counted
        for name, make in commands.items():
            dest = scratch / f"out-{name.split()[0]}-{i}"
            if name == "tar -xf":
                dest.mkdir()
            os.sync()
            argv = make(dest)
            shell = name == "sha256sum"
            env = python_env if name not in ("tar -xf", "sha256sum") else None
            figure = _run(list(argv) if not shell else argv[0], shell=shell, env=env)
            if i:
                runs[name].append(figure)
            # Outputs stay until the tree is done: deleting thousands of files between runs
            # leaves the filesystem freeing them during the next run, on its clock.
    wall = {name: statistics.median(w for w, _ in values) for name, values in runs.items()}
    cpu = {name: statistics.median(c for _, c in values) for name, values in runs.items()}
    return {"files": files, "max_file": max_file, "big": big, "big_count": big_count,
            "bytes": total, "bytecode_cache": bytecode_cache, "wall": wall,
            "cpu": cpu, "ranges": {n: (min(w for w, _ in v), max(w for w, _ in v))
                                   for n, v in runs.items()}}  # fmt: skip


def _print(result: dict[str, object]) -> None:
    wall: dict[str, float] = result["wall"]  # type: ignore[assignment]
    cpu: dict[str, float] = result["cpu"]  # type: ignore[assignment]
    ranges: dict[str, tuple[float, float]] = result["ranges"]  # type: ignore[assignment]
    print(
        f"tree: {result['files']} files of 1-{int(result['max_file']) >> 10} KiB + "
        f"{result['big_count']} x "
        f"{int(result['big']) >> 20} MiB = {int(result['bytes']) / 2**20:.1f} MiB"
    )
    print(f"  {'command':<18}{'wall s':>8} {'(min-max)':>15}{'cpu s':>8}  {'baseline':<11}"
          f"{'wall ratio':>11}{'cpu ratio':>10}  goal")  # fmt: skip
    for name, base, goal in (("pull", "tar -xf", 1.5), ("verify --deep", "sha256sum", 0.5)):
        for label in (base, name):
            low, high = ranges[label]
            line = (
                f"  {label:<18}{wall[label]:8.3f} {f'({low:.3f}-{high:.3f})':>15}{cpu[label]:8.3f}"
            )
            if label == name:
                ratio, cpu_ratio = wall[name] / wall[base], cpu[name] / max(cpu[base], 1e-9)
                verdict = "ok" if ratio <= goal else "MISSED"
                line += f"  {base:<11}{ratio:10.2f}x{cpu_ratio:9.2f}x  <= {goal}x {verdict}"
            print(line)
    fixed = wall["startup + import"]
    print(
        f"  floor: interpreter start + a pull's imports = {fixed:.3f} s wall "
        f"({cpu['startup + import']:.3f} s cpu), {fixed / wall['tar -xf']:.2f}x tar -xf's whole "
        f"run before pull touches a file; pull minus it = "
        f"{(wall['pull'] - fixed) / wall['tar -xf']:.2f}x tar -xf"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=None, help="one tree of this many files")
    parser.add_argument("--big", default="8M", help="size of each big file (with --files)")
    parser.add_argument("--big-count", type=int, default=0, help="big files (with --files)")
    parser.add_argument(
        "--max-file", default="64K", help="largest small file, e.g. 8K (with --files)"
    )
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    parser.add_argument("--no-bytecode-cache", dest="bytecode_cache", action="store_false",
                        help="leave PYTHONDONTWRITEBYTECODE as it is (no bytecode cache)")
    args = parser.parse_args(argv)
    for tool in ("tar", "find", "xargs", "sha256sum"):
        if shutil.which(tool) is None:
            print(f"pull_bench: needs {tool!r} on PATH for its baseline", file=sys.stderr)
            return 1
    if args.files is None:
        trees = [(2000, 8 << 20, 2, 64 << 10), (4000, 0, 0, 64 << 10)]
    else:
        trees = [(args.files, parse_size(args.big), args.big_count, parse_size(args.max_file))]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    cache = "cached" if args.bytecode_cache else "as the environment has it (--no-bytecode-cache)"
    print(f"pull_bench: whole commands, medians of {args.repeat} interleaved runs; load {load}; "
          f"koochak bytecode {cache}")  # fmt: skip
    results = []
    for files, big, big_count, max_file in trees:
        scratch = Path(tempfile.mkdtemp(prefix="koochak-pull-bench-", dir=args.dir))
        try:
            result = _bench_tree(scratch, files, big, big_count, args.repeat, max_file,
                                 args.bytecode_cache)  # fmt: skip
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        _print(result)
        results.append(result)
    print(f"load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
