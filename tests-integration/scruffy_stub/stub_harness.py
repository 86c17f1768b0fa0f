"""Test helpers for the Scruffy stub: import it as ``scruffy`` and run its controller.

Import this module after putting ``tests-integration/scruffy_stub`` on ``sys.path`` (the tests
do that); jobs and the controller get the folder on PYTHONPATH, nothing is installed.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

STUB_DIR = Path(__file__).resolve().parent
CONTRACT_CANDIDATES = [
    Path(p) / "contracts" / "scruffy-client-v1.md"
    for p in (
        os.environ.get("KOOCHAK_SHARED_DIR", ""),
        *(str(d / "shared") for d in STUB_DIR.parents),
    )
    if p
]


def load_client(contract: str, monkeypatch: Any) -> ModuleType:
    """Import the stub as ``scruffy`` (fresh) playing ``contract``; undone by ``monkeypatch``."""
    monkeypatch.syspath_prepend(str(STUB_DIR))
    monkeypatch.setenv("SCRUFFY_STUB_CONTRACT", contract)
    for name in [m for m in sys.modules if m == "scruffy" or m.startswith("scruffy.")]:
        monkeypatch.delitem(sys.modules, name)
    module = importlib.import_module("scruffy")
    return module


def stub_env(contract: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SCRUFFY_", "SLURM_"))}
    paths = [str(STUB_DIR), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env.update(PYTHONPATH=os.pathsep.join(paths), SCRUFFY_STUB_CONTRACT=contract)
    env.update(extra or {})
    return env


class StubController:
    """``python -m scruffy --root ROOT serve --launcher local`` as a real subprocess."""

    def __init__(
        self, root: Path, contract: str, *, cpus: int = 4, env: dict[str, str] | None = None
    ) -> None:
        self.root = Path(root)
        self.contract = contract
        self.root.mkdir(parents=True, exist_ok=True)
        self.inventory = self.root.parent / f"{self.root.name}-inventory.json"
        self.inventory.write_text(
            json.dumps({"nodes": {"node0": {"gpu_ids": [0], "cpus": cpus, "memory_gb": 16}}})
        )
        self.env = stub_env(contract, env)
        self.proc: subprocess.Popen | None = None

    def start(self) -> StubController:
        argv = [sys.executable, "-m", "scruffy", "--root", str(self.root), "serve"]
        argv += ["--launcher", "local", "--inventory", str(self.inventory)]
        argv += ["--allocation-id", "alloc-test", "--poll-interval", "0.05", "--cancel-grace", "5"]
        argv += ["--contract", self.contract]
        self.proc = subprocess.Popen(argv, env=self.env, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                state = json.loads((self.root / "state.json").read_text())
                if state["allocation"] == state["allocation"] | {
                    "id": "alloc-test",
                    "state": "running",
                }:
                    return self
            except (FileNotFoundError, ValueError, KeyError):
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"stub controller exited: {self.proc.stderr.read().decode()}")
            time.sleep(0.05)
        raise RuntimeError("stub controller did not become ready")

    def control(self, **knobs: Any) -> None:
        """Replace ``stub-control.json`` (hold_reports, until_retry, reject_reports_of, evacuate)."""
        control = self.root / "stub-control.json"
        tmp = control.with_suffix(".tmp")
        tmp.write_text(json.dumps(knobs))
        os.replace(tmp, control)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> StubController:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def journal(root: Path) -> list[dict[str, Any]]:
    path = Path(root) / "journal.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def read_spec(root: Path, job_id: str) -> dict[str, Any]:
    return json.loads((Path(root) / "requests" / job_id / "spec.json").read_text())


def read_report(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
