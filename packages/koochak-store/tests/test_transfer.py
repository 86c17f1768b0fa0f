"""copy_objects: verified, create-only, resumable copies between real LocalStores."""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from koochak.storage.profile import StoreProfile
from koochak.storage.store import LocalStore, ObjectInfo, StoreCapabilities
from koochak.storage.testing import Fault, FaultyStore, visible_files
from koochak.storage.transfer import CopyItem, CopyReport, copy_objects


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class _Wrapped:
    """A Store that forwards to a LocalStore; subclasses inject faults or record calls."""

    def __init__(self, inner: LocalStore) -> None:
        self.inner = inner
        self.location = f"wrapped:{inner.location}"

    def capabilities(self):  # the inner store's profile, no batch put (not forwarded)
        return StoreCapabilities(profile=self.inner.profile)

    def get(self, key, start=None, end=None):
        return self.inner.get(key, start, end)

    def open(self, key):
        return self.inner.open(key)

    def put(self, key, data, *, expected_size=None, expected_sha256=None):
        return self.inner.put(
            key, data, expected_size=expected_size, expected_sha256=expected_sha256
        )

    def stat(self, key):
        return self.inner.stat(key)

    def list(self, prefix=""):
        return self.inner.list(prefix)

    def delete(self, key):
        self.inner.delete(key)

    def local_path(self, key):
        return self.inner.local_path(key)


