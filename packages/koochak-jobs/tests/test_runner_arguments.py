"""The runner's one numeric option is checked whole: nan and inf are refused like a negative
(inf used to mean "wait out settling errors forever")."""

from __future__ import annotations

import pytest
from koochak.jobs.runner import main

DIGEST = "0" * 64


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "-1", "soon"])
def test_file_wait_seconds_must_be_a_finite_number_at_least_0(raw, capsys):
    assert main([f"--file-wait-seconds={raw}", "m.json", DIGEST]) == 64
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--file-wait-seconds {raw!r}: expected" in err[0], err
