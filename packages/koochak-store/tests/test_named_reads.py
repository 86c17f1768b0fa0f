"""Objects a manifest names are late, not absent: reads wait read_settle_seconds for them."""

from __future__ import annotations

import threading

import pytest
from koochak.storage.named import get_named, open_named, read_settle_seconds, stat_named
from koochak.storage.store import LocalStore


def test_a_late_object_is_waited_for(tmp_path):
    store = LocalStore(tmp_path, read_settle_seconds=5)
    threading.Timer(0.3, lambda: store.put("late.bin", b"here now")).start()
    assert get_named(store, "late.bin", named_by="index.json") == b"here now"
    assert stat_named(store, "late.bin", named_by="index.json").size == 8
    with open_named(store, "late.bin", named_by="index.json") as handle:
        assert handle.read(4) == b"here"


def test_after_the_wait_the_error_names_the_manifest(tmp_path):
    store = LocalStore(tmp_path, read_settle_seconds=0.2)
    with pytest.raises(FileNotFoundError, match="missing although index.json names it") as caught:
        get_named(store, "gone.bin", 0, 4, named_by="index.json")
    assert caught.value.filename.endswith("/gone.bin")


def test_a_store_without_the_setting_does_not_wait(tmp_path):
    class Plain:  # any Store; only LocalStore has read_settle_seconds
        location = "plain://x"

        def get(self, key, start=None, end=None):
            raise FileNotFoundError(key)

    assert read_settle_seconds(Plain()) == 0.0
    with pytest.raises(FileNotFoundError, match="read_settle_seconds=0"):
        get_named(Plain(), "k", named_by="m")
