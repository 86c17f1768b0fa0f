"""S3Store beyond the shared contract: conditional-write detection, multipart uploads, aborts,
listing, opening through open_store and the stores file, and no credential in any message."""

from __future__ import annotations

import hashlib
import logging
import os
import textwrap
import uuid

import pytest
from koochak.s3 import ConditionalWritesIgnored, S3Store
from koochak.s3 import conditional as conditional_module
from koochak.s3.config import S3Config
from koochak.storage.store import open_store


def _uploads(store) -> list:
    page = store._client.list_multipart_uploads(
        Bucket=store.config.bucket, Prefix=store.config.prefix
    )
    return page.get("Uploads", [])


# -- servers that ignore If-None-Match ---------------------------------------------------------


def test_a_server_ignoring_if_none_match_is_detected_and_create_only_put_refused(nocond_config):
    conditional_module.forget_answers()
    store = S3Store(nocond_config)
    with pytest.raises(ConditionalWritesIgnored, match="ignores If-None-Match.*single_writer"):
        store.put("k", b"1")
    assert store.list() == []
    assert store.get  # reads still work there: only create-only writes are refused


def test_the_detection_runs_once_per_endpoint(nocond_config, moto_config, monkeypatch):
    conditional_module.forget_answers()
    probes = []
    real = conditional_module._probe
    monkeypatch.setattr(conditional_module, "_probe", lambda *a: probes.append(a[1]) or real(*a))
    for _ in range(2):
        with pytest.raises(ConditionalWritesIgnored):
            S3Store(nocond_config).put("k", b"1")
    moto = S3Store(moto_config)
    moto.put("a", b"1")
    moto.put("b", b"2")
    assert probes == [nocond_config.bucket, moto_config.bucket]


def test_a_single_writer_store_may_use_such_a_server_and_still_refuses_existing_keys(
    nocond_config,
):
    from dataclasses import replace

    store = S3Store(replace(nocond_config, single_writer=True))
    try:
        store.put("k", b"first")
        with pytest.raises(FileExistsError):
            store.put("k", b"second")
        assert store.get("k") == b"first"
        big = os.urandom(11 << 20)
        assert store.put("big", big).sha256 == hashlib.sha256(big).hexdigest()
        assert store.get("big") == big
    finally:
        for info in store.list():
            store.delete(info.key)


def test_moto_refuses_a_second_create_only_put(moto_store):
    assert moto_store._trusts_conditional_writes()


# -- multipart ------------------------------------------------------------------------------


def test_a_large_put_goes_up_in_parts_and_is_committed_whole(moto_store):
    data = os.urandom(12 << 20)  # 3 parts of 5 MiB
    info = moto_store.put("big", iter([data[: 7 << 20], data[7 << 20 :]]))
    assert info.sha256 == hashlib.sha256(data).hexdigest() and info.size == len(data)
    head = moto_store._client.head_object(
        Bucket=moto_store.config.bucket, Key=moto_store.config.prefix + "big"
    )
    assert head["ETag"].endswith('-3"')
    assert moto_store.get("big") == data
    assert (
        moto_store.get("big", (5 << 20) - 3, (10 << 20) + 3) == data[(5 << 20) - 3 : (10 << 20) + 3]
    )
    with moto_store.open("big") as stream:
        stream.seek(6 << 20)
        assert stream.read(100) == data[6 << 20 : (6 << 20) + 100]
    with pytest.raises(FileExistsError):
        moto_store.put("big", data)


def test_a_large_put_whose_source_fails_aborts_its_upload(moto_store):
    def source():
        yield os.urandom(6 << 20)
        yield os.urandom(6 << 20)
        raise RuntimeError("source broke")

    with pytest.raises(RuntimeError, match="source broke"):
        moto_store.put("big", source())
    assert moto_store.list() == []
    assert _uploads(moto_store) == []


def test_a_large_put_with_the_wrong_sha256_publishes_nothing(moto_store):
    data = os.urandom(11 << 20)
    with pytest.raises(ValueError, match="expected_sha256"):
        moto_store.put("big", data, expected_sha256=hashlib.sha256(b"other").hexdigest())
    with pytest.raises(ValueError, match="expected_size"):
        moto_store.put("big", data, expected_size=10 << 20)
    assert moto_store.list() == [] and _uploads(moto_store) == []


def test_a_part_the_server_stored_with_another_checksum_fails_the_put(moto_store, monkeypatch):
    # moto and rclone serve s3 accept a body that does not match x-amz-checksum-sha256 (and moto
    # echoes the header back), so a server that reports what it really stored is simulated.
    client = moto_store._client
    real = client.upload_part

    def misreporting(**request):
        answer = real(**request)
        if request["PartNumber"] == 2:
            answer["ChecksumSHA256"] = "U7xczoxXZAGbtM5uWX7DiFtxYIZoybbvSUDTZNepFPo="
        return answer

    monkeypatch.setattr(client, "upload_part", misreporting)
    with pytest.raises(OSError, match="part 2 .*changed in transit"):
        moto_store.put("big", os.urandom(11 << 20))
    monkeypatch.undo()
    assert moto_store.list() == [] and _uploads(moto_store) == []


