"""The read side of the layout seam: one layout object per layout, picked in one place."""

from __future__ import annotations

import pytest
from koochak.loop.checkpoint import (
    checkpoint_objects,
    layouts,
    load,
    resolve_auto_resume,
    save,
    selection,
)
from koochak.loop.checkpoint.export import export_weights
from koochak.loop.checkpoint.layouts.one_file import ONE_FILE
from koochak.loop.checkpoint.layouts.parts import PARTS
from koochak.loop.checkpoint.selection import open_candidate
from koochak.loop.checkpoint.sharded_read import StoredTensor
from koochak.storage import artifact
from koochak.storage.store import LocalStore

NAME = "step000000003.pt"


@pytest.mark.parametrize("parts, layout", [(1, ONE_FILE), (2, PARTS)])
def test_each_layout_reads_its_own_and_every_read_asks_layout_of(
    tmp_path, make_ckpt, assert_same, monkeypatch, parts, layout
):
    store = LocalStore(tmp_path / "run")
    ckpt = make_ckpt(3)
    save(ckpt, store, parts=parts)
    head = store.get(NAME)
    assert layouts.layout_of(head) is layout
    assert_same(ckpt, layout.read(store, NAME, head, "here"))
    assert layout.objects(NAME, head) == checkpoint_objects(store, NAME)
    assert checkpoint_objects(store, NAME)[-2:] == [NAME, NAME + artifact.READY_SUFFIX]
    picked = []
    real = layouts.layout_of
    spy = lambda h: picked.append(real(h)) or real(h)  # noqa: E731
    monkeypatch.setattr(layouts, "layout_of", spy)
    monkeypatch.setattr(selection, "layout_of", spy)  # the sharded selection asks it too
    load(store, NAME)
    resolve_auto_resume(store)
    _, lazy = open_candidate(store, NAME)  # the sharded selection, on one process
    export_weights(store, tmp_path / "out")
    assert len(picked) >= 3 and all(p is layout for p in picked)
    if layout is PARTS:  # read lazily: references for each rank to read its slabs
        assert isinstance(lazy["model"]["0.weight"], StoredTensor)
