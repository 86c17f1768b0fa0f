"""A writer killed with SIGKILL in the middle of a multipart upload leaves nothing visible."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("kill_worker.py")


@pytest.mark.slow
def test_kill_9_mid_upload_leaves_no_object(moto_store):
    config = moto_store.config
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), config.endpoint, config.bucket, config.prefix],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "uploading"
        uploads = moto_store._client.list_multipart_uploads(
            Bucket=config.bucket, Prefix=config.prefix
        ).get("Uploads", [])
        assert [u["Key"] for u in uploads] == [config.prefix + "victim"]  # parts are up there
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    assert moto_store.list() == []
    with pytest.raises(FileNotFoundError):
        moto_store.stat("victim")
    # The abandoned upload is invisible; sweeping removes its parts, and the key is free.
    assert moto_store.abort_stale_uploads(older_than_seconds=0) == ["victim"]
    moto_store.put("victim", b"after the crash")
    assert moto_store.get("victim") == b"after the crash"
