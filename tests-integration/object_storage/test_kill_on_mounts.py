"""kill -9 during a put and during a publish on each mount: no client, and not the server, ever
sees a partial object under its final name, and publishing the name again works."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from koochak.storage.artifact import highest_valid, publish, read_verified
from koochak.storage.store import LocalStore

pytestmark = pytest.mark.slow

MIB = 1 << 20

# A child that puts (or publishes) 64 MiB, says "writing" once 8 MiB are in, then keeps going
# slowly so the parent's SIGKILL lands in the middle of the object.
_CHILD = textwrap.dedent(
    """
    import sys, time
    from koochak.storage.artifact import publish
    from koochak.storage.store import LocalStore

    root, how, key, settings = sys.argv[1], sys.argv[2], sys.argv[3], eval(sys.argv[4])

    def blocks():
        block = bytes(range(256)) * 4096
        for i in range(64):
            if i == 8:
                print("writing", flush=True)
            if i >= 8:
                time.sleep(0.1)
            yield block

    store = LocalStore(root, **settings)
    if how == "put":
        store.put(key, blocks())
    else:
        publish(store, key, blocks(), keep_last_k=2)
    print("done", flush=True)
    """
)


def _kill_mid_write(root, how: str, key: str, settings: dict) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(root), how, key, repr(settings)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "writing"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL


def _never_partial(mount_dir, key: str, watch_seconds: float = 4.0) -> None:
    """For a while after the kill, neither the server nor either mount shows ``key``."""
    deadline = time.monotonic() + watch_seconds
    mine = LocalStore(mount_dir.path)
    peer = LocalStore(mount_dir.peer)
    while time.monotonic() < deadline:
        on_server = mount_dir.server.objects()
        assert key not in on_server, f"the server holds {on_server[key]} bytes under {key}"
        for store in (mine, peer):
            listed = {info.key: info.size for info in store.list()}
            assert key not in listed, f"{store.location} lists {listed[key]} bytes under {key}"
        time.sleep(0.2)


def test_kill_during_put_leaves_no_partial_object(mount_dir):
    _kill_mid_write(mount_dir.path, "put", "big.bin", mount_dir.settings)
    _never_partial(mount_dir, "big.bin")
    store = LocalStore(mount_dir.path, **mount_dir.settings)
    data = os.urandom(3 * MIB)
    assert store.put("big.bin", data).sha256 == hashlib.sha256(data).hexdigest()
    assert store.get("big.bin") == data


def test_kill_during_publish_leaves_it_unpublished_and_it_can_be_published_again(mount_dir):
    settings = mount_dir.settings
    store = LocalStore(mount_dir.path, **settings)
    first = publish(store, "step000000001.pt", b"step one", keep_last_k=2)
    _kill_mid_write(mount_dir.path, "publish", "step000000002.pt", settings)
    _never_partial(mount_dir, "step000000002.pt")
    found = highest_valid(store, r"step(\d+)\.pt")
    assert found is not None and found[0] == first
    again = publish(store, "step000000002.pt", b"step two, again", keep_last_k=2)
    assert read_verified(store, "step000000002.pt") == (again, b"step two, again")
