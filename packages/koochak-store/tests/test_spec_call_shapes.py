"""The spec's store-side calls work as written, without torch: publish(store, name, data,
keep_last_k=k) with no pattern=, the latest.pt pointer on directory stores, prune_keep_last_k,
mkdir_p and the atomic file writers (issue 9, section 1)."""

from __future__ import annotations

import os
import stat

import pytest
from koochak.storage import (
    atomic_write_bytes,
    atomic_write_text,
    mkdir_p,
    prune_keep_last_k,
    publish,
)
from koochak.storage.artifact import READY_SUFFIX, numbered_pattern, published_candidates
from koochak.storage.keys import TEMP_PREFIX
from koochak.storage.store import LocalStore


def _name(step: int) -> str:
    return f"step{step:09d}.pt"


def _keys(store: LocalStore) -> set[str]:
    return {info.key for info in store.list()}


@pytest.mark.parametrize("mode", ["link", "exclusive"])
def test_keep_last_k_without_pattern_prunes_numbered_names_manifest_first(tmp_path, mode):
    store = LocalStore(tmp_path / "ckpt", publish=mode)
    deleted = []
    real_delete = store.delete

    def recording_delete(key):
        if not key.endswith(".publishing.json"):  # publish's own intent record, dropped at the end
            deleted.append(key)
        real_delete(key)

    store.delete = recording_delete  # type: ignore[method-assign]
    for step in (0, 100, 200, 300):
        publish(store, _name(step), f"s{step}".encode(), keep_last_k=2)
    assert _keys(store) == {_name(s) + sfx for s in (200, 300) for sfx in ("", READY_SUFFIX)}
    assert deleted == [
        _name(0) + READY_SUFFIX, _name(0),
        _name(100) + READY_SUFFIX, _name(100),
    ]  # fmt: skip


def test_directory_store_keeps_latest_pt_by_default_and_exclusive_never(tmp_path):
    link = LocalStore(tmp_path / "link")
    publish(link, _name(1), b"one", keep_last_k=3)
    publish(link, _name(2), b"two", keep_last_k=3)
    latest = tmp_path / "link" / "latest.pt"
    assert os.readlink(latest) == _name(2) and latest.read_bytes() == b"two"

    exclusive = LocalStore(tmp_path / "excl", publish="exclusive")
    publish(exclusive, _name(1), b"one", keep_last_k=3)
    assert not os.path.lexists(tmp_path / "excl" / "latest.pt")


def test_latest_sits_beside_a_nested_numbered_name_and_can_be_turned_off(tmp_path):
    store = LocalStore(tmp_path)
    publish(store, "runs/a/model-0007.bin", b"x", keep_last_k=1)
    assert os.readlink(tmp_path / "runs/a/latest.bin") == "model-0007.bin"
    publish(store, "runs/b/step000000001.pt", b"y", latest=False)
    assert not os.path.lexists(tmp_path / "runs/b/latest.pt")
    publish(store, "notes.txt", b"z")  # no number: nothing to point a latest at
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "notes.txt" + READY_SUFFIX, "runs"]


def test_numbered_pattern_takes_the_last_run_of_digits_in_the_last_segment():
    assert numbered_pattern("step000000100.pt") == r"step(\d+)\.pt"
    assert numbered_pattern("run2/v1-step000000100.pt") == r"run2/v1\-step(\d+)\.pt"
    with pytest.raises(ValueError, match="pattern="):
        numbered_pattern("run2/final.pt")


def test_keep_last_k_on_an_unnumbered_name_asks_for_a_pattern(tmp_path):
    with pytest.raises(ValueError, match="has no number.*pattern="):
        publish(LocalStore(tmp_path), "final.pt", b"x", keep_last_k=2)
    with pytest.raises(ValueError, match="does not fully match"):
        publish(LocalStore(tmp_path), "step1.pt", b"x", keep_last_k=2, pattern=r"ep(\d+)\.pt")


def test_prune_keep_last_k_keeps_the_highest_committed_pairs(tmp_path):
    store = LocalStore(tmp_path)
    for step in (5, 1, 30, 7):
        publish(store, _name(step), b"x", latest=False)
    store.put(_name(2), b"being published: no manifest yet")
    store.put("notes.txt", b"keep")
    removed = prune_keep_last_k(tmp_path, r"step(\d+)\.pt", 2)
    assert removed == [_name(5), _name(1)]
    assert _keys(store) == {
        _name(30), _name(30) + READY_SUFFIX, _name(7), _name(7) + READY_SUFFIX,
        _name(2), "notes.txt",
    }  # fmt: skip
    assert published_candidates(store, r"step(\d+)\.pt") == [(30, _name(30)), (7, _name(7))]
    with pytest.raises(ValueError, match="k="):
        prune_keep_last_k(tmp_path, r"step(\d+)\.pt", -1)


def test_mkdir_p_makes_parents_accepts_existing_and_names_a_file_in_the_way(tmp_path):
    made = mkdir_p(tmp_path / "a" / "b" / "c")
    assert made.is_dir() and made == tmp_path / "a" / "b" / "c"
    assert mkdir_p(str(made)) == made
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(NotADirectoryError, match="file"):
        mkdir_p(tmp_path / "file" / "sub")


def test_atomic_write_replaces_whole_leaves_no_temp_and_applies_mode(tmp_path):
    target = tmp_path / "config.json"
    target.write_bytes(b"old")
    assert atomic_write_bytes(target, b"new bytes", mode=0o600) == target
    assert target.read_bytes() == b"new bytes"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    atomic_write_text(target, "texte \u00e9")
    assert target.read_text(encoding="utf-8") == "texte \u00e9"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(TEMP_PREFIX)]


def test_atomic_write_create_only_never_replaces(tmp_path):
    target = tmp_path / "once.txt"
    atomic_write_text(target, "first", overwrite=False)
    with pytest.raises(FileExistsError):
        atomic_write_bytes(target, b"second", overwrite=False)
    assert target.read_text() == "first"
    assert os.listdir(tmp_path) == ["once.txt"]
    with pytest.raises(TypeError, match="atomic_write_text"):
        atomic_write_bytes(target, "a str")  # type: ignore[arg-type]


def test_a_real_latest_file_is_kept_and_only_an_explicit_latest_is_an_error(tmp_path, caplog):
    store = LocalStore(tmp_path)
    (tmp_path / "latest.pt").write_bytes(b"an older tool's copy")
    publish(store, _name(1), b"one", keep_last_k=2)  # the default pointer steps aside
    assert (tmp_path / "latest.pt").read_bytes() == b"an older tool's copy"
    assert "real file" in caplog.text
    with pytest.raises(FileExistsError):
        publish(store, _name(2), b"two", latest="latest.pt")
    assert (tmp_path / "latest.pt").read_bytes() == b"an older tool's copy"
