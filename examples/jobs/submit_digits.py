"""Prepare and stage the digits quick start as a reproducible job.

    python examples/jobs/submit_digits.py --profile my-env.yaml --run-dir /abs/runs/digits-1
    python examples/jobs/submit_digits.py --local --run-dir /tmp/digits-1   # this machine, CPU

It compiles ``examples/digits/config.yaml`` (with a few patches) and the environment profile into
a launch manifest under the run directory, stages it write-once, and prints the runner command a
scheduler would execute. ``--local`` builds a CPU profile for the interpreter running this
script instead of reading one, so the manifest can be tried on a laptop with ``koochak-run``.
Staging the same inputs again is a no-op; changed inputs into the same run directory are refused.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys

from koochak.jobs import (
    ConfigPatch,
    EnvironmentProfile,
    load_environment_profile,
    prepare_run,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "examples", "digits", "config.yaml")


def local_profile() -> EnvironmentProfile:
    """A CPU profile for this interpreter: its own bin directory first on PATH, the system
    compilers when there are any (then the c_compiler check runs too)."""
    bin_dir = os.path.dirname(sys.executable)
    variables = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONUNBUFFERED": "1"}
    preflight: tuple[str, ...] = ()
    cc = shutil.which("gcc", path="/usr/bin:/bin")
    if cc:
        variables["CC"] = cc
        preflight = ("c_compiler",)
    return EnvironmentProfile(
        profile_id="local-cpu",
        python=sys.executable,
        variables=variables,
        packages={"torch": "*", "sklearn": "*"},
        preflight=preflight,
        source="<local profile>",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--profile", help="environment profile YAML")
    source.add_argument("--local", action="store_true", help="a CPU profile for this python")
    parser.add_argument("--run-dir", required=True, help="absolute run directory")
    parser.add_argument("--steps", type=int, default=400, help="train.max_steps")
    parser.add_argument("--name", default="digits", help="job name")
    args = parser.parse_args(argv)

    profile = local_profile() if args.local else load_environment_profile(args.profile)
    prepared = prepare_run(
        name=args.name,
        profile=profile,
        python_args=["-m", "koochak.loop.cli", "--config", "{config}"],
        cwd=REPO,  # the digits entry points are importable from the repository root
        run_dir=os.path.abspath(args.run_dir),
        base_config=CONFIG,
        patches=[
            ConfigPatch("train.max_steps", args.steps),
            ConfigPatch("train.ckpt_every", max(1, args.steps // 2)),
            ConfigPatch("train.eval_every", max(1, args.steps // 2)),
            ConfigPatch("optim.scheduler.warmup_steps", max(1, min(50, args.steps // 4))),
        ],
    )
    written = prepared.stage()
    print(f"manifest {prepared.manifest_path} sha256 {prepared.manifest_sha256}")
    print("staged" if written else "already staged (identical)", *written)
    print(shlex.join(prepared.runner_argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
