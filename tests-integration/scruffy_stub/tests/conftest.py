"""Fixtures for the stub's own tests: the stub imported as ``scruffy`` for either contract."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

STUB_DIR = Path(__file__).resolve().parents[1]
if str(STUB_DIR) not in sys.path:
    sys.path.insert(0, str(STUB_DIR))

import stub_harness  # noqa: E402


@pytest.fixture(params=["0.1.1", "newer"])
def contract(request) -> str:
    return request.param


@pytest.fixture
def scruffy(contract, monkeypatch):
    """The stub client module, freshly imported for ``contract``."""
    return stub_harness.load_client(contract, monkeypatch)


@pytest.fixture
def released(monkeypatch):
    return stub_harness.load_client("0.1.1", monkeypatch)


@pytest.fixture
def newer(monkeypatch):
    return stub_harness.load_client("newer", monkeypatch)


@pytest.fixture
def controller(tmp_path, contract):
    """A running stub controller over ``tmp_path/root`` (stopped after the test)."""
    ctl = stub_harness.StubController(tmp_path / "root", contract)
    with ctl:
        yield ctl
