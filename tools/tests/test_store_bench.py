"""tools/bench/store_bench.py runs end to end at a tiny size and prints every ratio."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_store_bench_prints_all_ratios_and_cleans_up(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "bench" / "store_bench.py"),
            "--size",
            "1M",
            "--small",
            "20",
            "--repeat",
            "1",
            "--dir",
            str(tmp_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    for label in ("put (fsync+SHA256)", "copy_objects", "small puts", "sha256 streaming"):
        assert label in result.stdout
    document = json.loads(result.stdout[result.stdout.index("{") :])
    assert document["version"] == 1 and document["put"] > 0 and document["copy_objects"] > 0
    assert list(tmp_path.iterdir()) == []
