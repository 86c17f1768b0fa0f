"""tools/bench/s3_bench.py runs end to end at a tiny size and prints every ratio."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_s3_bench_prints_all_ratios_and_cleans_up(local_s3):
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench" / "s3_bench.py"), "--size", "6M",
         "--small", "5", "--copy-files", "3", "--repeat", "1", "--json"],
        capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    document = json.loads(result.stdout[result.stdout.index("{") :])
    assert document["version"] == 1
    assert set(document["ratios"]) == {
        "put_vs_s3fs", "put_vs_boto3", "get_vs_s3fs", "get_vs_boto3", "get_probed_vs_s3fs",
        "get_probed_vs_boto3",
        "copy_up_vs_rclone", "copy_down_vs_rclone", "small_puts_vs_boto3",
    }  # fmt: skip
    assert all(value > 0 for value in document["ratios"].values())
    assert not any(name.startswith("bench-") for name in _listing(local_s3))


def _listing(local_s3) -> list[str]:
    return [p.name for p in local_s3.s3fs_mount.iterdir()]
