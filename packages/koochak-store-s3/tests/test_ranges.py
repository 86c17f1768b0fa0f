"""Servers that answer a ranged GET with something else: the whole object (Range ignored), the
wrong window, or fewer bytes than they say. Every read path checks what it got, through the
fault proxy in front of moto (fault_proxy.py); the proxied store's part size is 5 MiB, which is
also the largest whole object a read takes and slices."""

from __future__ import annotations

import os

import pytest
from koochak.s3.download import RangeIgnored

SMALL = os.urandom(16384)


def _gets(fault_proxy) -> list[str]:
    return [fault for kind, fault in fault_proxy.log if kind == "get"]


@pytest.mark.parametrize(
    ("start", "end"), [(100, 200), (4096, None), (-50, None), (None, -100), (-300, -200)]
)
def test_a_200_to_a_range_of_a_small_object_is_sliced(proxied_store, fault_proxy, start, end):
    proxied_store.put("k", SMALL)
    fault_proxy.always["get"] = "ignore_range"
    assert proxied_store.get("k", start, end) == SMALL[start:end]
    assert _gets(fault_proxy) and set(_gets(fault_proxy)) == {"ignore_range"}


def test_a_200_to_a_range_of_a_large_object_is_refused_in_one_line(proxied_store, fault_proxy):
    data = os.urandom((5 << 20) + 1000)  # above the 5 MiB part: too large to take whole
    proxied_store.put("big", data)
    fault_proxy.always["get"] = "ignore_range"
    for start, end in ((100, 200), (-50, None), (4096, None)):
        with pytest.raises(RangeIgnored, match="ignored Range") as caught:
            proxied_store.get("big", start, end)
        assert "\n" not in str(caught.value) and "s3://" in str(caught.value)
    fault_proxy.always.clear()
    assert proxied_store.get("big", -50, None) == data[-50:]


@pytest.mark.parametrize(("start", "end"), [(100, 200), (4096, None), (-50, None)])
def test_a_206_for_another_window_is_refused(proxied_store, fault_proxy, start, end):
    proxied_store.put("k", SMALL)
    fault_proxy.always["get"] = "shift_range"
    with pytest.raises(OSError, match="wrong window"):
        proxied_store.get("k", start, end)


def test_a_later_range_of_a_parallel_read_is_checked_too(proxied_store, fault_proxy):
    data = os.urandom(11 << 20)  # three 5 MiB ranges
    proxied_store.put("big", data)
    fault_proxy.plan[("get", 2)] = "shift_range"
    with pytest.raises(OSError, match="wrong window"):
        proxied_store.get("big")
    fault_proxy.seen.clear()
    fault_proxy.plan.clear()
    fault_proxy.plan[("get", 3)] = "ignore_range"  # 11 MiB whole: too large to take
    with pytest.raises(RangeIgnored):
        proxied_store.get("big")


def test_a_body_shorter_than_its_content_range_is_fetched_again(proxied_store, fault_proxy):
    proxied_store.put("k", SMALL)
    fault_proxy.plan[("get", 1)] = "short"
    assert proxied_store.get("k", 100, 9000) == SMALL[100:9000]
    assert _gets(fault_proxy) == ["short", "pass"]


def test_a_short_whole_object_to_a_range_is_fetched_again(proxied_store, fault_proxy):
    proxied_store.put("k", SMALL)
    fault_proxy.plan[("get", 1)] = "short_whole"  # its Content-Length matches the short body
    fault_proxy.always["get"] = "ignore_range"
    assert proxied_store.get("k", -50, None) == SMALL[-50:]
    assert _gets(fault_proxy) == ["short_whole", "ignore_range"]


def test_a_stream_reopened_mid_object_checks_the_answer(proxied_store, fault_proxy):
    data = os.urandom(3 << 20)
    proxied_store.put("s", data)
    # The re-open after the cut is answered 200 whole: small enough, so skipped to the byte.
    fault_proxy.plan.update({("get", 1): "cut", ("get", 2): "ignore_range"})
    with proxied_store.open("s") as stream:
        assert stream.read() == data
    assert _gets(fault_proxy) == ["cut", "ignore_range"]
    # A re-open answered with another window fails instead of returning wrong bytes.
    fault_proxy.seen.clear()
    fault_proxy.log.clear()
    fault_proxy.plan.clear()
    fault_proxy.plan.update({("get", 1): "cut"})
    fault_proxy.always["get"] = "shift_range"
    with proxied_store.open("s") as stream, pytest.raises(OSError, match="wrong window"):
        stream.read()


def test_a_stream_reopen_answered_whole_for_a_large_object_is_refused(proxied_store, fault_proxy):
    data = os.urandom((5 << 20) + 4096)
    proxied_store.put("s", data)
    fault_proxy.plan[("get", 1)] = "cut"
    fault_proxy.always["get"] = "ignore_range"
    with proxied_store.open("s") as stream, pytest.raises(RangeIgnored, match="ignored Range"):
        stream.read()
