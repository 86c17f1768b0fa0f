"""A writer killed with SIGKILL in the middle of put() leaves no visible or committed object."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from koochak.storage.artifact import highest_valid, publish, published_candidates
from koochak.storage.store import LocalStore
from koochak.storage.testing import visible_files


def _kill_mid_write(tmp_path, imports: str, call: str) -> None:
    """Run ``call`` (which writes ``chunks()``, an endless stream) in a child; SIGKILL it mid-write."""
    marker = tmp_path / "writing"
    script = textwrap.dedent(f"""
        import pathlib, time
        {imports}

        def chunks():
            yield b"x" * (1 << 20)
            pathlib.Path({str(marker)!r}).write_text("started")
            while True:  # keep writing until killed
                yield b"y" * (1 << 20)
                time.sleep(0.01)

        {call}
    """)
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None, "writer exited before it was killed"
            assert time.monotonic() < deadline, "writer never started"
            time.sleep(0.02)
        time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.slow
def test_a_process_killed_mid_put_leaves_no_visible_object(tmp_path):
    root = tmp_path / "store"
    _kill_mid_write(
        tmp_path,
        "from koochak.storage.store import LocalStore",
        f"LocalStore({str(root)!r}).put('ckpt/step000000100.pt', chunks())",
    )
    store = LocalStore(root)
    assert store.list() == []
    assert visible_files(root) == []
    with pytest.raises(FileNotFoundError):
        store.stat("ckpt/step000000100.pt")
    # The hidden temp the writer left does not block a new put of the same key.
    assert any(name.startswith(".koochak-tmp-") for name in os.listdir(root / "ckpt"))
    store.put("ckpt/step000000100.pt", b"complete")
    assert [info.key for info in store.list()] == ["ckpt/step000000100.pt"]
    # The leftover only costs space; a sweep reclaims it once it is old enough.
    assert store.remove_stale_temps(older_than_seconds=3600) == []
    removed = store.remove_stale_temps(older_than_seconds=-1)
    assert len(removed) == 1 and ".koochak-tmp-" in removed[0]
    assert os.listdir(root / "ckpt") == ["step000000100.pt"]
    assert store.get("ckpt/step000000100.pt") == b"complete"


@pytest.mark.slow
def test_a_publish_killed_mid_put_on_an_exclusive_store_is_never_committed(tmp_path):
    # publish="exclusive" writes a hidden temp file and renames it into place once whole, so a
    # killed writer's bytes stay under the temp name (a FUSE mount uploads them there, on the
    # implicit close), never under the final name; the ready manifest still guards readers.
    root = tmp_path / "store"
    pattern = r"step(\d+)\.pt"
    store = LocalStore(root, publish="exclusive")
    publish(store, "step000000100.pt", b"committed", pattern=pattern, keep_last_k=2)
    _kill_mid_write(
        tmp_path,
        "from koochak.storage.artifact import publish; from koochak.storage.store import LocalStore",
        f"publish(LocalStore({str(root)!r}, publish='exclusive'), 'step000000200.pt', chunks())",
    )
    assert not (root / "step000000200.pt").exists()
    assert any(name.startswith(".koochak-tmp-") for name in os.listdir(root))
    assert published_candidates(store, pattern) == [(100, "step000000100.pt")]
    publication, data = highest_valid(store, pattern)
    assert (publication.key, data) == ("step000000100.pt", b"committed")
    publish(store, "step000000200.pt", b"complete", pattern=pattern, keep_last_k=2)
    publication, data = highest_valid(store, pattern)
    assert (publication.key, data) == ("step000000200.pt", b"complete")
