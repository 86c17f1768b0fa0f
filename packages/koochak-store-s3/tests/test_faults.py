"""Faults between the store and a real S3 server: 503s, connections dropped mid-part, answers
lost after the server acted, bodies cut short. Reads and idempotent steps are retried; a
conditional commit is never re-sent blindly, and a lost answer is resolved by reading back."""

from __future__ import annotations

import hashlib
import os

import pytest


def _data(size: int, seed: int = 0) -> bytes:
    return hashlib.sha256(str(seed).encode()).digest() * (size // 32) + b"x" * (size % 32)


def _uploads(store) -> list:
    page = store._client.list_multipart_uploads(
        Bucket=store.config.bucket, Prefix=store.config.prefix
    )
    return page.get("Uploads", [])


def test_reads_are_retried_after_503s(proxied_store, fault_proxy):
    proxied_store.put("k", b"payload")
    fault_proxy.plan.update({("get", 1): "503", ("get", 2): "503", ("head", 1): "503"})
    assert proxied_store.get("k") == b"payload"
    assert proxied_store.stat("k").size == 7
    assert [f for k, f in fault_proxy.log if k == "get"] == ["503", "503", "pass"]


def test_a_part_dropped_mid_body_is_sent_again_and_the_put_completes(proxied_store, fault_proxy):
    data = _data(12 << 20, seed=1)
    fault_proxy.plan.update({("part", 2): "drop", ("part", 3): "503"})
    info = proxied_store.put("big", data)
    assert info.sha256 == hashlib.sha256(data).hexdigest()
    assert proxied_store.get("big") == data
    assert fault_proxy.seen["part"] == 5  # 3 parts, two of them twice
    assert _uploads(proxied_store) == []


def test_a_lost_answer_to_a_single_put_is_resolved_by_reading_back(proxied_store, fault_proxy):
    fault_proxy.plan[("put", 1)] = "lose"  # the server stored it; the client never heard
    info = proxied_store.put("k", b"mine")
    # Sent once, then read back (never a blind re-send that would answer 412).
    assert [k for k, _ in fault_proxy.log] == ["put", "head"]
    assert info.size == 4 and proxied_store.get("k") == b"mine"


def test_a_lost_answer_to_a_multipart_commit_is_resolved_by_reading_back(
    proxied_store, fault_proxy
):
    data = _data(11 << 20, seed=2)
    fault_proxy.plan[("complete", 1)] = "lose"
    info = proxied_store.put("big", data)
    assert info.sha256 == hashlib.sha256(data).hexdigest()
    assert proxied_store.get("big") == data
    assert fault_proxy.seen["complete"] == 1


def test_a_503_on_the_commit_is_resent_only_after_reading_back_nothing(proxied_store, fault_proxy):
    fault_proxy.plan[("put", 1)] = "503"  # not forwarded: nothing was stored
    proxied_store.put("k", b"mine")
    assert [k for k, _ in fault_proxy.log] == ["put", "head", "put"]  # then no read-back
    assert proxied_store.get("k") == b"mine"


def test_a_lost_answer_when_another_writer_won_is_file_exists(proxied_store, fault_proxy):
    proxied_store.put("k", b"theirs")
    fault_proxy.seen.clear()
    fault_proxy.plan[("put", 1)] = "503"
    with pytest.raises(FileExistsError):
        proxied_store.put("k", b"mine")
    assert proxied_store.get("k") == b"theirs"


def test_parts_failing_for_good_fail_cleanly_and_abort_the_upload(proxied_store, fault_proxy):
    fault_proxy.always["part"] = "503"
    with pytest.raises(OSError, match="SlowDown|503"):
        proxied_store.put("big", _data(11 << 20))
    fault_proxy.always.clear()
    assert proxied_store.list() == []
    assert _uploads(proxied_store) == []
    assert fault_proxy.seen["abort"] == 1


def test_a_stream_cut_mid_body_resumes_where_it_broke(proxied_store, fault_proxy):
    data = os.urandom(3 << 20)
    proxied_store.put("s", data)
    fault_proxy.plan[("get", 1)] = "cut"
    with proxied_store.open("s") as stream:
        assert stream.read() == data
    assert fault_proxy.seen["get"] == 2  # the second GET asked for the rest only


def test_a_ranged_get_cut_short_is_fetched_again(proxied_store, fault_proxy):
    data = os.urandom(1 << 20)
    proxied_store.put("r", data)
    fault_proxy.plan[("get", 1)] = "cut"
    assert proxied_store.get("r", 10, 900_000) == data[10:900_000]
