"""--min-age-hours is refused unless it is a finite number >= 0: nan and inf used to pass the
``< 0`` check and fail later with an error that named neither the flag nor the fix."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from koochak.data.archive import scan_source


@pytest.mark.parametrize("hours", [math.nan, math.inf, -math.inf, -1.0])
def test_a_min_age_that_is_not_a_finite_number_at_least_0_is_refused(tmp_path, hours):
    (tmp_path / "a.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="--min-age-hours .*: expected a finite number >= 0"):
        scan_source(tmp_path, min_age_hours=hours)
    assert [f.path for f in scan_source(tmp_path, min_age_hours=0)[0]] == ["a.bin"]


def test_the_cli_says_so_in_one_line(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"x")
    argv = [sys.executable, "-m", "koochak.data", "archive", str(src), str(tmp_path / "dest")]
    done = subprocess.run(
        [*argv, "--min-age-hours", "nan"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--min-age-hours nan: expected a finite number >= 0" in lines[0]
