"""Fixtures: S3 stores on the loopback servers of tools/local_s3.sh (the root ``local_s3``).

Every store gets a prefix of its own (xdist workers and other suites share the servers) and
everything under it is removed afterwards.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import uuid
from collections.abc import Iterator

import pytest
from koochak.s3 import S3Config, S3Store


@pytest.fixture(scope="session")
def s3_env(local_s3) -> Iterator[dict[str, str]]:
    """The loopback servers' test credentials in os.environ (boto3 reads them from there)."""
    saved = {name: os.environ.get(name) for name in local_s3.credentials}
    os.environ.update(local_s3.credentials)
    yield dict(local_s3.credentials)
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _config(endpoint: str, bucket: str, **settings) -> S3Config:
    return S3Config(
        bucket=bucket,
        prefix=f"tests/{uuid.uuid4().hex}",
        endpoint=endpoint,
        region="us-east-1",
        path_style=True,
        **settings,
    )


def _empty(store: S3Store) -> None:
    client = store._client
    for info in store.list():
        client.delete_object(Bucket=store.config.bucket, Key=store.config.prefix + info.key)
    store.abort_stale_uploads(older_than_seconds=-60)


@pytest.fixture
def moto_config(local_s3, s3_env) -> S3Config:
    """Settings for a fresh prefix on moto (honours If-None-Match), 5 MiB parts.

    verify_commit: moto's conditional PutObject checks, then writes, without a lock; under load
    two racing puts can both be accepted (about one round in a hundred of six racing threads).
    """
    return _config(local_s3.endpoint, local_s3.native_bucket, part_bytes=5 << 20, concurrency=4,
                   verify_commit=True)  # fmt: skip


@pytest.fixture
def moto_store(moto_config) -> Iterator[S3Store]:
    store = S3Store(moto_config)
    yield store
    _empty(store)


@pytest.fixture
def nocond_config(local_s3, s3_env) -> S3Config:
    """Settings for a fresh prefix on rclone serve s3 (ignores If-None-Match)."""
    return _config(local_s3.nocond_endpoint, local_s3.nocond_bucket, part_bytes=5 << 20)


def _load_fault_proxy():
    # importlib import mode: test-folder helpers are loaded by path, not by name.
    path = pathlib.Path(__file__).with_name("fault_proxy.py")
    spec = importlib.util.spec_from_file_location("koochak_s3_fault_proxy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FaultProxy


@pytest.fixture
def fault_proxy(local_s3, s3_env):
    """A FaultProxy (see fault_proxy.py) in front of moto."""
    proxy = _load_fault_proxy()(local_s3.endpoint)
    yield proxy
    proxy.close()


@pytest.fixture
def proxied_store(fault_proxy, local_s3, s3_env) -> Iterator[S3Store]:
    """An S3Store on moto through the fault proxy, with fast retries (no real sleeping)."""
    from koochak.s3 import RetryPolicy

    config = _config(fault_proxy.endpoint, local_s3.native_bucket, part_bytes=5 << 20,
                     concurrency=2)  # fmt: skip
    store = S3Store(config, retry=RetryPolicy(attempts=4, sleep=lambda _s: None))
    store._trusts_conditional_writes()  # the once-per-endpoint check, before counting requests
    fault_proxy.seen.clear()
    fault_proxy.log.clear()
    yield store
    fault_proxy.plan.clear()
    fault_proxy.always.clear()
    _empty(store)
