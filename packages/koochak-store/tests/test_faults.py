"""Faults injected under LocalStore: nothing half-written is ever visible, reads settle, writes don't retry."""

from __future__ import annotations

import errno
import os

import pytest
from koochak.storage.keys import TEMP_PREFIX
from koochak.storage.store import SETTLING_ERRNOS, ObjectCollision
from koochak.storage.testing import FakeClock, Fault, FaultyStore, visible_files

MODES = ["link", "exclusive"]
DATA = bytes(range(256)) * 40_000  # ~10 MB: two write chunks, so faults can land mid-object


def _assert_nothing_visible(store: FaultyStore) -> None:
    store.set_faults([])
    assert store.list() == []
    assert visible_files(store.inner.root) == []
    with pytest.raises(FileNotFoundError):
        store.get("obj")


@pytest.mark.parametrize("publish", MODES)
@pytest.mark.parametrize(
    "fault",
    [
        Fault("write", nth=1),
        Fault("write", nth=2, errno=errno.ENOSPC),
        Fault("fsync", nth=1),
        Fault("close", nth=1),
        Fault("stat", nth=1, errno=errno.EACCES),
    ],
    ids=repr,
)
def test_a_failed_write_fsync_or_close_leaves_nothing_visible(tmp_path, publish, fault):
    store = FaultyStore(tmp_path, [fault], publish=publish)
    with pytest.raises(OSError) as caught:
        store.put("obj", DATA)
    assert caught.value.errno == fault.errno
    _assert_nothing_visible(store)
    store.put("obj", DATA)  # the key is free again
    assert store.get("obj") == DATA


def test_a_failed_link_leaves_nothing_visible_and_removes_the_temp(tmp_path):
    store = FaultyStore(tmp_path, [Fault("link", errno=errno.EPERM)], publish="link")
    with pytest.raises(PermissionError):
        store.put("obj", DATA)
    _assert_nothing_visible(store)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("publish", MODES)
def test_a_failed_directory_fsync_after_publish_unpublishes(tmp_path, publish):
    # The file fsync is call 1; the directory fsync after linking/closing is call 2.
    store = FaultyStore(tmp_path, [Fault("fsync", nth=2)], publish=publish)
    with pytest.raises(OSError):
        store.put("obj", DATA)
    _assert_nothing_visible(store)


@pytest.mark.parametrize("publish", MODES)
def test_short_writes_are_completed_not_truncated(tmp_path, publish):
    store = FaultyStore(tmp_path, [Fault("write", times=5, mode="short")], publish=publish)
    info = store.put("obj", DATA)
    assert info.size == len(DATA)
    assert store.get("obj") == DATA
    assert store.calls["write"] > 2


@pytest.mark.parametrize("publish", MODES)
def test_verify_readback_catches_corruption_and_leaves_nothing(tmp_path, publish):
    store = FaultyStore(
        tmp_path, [Fault("read", mode="corrupt")], publish=publish, verify_readback=True
    )
    with pytest.raises(OSError, match="read-back"):
        store.put("obj", DATA)
    _assert_nothing_visible(store)


def test_without_verify_readback_put_never_reads_the_data_back(tmp_path):
    store = FaultyStore(tmp_path, [], publish="link")
    store.put("obj", DATA)
    assert store.calls["read"] == 0  # SHA256 is computed while writing, not by a second read


@pytest.mark.parametrize("publish", MODES)
def test_writes_are_never_retried_even_with_read_settle(tmp_path, publish):
    clock = FakeClock()
    store = FaultyStore(
        tmp_path,
        [Fault("write", errno=errno.ETIME)],
        publish=publish,
        read_settle_seconds=600,
        clock=clock,
    )
    with pytest.raises(OSError) as caught:
        store.put("obj", DATA)
    assert caught.value.errno == errno.ETIME
    assert clock.sleeps == []
    assert store.calls["write"] == 1
    _assert_nothing_visible(store)


@pytest.mark.parametrize("code", sorted(SETTLING_ERRNOS), ids=errno.errorcode.get)
@pytest.mark.parametrize("op", ["open", "read", "stat"])
def test_reads_wait_out_settling_errnos_within_the_deadline(tmp_path, code, op):
    store = FaultyStore(tmp_path, read_settle_seconds=60)
    store.put("obj", b"payload")
    store.set_faults([Fault(op, errno=code, times=4)])
    call = {"open": lambda: store.open("obj").read(), "read": lambda: store.get("obj"),
            "stat": lambda: store.stat("obj").size}[op]  # fmt: skip
    assert call() in (b"payload", 7)
    assert len(store.clock.sleeps) == 4
    assert 0 < sum(store.clock.sleeps) <= 60


