"""tools/gpu_smoke.py on a machine without CUDA: every check is SKIP, the summary says so, exit 0."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "tools" / "gpu_smoke.py")
gpu_smoke = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("gpu_smoke", gpu_smoke)
_spec.loader.exec_module(gpu_smoke)

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="with CUDA the script runs the real checks"
)


def test_without_cuda_every_check_skips_and_exits_zero(tmp_path, capsys):
    assert gpu_smoke.main(["--out", str(tmp_path)]) == 0

    summary = json.loads((tmp_path / "gpu_smoke.json").read_text())
    assert summary["version"] == 1
    assert summary["cuda_available"] is False
    assert [c["name"] for c in summary["checks"]] == list(gpu_smoke.CHECKS)
    assert {c["status"] for c in summary["checks"]} == {"SKIP"}
    assert summary["counts"] == {"PASS": 0, "FAIL": 0, "SKIP": len(gpu_smoke.CHECKS)}
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("SKIP ") for line in lines) == len(gpu_smoke.CHECKS)


def test_only_runs_the_named_checks(tmp_path):
    assert gpu_smoke.main(["--out", str(tmp_path), "--only", "amp,checkpoint"]) == 0
    summary = json.loads((tmp_path / "gpu_smoke.json").read_text())
    assert [c["name"] for c in summary["checks"]] == ["amp", "checkpoint"]


def test_a_failing_check_is_reported_and_sets_the_exit_code(tmp_path, monkeypatch):
    def broken(out: Path) -> dict:
        raise AssertionError("deliberately broken")

    monkeypatch.setitem(gpu_smoke.CHECKS, "amp", broken)
    assert gpu_smoke.main(["--out", str(tmp_path), "--only", "amp,health"]) == 1
    checks = json.loads((tmp_path / "gpu_smoke.json").read_text())["checks"]
    assert [(c["name"], c["status"]) for c in checks] == [("amp", "FAIL"), ("health", "SKIP")]
    assert checks[0]["error"] == "AssertionError: deliberately broken"


def test_an_unknown_check_name_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_smoke.main(["--out", str(tmp_path), "--only", "amp,nope"])
    assert exc.value.code == 2
    assert "nope" in capsys.readouterr().err
    assert not (tmp_path / "gpu_smoke.json").exists()
