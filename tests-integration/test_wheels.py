"""Each distribution builds to a wheel and an sdist, and each wheel installs and imports alone.

This is the proof behind "pip install koochak-store alone for storage": a fresh virtual
environment gets one wheel plus what it declares (siblings come only from the same wheel folder),
and the torch-free subpackages must import without pulling torch in.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DISTS = {
    "koochak-store": ("koochak.storage", True),
    "koochak-data": ("koochak.data", True),
    "koochak-events": ("koochak.events", True),
    "koochak-jobs": ("koochak.jobs", True),
    "koochak-loop": ("koochak.loop", False),
    "koochak-store-s3": ("koochak.s3", True),
}
UV = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path(UV).exists(), reason="uv is not installed"),
]


@pytest.fixture(scope="module")
def dist_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([UV, "build", "--quiet", "--all-packages", "--project", str(ROOT),
                    "--out-dir", str(out)], check=True, cwd=ROOT)
    return out


def test_build_yields_a_wheel_and_sdist_per_distribution(dist_dir):
    names = sorted(p.name for p in dist_dir.iterdir() if p.suffix in (".whl", ".gz"))
    assert len(names) == 2 * len(DISTS), names
    for dist in DISTS:
        stem = dist.replace("-", "_")
        assert any(n.startswith(stem) and n.endswith(".whl") for n in names), dist
        assert any(n.startswith(stem) and n.endswith(".tar.gz") for n in names), dist


def test_no_wheel_ships_the_namespace_init_or_another_subpackage(dist_dir):
    for dist, (module, _) in DISTS.items():
        wheel = next(dist_dir.glob(dist.replace("-", "_") + "-*.whl"))
        sub = module.split(".")[1]
        files = [n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("koochak/")]
        assert "koochak/__init__.py" not in files
        assert all(n.startswith(f"koochak/{sub}/") for n in files), (dist, files)
        assert f"koochak/{sub}/py.typed" in files


@pytest.mark.parametrize("dist", sorted(DISTS))
def test_wheel_installs_alone(dist, dist_dir, tmp_path):
    module, torch_free = DISTS[dist]
    venv = tmp_path / "venv"
    subprocess.run([UV, "venv", "--quiet", "--python", sys.executable, str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([UV, "pip", "install", "--quiet", "--python", str(python),
                    "--find-links", str(dist_dir), dist], check=True)
    probe = (f"import sys, {module}; "
             f"print('torch' in sys.modules); "
             f"print(sorted(m for m in ('koochak.storage','koochak.data','koochak.events','koochak.loop','koochak.jobs','koochak.s3') "
             f"if __import__('importlib.util').util.find_spec(m)))")
    out = subprocess.run([str(python), "-c", probe], check=True, capture_output=True, text=True).stdout
    torch_loaded, present = out.splitlines()
    if torch_free:
        assert torch_loaded == "False", f"import {module} pulled torch in"
    assert module in present


def test_the_s3_wheel_alone_with_koochak_store_opens_s3_locations(dist_dir, tmp_path):
    """pip install koochak-store-s3 (which brings koochak-store and boto3) is enough for
    open_store("s3://...") through the entry point; nothing else of Koochak is installed."""
    venv = tmp_path / "venv"
    subprocess.run([UV, "venv", "--quiet", "--python", sys.executable, str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([UV, "pip", "install", "--quiet", "--python", str(python),
                    "--find-links", str(dist_dir), "koochak-store-s3"], check=True)
    probe = ("import importlib.util as u, sys; from koochak.storage.store import open_store; "
             "s = open_store('s3://some-bucket/runs'); print(type(s).__name__, s.location); "
             "print([m for m in ('koochak.data','koochak.loop','koochak.jobs','koochak.events') "
             "if u.find_spec(m)]); print('torch' in sys.modules)")
    env = {"PATH": "/usr/bin:/bin", "AWS_DEFAULT_REGION": "us-east-1"}
    out = subprocess.run([str(python), "-c", probe], check=True, capture_output=True, text=True,
                         env=env).stdout.splitlines()
    assert out == ["S3Store s3://some-bucket/runs", "[]", "False"]
