"""A third-party backend: an in-memory Store served through a `koochak.stores` entry point.

It runs the same conformance suite as LocalStore, and artifacts work on it unchanged — proof that
nothing above the protocol depends on LocalStore.
"""

from __future__ import annotations

import hashlib
import io
import textwrap

import pytest
from koochak.storage.artifact import highest_valid, publish, read_verified
from koochak.storage.store import ObjectInfo, open_store
from koochak.storage.testing import StoreConformance

PLUGIN = textwrap.dedent('''
    import io, threading, time
    from koochak.storage.store import ObjectInfo, validate_key

    class MemoryStore:
        """Objects in a dict."""

        def __init__(self, name):
            self.location = "mem://" + name
            self._objects = {}
            self._lock = threading.Lock()

        def _chunks(self, data):
            if isinstance(data, str):
                raise TypeError("put() needs bytes, not str")
            if isinstance(data, (bytes, bytearray, memoryview)):
                return [bytes(data)]
            if hasattr(data, "read"):
                return [data.read()]
            return [bytes(c) for c in data]

        def get(self, key, start=None, end=None):
            validate_key(key)
            with self._lock:
                if key not in self._objects:
                    raise FileNotFoundError(key)
                return self._objects[key][0][start:end]

        def open(self, key):
            return io.BytesIO(self.get(key))

        def put(self, key, data, *, expected_size=None, expected_sha256=None):
            import hashlib
            validate_key(key)
            if any(k.startswith(key + "/") for k in self._objects) or any(
                key.startswith(k + "/") for k in self._objects
            ):
                raise FileExistsError(key)
            payload = b"".join(self._chunks(data))
            if expected_size is not None and len(payload) != expected_size:
                raise ValueError(f"expected_size={expected_size}, got {len(payload)}")
            if expected_sha256 is not None and hashlib.sha256(payload).hexdigest() != expected_sha256.lower():
                raise ValueError("expected_sha256 mismatch")
            with self._lock:
                if key in self._objects:
                    raise FileExistsError(key)
                self._objects[key] = (payload, time.time_ns())
            return ObjectInfo(
                key, len(payload), self._objects[key][1], hashlib.sha256(payload).hexdigest()
            )

        def stat(self, key):
            validate_key(key)
            with self._lock:
                if key not in self._objects:
                    raise FileNotFoundError(key)
                payload, mtime = self._objects[key]
            return ObjectInfo(key, len(payload), mtime)

        def list(self, prefix=""):
            with self._lock:
                items = sorted(self._objects.items())
            return [ObjectInfo(k, len(v[0]), v[1]) for k, v in items if k.startswith(prefix)]

        def delete(self, key):
            validate_key(key)
            with self._lock:
                if key not in self._objects:
                    raise FileNotFoundError(key)
                del self._objects[key]

        def local_path(self, key):
            return None

    def open_memory(path):
        return MemoryStore(path)
''')


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "koochak_memstore.py").write_text(PLUGIN)
    dist = site / "koochak_memstore-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: koochak-memstore\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[koochak.stores]\nmem = koochak_memstore:open_memory\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("KOOCHAK_STORES", str(tmp_path / "absent.yaml"))


class TestEntryPointMemoryStore(StoreConformance):
    @pytest.fixture
    def store(self, plugin):
        return open_store("mem://conformance")


def test_artifacts_work_on_a_store_without_local_paths(plugin):
    store = open_store("mem://ckpt")
    assert store.location == "mem://ckpt"
    for step in (1, 2, 3):
        publish(store, f"step{step:09d}.pt", io.BytesIO(b"w%d" % step), keep_last_k=2,
                pattern=r"step(\d+)\.pt", latest="latest.pt")  # fmt: skip
    # No latest alias: only a LocalStore with hard links can swing one atomically.
    assert [i.key for i in store.list()] == [
        "step000000002.pt", "step000000002.pt.ready.json",
        "step000000003.pt", "step000000003.pt.ready.json",
    ]  # fmt: skip
    pub, data = highest_valid(store, r"step(\d+)\.pt")
    assert (pub.key, pub.path, data) == ("step000000003.pt", None, b"w3")
    assert pub.sha256 == hashlib.sha256(b"w3").hexdigest()
    assert read_verified(store, "step000000002.pt")[1] == b"w2"


def test_publish_hashes_the_object_when_put_reports_no_digest(plugin, monkeypatch):
    store = open_store("mem://nodigest")
    real_put = store.put

    def put_without_digest(key, data, **kwargs):
        info = real_put(key, data, **kwargs)
        return ObjectInfo(info.key, info.size, info.mtime_ns)

    monkeypatch.setattr(store, "put", put_without_digest)
    pub = publish(store, "a.pt", b"payload")
    assert pub.sha256 == hashlib.sha256(b"payload").hexdigest()
    assert read_verified(store, "a.pt") == (pub, b"payload")
