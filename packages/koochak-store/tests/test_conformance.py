"""The Store conformance suite, run for every Store this package ships."""

from __future__ import annotations

import pytest
from koochak.storage.store import LocalStore
from koochak.storage.testing import FaultyStore, StoreConformance, ThrottledStore


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


class TestThrottledStore(StoreConformance):
    """The throttling wrapper keeps the contract of the store it wraps."""

    @pytest.fixture
    def store(self, tmp_path):
        return ThrottledStore(LocalStore(tmp_path / "store"), 1e12)


def test_throttled_store_makes_bytes_wait_for_their_share_of_the_link(tmp_path):
    waits: list[float] = []
    store = ThrottledStore(LocalStore(tmp_path), 1e6, sleep=waits.append)  # 1 MB/s, no sleeping
    store.put("a", b"x" * 3_000_000)
    # Each chunk waits until the link has carried everything before it and itself (the fake
    # sleep lets no time pass): the last one until 3 MB at 1 MB/s, less the calls' own time.
    assert len(waits) == 3 and waits == sorted(waits) and 2.5 < waits[-1] <= 3.0
    waits.clear()
    assert store.get("a", 0, 500_000) == b"x" * 500_000
    store.get("a", 0, 500_000)  # the second read queues behind the first on the one read link
    assert waits[1] > waits[0] and 0.9 < waits[1] <= 1.0
    waits.clear()
    store.stat("a"), store.list(), store.delete("a")  # metadata is not slowed
    assert waits == []
    with pytest.raises(ValueError, match="bytes_per_second must be > 0"):
        ThrottledStore(LocalStore(tmp_path), 0)
