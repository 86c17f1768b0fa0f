"""Objects that are not what they claim: FIFOs and symlinks under a LocalStore root never block
or get followed, and format readers accept only the exact integer version and no duplicate
fields (issue 9, defects 3 and 6)."""

from __future__ import annotations

import json
import os
import threading

import pytest
from koochak.storage.artifact import (
    InvalidArtifact,
    publish,
    read_ready_manifest,
    read_verified,
    write_ready_manifest,
)
from koochak.storage.store import LocalStore
from koochak.storage.stores_file import load_stores_file


def _finishes(call, seconds=30.0):
    """Run ``call`` in a thread; the error it raised, or a failure if it is still blocked."""
    outcome: list[BaseException | None] = []

    def run():
        try:
            call()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, "the call is still blocked (it opened a FIFO without O_NONBLOCK)"
    return outcome[0]


@pytest.mark.parametrize("read", ["get", "range", "open"])
def test_a_fifo_object_is_missing_at_once_never_a_hang(tmp_path, read):
    os.mkfifo(tmp_path / "pack.tar")
    store = LocalStore(tmp_path)
    call = {
        "get": lambda: store.get("pack.tar"),
        "range": lambda: store.get("pack.tar", 0, 10),
        "open": lambda: store.open("pack.tar").close(),
    }[read]
    error = _finishes(call)
    assert isinstance(error, FileNotFoundError) and "FIFO" in str(error)
    with pytest.raises(FileNotFoundError):
        store.stat("pack.tar")


def test_a_symlinked_key_is_not_an_object(tmp_path):
    (tmp_path / "real").write_bytes(b"data")
    os.symlink("real", tmp_path / "alias")
    store = LocalStore(tmp_path)
    for call in (
        lambda: store.get("alias"),
        lambda: store.open("alias"),
        lambda: store.stat("alias"),
    ):
        with pytest.raises(FileNotFoundError, match="symlink"):
            call()
    assert store.get("real") == b"data"


def _rewrite_manifest(path, edit):
    doc = json.loads(path.read_text())
    text = edit(doc)
    os.chmod(path, 0o644)
    path.write_text(text)


@pytest.mark.parametrize(
    "edit",
    [
        lambda doc: json.dumps({**doc, "version": True}),
        lambda doc: json.dumps({**doc, "version": 1.0}),
        lambda doc: json.dumps(doc)[:-1] + ', "version": 1}',  # duplicate field
    ],
    ids=["true", "1.0", "duplicate"],
)
def test_ready_manifest_version_must_be_the_integer_one_without_duplicates(tmp_path, edit):
    store = LocalStore(tmp_path / "s")
    publish(store, "step000000001.pt", b"w")
    _rewrite_manifest(tmp_path / "s" / "step000000001.pt.ready.json", edit)
    with pytest.raises(InvalidArtifact, match="version|appears twice"):
        read_verified(store, "step000000001.pt")

    target = tmp_path / "out.bin"
    target.write_bytes(b"o")
    manifest = write_ready_manifest(target)
    _rewrite_manifest(manifest, edit)
    with pytest.raises(InvalidArtifact, match="version|appears twice"):
        read_ready_manifest(target)


@pytest.mark.parametrize("version", ["true", "1.0"])
def test_stores_file_version_must_be_the_integer_one(tmp_path, version):
    file = tmp_path / "stores.yaml"
    file.write_text(f"version: {version}\nstores: {{a: {{root: {tmp_path}}}}}\n")
    with pytest.raises(ValueError, match=f"{file}.*version"):
        load_stores_file(file)


def test_a_fifo_planted_as_a_ready_manifest_is_refused_at_once(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"o")
    os.mkfifo(tmp_path / "out.bin.ready.json")
    error = _finishes(lambda: read_ready_manifest(target))
    assert isinstance(error, InvalidArtifact) and "not a regular file" in str(error)
