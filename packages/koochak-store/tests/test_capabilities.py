"""Optional store abilities are declared on the contract (``capabilities_of``), never guessed.

Each test below fails where a caller looks for an attribute (``getattr(store, "put_many")``,
``isinstance(store, LocalStore)``) instead of asking what the store declares.
"""

from __future__ import annotations

import os

import pytest
from koochak.storage import artifact
from koochak.storage.named import get_named, read_settle_seconds
from koochak.storage.probe import _store_checks
from koochak.storage.profile import LOCAL_PROFILE, REMOTE_PROFILE, StoreProfile, profile_of
from koochak.storage.store import LocalStore, StoreCapabilities, capabilities_of
from koochak.storage.testing import FaultyStore, ThrottledStore, _Delegating
from koochak.storage.transfer import CopyItem, copy_objects


class Undeclared(_Delegating):
    """A third-party store that says nothing about itself but has look-alike attributes."""

    def __init__(self, root):
        self.inner = LocalStore(root)
        self.location = f"undeclared:{root}"
        self.root = self.inner.root  # an attribute, not a declaration
        self.publish = "link"
        self.profile = "not a profile"
        self.read_settle_seconds = 99.0
        self.batches = 0

    def put_many(self, objects):  # never declared: copy_objects must not call it
        self.batches += 1
        raise AssertionError("put_many was called although the store does not declare it")

    def probe_checks(self, prefix):
        raise AssertionError("probe_checks was called although the store does not declare it")


class Declared(_Delegating):
    """A wrapper that declares what it wants through the contract only."""

    def __init__(self, where, **declared):
        self.inner = LocalStore(where)
        self.location = f"declared:{where}"
        self.declared = StoreCapabilities(**declared)

    def capabilities(self):
        return self.declared


def test_a_store_that_declares_nothing_gets_the_safe_defaults(tmp_path):
    store = Undeclared(tmp_path)
    assert capabilities_of(store) == StoreCapabilities()
    assert profile_of(store) is REMOTE_PROFILE
    assert read_settle_seconds(store) == 0.0
    assert _store_checks(store, "p/") == []
    store.inner.put("src/a", b"a")
    store.inner.put("src/b", b"b")
    items = [CopyItem(f"src/{k}", 1, target_key=f"dst/{k}") for k in "ab"]
    report = copy_objects(store, store, items)
    assert report.copied == 2 and store.batches == 0
    published = artifact.publish(store, "step000000001.pt", b"x", kind="checkpoint")
    assert published.key == "step000000001.pt"
    assert not os.path.lexists(tmp_path / "latest.pt")  # no declared link-mode root: no pointer


def test_local_store_declares_its_mode_root_settling_batch_put_and_profile(tmp_path):
    profile = StoreProfile(
        request_seconds=0.01,
        stream_bytes_per_second=1e9,
        concurrency=4,
        range_reads_scale=False,
        part_bytes=8 << 20,
        listing_cheap=True,
    )
    link = LocalStore(tmp_path / "a")
    exclusive = LocalStore(tmp_path / "b", publish="exclusive", read_settle_seconds=5, profile=profile)
    assert capabilities_of(link) == StoreCapabilities(
        publish="link", root=str(tmp_path / "a"), put_many=True, list_shallow=True
    )
    assert capabilities_of(exclusive) == StoreCapabilities(
        publish="exclusive",
        root=str(tmp_path / "b"),
        read_settle_seconds=5.0,
        put_many=True,
        profile=profile,
        list_shallow=True,
    )
    assert profile_of(link) is LOCAL_PROFILE and profile_of(exclusive) is profile


def test_a_declared_link_mode_root_gets_the_latest_pointer(tmp_path):
    store = Declared(tmp_path, publish="link", root=str(tmp_path))
    artifact.publish(store, "step000000001.pt", b"x", kind="checkpoint")
    assert os.readlink(tmp_path / "latest.pt") == "step000000001.pt"
    assert profile_of(store) is LOCAL_PROFILE


def test_declared_read_settling_is_waited_out_by_named_reads(tmp_path):
    store = Declared(tmp_path, read_settle_seconds=0.3)
    assert read_settle_seconds(store) == 0.3
    with pytest.raises(FileNotFoundError, match="read_settle_seconds=0.3"):
        get_named(store, "missing", named_by="a manifest")


def test_declared_probe_checks_are_asked_for(tmp_path):
    class Checked(Declared):
        def probe_checks(self, prefix):
            return [{"name": "own", "supported": True, "detail": prefix, "seconds": None}]

    checks = _store_checks(Checked(tmp_path, probe_checks=True), "scratch/")
    assert [(c.name, c.supported, c.detail) for c in checks] == [("own", True, "scratch/")]


def test_wrappers_declare_what_they_forward(tmp_path):
    faulty = FaultyStore(tmp_path / "f", publish="exclusive", read_settle_seconds=2)
    assert capabilities_of(faulty) == StoreCapabilities()  # nothing around its fault seam
    throttled = ThrottledStore(LocalStore(tmp_path / "t"), 1e9)
    assert capabilities_of(throttled) == StoreCapabilities(profile=LOCAL_PROFILE)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"publish": "rename"}, "publish"),
        ({"root": "relative/dir"}, "root"),
        ({"read_settle_seconds": -1}, "read_settle_seconds"),
        ({"read_settle_seconds": True}, "read_settle_seconds"),
        ({"put_many": "yes"}, "put_many"),
        ({"probe_checks": 1}, "probe_checks"),
    ],
)
def test_malformed_declarations_are_refused(fields, named):
    with pytest.raises(ValueError, match=named):
        StoreCapabilities(**fields)


def test_a_capabilities_method_that_returns_something_else_is_a_type_error(tmp_path):
    class Wrong(_Delegating):
        def __init__(self):
            self.inner = LocalStore(tmp_path)
            self.location = "wrong"

        def capabilities(self):
            return {"put_many": True}

    with pytest.raises(TypeError, match=r"Wrong.capabilities\(\) returned dict"):
        capabilities_of(Wrong())
