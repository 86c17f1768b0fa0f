"""koochak.jobs is importable on its own and stays torch-free."""

from __future__ import annotations

import subprocess
import sys
from importlib import resources


def test_ships_type_information():
    assert resources.files("koochak.jobs").joinpath("py.typed").is_file()


def test_import_does_not_pull_in_torch():
    code = "import sys, koochak.jobs; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "False"
