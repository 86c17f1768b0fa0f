"""A committed checkpoint with an object gone falls back to a lower one (issue 27, defect 5).

The spec: "A missing or invalid candidate falls back to a lower one; any other I/O error is
raised". On a store whose reads settle, the missing object is waited for first
(``read_settle_seconds``); still missing, the candidate is invalid, with one line naming it.
"""

from __future__ import annotations

import logging
import os
import threading

import pytest
from koochak.loop.checkpoint import best, load, resolve_auto_resume, save
from koochak.loop.checkpoint.parts_index import part_key
from koochak.loop.checkpoint.selection import resolve_sharded
from koochak.storage.store import LocalStore

NAME = "step000000002.pt"
OBJECTS = [("one file", NAME), ("index", NAME), ("part 0", part_key(NAME, 0, 0)),
           ("part 1", part_key(NAME, 0, 1))]  # fmt: skip


def _saved(root, make_ckpt, what, **store_options):
    parts = 1 if what == "one file" else 2
    store = LocalStore(root, **store_options)
    save(make_ckpt(1), store, parts=parts)
    save(make_ckpt(2), store, parts=parts)
    return store


@pytest.mark.parametrize("what, key", OBJECTS)
def test_a_missing_object_falls_back_with_its_name(tmp_path, make_ckpt, caplog, what, key):
    store = _saved(tmp_path, make_ckpt, what)
    os.unlink(tmp_path / key)
    with caplog.at_level(logging.WARNING, logger="koochak"):
        path, ckpt = resolve_auto_resume(store)
    assert ckpt["step"] == 1 and path.endswith("step000000001.pt")
    lines = [r.getMessage() for r in caplog.records if key in r.getMessage()]
    assert len(lines) == 1 and "missing" in lines[0] and "\n" not in lines[0], caplog.text
    assert best(store, "loss") is not None  # best() passes it over too
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="koochak"):
        path, ckpt = resolve_sharded(store)  # the FSDP selection, on one process
    assert ckpt["step"] == 1
    assert any(key in r.getMessage() for r in caplog.records), caplog.text


@pytest.mark.parametrize("what, key", OBJECTS)
def test_a_settling_store_waits_before_falling_back(tmp_path, make_ckpt, caplog, what, key):
    store = _saved(tmp_path, make_ckpt, what, read_settle_seconds=0.2)
    os.unlink(tmp_path / key)
    with caplog.at_level(logging.INFO, logger="koochak"):
        assert resolve_auto_resume(store).checkpoint["step"] == 1
    assert "not visible yet" in caplog.text  # it waited for the object first
    assert "read_settle_seconds=0.2" in caplog.text


@pytest.mark.parametrize("what, key", OBJECTS)
def test_an_object_that_shows_up_while_settling_is_selected(
    tmp_path, make_ckpt, assert_same, what, key
):
    store = _saved(tmp_path, make_ckpt, what, read_settle_seconds=60)
    hidden = tmp_path / f".hidden-{key}"
    os.rename(tmp_path / key, hidden)
    back = threading.Timer(0.3, os.rename, (hidden, tmp_path / key))
    back.start()
    try:
        path, ckpt = resolve_auto_resume(store)
    finally:
        back.join()
    assert path.endswith(NAME)
    assert_same(load(store, NAME), ckpt)