def test_abort_stale_uploads_removes_what_a_killed_writer_left(moto_store):
    client, bucket = moto_store._client, moto_store.config.bucket
    client.create_multipart_upload(Bucket=bucket, Key=moto_store.config.prefix + "orphan")
    # moto reports a fixed initiation date in 2010, so only a threshold beyond that spares it.
    assert moto_store.abort_stale_uploads(older_than_seconds=1e9) == []
    assert moto_store.abort_stale_uploads(older_than_seconds=-60) == ["orphan"]
    assert _uploads(moto_store) == []


# -- listing --------------------------------------------------------------------------------


def test_list_pages_through_everything_and_skips_markers_and_temp_names(moto_store, monkeypatch):
    client, bucket, base = moto_store._client, moto_store.config.bucket, moto_store.config.prefix
    for i in range(23):
        moto_store.put(f"d/{i:03d}", b"x" * i)
    for foreign in ("d/", "d/.koochak-tmp-abc", "odd//key"):
        client.put_object(Bucket=bucket, Key=base + foreign, Body=b"")
    real = client.list_objects_v2
    pages = []
    monkeypatch.setattr(
        client, "list_objects_v2", lambda **r: pages.append(1) or real(MaxKeys=5, **r)
    )
    found = moto_store.list("d/")
    assert [i.key for i in found] == [f"d/{i:03d}" for i in range(23)]
    assert [i.size for i in found] == list(range(23))
    assert len(pages) >= 5


# -- opening ----------------------------------------------------------------------------------


def test_open_store_finds_s3_through_the_entry_point(moto_config, local_s3, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", local_s3.endpoint)
    store = open_store(f"s3://{moto_config.bucket}/{moto_config.prefix}")
    assert isinstance(store, S3Store)
    assert store.location == f"s3://{moto_config.bucket}/{moto_config.prefix}".rstrip("/")
    store.put("x", b"1")
    try:
        assert open_store(store.location).get("x") == b"1"
    finally:
        store.delete("x")


def test_a_stores_file_entry_configures_an_s3_store(tmp_path, monkeypatch, local_s3, s3_env):
    prefix = f"tests/{uuid.uuid4().hex}"
    stores = tmp_path / "stores.yaml"
    stores.write_text(
        textwrap.dedent(
            f"""
            version: 1
            stores:
              ckpt:
                backend: s3
                options:
                  endpoint: {local_s3.endpoint}
                  region: us-east-1
                  bucket: {local_s3.native_bucket}
                  prefix: {prefix}
                  path_style: true
                  part_size: 8MiB
                  concurrency: 3
                  verify_commit: true
                profile:
                  request_seconds: 0.002
                  stream_bytes_per_second: 500MB
                  concurrency: 4
                  range_reads_scale: false
                  part_bytes: 8MiB
                  listing_cheap: true
            """
        )
    )
    monkeypatch.setenv("KOOCHAK_STORES", str(stores))
    store = open_store("ckpt://exp0")
    assert isinstance(store, S3Store)
    assert store.location == f"s3://{local_s3.native_bucket}/{prefix}/exp0"
    assert (store.config.part_bytes, store.config.concurrency) == (8 << 20, 3)
    assert store.config.verify_commit
    assert store.profile.concurrency == 4 and not store.profile.range_reads_scale
    store.put("a", b"1")
    try:
        assert open_store("ckpt://").get("exp0/a") == b"1"
    finally:
        store.delete("a")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"bucket": "b", "colour": "red"}, "unknown S3 option colour"),
        ({"prefix": "x"}, "need 'bucket'"),
        ({"bucket": "bkt", "part_size": "1M"}, "at least 5 MiB"),
        ({"bucket": "bkt", "endpoint": "http://user:pw@host:1"}, "carries a user or password"),
        ({"bucket": "B!"}, "not a bucket name"),
    ],
)
def test_bad_s3_options_are_refused_naming_the_option(options, message):
    from koochak.s3 import open_s3_store

    with pytest.raises(ValueError, match=message) as caught:
        open_s3_store("", options=options)
    assert "pw" not in str(caught.value)


# -- credentials ------------------------------------------------------------------------------


def test_no_credential_appears_in_errors_or_logs(moto_config, monkeypatch, caplog, local_s3):
    secret = "KOOCHAKSECRETVALUE0123456789"
    key_id = "KOOCHAKKEYID42"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    caplog.set_level(logging.DEBUG, logger="koochak")
    store = S3Store(moto_config, client=_fresh_client(moto_config))
    messages = []
    for call in (
        lambda: store.get("missing"),
        lambda: store.stat("missing"),
        lambda: store.delete("missing"),
        lambda: store.put("k", b"1", expected_size=5),
    ):
        with pytest.raises((OSError, ValueError)) as caught:
            call()
        messages.append(str(caught.value))
    store.put("k", b"1")
    with pytest.raises(FileExistsError) as caught:
        store.put("k", b"2")
    messages.append(str(caught.value))
    messages.append(repr(store))
    text = "\n".join(messages + [r.getMessage() for r in caplog.records])
    assert secret not in text and key_id not in text
    store.delete("k")


