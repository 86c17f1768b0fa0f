"""S3Store keeps the Store contract: koochak.storage.testing's conformance suite on moto."""

from __future__ import annotations

import pytest
from koochak.storage.testing import StoreConformance


class TestS3StoreOnMoto(StoreConformance):
    @pytest.fixture
    def store(self, moto_store):
        return moto_store