@pytest.mark.parametrize("op", ["get", "open", "stat", "list"])
def test_read_settle_gives_up_at_the_deadline(tmp_path, op):
    store = FaultyStore(tmp_path, read_settle_seconds=30)
    store.put("obj", b"payload")
    started = store.clock.now
    fault_op = {"get": "open", "open": "open", "stat": "stat", "list": "list"}[op]
    store.set_faults([Fault(fault_op, errno=errno.ETIME, times=10**9)])
    with pytest.raises(OSError) as caught:
        {"get": lambda: store.get("obj"), "open": lambda: store.open("obj"),
         "stat": lambda: store.stat("obj"), "list": lambda: store.list()}[op]()  # fmt: skip
    assert caught.value.errno == errno.ETIME
    assert store.clock.now - started == pytest.approx(30)  # waited exactly to the deadline
    assert len(store.clock.sleeps) > 3  # with backoff, not one long sleep


@pytest.mark.parametrize(
    "code",
    [errno.EACCES, errno.ENOSPC, errno.EROFS, errno.EINVAL, errno.ESTALE],
    ids=errno.errorcode.get,
)
def test_other_read_errors_are_raised_at_once(tmp_path, code):
    store = FaultyStore(tmp_path, read_settle_seconds=600)
    store.put("obj", b"payload")
    store.set_faults([Fault("open", errno=code)])
    with pytest.raises(OSError) as caught:
        store.get("obj")
    assert caught.value.errno == code
    assert store.clock.sleeps == []


def test_missing_objects_are_not_waited_for(tmp_path):
    store = FaultyStore(tmp_path, read_settle_seconds=600)
    with pytest.raises(FileNotFoundError):
        store.get("never-written")
    assert store.clock.sleeps == []


def test_without_read_settle_a_settling_errno_is_raised_at_once(tmp_path):
    store = FaultyStore(tmp_path)
    store.put("obj", b"payload")
    store.set_faults([Fault("read", errno=errno.EIO)])
    with pytest.raises(OSError):
        store.get("obj")
    assert store.clock.sleeps == []


@pytest.mark.parametrize("publish", MODES)
def test_settle_seconds_waits_for_a_just_closed_object_to_appear(tmp_path, publish):
    # After the write, the read-back stat sees ENOENT twice (an asynchronous close), then the object.
    nth = 1
    store = FaultyStore(tmp_path, [Fault("stat", nth=nth, errno=errno.ENOENT, times=2)],
                        publish=publish, settle_seconds=10)  # fmt: skip
    info = store.put("obj", b"payload")
    assert info.size == 7
    assert len(store.clock.sleeps) == 2


@pytest.mark.parametrize("publish", MODES)
def test_an_object_that_never_settles_fails_the_put_and_is_removed(tmp_path, publish):
    store = FaultyStore(tmp_path, [Fault("stat", errno=errno.ENOENT, times=10**9)],
                        publish=publish, settle_seconds=5)  # fmt: skip
    with pytest.raises(OSError, match="settle_seconds=5"):
        store.put("obj", b"payload")
    assert sum(store.clock.sleeps) == pytest.approx(5)
    _assert_nothing_visible(store)


def test_fsync_false_never_fsyncs(tmp_path):
    store = FaultyStore(tmp_path, [Fault("fsync", times=10**9, errno=errno.EINVAL)], fsync=False)
    store.put("a/b/obj", DATA)
    assert store.calls["fsync"] == 0
    assert store.get("a/b/obj") == DATA


def test_fault_descriptions_are_validated():
    with pytest.raises(ValueError, match="op"):
        Fault("truncate")
    with pytest.raises(ValueError, match="short"):
        Fault("fsync", mode="short")


def test_a_failed_exclusive_put_leaves_at_most_a_hidden_temp_name(tmp_path):
    # Exclusive mode writes a hidden temp file and renames it into place only once it is whole
    # (issue 20: a mount uploads whatever a killed writer left under the name it was writing),
    # so a failed put whose cleanup fails too leaves a hidden temp file, never an object.
    store = FaultyStore(
        tmp_path, [Fault("write", errno=errno.EIO), Fault("unlink", errno=errno.EACCES)],
        publish="exclusive",
    )  # fmt: skip
    with pytest.raises(OSError) as caught:
        store.put("obj", DATA)
    assert caught.value.errno == errno.EIO
    assert [p.name[: len(TEMP_PREFIX)] for p in tmp_path.iterdir()] == [TEMP_PREFIX]
    _assert_nothing_visible(store)


# -- the calls outside put and the reads go through the same seam ------------------------------


