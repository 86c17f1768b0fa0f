"""Fixtures for the tests on real object-storage mounts (tools/local_s3.sh).

One bucket is mounted twice, with s3fs and with rclone; each mount is "another node" for the
other, and the S3 server itself (moto, reached with boto3) says what is really stored. Every test
works in a directory of its own (``t-<uuid>``), so xdist workers and other suites sharing the
servers never meet, and removes it through the S3 API when it ends.

``MOUNT_SETTINGS`` are the LocalStore settings each mount needs: the ones ``koochak-probe --peer``
recommends for these mounts (test_probe_on_mounts.py checks that it does).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

MOUNTS = ("s3fs", "rclone")

# What each mount needs (docs/storage.md, "Object-storage mounts"): a hidden temp name renamed
# into place (neither mount has hard links), fsync, and a read-back once another client could
# have replaced the object, which is how a collision between two clients is caught.
MOUNT_SETTINGS: dict[str, dict[str, Any]] = {
    "s3fs": {
        "publish": "exclusive",
        "fsync": True,
        "verify_readback": True,
        "settle_seconds": 2.0,
        "read_settle_seconds": 5.0,
    },
    "rclone": {
        "publish": "exclusive",
        "fsync": True,
        "verify_readback": True,
        "settle_seconds": 2.0,
        "read_settle_seconds": 5.0,
    },
}


class Server:
    """What the S3 server holds under one test's prefix (boto3 against moto)."""

    def __init__(self, local_s3: Any, prefix: str) -> None:
        import boto3

        creds = local_s3.credentials
        self.client = boto3.client(
            "s3",
            endpoint_url=local_s3.endpoint,
            aws_access_key_id=creds["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=creds["AWS_SECRET_ACCESS_KEY"],
            region_name=creds["AWS_DEFAULT_REGION"],
        )
        self.bucket = local_s3.mount_bucket
        self.prefix = prefix

    def objects(self, under: str = "") -> dict[str, int]:
        """{key below the prefix: size} of every object (directory markers left out)."""
        found: dict[str, int] = {}
        pages = self.client.get_paginator("list_objects_v2")
        for page in pages.paginate(Bucket=self.bucket, Prefix=f"{self.prefix}/{under}"):
            for item in page.get("Contents", []):
                key = item["Key"][len(self.prefix) + 1 :]
                if key and not key.endswith("/"):
                    found[key] = item["Size"]
        return found

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")["Body"].read()

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}", Body=data)

    def remove_all(self) -> None:
        pages = self.client.get_paginator("list_objects_v2")
        for page in pages.paginate(Bucket=self.bucket, Prefix=f"{self.prefix}/"):
            keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
            if keys:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys})


@dataclass(frozen=True)
class MountDir:
    """One test's directory, seen through ``name``'s mount and through the other one."""

    name: str  # "s3fs" or "rclone"
    path: Path  # the directory through this mount
    peer_name: str
    peer: Path  # the same directory through the other mount
    server: Server

    @property
    def settings(self) -> dict[str, Any]:
        return dict(MOUNT_SETTINGS[self.name])


def _mount_path(local_s3: Any, name: str) -> Path:
    return {"s3fs": local_s3.s3fs_mount, "rclone": local_s3.rclone_mount}[name]


@pytest.fixture
def bucket_dir(local_s3: Any) -> Iterator[Callable[[str], MountDir]]:
    """``open(name)``: this test's directory through mount ``name`` (one directory per test)."""
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    server = Server(local_s3, prefix)

    def open_dir(name: str) -> MountDir:
        peer = MOUNTS[1 - MOUNTS.index(name)]
        path = _mount_path(local_s3, name) / prefix
        path.mkdir(exist_ok=True)
        return MountDir(name, path, peer, _mount_path(local_s3, peer) / prefix, server)

    yield open_dir
    server.remove_all()


@pytest.fixture(params=MOUNTS)
def mount_dir(request: pytest.FixtureRequest, bucket_dir: Callable[[str], MountDir]) -> MountDir:
    """This test's directory through each mount in turn (the test runs once per mount)."""
    return bucket_dir(request.param)


def _wait_for(predicate: Callable[[], bool], seconds: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > seconds:
            pytest.fail(f"{what} did not happen within {seconds} s")
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.fixture
def wait_for() -> Callable[[Callable[[], bool], float, str], float]:
    """``wait_for(predicate, seconds, what)``: poll until it holds; how long that took, or fail."""
    return _wait_for
