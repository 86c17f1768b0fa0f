"""Property tests: LocalStore listing and ranges agree with a plain in-memory model."""

from __future__ import annotations

import tempfile

from hypothesis import given, settings
from hypothesis import strategies as st
from koochak.storage.profile import parse_size
from koochak.storage.store import LocalStore, validate_key

_segment = st.text(alphabet="ab.-_1", min_size=1, max_size=3).filter(lambda s: s not in (".", ".."))
_key = st.lists(_segment, min_size=1, max_size=3).map("/".join)


@settings(max_examples=60, deadline=None)
@given(
    keys=st.lists(_key, min_size=1, max_size=8, unique=True),
    prefix=st.text(alphabet="ab./1", max_size=4),
)
def test_list_matches_a_string_prefix_filter_over_all_keys(keys, prefix):
    # A key cannot be both an object and a directory of objects; keep the first of any clash.
    chosen: list[str] = []
    for key in keys:
        if not any(key.startswith(k + "/") or k.startswith(key + "/") for k in chosen):
            chosen.append(key)
    try:
        from koochak.storage.keys import _validate_prefix

        _validate_prefix(prefix)
    except ValueError:
        return
    with tempfile.TemporaryDirectory() as root:
        store = LocalStore(root, fsync=False)
        for key in chosen:
            store.put(key, key.encode())
        listed = [info.key for info in store.list(prefix)]
    assert listed == sorted(k for k in chosen if k.startswith(prefix))


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(max_size=300),
    start=st.one_of(st.none(), st.integers(-400, 400)),
    end=st.one_of(st.none(), st.integers(-400, 400)),
)
def test_get_ranges_behave_like_slices(data, start, end):
    with tempfile.TemporaryDirectory() as root:
        store = LocalStore(root, fsync=False)
        store.put("k", data)
        assert store.get("k", start, end) == data[start:end]


@given(st.text(max_size=12))
def test_validate_key_accepts_only_keys_that_stay_below_the_root(key):
    try:
        validate_key(key)
    except ValueError:
        return
    parts = key.split("/")
    assert key and not key.startswith("/")
    assert all(part not in ("", ".", "..") for part in parts)
    assert not set(key) & {"?", "#", "\\", "\x00"}


@given(st.integers(0, 10**15))
def test_parse_size_of_an_int_or_its_decimal_string_is_itself(n):
    assert parse_size(n) == n == parse_size(str(n)) == parse_size(f"{n}B")
