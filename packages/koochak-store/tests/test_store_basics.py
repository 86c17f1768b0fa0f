"""LocalStore, validate_key, open_store and register_store: the basics every engineer relies on."""

from __future__ import annotations

import io
import os

import pytest
from koochak.storage.store import (
    LocalStore,
    ObjectInfo,
    Store,
    open_store,
    register_store,
    validate_key,
)


@pytest.mark.parametrize("publish", ["link", "exclusive"])
def test_put_then_get_round_trips_bytes_streams_and_iterables(tmp_path, publish):
    store = LocalStore(tmp_path, publish=publish)
    a = store.put("a.bin", b"abc")
    b = store.put("dir/b.bin", io.BytesIO(b"x" * 100))
    c = store.put("dir/sub/c.bin", iter([b"12", bytearray(b"34"), memoryview(b"56")]))
    assert (a.size, b.size, c.size) == (3, 100, 6)
    assert store.get("a.bin") == b"abc"
    assert store.get("dir/sub/c.bin", 1, 4) == b"234"
    with store.open("dir/b.bin") as f:
        assert f.read() == b"x" * 100
    assert [i.key for i in store.list()] == ["a.bin", "dir/b.bin", "dir/sub/c.bin"]
    assert store.stat("a.bin") == ObjectInfo("a.bin", 3, a.mtime_ns)


def test_localstore_satisfies_the_store_protocol(tmp_path):
    assert isinstance(LocalStore(tmp_path), Store)


@pytest.mark.parametrize(
    "key", ["", "/abs", "a/../b", "..", "a//b", "a/", "./a", "a/./b", "a?b", "a#b", "a\\b"]
)
def test_validate_key_rejects_unsafe_keys(key):
    with pytest.raises(ValueError):
        validate_key(key)


def test_validate_key_accepts_relative_paths():
    assert validate_key("a/b-c_d.e/f.bin") == "a/b-c_d.e/f.bin"
    assert validate_key(".hidden") == ".hidden"


def test_open_store_maps_paths_and_file_uris_to_localstore(tmp_path):
    assert open_store(str(tmp_path)).root == tmp_path
    assert open_store(tmp_path).root == tmp_path
    assert open_store(f"file://{tmp_path}").root == tmp_path
    store = LocalStore(tmp_path)
    assert open_store(store) is store


def test_open_store_uses_registered_factory(tmp_path):
    seen = []

    def factory(path: str) -> LocalStore:
        seen.append(path)
        return LocalStore(tmp_path / path)

    register_store("koochaktest", factory)
    store = open_store("koochaktest://datasets/foo")
    assert seen == ["datasets/foo"]
    assert store.root == tmp_path / "datasets" / "foo"


def test_open_store_unknown_scheme_names_it(tmp_path, monkeypatch):
    monkeypatch.setenv("KOOCHAK_STORES", str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match="nosuchscheme"):
        open_store("nosuchscheme://x")


def test_child_keeps_settings(tmp_path):
    store = LocalStore(tmp_path, publish="exclusive", fsync=False, read_settle_seconds=3)
    child = store.child("runs/exp0")
    assert child.root == tmp_path / "runs" / "exp0"
    assert (child.publish, child.fsync, child.read_settle_seconds) == ("exclusive", False, 3.0)
    child.put("x", b"1")
    assert store.get("runs/exp0/x") == b"1"


def test_bad_constructor_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="publish"):
        LocalStore(tmp_path, publish="rename")
    with pytest.raises(ValueError, match="read_settle_seconds"):
        LocalStore(tmp_path, read_settle_seconds=-1)


def test_put_leaves_no_temp_files(tmp_path):
    store = LocalStore(tmp_path)
    store.put("d/a", b"1")
    assert sorted(os.listdir(tmp_path / "d")) == ["a"]


def test_localstore_pickles_with_its_settings(tmp_path):
    # DataLoader workers started with spawn receive their store by pickling.
    import pickle

    from koochak.storage.profile import REMOTE_PROFILE

    store = LocalStore(tmp_path, publish="exclusive", fsync=False, read_settle_seconds=3,
                       profile=REMOTE_PROFILE)  # fmt: skip
    store.put("k", b"v")
    copy = pickle.loads(pickle.dumps(store))
    assert (copy.root, copy.publish, copy.fsync, copy.read_settle_seconds, copy.profile) == (
        store.root, "exclusive", False, 3.0, REMOTE_PROFILE,
    )  # fmt: skip
    assert copy.get("k") == b"v"
