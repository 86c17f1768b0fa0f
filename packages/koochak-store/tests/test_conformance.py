"""The Store conformance suite, run for every Store this package ships."""

from __future__ import annotations

import pytest
from koochak.storage.store import LocalStore
from koochak.storage.testing import FaultyStore, StoreConformance


class TestLocalStoreLink(StoreConformance):
    @pytest.fixture
    def store(self, tmp_path):
        return LocalStore(tmp_path / "store", publish="link")


class TestLocalStoreExclusive(StoreConformance):
    @pytest.fixture
    def store(self, tmp_path):
        return LocalStore(tmp_path / "store", publish="exclusive")


class TestLocalStoreForFuseMounts(StoreConformance):
    """The settings the stores file recommends for object-storage mounts."""

    @pytest.fixture
    def store(self, tmp_path):
        return LocalStore(
            tmp_path / "store",
            publish="exclusive",
            fsync=False,
            verify_readback=True,
            settle_seconds=0.1,  # every put reads back this long after its rename
            read_settle_seconds=1.0,
        )


class TestFaultyStoreWithShortWritesAndReads(StoreConformance):
    """Every write and read moves only half of what was asked: callers must loop."""

    @pytest.fixture
    def store(self, tmp_path):
        from koochak.storage.testing import Fault

        faults = [
            Fault("write", times=10**9, mode="short"),
            Fault("read", times=10**9, mode="short"),
        ]
        return FaultyStore(tmp_path / "store", faults, verify_readback=True)
