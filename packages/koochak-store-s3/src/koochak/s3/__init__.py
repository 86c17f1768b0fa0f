"""koochak.s3: a native S3 Store with create-only commits (the ``koochak-store-s3`` distribution).

``open_store("s3://bucket/prefix")`` finds ``open_s3_store`` through the ``koochak.stores`` entry
point; a stores-file entry ``backend: s3`` with ``options:`` (bucket, prefix, endpoint, region,
path_style, single_writer, part_size, concurrency) reaches it the same way. Credentials come
from the environment or the AWS configuration, never from Koochak's files.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from koochak.s3.config import S3Config, config_from_options, config_from_path
from koochak.s3.download import RangeIgnored
from koochak.s3.errors import ConditionalWritesIgnored
from koochak.s3.retry import RetryPolicy
from koochak.s3.store import S3_PROFILE, S3Store
from koochak.storage.profile import StoreProfile

__all__ = [
    "ConditionalWritesIgnored",
    "RangeIgnored",
    "RetryPolicy",
    "S3Config",
    "S3Store",
    "S3_PROFILE",
    "open_s3_store",
]


def open_s3_store(
    path: str,
    *,
    options: Mapping[str, Any] | None = None,
    profile: StoreProfile | None = None,
) -> S3Store:
    """The ``koochak.stores`` factory for ``s3``.

    ``open_store("s3://bucket/prefix")`` calls it with ``"bucket/prefix"``; endpoint, region and
    addressing then come from the AWS configuration. A stores-file entry ``backend: s3`` calls it
    with the text after ``scheme://`` as ``path`` (appended to the entry's prefix) and the
    entry's ``options`` and ``profile``.
    """
    if options is None:
        config = config_from_path(path)
    else:
        config = config_from_options(path, options)
    return S3Store(config, profile=profile)
