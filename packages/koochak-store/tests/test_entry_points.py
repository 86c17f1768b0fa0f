"""`koochak.stores` entry points: an installed package can provide a scheme."""

from __future__ import annotations

import textwrap

import pytest
from koochak.storage.store import LocalStore, open_store


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    """A real (tiny) installed distribution on sys.path exposing `plugtest` under koochak.stores."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "koochak_plugtest.py").write_text(
        textwrap.dedent(f"""
        from koochak.storage.store import LocalStore

        def make(path):
            return LocalStore({str(tmp_path / "plugin-root")!r} + "/" + path, publish="exclusive")

        def broken(path):
            return "not a store"
    """)
    )
    dist = site / "koochak_plugtest-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: koochak-plugtest\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[koochak.stores]\nplugtest = koochak_plugtest:make\nplugbroken = koochak_plugtest:broken\n"
        "plugcrash = koochak_plugcrash:make\n"
    )
    (site / "koochak_plugcrash.py").write_text("raise RuntimeError('no credentials here')\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("KOOCHAK_STORES", str(tmp_path / "no-stores-file.yaml"))
    return tmp_path / "plugin-root"


def test_entry_point_factory_receives_the_path_after_the_scheme(installed_plugin):
    store = open_store("plugtest://bucket/prefix")
    assert isinstance(store, LocalStore)
    assert store.root == installed_plugin / "bucket" / "prefix"
    assert store.publish == "exclusive"


def test_entry_point_returning_a_non_store_is_an_error(installed_plugin):
    with pytest.raises(TypeError, match="plugbroken"):
        open_store("plugbroken://x")


def test_entry_point_that_fails_to_import_is_named_in_one_error(installed_plugin):
    with pytest.raises(
        ImportError, match=r"'plugcrash' = 'koochak_plugcrash:make'.*no credentials"
    ):
        open_store("plugcrash://x")
