"""The stores file: resolution, strict validation, no secrets, sizes, and live reloading."""

from __future__ import annotations

import os
import pathlib
import textwrap

import pytest
from koochak.storage.profile import StoreProfile
from koochak.storage.store import LocalStore, open_store
from koochak.storage.stores_file import load_stores_file, stores_file_path

EXAMPLE = (
    pathlib.Path(__file__).resolve().parents[3] / "examples" / "storage" / "stores.example.yaml"
)


def _write(path: pathlib.Path, text: str) -> pathlib.Path:
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def stores(tmp_path, monkeypatch):
    """A stores file in tmp_path, selected via $KOOCHAK_STORES."""
    path = tmp_path / "stores.yaml"
    monkeypatch.setenv("KOOCHAK_STORES", str(path))
    return path


def test_open_store_resolves_a_scheme_to_a_localstore_under_its_root(tmp_path, stores, monkeypatch):
    monkeypatch.setenv("USER", "ana")
    _write(
        stores,
        f"""
        version: 1
        stores:
          archive:
            root: {tmp_path}/tier/${{oc.env:USER}}
            publish: exclusive
            fsync: false
            verify_readback: true
            settle_seconds: 5
            read_settle_seconds: 900
            profile:
              request_seconds: 0.8
              stream_bytes_per_second: 120MB
              concurrency: 32
              range_reads_scale: true
              part_bytes: 64MiB
              listing_cheap: false
    """,
    )
    store = open_store("archive://datasets/foo")
    assert isinstance(store, LocalStore)
    assert store.root == tmp_path / "tier" / "ana" / "datasets" / "foo"
    assert (store.publish, store.fsync, store.verify_readback) == ("exclusive", False, True)
    assert (store.settle_seconds, store.read_settle_seconds) == (5.0, 900.0)
    assert store.profile == StoreProfile(0.8, 120_000_000, 32, True, 64 << 20, False)
    store.put("x.bin", b"1")
    assert (tmp_path / "tier" / "ana" / "datasets" / "foo" / "x.bin").read_bytes() == b"1"
    assert open_store("archive://").root == tmp_path / "tier" / "ana"


def test_the_same_path_under_two_schemes_names_two_tiers(tmp_path, stores):
    _write(
        stores,
        f"""
        version: 1
        stores:
          fast: {{root: {tmp_path}/fast}}
          slow: {{root: {tmp_path}/slow, publish: exclusive}}
    """,
    )
    assert open_store("fast://runs/a").root == tmp_path / "fast" / "runs" / "a"
    assert open_store("slow://runs/a").root == tmp_path / "slow" / "runs" / "a"


def test_a_change_to_the_file_is_picked_up_without_restart(tmp_path, stores):
    _write(stores, f"version: 1\nstores:\n  arc: {{root: {tmp_path}/one}}\n")
    assert open_store("arc://x").root == tmp_path / "one" / "x"
    _write(stores, f"version: 1\nstores:\n  arc: {{root: {tmp_path}/two, publish: exclusive}}\n")
    os.utime(stores, ns=(1, 1))  # even an edit that keeps the size is seen (mtime changed)
    store = open_store("arc://x")
    assert (store.root, store.publish) == (tmp_path / "two" / "x", "exclusive")


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ("version: 1\nstores: {a: {root: /x, publsh: link}}\n", "stores.a.publsh"),
        ("version: 1\nstores: {a: {root: /x}}\nextra: 1\n", "extra"),
        (
            "version: 1\nstores: {a: {root: /x, profile: {concurrency: 1, speed: 2}}}\n",
            "stores.a.profile.speed",
        ),
    ],
)
def test_unknown_keys_fail_naming_file_and_key(stores, body, named):
    _write(stores, body)
    with pytest.raises(ValueError) as caught:
        load_stores_file()
    assert str(stores) in str(caught.value) and named in str(caught.value)


