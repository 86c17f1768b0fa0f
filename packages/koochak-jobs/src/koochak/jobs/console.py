"""The ``koochak-run`` console script. A console script starts without ``-I``, so this module
imports nothing but ``os`` and ``sys`` and re-executes ``python -I -m koochak.jobs.runner``:
an ambient PYTHONPATH or user site-packages never shapes the runner, exactly as when a
scheduler runs the prepared ``runner_argv``."""

import os
import sys


def main() -> None:
    argv = [sys.executable, "-I", "-m", "koochak.jobs.runner", *sys.argv[1:]]
    os.execv(sys.executable, argv)