def test_a_fault_reaches_delete(tmp_path):
    store = FaultyStore(tmp_path)
    store.put("obj", b"payload")
    store.set_faults([Fault("stat", errno=errno.EIO)])
    with pytest.raises(OSError) as caught:
        store.delete("obj")
    assert caught.value.errno == errno.EIO
    store.set_faults([])
    assert store.get("obj") == b"payload"  # nothing was removed


@pytest.mark.parametrize("op", ["stat", "unlink"])
def test_a_fault_reaches_the_stale_temp_sweep(tmp_path, op):
    store = FaultyStore(tmp_path, [Fault(op, errno=errno.EIO)])
    temp = tmp_path / f"{TEMP_PREFIX}killed-writer-obj"
    temp.write_bytes(b"half")
    with pytest.raises(OSError) as caught:
        store.inner.remove_stale_temps(older_than_seconds=0)
    assert caught.value.errno == errno.EIO and temp.exists()
    store.set_faults([])
    assert store.inner.remove_stale_temps(older_than_seconds=0) == [str(temp)]


def test_the_stale_temp_sweep_skips_a_directory_it_cannot_list(tmp_path):
    # As os.walk does: the sweep does not fail, and the next sweep finds what it skipped.
    store = FaultyStore(tmp_path, [Fault("list", nth=2)])
    (tmp_path / "sub").mkdir()
    top, below = tmp_path / f"{TEMP_PREFIX}a", tmp_path / "sub" / f"{TEMP_PREFIX}b"
    top.write_bytes(b"1")
    below.write_bytes(b"2")
    assert store.inner.remove_stale_temps(older_than_seconds=0) == [str(top)]
    assert below.exists()
    assert store.inner.remove_stale_temps(older_than_seconds=0) == [str(below)]


@pytest.mark.parametrize(
    "fault",
    [Fault("stat", nth=1, errno=errno.EIO), Fault("open", nth=4, errno=errno.EIO)],
    ids=["stat-of-a-directory", "open-of-a-directory"],
)
def test_a_fault_reaches_the_batch_flush_before_anything_is_linked(tmp_path, fault):
    # Three temp files are opened first (opens 1-3); the flush then stats and opens the directory.
    store = FaultyStore(tmp_path, [fault])
    with pytest.raises(OSError) as caught:
        store.inner.put_many([(f"o{i}", b"x" * (i + 1), None, None) for i in range(3)])
    assert caught.value.errno == errno.EIO
    assert store.calls["link"] == 0
    assert list(tmp_path.iterdir()) == []  # no object and no temp file


@pytest.mark.parametrize("publish", MODES)
def test_a_fault_reaches_the_directory_sync_after_a_put(tmp_path, publish):
    # Open 1 is the object (or its temp file), open 2 the directory whose entry makes it durable.
    store = FaultyStore(tmp_path, [Fault("open", nth=2, errno=errno.EIO)], publish=publish)
    with pytest.raises(OSError) as caught:
        store.put("obj", b"payload")
    assert caught.value.errno == errno.EIO
    _assert_nothing_visible(store)


class _ReplacingClock(FakeClock):
    """A fake clock whose first sleep is when another client replaces the object."""

    def __init__(self, path) -> None:
        super().__init__()
        self.path = path

    def sleep(self, seconds: float) -> None:
        if not self.sleeps:
            other = self.path.with_name(".other-client")
            other.write_bytes(b"the other client's bytes")
            os.replace(other, self.path)
        super().sleep(seconds)


def test_an_object_replaced_before_the_read_back_is_a_collision_and_stays(tmp_path):
    clock = _ReplacingClock(tmp_path / "obj")
    store = FaultyStore(tmp_path, [], clock=clock, publish="exclusive", verify_readback=True,
                        settle_seconds=2)  # fmt: skip
    with pytest.raises(ObjectCollision, match="another client published the same key") as lost:
        store.put("obj", DATA)
    assert isinstance(lost.value, FileExistsError)
    assert sum(clock.sleeps) == pytest.approx(2)  # read back once settle_seconds had passed
    assert store.get("obj") == b"the other client's bytes"  # nothing of theirs removed


def test_an_exclusive_put_renames_under_the_directory_lock_once_the_name_is_free(tmp_path):
    store = FaultyStore(tmp_path, [], publish="exclusive")
    store.put("a/obj", b"first")
    with pytest.raises(FileExistsError):
        store.put("a/obj", b"second")  # refused before a byte is written
    assert store.calls["lock"] == 1 and store.calls["rename"] == 1
    assert store.get("a/obj") == b"first"
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["obj"]  # no temp left
