"""Shared test parts: a recording publisher, a hand-turned clock, loop-shaped info dicts."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import pytest
from koochak.events import Event


class RecordingPublisher:
    """Keeps every event with the ``wait`` it was published with; can be told to fail."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.waits: list[bool] = []
        self.fail_with: BaseException | None = None

    def __call__(self, event: Event, *, wait: bool = False) -> None:
        if self.fail_with is not None:
            raise self.fail_with
        self.events.append(event)
        self.waits.append(wait)

    def kinds(self) -> list[str]:
        return [e.kind for e in self.events]

    def of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass(frozen=True)
class FakePublication:
    """Shaped like koochak.storage.artifact.Publication (not imported: a lower layer's tests)."""

    artifact_id: str
    key: str
    size: int
    sha256: str
    manifest_key: str
    path: str | None


def checkpoint_info(directory: str, step: int, data: bytes = b"weights") -> dict[str, Any]:
    """An on_checkpoint info dict as the loop builds it for ``step{N:09d}.pt``."""
    name = f"step{step:09d}.pt"
    path = f"{directory}/{name}"
    pub = FakePublication(
        artifact_id=f"checkpoint/{name}",
        key=name,
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        manifest_key=f"{name}.ready.json",
        path=path,
    )
    return {"step": step, "path": path, "checkpoint": {"model": object()}, "publication": pub}


def start_info(rank: int = 0, step: int = 0, max_steps: int | None = 100) -> dict[str, Any]:
    return {
        "step": step,
        "max_steps": max_steps,
        "train_cfg": {"lr": 0.1, "huge": "x" * 100_000},
        "config_json": {"train": {"lr": 0.1}},
        "model": object(),
        "num_params": 10,
        "rank": rank,
        "world_size": 2,
        "out_dir": "/tmp/run",
        "resumed": False,
        "resume_path": None,
    }


@pytest.fixture
def publisher() -> RecordingPublisher:
    return RecordingPublisher()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def ckpt_info():
    """Factory: ckpt_info(directory, step, data=b"...") -> an on_checkpoint info dict."""
    return checkpoint_info


@pytest.fixture
def train_start():
    """Factory: train_start(rank=0, step=0, max_steps=100) -> an on_train_start info dict."""
    return start_info


@pytest.fixture(autouse=True)
def _no_torchrun_rank(monkeypatch):
    """Hooks fall back to $RANK before on_train_start; tests start from rank 0 unless they say."""
    monkeypatch.delenv("RANK", raising=False)
