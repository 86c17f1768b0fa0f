"""Slow: real Inductor on CPU as a preflight check, run by the real runner. (The digits
training run through a manifest needs koochak-loop: tests-integration/test_jobs_digits.py.)"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
GCC, GXX = shutil.which("gcc"), shutil.which("g++")
needs_compilers = pytest.mark.skipif(not (GCC and GXX), reason="needs gcc and g++")
needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="needs torch in this interpreter"
)


def compile_profile(kit, tmp_path, cxx, name="p.yaml"):
    return kit.basic_profile(
        tmp_path,
        f"CC: {GCC}\nCXX: {cxx}\n"
        'TORCHINDUCTOR_CACHE_DIR: "{run_dir}/inductor-cache"\n'
        'TRITON_CACHE_DIR: "{run_dir}/triton-cache"\n',
        'create_directories: ["{run_dir}/inductor-cache"]\n',
        "preflight: [c_compiler, torch_compile]\n",
        name=name,
    )


@needs_compilers
@needs_torch
def test_torch_compile_with_inductor_on_cpu_passes_and_a_broken_cxx_fails_first(
    kit, tmp_path, marker
):
    script = kit.workload(tmp_path, f"open({str(marker)!r}, 'w').close()\n")
    prepared = kit.staged(tmp_path, compile_profile(kit, tmp_path, GXX), script)
    done = kit.run_runner(prepared, timeout=900)
    assert done.returncode == 0, done.stderr
    assert marker.exists()
    record = json.loads(Path(prepared.preflight_path).read_text())
    assert record["checks"] == ["c_compiler", "torch_compile"]
    assert record["observed"]["torch_compile"]["device"] == "cpu"
    assert record["observed"]["torch_compile"]["backend"] == "inductor"

    marker.unlink()
    broken = tmp_path / "g++"
    broken.write_text("#!/bin/sh\necho 'g++: internal compiler error' >&2\nexit 4\n")
    broken.chmod(0o755)
    prepared = kit.staged(
        tmp_path,
        compile_profile(kit, tmp_path, str(broken), "b.yaml"),
        script,
        run_dir=str(tmp_path / "broken"),
    )
    done = kit.run_runner(prepared, timeout=900)
    assert done.returncode == 78
    assert kit.failure(done.stderr)["check"] == "torch_compile"
    assert not marker.exists()


@needs_torch
def test_the_cuda_check_runs_in_the_target_interpreter(kit, tmp_path, marker):
    """Passes on a machine with a GPU; elsewhere fails closed before user code, naming why."""
    import subprocess
    import sys

    probe = "import torch; print(torch.cuda.is_available() and torch.cuda.device_count() > 0)"
    has_cuda = (
        subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300
        ).stdout.strip()
        == "True"
    )
    script = kit.workload(tmp_path, f"open({str(marker)!r}, 'w').close()\n")
    prepared = kit.staged(tmp_path, kit.basic_profile(tmp_path, tail="preflight: [cuda]\n"), script)
    done = kit.run_runner(prepared, timeout=600)
    if has_cuda:
        assert done.returncode == 0, done.stderr
        observed = json.loads(Path(prepared.preflight_path).read_text())["observed"]["cuda"]
        assert observed["devices"] >= 1
    else:
        assert done.returncode == 78
        line = kit.failure(done.stderr)
        assert line["check"] == "cuda" and "no CUDA device" in line["error"]
        assert not marker.exists()
