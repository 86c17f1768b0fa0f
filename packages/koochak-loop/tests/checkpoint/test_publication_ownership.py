"""A parts publish never deletes what another live publisher wrote (issue 27, defect 1)."""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest
from koochak.loop.checkpoint import load, publish, resolve_auto_resume
from koochak.loop.checkpoint.parts_index import parse_index
from koochak.loop.checkpoint.serialization import split_checkpoint, write_checkpoint_parts
from koochak.storage import _publish_intent, artifact
from koochak.storage.store import LocalStore

NAME = "step000000005.pt"


def _snapshot(store):
    return {info.key: store.get(info.key) for info in store.list("") if info.key.startswith(NAME)}


def _half_published(store, ckpt, *, deadline=None):
    """Publisher A, mid-save: its intent stands and its parts are written, no index yet."""
    intent = _publish_intent.ours(NAME)
    if deadline is not None:
        intent = dataclasses.replace(intent, deadline=deadline)
    store.put(NAME + _publish_intent.INTENT_SUFFIX, intent.to_bytes())
    return write_checkpoint_parts(store, NAME, split_checkpoint(ckpt), 2)


def test_a_publish_never_deletes_a_live_publishers_parts(tmp_path, make_ckpt, assert_same):
    store = LocalStore(tmp_path)
    publish(store, "step000000004.pt", make_ckpt(4), parts=2)
    theirs = make_ckpt(5)
    index = _half_published(store, theirs)
    before = _snapshot(store)
    with pytest.raises(FileExistsError, match="being published by pid"):
        publish(store, NAME, make_ckpt(50), parts=2)  # B: the same name, other values
    assert _snapshot(store) == before  # nothing of A's deleted or replaced, nothing of B's left
    # A commits its index: the checkpoint it commits is whole, and resume selects it.
    store.delete(NAME + _publish_intent.INTENT_SUFFIX)
    artifact.publish(store, NAME, index, kind="checkpoint", latest=None)
    path, ckpt = resolve_auto_resume(store)
    assert path.endswith(NAME)
    assert_same(theirs, ckpt)


def test_a_dead_publishers_leftovers_are_cleared_and_replaced(
    tmp_path, make_ckpt, assert_same, caplog
):
    store = LocalStore(tmp_path)
    _half_published(store, make_ckpt(5, width=24), deadline=time.time() - 10 * 3600)
    store.put(NAME, b'{"stale": "index"}')  # it even wrote its index, never its manifest
    ours = make_ckpt(5)
    with caplog.at_level(logging.WARNING, logger="koochak"):
        publish(store, NAME, ours, parts=3)
    assert "is gone" in caplog.text
    index = parse_index(store.get(NAME), NAME, NAME)
    keys = {key for key in _snapshot(store)}
    assert keys == {part.key for part in index.parts} | {NAME, NAME + artifact.READY_SUFFIX}
    assert_same(ours, load(store, NAME))


def test_a_failed_parts_publish_deletes_only_its_own_parts(tmp_path, make_ckpt):
    other = tmp_path / "step000000005.pt.part-99999-00000"  # not a key this publish writes

    class ManifestFails(LocalStore):
        def put(self, key, data, **kwargs):
            if key.endswith(artifact.READY_SUFFIX):
                other.write_bytes(b"appeared while this publish ran")
                raise OSError(28, "No space left on device", key)
            return super().put(key, data, **kwargs)

    with pytest.raises(OSError, match="No space left"):
        publish(ManifestFails(tmp_path), NAME, make_ckpt(5), parts=2)
    # Its own parts, index and intent are gone; the object it did not write stays.
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        other.name
    ]


def test_resaving_a_checkpoint_in_parts_as_one_file_leaves_no_part(
    tmp_path, make_ckpt, assert_same
):
    store = LocalStore(tmp_path)
    publish(store, NAME, make_ckpt(5, width=24), parts=3)
    again = make_ckpt(5)
    publish(store, NAME, again)  # the same step, now one file (a resumed run, parts: 1)
    assert set(_snapshot(store)) == {NAME, NAME + artifact.READY_SUFFIX}
    assert_same(again, load(store, NAME))


@pytest.mark.parametrize("parts", [1, 2])
def test_a_live_publishers_committed_name_is_not_touched(tmp_path, make_ckpt, parts):
    store = LocalStore(tmp_path)
    publish(store, NAME, make_ckpt(5), parts=2)
    store.put(NAME + _publish_intent.INTENT_SUFFIX, _publish_intent.ours(NAME).to_bytes())
    before = _snapshot(store)  # a live publisher is replacing the committed step 5
    with pytest.raises(FileExistsError):
        publish(store, NAME, make_ckpt(50), parts=parts)
    assert _snapshot(store) == before
