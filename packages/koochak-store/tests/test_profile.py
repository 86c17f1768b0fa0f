"""StoreProfile, profile_of, min_object_bytes and parse_size."""

from __future__ import annotations

import dataclasses

import pytest
from koochak.storage.profile import (
    LOCAL_PROFILE,
    REMOTE_PROFILE,
    StoreProfile,
    min_object_bytes,
    parse_size,
    profile_of,
)
from koochak.storage.store import LocalStore


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (0, 0),
        (4096, 4096),
        ("512", 512),
        ("512B", 512),
        ("64M", 64 << 20),
        ("64m", 64 << 20),
        ("16MiB", 16 << 20),
        ("1.5GB", 1_500_000_000),
        ("4G", 4 << 30),
        ("2kB", 2000),
        ("1.5K", 1536),
        (" 8 MiB ", 8 << 20),
    ],
)
def test_parse_size_accepts_binary_and_decimal_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "M", "12Q", "-1", "1..5M", -3, True, None, "1e6"])
def test_parse_size_rejects_garbage_naming_the_value(bad):
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)


def test_profile_is_frozen_and_validated():
    with pytest.raises(dataclasses.FrozenInstanceError):
        LOCAL_PROFILE.concurrency = 3  # type: ignore[misc]
    with pytest.raises(ValueError, match="concurrency"):
        dataclasses.replace(LOCAL_PROFILE, concurrency=0)
    with pytest.raises(ValueError, match="stream_bytes_per_second"):
        dataclasses.replace(LOCAL_PROFILE, stream_bytes_per_second=0)


def test_profile_of_returns_attached_profile_or_a_default(tmp_path):
    custom = dataclasses.replace(REMOTE_PROFILE, concurrency=64)
    assert profile_of(LocalStore(tmp_path, profile=custom)) is custom
    assert profile_of(LocalStore(tmp_path)) is LOCAL_PROFILE
    assert profile_of(LocalStore(tmp_path, publish="exclusive")) is REMOTE_PROFILE
    assert profile_of(object()) is REMOTE_PROFILE


def test_min_object_bytes_grows_with_request_cost():
    cheap = min_object_bytes(LOCAL_PROFILE)
    costly = min_object_bytes(REMOTE_PROFILE)
    assert 4096 <= cheap < costly <= REMOTE_PROFILE.part_bytes
    slow = StoreProfile(2.0, 1e9, 4, True, 16 << 20, False)
    assert min_object_bytes(slow) == 16 << 20
