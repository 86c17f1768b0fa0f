"""Runner start-up benchmark: what the isolated runner costs before user code starts.

Measured from the moment a process is spawned to the first line of user code (the workload
writes ``time.time()`` as its first statement), as a ratio against the same workload started
bare with ``python -I`` in the same run. The runner's own work is the difference: verify the
manifest, rebuild the environment, check requirements, run the preflight checks, write
``preflight.json``, spawn the managed child. Target: under 0.3 s without checks.

Rows: no checks; ``c_compiler`` (gcc compiles and runs a tiny C program); ``packages`` (torch's
version read in the target interpreter, i.e. one torch import); ``torch_compile`` (Inductor on
CPU, one run by default, the cache directory fresh each time); ``cuda`` only where CUDA exists.
Each row is the median of ``--repeats`` interleaved runs.

    .venv/bin/python tools/bench/runner_bench.py [--repeats 7] [--no-compile] [--json]
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

from koochak.jobs import EnvironmentProfile, prepare_run

WORKLOAD = "import time, sys\nt = time.time()\nopen(sys.argv[1], 'w').write(repr(t))\n"


def _profile(name: str, checks: tuple[str, ...], packages: dict[str, str]) -> EnvironmentProfile:
    variables = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin"}
    gcc, gxx = shutil.which("gcc"), shutil.which("g++")
    if gcc and gxx:
        variables.update(CC=gcc, CXX=gxx, TORCHINDUCTOR_CACHE_DIR="{run_dir}/inductor")
    return EnvironmentProfile(
        profile_id=name,
        python=sys.executable,
        variables=variables,
        packages=packages,
        preflight=checks,
        source=name,
    )


def _time_to_user_code(argv: list[str], stamp: str) -> float:
    if os.path.exists(stamp):
        os.unlink(stamp)
    start = time.time()
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{argv[:4]} failed ({done.returncode}): {done.stderr[-500:]}")
    with open(stamp) as f:
        return float(f.read()) - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--compile-repeats", type=int, default=1)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch_compile row")
    parser.add_argument("--json", action="store_true", help="also print the raw figures")
    args = parser.parse_args(argv)

    have_cc = bool(shutil.which("gcc") and shutil.which("g++"))
    try:
        import torch

        have_cuda = torch.cuda.is_available()
    except ImportError:
        have_cuda = False
    rows = [("no checks", (), {})]
    if have_cc:
        rows.append(("c_compiler", ("c_compiler",), {}))
    rows.append(("packages {torch: *}", (), {"torch": "*"}))
    if have_cuda:
        rows.append(("cuda", ("cuda",), {}))
    if have_cc and not args.no_compile:
        rows.append(("torch_compile (inductor, cpu)", ("torch_compile",), {}))

    with tempfile.TemporaryDirectory(prefix="runner-bench-") as tmp:
        script = os.path.join(tmp, "work.py")
        stamp = os.path.join(tmp, "stamp")
        with open(script, "w") as f:
            f.write(WORKLOAD)
        commands = {"bare python -I": [sys.executable, "-I", script, stamp]}
        # Part of "no checks": an interpreter that imports the runner, then starts the workload.
        importing = os.path.join(tmp, "import_then_run.py")
        with open(importing, "w") as f:
            f.write(
                "import subprocess, sys\nimport koochak.jobs.runner\n"
                "subprocess.run([sys.executable, '-I', *sys.argv[1:]], check=True)\n"
            )
        commands["(runner imports + spawn only)"] = [sys.executable, "-I", importing, script, stamp]
        for index, (label, checks, packages) in enumerate(rows):
            prepared = prepare_run(
                name=f"bench{index}",
                profile=_profile(f"bench{index}", checks, packages),
                python_args=["-I", script, stamp],
                cwd=tmp,
                run_dir=os.path.join(tmp, f"run{index}"),
            )
            prepared.stage()
            commands[label] = list(prepared.runner_argv)
        figures: dict[str, list[float]] = {label: [] for label in commands}
        for _ in range(args.repeats):
            for label, command in commands.items():
                if (
                    label.startswith("torch_compile")
                    and len(figures[label]) >= args.compile_repeats
                ):
                    continue
                if label.startswith("torch_compile"):
                    shutil.rmtree(os.path.join(os.path.dirname(command[4]), "inductor"), True)
                figures[label].append(_time_to_user_code(command, stamp))

    bare = statistics.median(figures["bare python -I"])
    load = os.getloadavg()[0]
    print(f"runner start -> user code start, median of {args.repeats} (load average {load:.1f})")
    print(f"{'':32} {'seconds':>9} {'x bare':>8} {'runner work':>12}")
    for label, values in figures.items():
        median = statistics.median(values)
        print(f"{label:32} {median:9.3f} {median / bare:8.2f} {median - bare:12.3f}")
    if args.json:
        print(json.dumps({"load": load, "seconds": figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
