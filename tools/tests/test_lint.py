"""The tree stays ruff-clean; lint is part of the suite so CI enforces it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUFF = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))


@pytest.mark.skipif(not Path(RUFF).exists(), reason="ruff is not installed")
def test_ruff_check_is_clean():
    paths = [p for p in ("packages", "tools", "examples", "tests-integration") if (ROOT / p).exists()]
    result = subprocess.run([RUFF, "check", "--no-cache", *paths], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
