"""artifact.claimed: hold a name's intent across several objects, then publish under it."""

from __future__ import annotations

import dataclasses
import time

import pytest
from koochak.storage import _publish_intent
from koochak.storage.artifact import READY_SUFFIX, claimed, publish, read_verified
from koochak.storage.store import LocalStore

NAME = "step000000007.pt"
INTENT = NAME + _publish_intent.INTENT_SUFFIX


def test_the_claim_stands_for_the_block_and_publish_under_it_keeps_it(tmp_path):
    store = LocalStore(tmp_path)
    with claimed(store, NAME) as intent:
        assert store.get(INTENT) == intent.to_bytes()
        store.put(NAME + ".extra", b"an object of this publication")  # written while held
        publish(store, NAME, b"mine", intent=intent)
        assert store.get(INTENT) == intent.to_bytes()  # not dropped: the block owns it
        with pytest.raises(FileExistsError, match="being published by pid"):
            publish(store, NAME, b"another publisher")  # a second claim meets the first
    assert {info.key for info in store.list()} == {NAME, NAME + READY_SUFFIX, NAME + ".extra"}
    assert read_verified(store, NAME)[1] == b"mine"


def test_a_live_claim_refuses_and_touches_nothing_a_dead_one_is_taken_over(tmp_path, caplog):
    store = LocalStore(tmp_path)
    live = _publish_intent.ours(NAME)
    store.put(INTENT, live.to_bytes())
    with pytest.raises(FileExistsError, match="being published by pid"), claimed(store, NAME):
        pytest.fail("entered the block while another publisher holds the name")
    assert store.get(INTENT) == live.to_bytes()
    store.delete(INTENT)
    store.put(INTENT, dataclasses.replace(live, deadline=time.time() - 10 * 3600).to_bytes())
    with claimed(store, NAME) as intent:
        assert intent.deadline > time.time()
    assert "is gone" in caplog.text
    assert not any(info.key == INTENT for info in store.list())


def test_an_intent_for_another_name_is_refused(tmp_path):
    store = LocalStore(tmp_path)
    with claimed(store, NAME) as intent, pytest.raises(ValueError, match="claims"):
        publish(store, "step000000008.pt", b"x", intent=intent)
