"""The read side of the layout seam: one reader per layout, picked in one place."""

from __future__ import annotations

import pytest
from koochak.loop.checkpoint import (
    checkpoint_objects,
    layout_read,
    load,
    resolve_auto_resume,
    save,
    sharded_read,
)
from koochak.loop.checkpoint.export import export_weights
from koochak.loop.checkpoint.sharded_read import StoredTensor, open_candidate
from koochak.storage import artifact
from koochak.storage.store import LocalStore

NAME = "step000000003.pt"


@pytest.mark.parametrize("parts, reader", [(1, layout_read.ONE_FILE), (2, layout_read.PARTS)])
def test_each_layout_has_its_reader_and_every_read_goes_through_it(
    tmp_path, make_ckpt, assert_same, monkeypatch, parts, reader
):
    store = LocalStore(tmp_path / "run")
    ckpt = make_ckpt(3)
    save(ckpt, store, parts=parts)
    head = store.get(NAME)
    assert layout_read.layout_of(head) is reader
    assert_same(ckpt, reader.read(store, NAME, head, "here"))
    assert reader.objects(NAME, head, "here") == checkpoint_objects(store, NAME)
    assert checkpoint_objects(store, NAME)[-2:] == [NAME, NAME + artifact.READY_SUFFIX]
    picked = []
    real = layout_read.layout_of
    spy = lambda h: picked.append(real(h)) or real(h)  # noqa: E731
    monkeypatch.setattr(layout_read, "layout_of", spy)
    monkeypatch.setattr(sharded_read, "layout_of", spy)  # the sharded selection asks it too
    load(store, NAME)
    resolve_auto_resume(store)
    _, lazy = open_candidate(store, NAME)  # the sharded selection, on one process
    export_weights(store, tmp_path / "out")
    assert picked == [reader] * 4
    if reader is layout_read.PARTS:  # read lazily: references for each rank to read its slabs
        assert isinstance(lazy["model"]["0.weight"], StoredTensor)