class _RecordingSource(_Wrapped):
    """Records every get (key, start, end) and the most range reads ever in flight at once."""

    def __init__(self, inner: LocalStore) -> None:
        super().__init__(inner)
        self.calls: list[tuple[str, int | None, int | None]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()

    def get(self, key, start=None, end=None):
        with self._lock:
            self.calls.append((key, start, end))
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            time.sleep(0.002)  # let concurrent reads overlap so the bound is really exercised
            return super().get(key, start, end)
        finally:
            with self._lock:
                self.in_flight -= 1


class _FailingSource(_Wrapped):
    """Raises EIO on the get calls whose 1-based number is in ``fail_on``."""

    def __init__(self, inner: LocalStore, fail_on: set[int]) -> None:
        super().__init__(inner)
        self.fail_on = fail_on
        self.count = 0
        self._lock = threading.Lock()

    def get(self, key, start=None, end=None):
        with self._lock:
            self.count += 1
            n = self.count
        if n in self.fail_on:
            raise OSError(5, f"injected EIO on get #{n}", key)
        return super().get(key, start, end)


def _fill(store: LocalStore, objects: dict[str, bytes]) -> list[CopyItem]:
    return [
        CopyItem(key, len(data), store.put(key, data).sha256)
        for key, data in sorted(objects.items())
    ]


def _objects() -> dict[str, bytes]:
    return {
        "empty.bin": b"",
        "small.txt": b"hello koochak\n",
        "dir/medium.bin": os.urandom(2500),
        "dir/sub/large.bin": os.urandom(10_007),  # not a multiple of the part size
        "exact.bin": os.urandom(4000),  # exactly four parts
    }


@pytest.fixture
def stores(tmp_path):
    return LocalStore(tmp_path / "src"), LocalStore(tmp_path / "dst")


def test_copy_is_byte_identical_and_reports_counts(stores):
    source, target = stores
    objects = _objects()
    items = _fill(source, objects)
    report = copy_objects(source, target, items, streams=3, range_streams=3, part_bytes=1000)
    assert report == CopyReport(
        copied=5, skipped=0, bytes_copied=sum(map(len, objects.values())), bytes_skipped=0
    )
    for key, data in objects.items():
        assert target.get(key) == data
    assert [info.key for info in target.list()] == sorted(objects)


def test_large_objects_are_read_as_bounded_parallel_ranges(stores):
    source, target = stores
    data = os.urandom(50_000)
    item = CopyItem("big.bin", len(data), source.put("big.bin", data).sha256)
    recording = _RecordingSource(source)
    copy_objects(recording, target, [item], streams=1, range_streams=4, part_bytes=1000)
    assert target.get("big.bin") == data
    ranges = sorted((start, end) for _, start, end in recording.calls)
    assert len(ranges) == 50
    assert ranges[0] == (0, 1000)
    # The last range asks one byte past the end, so a longer source cannot be silently cut.
    assert ranges[-1] == (49_000, 50_001)
    assert 1 < recording.max_in_flight <= 4


def test_small_objects_are_read_in_one_request_bounded_by_their_size(stores):
    source, target = stores
    items = _fill(source, {"a": b"x" * 999, "b": b"y" * 1000})
    recording = _RecordingSource(source)
    copy_objects(recording, target, items, part_bytes=1000)
    assert sorted(recording.calls) == [("a", 0, 1000), ("b", 0, 1001)]


def test_a_stale_small_size_never_reads_a_large_source_whole(stores):
    source, target = stores
    source.put("big.bin", os.urandom(200_000))
    recording = _RecordingSource(source)
    with pytest.raises(ValueError, match=r"'big\.bin' has more than 10 bytes, expected 10"):
        copy_objects(recording, target, [CopyItem("big.bin", 10)])
    assert recording.calls == [("big.bin", 0, 11)]
    assert target.list() == []


def test_rerun_after_failure_resumes_and_ends_verified(stores):
    source, target = stores
    objects = {f"obj{i:02d}": os.urandom(3000 + i) for i in range(8)}
    items = _fill(source, objects)
    # Fail the 9th read: some objects are done, one large put is aborted mid-stream.
    with pytest.raises(OSError, match="injected EIO"):
        copy_objects(
            _FailingSource(source, {9}), target, items, streams=1, range_streams=1, part_bytes=1000
        )
    done = {info.key for info in target.list()}
    assert done and done != set(objects)
    for key in done:  # whatever is visible is complete
        assert target.get(key) == objects[key]
    # Nothing half-written is left behind as a visible object or a stray file besides temp names.
    report = copy_objects(source, target, items, streams=2, part_bytes=1000)
    assert report.skipped == len(done)
    assert report.copied == len(objects) - len(done)
    assert report.bytes_skipped == sum(len(objects[k]) for k in done)
    for key, data in objects.items():
        assert _sha(target.get(key)) == _sha(data)


@pytest.mark.parametrize("publish", ["link", "exclusive"])
def test_copy_interrupted_mid_range_leaves_nothing_and_resumes_byte_identical(tmp_path, publish):
    source = LocalStore(tmp_path / "src")
    data = os.urandom(20_500)  # 21 ranges of 1000 bytes, read three at a time
    item = CopyItem("big.bin", len(data), source.put("big.bin", data).sha256)
    target = LocalStore(tmp_path / "dst", publish=publish)
    failing = _FailingSource(source, {12})  # half-way, with ranges before and after in flight
    with pytest.raises(OSError, match="injected EIO on get #12"):
        copy_objects(failing, target, [item], streams=1, range_streams=3, part_bytes=1000)
    assert target.list() == [] and visible_files(tmp_path / "dst") == []
    assert [p for p in (tmp_path / "dst").rglob("*") if p.is_file()] == []  # no temp left either
    report = copy_objects(source, target, [item], range_streams=3, part_bytes=1000)
    assert (report.copied, report.skipped) == (1, 0)
    assert target.get("big.bin") == data
    assert copy_objects(source, target, [item], part_bytes=1000).skipped == 1  # and stays done


def test_mismatching_digest_leaves_no_object(stores):
    source, target = stores
    data = os.urandom(5000)
    source.put("x.bin", data)
    source.put("y.bin", b"tiny")
    wrong = _sha(b"something else")
    for part_bytes in (100, 10_000):  # ranged and whole-object paths
        with pytest.raises(ValueError, match="x.bin"):
            copy_objects(
                source, target, [CopyItem("x.bin", len(data), wrong)], part_bytes=part_bytes
            )
        assert target.list() == []
    with pytest.raises(ValueError):
        copy_objects(source, target, [CopyItem("y.bin", 4, wrong)])
    assert target.list() == []


def test_conflicting_size_is_refused_and_untouched(stores):
    source, target = stores
    source.put("k.bin", b"new content")
    target.put("k.bin", b"old")
    with pytest.raises(FileExistsError, match=r"'k\.bin'.*3 bytes, expected 11") as caught:
        copy_objects(source, target, [CopyItem("k.bin", 11)])
    assert "delete it and rerun" in str(caught.value)  # says how to get unstuck
    assert target.get("k.bin") == b"old"


def test_existing_target_of_expected_size_is_skipped(stores):
    source, target = stores
    source.put("k.bin", b"abc")
    target.put("renamed.bin", b"abc")
    seen: list[int] = []
    report = copy_objects(
        source, target, [CopyItem("k.bin", 3, target_key="renamed.bin")], progress=seen.append
    )
    assert report == CopyReport(copied=0, skipped=1, bytes_copied=0, bytes_skipped=3)
    assert sum(seen) == 3


def test_source_size_differing_from_item_is_an_error(stores):
    source, target = stores
    source.put("k.bin", os.urandom(5000))
    for size, part_bytes in ((4999, 100), (5001, 100), (4999, 10_000), (5001, 10_000)):
        with pytest.raises(ValueError, match="k.bin"):
            copy_objects(source, target, [CopyItem("k.bin", size)], part_bytes=part_bytes)
        assert target.list() == []


def test_target_key_renames_and_progress_counts_every_byte(stores):
    source, target = stores
    objects = _objects()
    items = [
        CopyItem(item.key, item.size, item.sha256, target_key=f"copy/{item.key}")
        for item in _fill(source, objects)
    ]
    seen: list[int] = []
    copy_objects(source, target, items, part_bytes=1000, progress=seen.append, show_progress=False)
    assert sum(seen) == sum(map(len, objects.values()))
    assert sorted(info.key for info in target.list()) == sorted(f"copy/{k}" for k in objects)


def test_first_failure_is_raised_after_in_flight_items_finish(stores):
    source, target = stores
    for key in ("a", "b", "c", "d"):
        source.put(key, key.encode() * 10)
    failed = threading.Event()

    class Source(_Wrapped):
        def get(self, key, start=None, end=None):
            if key == "a":
                failed.set()
                raise OSError(5, "injected", key)
            if key == "b":  # in flight when "a" fails; must still complete
                assert failed.wait(5)
                time.sleep(0.05)
            return super().get(key, start, end)

    items = [CopyItem(k, 10) for k in ("a", "b", "c", "d")]
    with pytest.raises(OSError, match="injected"):
        # A target without put_many: one item per task (batches are tested below).
        copy_objects(Source(source), _Wrapped(target), items, streams=2)
    assert [info.key for info in target.list()] == ["b"]  # c and d never started


def test_every_failure_beyond_the_first_is_logged(stores, caplog):
    source, target = stores
    items = [CopyItem(k, 3) for k in ("x", "y")]  # neither exists in the source
    with pytest.raises(FileNotFoundError):
        copy_objects(source, target, items, streams=2)
    assert "another item failed too" in caplog.text


@pytest.mark.parametrize(
    ("item", "message"),
    [
        (CopyItem("a", -1), "size"),
        (CopyItem("a", True), "size"),  # a bool is not a byte count
        (CopyItem("a", 1.0), "size"),  # type: ignore[arg-type]
        (CopyItem("a", 1, "ABC"), "sha256"),
        (CopyItem("../escape", 1), "escape"),
        (CopyItem("a", 1, target_key="/abs"), "absolute"),
    ],
)
def test_bad_items_are_rejected_before_anything_moves(stores, item, message):
    source, target = stores
    with pytest.raises(ValueError, match=message):
        copy_objects(source, target, [item])


def test_duplicate_target_keys_are_rejected(stores):
    source, target = stores
    with pytest.raises(ValueError, match="twice"):
        copy_objects(source, target, [CopyItem("a", 1), CopyItem("b", 1, target_key="a")])


@pytest.mark.parametrize("name", ["streams", "range_streams", "part_bytes"])
def test_bad_settings_name_the_argument(stores, name):
    source, target = stores
    with pytest.raises(ValueError, match=name):
        copy_objects(source, target, [], **{name: 0})


def test_defaults_come_from_the_store_profiles(tmp_path):
    profile = StoreProfile(
        request_seconds=0.5,
        stream_bytes_per_second=100 << 20,
        concurrency=3,
        range_reads_scale=True,
        part_bytes=1000,
        listing_cheap=False,
    )
    source = LocalStore(tmp_path / "src", profile=profile)
    target = LocalStore(tmp_path / "dst")
    data = os.urandom(4500)
    source.put("k", data)
    recording = _RecordingSource(source)
    copy_objects(recording, target, [CopyItem("k", len(data), _sha(data))])
    assert sorted(start for _, start, _ in recording.calls) == [0, 1000, 2000, 3000, 4000]
    assert recording.max_in_flight <= 3
    assert target.get("k") == data


def test_show_progress_draws_a_bar_on_request(stores, capsys):
    pytest.importorskip("tqdm")
    source, target = stores
    items = _fill(source, {"a": b"1" * 100})
    copy_objects(source, target, items, show_progress=True)
    assert "copy" in capsys.readouterr().err


def test_put_race_with_same_size_counts_as_skipped(stores):
    source, target = stores
    source.put("k", b"abc")

    class Racing(_Wrapped):
        """Another process publishes the key between our stat and our put."""

        def stat(self, key):
            if not hasattr(self, "raced"):
                self.raced = True
                raise FileNotFoundError(key)
            return super().stat(key)

        def put(self, key, data, **kwargs):
            self.inner.put(key, b"abc")
            return super().put(key, data, **kwargs)

    report = copy_objects(source, Racing(target), [CopyItem("k", 3)])
    assert report.skipped == 1 and report.copied == 0


_CRASHING_COPY = textwrap.dedent(
    """
    import sys, time
    from koochak.storage.store import LocalStore
    from koochak.storage.transfer import CopyItem, copy_objects

    class Slow:
        def __init__(self, inner):
            self.inner, self.location, self.profile = inner, inner.location, None
        def get(self, key, start=None, end=None):
            if key == "b.bin" and start is not None and start > 0:
                print("stalled", flush=True)
                time.sleep(60)  # killed here, mid-put
            return self.inner.get(key, start, end)
        def stat(self, key):
            return self.inner.stat(key)

    source, target = LocalStore(sys.argv[1]), LocalStore(sys.argv[2])
    items = [CopyItem(k, source.stat(k).size) for k in ("a.bin", "b.bin", "c.bin")]
    copy_objects(Slow(source), target, items, streams=1, range_streams=1, part_bytes=1000)
    """
)


@pytest.mark.slow
def test_copy_killed_mid_put_resumes_to_identical_objects(tmp_path):
    source, target = LocalStore(tmp_path / "src"), LocalStore(tmp_path / "dst")
    objects = {"a.bin": os.urandom(3000), "b.bin": os.urandom(5000), "c.bin": os.urandom(100)}
    items = _fill(source, objects)
    proc = subprocess.Popen(
        [sys.executable, "-c", _CRASHING_COPY, str(source.root), str(target.root)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "stalled"
    finally:
        proc.kill()
        proc.wait()
    assert [info.key for info in target.list()] == ["a.bin"]  # b.bin half-written, not visible
    report = copy_objects(source, target, items, part_bytes=1000)
    assert (report.copied, report.skipped) == (2, 1)
    for key, data in objects.items():
        assert target.get(key) == data
    assert isinstance(target.stat("b.bin"), ObjectInfo)


def test_cheap_request_sources_read_in_pipeline_sized_parts(tmp_path):
    fast = StoreProfile(
        request_seconds=0.0001,
        stream_bytes_per_second=1e9,
        concurrency=4,
        range_reads_scale=False,
        part_bytes=64 << 20,
        listing_cheap=True,
    )
    source = LocalStore(tmp_path / "src", profile=fast)
    target = LocalStore(tmp_path / "dst")
    size = (16 << 20) + 5
    data = os.urandom(size)
    source.put("k", data)
    recording = _RecordingSource(source)
    copy_objects(recording, target, [CopyItem("k", size, _sha(data))])
    assert sorted((s, e) for _, s, e in recording.calls) == [(0, 16 << 20), (16 << 20, size + 1)]
    assert recording.max_in_flight == 1  # ranges do not scale: one read ahead of the put
    assert target.get("k") == data


# -- with koochak.storage.testing.FaultyStore (errno on the Nth filesystem call) ----------------


@pytest.mark.parametrize(
    ("fault", "fails"),
    [
        (Fault("write", nth=3, errno=errno.ENOSPC), True),
        (Fault("fsync", nth=2), True),
        (Fault("write", nth=2, mode="short", times=1000), False),  # put keeps writing the rest
    ],
    ids=["enospc", "fsync", "short-writes"],
)
def test_target_faults_leave_nothing_partial_and_a_rerun_completes(tmp_path, fault, fails):
    source = LocalStore(tmp_path / "src")
    objects = {f"o{i}": os.urandom(2500 + i) for i in range(4)}
    items = _fill(source, objects)
    target = FaultyStore(tmp_path / "dst", [fault])
    if fails:
        with pytest.raises(OSError):
            copy_objects(source, target, items, streams=1, part_bytes=1000)
        assert len(visible_files(tmp_path / "dst")) < len(objects)
    else:
        copy_objects(source, target, items, streams=1, part_bytes=1000)
    for path in visible_files(tmp_path / "dst"):
        assert (tmp_path / "dst" / path).read_bytes() == objects[path]
    target.set_faults([])
    copy_objects(source, target, items, part_bytes=1000)
    assert sorted(visible_files(tmp_path / "dst")) == sorted(objects)
    for key, data in objects.items():
        assert target.get(key) == data


def test_corrupted_source_read_is_caught_by_the_digest(tmp_path):
    source = FaultyStore(tmp_path / "src")
    data = os.urandom(3000)
    item = CopyItem("k", len(data), source.put("k", data).sha256)
    target = LocalStore(tmp_path / "dst")
    source.set_faults([Fault("read", nth=2, mode="corrupt")])
    with pytest.raises(ValueError, match="SHA256"):
        copy_objects(source, target, [item], streams=1, range_streams=1, part_bytes=1000)
    assert target.list() == []
    source.set_faults([])
    assert copy_objects(source, target, [item], part_bytes=1000).copied == 1
    assert target.get("k") == data


_INTERRUPTED_COPY = textwrap.dedent(
    """
    import sys, time
    from koochak.storage.store import LocalStore
    from koochak.storage.transfer import CopyItem, copy_objects

    class Slow:
        def __init__(self, inner):
            self.inner, self.location, self.profile = inner, inner.location, None
        def get(self, key, start=None, end=None):
            if start == 1000:
                print("copying", flush=True)
            time.sleep(0.05)  # 200 parts: ten seconds unless Ctrl-C stops the copy
            return self.inner.get(key, start, end)

    source, target = LocalStore(sys.argv[1]), LocalStore(sys.argv[2])
    try:
        copy_objects(Slow(source), target, [CopyItem("big.bin", 200_000)],
                     streams=1, range_streams=2, part_bytes=1000)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
    """
)


@pytest.mark.slow
def _default_sigint() -> None:
    """In the child, before exec: SIGINT back to its default. A process started with SIGINT
    ignored (a job run with ``&`` by a non-interactive shell, ``nohup``, some CI runners) hands
    that on, and Python then installs no KeyboardInterrupt handler, so the test's Ctrl-C would
    reach nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_aborts_an_in_flight_copy_promptly_leaving_nothing(tmp_path):
    source, target = LocalStore(tmp_path / "src"), LocalStore(tmp_path / "dst")
    data = os.urandom(200_000)
    source.put("big.bin", data)
    proc = subprocess.Popen(
        [sys.executable, "-c", _INTERRUPTED_COPY, str(source.root), str(target.root)],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
    )
    try:
        assert proc.stdout.readline().strip() == "copying"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=5)  # far less than the 10 s the copy would take
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "interrupted" in out
    assert target.list() == []
    assert (
        copy_objects(source, target, [CopyItem("big.bin", len(data))], part_bytes=1000).copied == 1
    )
    assert target.get("big.bin") == data


def test_a_verified_copy_reads_each_source_byte_once_and_nothing_back(tmp_path):
    # The SHA256 check happens in flight: no second read of the source, no read-back of the
    # target (FaultyStore counts every positional read the target makes).
    source = LocalStore(tmp_path / "src")
    data = os.urandom(30_000)
    item = CopyItem("k", len(data), source.put("k", data).sha256)
    recording = _RecordingSource(source)
    target = FaultyStore(tmp_path / "dst")
    copy_objects(recording, target, [item], part_bytes=4000)
    read = sum(min(end, len(data)) - start for _, start, end in recording.calls)
    assert read == len(data)
    assert target.calls["read"] == 0
    target.set_faults([])
    assert target.get("k") == data


# -- small objects in batches: LocalStore.put_many ---------------------------------------------


def _batch(n: int) -> dict[str, bytes]:
    return {f"d{i % 3}/o{i:03d}": os.urandom(100 + i) for i in range(n)}


def test_put_many_publishes_every_object_for_two_flushes(tmp_path):
    faulty = FaultyStore(tmp_path / "dst")  # no faults: it counts the filesystem calls
    store = faulty.inner
    objects = _batch(30)
    infos = store.put_many([(k, v, len(v), _sha(v)) for k, v in objects.items()])
    assert [i.key for i in infos] == list(objects)
    assert all(i.sha256 == _sha(objects[i.key]) and i.size == len(objects[i.key]) for i in infos)
    for key, data in objects.items():
        assert store.get(key) == data
    assert faulty.calls["syncfs"] == 2  # the data, then the names, for the whole batch
    assert faulty.calls["fsync"] <= 4  # only the new directories' parents, never per object
    assert visible_files(tmp_path / "dst") == sorted(objects)
    assert [p.name for p in (tmp_path / "dst").rglob(".koochak-tmp-*")] == []


def test_put_many_that_fails_while_writing_publishes_nothing_of_the_batch(tmp_path):
    store = LocalStore(tmp_path / "dst")
    store.put("b", b"already here")
    with pytest.raises(FileExistsError, match="b"):
        store.put_many([("a", b"1", 1, None), ("b", b"2", 1, None), ("c", b"3", 1, None)])
    assert {i.key for i in store.list()} == {"b"} and store.get("b") == b"already here"
    with pytest.raises(ValueError, match="expected_sha256"):
        store.put_many([("x", b"1", 1, None), ("y", b"2", 1, _sha(b"other"))])
    assert {i.key for i in store.list()} == {"b"}  # checked before any link: none of x, y
    assert [p.name for p in (tmp_path / "dst").rglob(".koochak-tmp-*")] == []


def test_put_many_whose_data_flush_fails_publishes_nothing(tmp_path):
    faulty = FaultyStore(tmp_path / "dst", [Fault("syncfs", nth=1)])
    with pytest.raises(OSError, match="injected"):
        faulty.inner.put_many([(k, v, len(v), None) for k, v in _batch(5).items()])
    assert visible_files(tmp_path / "dst") == []


def test_objects_above_a_mebibyte_or_alone_are_not_batched(tmp_path):
    source = LocalStore(tmp_path / "src")
    items = _fill(source, {"big": os.urandom((1 << 20) + 1), "one": b"x"})
    faulty = FaultyStore(tmp_path / "dst")
    copy_objects(source, faulty.inner, items, part_bytes=4 << 20)
    assert faulty.calls["syncfs"] == 0  # each was put on its own, fsynced
    assert faulty.inner.get("one") == b"x"


def test_put_many_on_an_exclusive_store_puts_each_object(tmp_path):
    store = LocalStore(tmp_path / "dst", publish="exclusive")
    objects = _batch(4)
    store.put_many([(k, v, len(v), _sha(v)) for k, v in objects.items()])
    assert {k: store.get(k) for k in objects} == objects


def test_small_objects_are_copied_in_batches_and_resume_after_a_failure(tmp_path):
    source = LocalStore(tmp_path / "src")
    objects = _batch(40)
    items = _fill(source, objects)
    faulty = FaultyStore(tmp_path / "dst")
    report = copy_objects(source, faulty.inner, items, streams=4, part_bytes=10_000)
    assert (report.copied, report.skipped) == (40, 0)
    assert faulty.calls["syncfs"] == 8  # four batches of ten, two flushes each
    assert faulty.calls["fsync"] <= 4  # only for new directories, never per object
    for key, data in objects.items():
        assert faulty.inner.get(key) == data
    # A read failing inside a batch: what that stream read before it is still published.
    target = LocalStore(tmp_path / "dst2")
    with pytest.raises(OSError, match="injected EIO on get #5"):
        copy_objects(_FailingSource(source, {5}), target, items, streams=1, part_bytes=1000)
    assert [i.key for i in target.list()] == sorted(objects)[:4]
    report = copy_objects(source, target, items, streams=4, part_bytes=1000)
    assert (report.copied, report.skipped) == (36, 4)
    assert {k: target.get(k) for k in objects} == objects


_KILLED_BATCH = textwrap.dedent(
    """
    import sys, time
    from koochak.storage._syscalls import _Syscalls
    from koochak.storage.store import LocalStore
    from koochak.storage.transfer import CopyItem, copy_objects

    class Stall(_Syscalls):
        def syncfs(self, fd):  # the batch is written under temp names, nothing linked yet
            print("stalled", flush=True)
            time.sleep(60)  # killed here
            return super().syncfs(fd)

    source, target = LocalStore(sys.argv[1]), LocalStore(sys.argv[2])
    target._sys = Stall()
    copy_objects(source, target, [CopyItem(i.key, i.size) for i in source.list()], streams=1)
    """
)


@pytest.mark.slow
def test_copy_killed_inside_a_batch_shows_nothing_and_a_rerun_is_identical(tmp_path):
    source, target = LocalStore(tmp_path / "src"), LocalStore(tmp_path / "dst")
    objects = _batch(20)
    items = _fill(source, objects)
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_BATCH, str(source.root), str(target.root)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "stalled"
    finally:
        proc.kill()
        proc.wait()
    assert target.list() == [] and visible_files(tmp_path / "dst") == []
    assert len(list((tmp_path / "dst").rglob(".koochak-tmp-*"))) == len(objects)  # hidden only
    report = copy_objects(source, target, items)
    assert (report.copied, report.skipped) == (len(objects), 0)
    assert {k: target.get(k) for k in objects} == objects
    assert len(target.remove_stale_temps(older_than_seconds=0)) == len(objects)
