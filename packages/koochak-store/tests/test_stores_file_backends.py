"""Stores-file entries for plugin stores: ``backend: NAME`` hands ``options`` to its factory.

This is how a site configures its own store (or koochak-store-s3) without koochak-store knowing
what the options mean; the file's rules (no secrets, strict keys) still apply.
"""

from __future__ import annotations

import textwrap

import pytest
from koochak.storage.profile import StoreProfile
from koochak.storage.store import _FACTORIES, LocalStore, open_store, register_store


@pytest.fixture
def stores(tmp_path, monkeypatch):
    path = tmp_path / "stores.yaml"
    monkeypatch.setenv("KOOCHAK_STORES", str(path))
    return path


@pytest.fixture
def lab_backend(tmp_path):
    calls: list[tuple[str, dict, StoreProfile | None]] = []

    def factory(path, *, options, profile):
        calls.append((path, options, profile))
        return LocalStore(tmp_path / "lab" / options["bucket"] / path)

    register_store("labstore", factory)
    yield calls
    _FACTORIES.pop("labstore", None)


def _write(path, text):
    path.write_text(textwrap.dedent(text))


def test_a_backend_entry_hands_its_options_and_profile_to_the_factory(
    stores, lab_backend, monkeypatch, tmp_path
):
    monkeypatch.setenv("LAB_ENDPOINT", "https://s3.lab.example")
    _write(
        stores,
        """
        version: 1
        stores:
          ckpt:
            backend: labstore
            options:
              bucket: runs
              endpoint: ${oc.env:LAB_ENDPOINT}
              single_writer: true
            profile:
              request_seconds: 0.02
              stream_bytes_per_second: 1GB
              concurrency: 16
              range_reads_scale: true
              part_bytes: 16MiB
              listing_cheap: true
        """,
    )
    store = open_store("ckpt://exp0/ckpts")
    assert isinstance(store, LocalStore)
    assert store.root == tmp_path / "lab" / "runs" / "exp0" / "ckpts"
    [(path, options, profile)] = lab_backend
    assert path == "exp0/ckpts"
    assert options == {
        "bucket": "runs",
        "endpoint": "https://s3.lab.example",
        "single_writer": True,
    }
    assert profile == StoreProfile(0.02, 1e9, 16, True, 16 << 20, True)


@pytest.mark.parametrize(
    "entry, message",
    [
        ("backend: labstore\n    root: /x", "unknown key stores.ckpt.root"),
        ("backend: labstore\n    publish: exclusive", "unknown key stores.ckpt.publish"),
        ("backend: labstore\n    options: [1, 2]", "stores.ckpt.options must be a mapping"),
        ("backend: 'not a name'", "stores.ckpt.backend="),
        ("backend: file", "root: instead"),
        ("backend: labstore\n    options:\n      secret_key: abc", "looks like a secret"),
        (
            "backend: labstore\n    options:\n      key: ${oc.env:AWS_SECRET_ACCESS_KEY}",
            "looks like a secret",
        ),
    ],
)
def test_bad_backend_entries_fail_naming_the_key(stores, lab_backend, entry, message):
    _write(stores, "version: 1\nstores:\n  ckpt:\n    " + entry + "\n")
    with pytest.raises(ValueError, match=message):
        open_store("ckpt://x")
    assert lab_backend == []


def test_a_backend_that_is_not_installed_says_so(stores):
    _write(stores, "version: 1\nstores:\n  ckpt:\n    backend: nosuchbackend\n")
    with pytest.raises(ValueError, match="names backend 'nosuchbackend'.*installed"):
        open_store("ckpt://x")


def test_a_factory_without_the_options_keyword_is_refused_with_the_fix(stores, tmp_path):
    register_store("plainstore", lambda path: LocalStore(tmp_path / path))
    try:
        _write(stores, "version: 1\nstores:\n  ckpt:\n    backend: plainstore\n")
        with pytest.raises(TypeError, match="options= and profile="):
            open_store("ckpt://x")
    finally:
        _FACTORIES.pop("plainstore", None)


def test_a_factory_refusing_its_options_names_the_entry(stores, tmp_path):
    def picky(path, *, options, profile):
        raise ValueError("unknown option colour")

    register_store("pickystore", picky)
    try:
        _write(stores, "version: 1\nstores:\n  ckpt:\n    backend: pickystore\n")
        with pytest.raises(ValueError, match="entry 'ckpt': options: unknown option colour"):
            open_store("ckpt://x")
    finally:
        _FACTORIES.pop("pickystore", None)


def test_a_backend_returning_something_else_than_a_store_is_refused(stores):
    register_store("notastore", lambda path, *, options, profile: object())
    try:
        _write(stores, "version: 1\nstores:\n  ckpt:\n    backend: notastore\n")
        with pytest.raises(TypeError, match="does not implement the Store protocol"):
            open_store("ckpt://x")
    finally:
        _FACTORIES.pop("notastore", None)