def _fresh_client(config: S3Config):
    from koochak.s3.client import _make_client

    return _make_client(config, 10)


# -- probe checks -----------------------------------------------------------------------------


def test_probe_checks_tell_the_two_servers_apart(moto_store, nocond_config):
    moto = {row["name"]: row["supported"] for row in moto_store.probe_checks("probe/")}
    assert moto["conditional_create"] is True and moto["conditional_multipart"] is True
    nocond_store = S3Store(nocond_config)
    nocond = {row["name"]: row for row in nocond_store.probe_checks("probe/")}
    assert nocond["conditional_create"]["supported"] is False
    assert "overwrote" in nocond["conditional_create"]["detail"]
    assert nocond["conditional_multipart"]["supported"] is False
    assert moto_store.list() == [] and nocond_store.list() == []


def test_ranges_are_one_get_when_the_profile_says_they_do_not_scale(moto_config):
    from dataclasses import replace

    from koochak.s3 import S3_PROFILE

    profile = replace(S3_PROFILE, part_bytes=1 << 20, range_reads_scale=False)
    store = S3Store(moto_config, profile=profile)
    data = os.urandom(5 << 20)
    store.put("o", data)
    calls = []
    real = store._client.get_object
    store._client = _Spy(store._client, "get_object", lambda **r: calls.append(r) or real(**r))
    try:
        assert store.get("o") == data
        assert store.get("o", 100, (4 << 20) + 7) == data[100 : (4 << 20) + 7]
        assert len(calls) == 2
        fast = S3Store(moto_config, profile=replace(profile, range_reads_scale=True))
        fast._client = store._client
        assert fast.get("o") == data
        assert len(calls) == 2 + 5  # the first MiB, then four more ranges in parallel
    finally:
        store._client = store._client._inner
        store.delete("o")


class _Spy:
    def __init__(self, inner, name, call):
        self._inner, self._name, self._call = inner, name, call

    def __getattr__(self, attr):
        return self._call if attr == self._name else getattr(self._inner, attr)


def test_a_store_pickles_for_worker_processes(moto_store):
    import pickle

    moto_store.put("p", b"for a worker")
    copy = pickle.loads(pickle.dumps(moto_store))
    assert copy.location == moto_store.location and copy.get("p") == b"for a worker"


def test_small_puts_skip_the_100_continue_round_trip_and_large_ones_keep_it(moto_config):
    client = _fresh_client(moto_config)
    sent = []
    client.meta.events.register(
        "before-send.s3.PutObject", lambda request, **_: sent.append(request.headers.get("Expect"))
    )
    store = S3Store(moto_config, client=client)
    store.put("small", b"x" * 1000)
    store.put("large", os.urandom(2 << 20))  # one part: a single PutObject
    assert sent[-2:] == [None, b"100-continue"]
    for key in ("small", "large"):
        store.delete(key)


def test_verify_commit_catches_a_racing_writer_a_non_atomic_server_let_through(
    moto_config, monkeypatch
):
    # moto checks If-None-Match and then writes, without a lock: two racing puts can both be
    # accepted. Simulated: right after our accepted put, another writer's put lands too.
    from dataclasses import replace

    client = _fresh_client(moto_config)
    real = client.put_object

    def raced(**request):
        answer = real(**request)
        if request["Key"].endswith("/k"):
            real(Bucket=request["Bucket"], Key=request["Key"], Body=b"theirs",
                 Metadata={"koochak-writer": "someone-else"})  # fmt: skip
        return answer

    monkeypatch.setattr(client, "put_object", raced)
    trusting = S3Store(replace(moto_config, verify_commit=False), client=client)
    assert trusting.put("k", b"mine").size == 4  # not seen: the server said yes
    trusting.delete("k")
    checking = S3Store(moto_config, client=client)  # verify_commit=True
    with pytest.raises(FileExistsError, match="another writer"):
        checking.put("k", b"mine")
    assert checking.get("k") == b"theirs"
    checking.delete("k")


def test_a_stream_of_short_reads_is_cut_into_whole_parts(moto_store):
    import io

    class Trickle(io.RawIOBase):  # returns at most 64 KiB per read, like a pipe
        def __init__(self, data):
            self._data, self._pos = data, 0

        def readable(self):
            return True

        def read(self, n=-1):
            n = min(n if n >= 0 else len(self._data), 64 << 10)
            chunk = self._data[self._pos : self._pos + n]
            self._pos += len(chunk)
            return chunk

    data = os.urandom(11 << 20)
    info = moto_store.put("trickle", Trickle(data))
    assert info.sha256 == hashlib.sha256(data).hexdigest()
    assert moto_store.get("trickle") == data
