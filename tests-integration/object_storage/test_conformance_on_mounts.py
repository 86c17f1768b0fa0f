"""The Store conformance suite on both real mounts, with the settings each mount needs.

``settle_seconds`` is 0 here: it only delays the read-back until another client could have
replaced the object, which test_collisions.py checks with the full setting; waiting it out after
each of the suite's puts would only make CI slower.
"""

from __future__ import annotations

import pytest
from koochak.storage.store import LocalStore
from koochak.storage.testing import StoreConformance


class TestLocalStoreOnMounts(StoreConformance):
    @pytest.fixture
    def store(self, mount_dir):
        return LocalStore(mount_dir.path / "store", **{**mount_dir.settings, "settle_seconds": 0})