@pytest.mark.parametrize(
    "body",
    [
        "version: 1\nstores: {a: {root: /x, password: hunter2}}\n",
        "version: 1\nstores: {a: {root: /x}}\naws_secret_access_key: abc\n",
        "version: 1\nstores: {a: {root: /x, api_key: abc}}\n",
        "version: 1\nstores: {a: {root: '/x/${oc.env:MY_TOKEN}'}}\n",
    ],
)
def test_secret_looking_keys_are_refused(stores, body):
    _write(stores, body)
    with pytest.raises(ValueError, match="no secrets"):
        load_stores_file()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("version: 2\nstores: {}\n", "version=2"),
        ("stores: {}\n", "field 'version' is missing"),
        ("version: 1\nstores: {a: {publish: link}}\n", "stores.a.root is required"),
        ("version: 1\nstores: {a: {root: relative/dir}}\n", "must be an absolute path"),
        ("version: 1\nstores: {a: {root: /x, publish: rename}}\n", "stores.a.publish='rename'"),
        ("version: 1\nstores: {a: {root: /x, fsync: 'no'}}\n", "stores.a.fsync"),
        ("version: 1\nstores: {a: {root: /x, read_settle_seconds: -1}}\n", "read_settle_seconds"),
        ("version: 1\nstores: {a: {root: /x}, a: {root: /y}}\n", "duplicate key 'a'"),
        (
            "version: 1\nstores: {a: {root: '/x/${oc.env:KOOCHAK_UNSET_VAR}'}}\n",
            "KOOCHAK_UNSET_VAR",
        ),
        ("version: 1\nstores: {file: {root: /x}}\n", "'file'"),
        ("version: 1\nstores: {a: {root: /x, profile: {concurrency: 1}}}\n", "missing"),
        (
            "version: 1\nstores: {a: {root: /x, profile: {request_seconds: 1, stream_bytes_per_second: 12Q,"
            " concurrency: 1, range_reads_scale: true, part_bytes: 1M, listing_cheap: true}}}\n",
            "stream_bytes_per_second",
        ),
        ("version: 1\nstores: [a, b]\n", "'stores' must map"),
        ("version: 1\nstores: {a: {root: /x}\n", "not valid YAML"),
    ],
)
def test_bad_values_fail_naming_file_and_field(stores, monkeypatch, body, message):
    monkeypatch.delenv("KOOCHAK_UNSET_VAR", raising=False)
    _write(stores, body)
    with pytest.raises(ValueError) as caught:
        load_stores_file()
    assert message in str(caught.value) and str(stores) in str(caught.value)


def test_an_unresolvable_entry_does_not_break_other_schemes(tmp_path, stores, monkeypatch):
    monkeypatch.delenv("KOOCHAK_UNSET_VAR", raising=False)
    _write(
        stores,
        f"""
        version: 1
        stores:
          good: {{root: {tmp_path}/good}}
          broken: {{root: "/x/${{oc.env:KOOCHAK_UNSET_VAR}}"}}
    """,
    )
    assert open_store("good://k").root == tmp_path / "good" / "k"
    with pytest.raises(ValueError, match="stores.broken.root"):
        open_store("broken://k")


def test_unknown_scheme_lists_what_the_file_defines(tmp_path, stores):
    _write(stores, f"version: 1\nstores: {{arc: {{root: {tmp_path}}}}}\n")
    with pytest.raises(ValueError, match=r"'nope' is not in the stores file .*it defines: arc"):
        open_store("nope://x")


def test_a_bad_path_under_a_scheme_is_refused(tmp_path, stores):
    _write(stores, f"version: 1\nstores: {{arc: {{root: {tmp_path}}}}}\n")
    with pytest.raises(ValueError, match=r"arc://a/\.\./b"):
        open_store("arc://a/../b")


def test_file_location_follows_env_then_xdg_then_home(tmp_path, monkeypatch):
    monkeypatch.setenv("KOOCHAK_STORES", str(tmp_path / "explicit.yaml"))
    assert stores_file_path() == tmp_path / "explicit.yaml"
    monkeypatch.delenv("KOOCHAK_STORES")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert stores_file_path() == tmp_path / "xdg" / "koochak" / "stores.yaml"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert stores_file_path() == tmp_path / "home" / ".config" / "koochak" / "stores.yaml"


def test_missing_stores_file_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("KOOCHAK_STORES", str(tmp_path / "absent.yaml"))
    with pytest.raises(ValueError, match="absent.yaml"):
        open_store("archive://x")


def test_the_shipped_example_is_valid(monkeypatch):
    monkeypatch.setenv("USER", "example")
    entries = load_stores_file(EXAMPLE)
    assert set(entries) == {"scratch", "archive", "ckpt"}
    assert (entries["ckpt"].backend, entries["ckpt"].options["prefix"]) == ("s3", "example")
    assert entries["archive"].publish == "exclusive"
    assert entries["archive"].profile is not None
    assert entries["scratch"].root == "/scratch/example/koochak"


def test_the_probes_emitted_profile_block_pastes_into_the_stores_file(tmp_path, stores):
    from koochak.storage.probe import profile_yaml

    measured = StoreProfile(0.00003, 123_456_789.0, 12, True, 32 << 20, False)
    block = textwrap.indent(profile_yaml(measured), "    ")
    stores.write_text(f"version: 1\nstores:\n  arc:\n    root: {tmp_path}\n{block}\n")
    loaded = load_stores_file()["arc"].profile
    assert loaded is not None
    assert loaded.request_seconds == pytest.approx(measured.request_seconds)
    assert (loaded.concurrency, loaded.part_bytes, loaded.range_reads_scale) == (12, 32 << 20, True)
    assert loaded.stream_bytes_per_second == pytest.approx(
        measured.stream_bytes_per_second, rel=1e-6
    )
