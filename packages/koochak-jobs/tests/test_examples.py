"""examples/jobs: the site-neutral profile loads. (The submission script end to end needs
koochak-loop and torch: tests-integration/test_jobs_digits.py.)"""

from __future__ import annotations

import re
from pathlib import Path

from koochak.jobs import load_environment_profile

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "jobs"


def test_the_example_profile_is_valid_and_site_neutral():
    profile = load_environment_profile(EXAMPLES / "environment.yaml")
    assert profile.preflight == ("c_compiler", "cuda", "torch_compile")
    assert profile.secrets == ("TRACKING_TOKEN",)
    for path in EXAMPLES.iterdir():
        if path.is_file():
            text = path.read_text()
            assert not re.search(r"/(home|scratch|gpfs|lustre|users?)/", text), path
            assert not re.search(r"\b[a-z0-9-]+\.(edu|org|com|net)\b", text), path
