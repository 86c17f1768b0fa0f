"""One live holder per location (koochak.storage.lease): refused while alive, taken over when
provably gone (same host: its pid; other hosts: its renewals expired), released at the end."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from koochak.storage import lease as leases
from koochak.storage.store import LocalStore

HOLDER = textwrap.dedent(
    """
    import sys, time
    from koochak.storage.lease import acquire_lease
    from koochak.storage.store import LocalStore

    held = acquire_lease(LocalStore(sys.argv[1]), purpose="holder-under-test")
    print("held", flush=True)
    time.sleep(600)
    """
)


@pytest.fixture
def store(tmp_path):
    return LocalStore(tmp_path / "ckpt")


def _elsewhere(started: float, **changes) -> leases.LeaseRecord:
    fields = dict(token="f" * 32, host="some-other-node", boot_id="b", pid_ns="pid:[1]", pid=4242,
                  pid_start=7, started=started, ttl_seconds=600.0, purpose="")  # fmt: skip
    return leases.LeaseRecord(**{**fields, **changes})


def test_a_second_holder_is_refused_naming_the_first_until_it_releases(store):
    first = leases.acquire_lease(store, purpose="run A")
    with pytest.raises(leases.LeaseHeld, match=rf"pid {os.getpid()} on .*\(run A\)") as refused:
        leases.acquire_lease(store)
    assert refused.value.holder == first.record
    assert leases.LEASE_KEY in str(refused.value)
    first.release()
    assert store.list() == []  # nothing left behind
    with leases.acquire_lease(store) as second:
        assert leases.read_lease(store) == second.record
    assert store.list() == []


def test_a_live_holder_in_another_process_is_refused_and_taken_over_once_killed(store, caplog):
    store.root.mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(store.root)],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(leases.LeaseHeld, match=rf"pid {proc.pid} .*holder-under-test"):
            leases.acquire_lease(store)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with caplog.at_level(logging.WARNING, logger="koochak.storage.lease"):
        taken = leases.acquire_lease(store)
    (line,) = [r.getMessage() for r in caplog.records if "taking over" in r.getMessage()]
    assert f"pid {proc.pid}" in line and "no longer running" in line
    assert leases.read_lease(store).token == taken.record.token
    taken.release()


def test_another_hosts_lease_is_taken_over_only_once_its_renewals_expired(store):
    now = time.time()
    store.put(leases.LEASE_KEY, _elsewhere(now - 60).to_bytes())
    with pytest.raises(leases.LeaseHeld, match="some-other-node"):
        leases.acquire_lease(store)
    store.delete(leases.LEASE_KEY)
    old = _elsewhere(now - 3600)
    store.put(leases.LEASE_KEY, old.to_bytes())
    # ... but renewed a minute ago: still alive
    store.put(f"{leases.LEASE_KEY}.renewed-{old.token}-000000001.json",
              b'{"version": 1, "token": "%s", "renewed": %f}' % (old.token.encode(), now - 60))  # fmt: skip
    with pytest.raises(leases.LeaseHeld):
        leases.acquire_lease(store)
    assert leases.why_gone(store, leases.LEASE_KEY, old, now=now + 901) is not None
    assert leases.why_gone(store, leases.LEASE_KEY, old, now=now + 800) is None
    store.delete(f"{leases.LEASE_KEY}.renewed-{old.token}-000000001.json")
    taken = leases.acquire_lease(store)  # its last sign of life, the start, is an hour old
    assert leases.read_lease(store).token == taken.record.token
    taken.release()
    assert store.list() == []


def test_renewals_keep_one_object_and_a_taken_over_holder_learns_it(store, caplog):
    held = leases.acquire_lease(store, ttl_seconds=10, renew_seconds=1)
    held.renew()
    held.renew()
    renewals = [i.key for i in store.list(f"{leases.LEASE_KEY}.renewed-")]
    assert renewals == [f"{leases.LEASE_KEY}.renewed-{held.record.token}-000000002.json"]
    store.delete(leases.LEASE_KEY)  # as a takeover by another run would
    other = _elsewhere(time.time())
    store.put(leases.LEASE_KEY, other.to_bytes())
    with caplog.at_level(logging.ERROR, logger="koochak.storage.lease"):
        held.renew()
    assert held.lost and "taken over" in caplog.text and "some-other-node" in caplog.text
    held.release()
    assert leases.read_lease(store) == other  # never removes another holder's lease


def test_a_leftover_of_this_very_process_is_taken_over(store):
    held = leases.acquire_lease(store)
    leases._ACTIVE.discard(held.record.token)  # as if its release had failed
    again = leases.acquire_lease(store)
    assert leases.read_lease(store).token == again.record.token
    again.release()


def test_bad_arguments_and_unreadable_leases_are_one_line_errors(store):
    with pytest.raises(ValueError, match="renew_seconds"):
        leases.acquire_lease(store, ttl_seconds=10, renew_seconds=6)
    with pytest.raises(ValueError, match="ttl_seconds"):
        leases.acquire_lease(store, ttl_seconds=0)
    store.put(leases.LEASE_KEY, b"{not json")
    with pytest.raises(leases.LeaseHeld, match="unreadable"):
        leases.acquire_lease(store)
    assert store.get(leases.LEASE_KEY) == b"{not json"  # left for a person to judge


def test_a_lease_works_on_an_exclusive_mode_store(tmp_path):
    store = LocalStore(tmp_path, publish="exclusive", verify_readback=True, settle_seconds=0.1)
    with leases.acquire_lease(store), pytest.raises(leases.LeaseHeld):
        leases.acquire_lease(store)
    assert store.list() == []


@pytest.mark.slow
def test_a_lease_on_real_object_storage_mounts_refuses_the_other_client(local_s3):
    """The lease through s3fs; a second run through the rclone mount of the same bucket (another
    client, as another node would be) is refused once the mount settings' settle has passed."""
    import shutil
    import uuid

    name = f"t-{uuid.uuid4().hex[:12]}"
    settings = dict(publish="exclusive", verify_readback=True, settle_seconds=2.0,
                    read_settle_seconds=5.0)  # fmt: skip  (what koochak-probe --peer advises)
    (local_s3.s3fs_mount / name).mkdir()
    try:
        s3fs = LocalStore(local_s3.s3fs_mount / name, **settings)
        rclone = LocalStore(local_s3.rclone_mount / name, **settings)
        held = leases.acquire_lease(s3fs, purpose="through s3fs")
        time.sleep(settings["settle_seconds"])  # another node starts later than that
        with pytest.raises(leases.LeaseHeld, match="through s3fs"):
            leases.acquire_lease(rclone)
        with pytest.raises(leases.LeaseHeld, match="through s3fs"):
            leases.acquire_lease(s3fs)
        held.release()
        assert s3fs.list() == []
    finally:
        shutil.rmtree(local_s3.s3fs_mount / name, ignore_errors=True)


def test_a_lease_that_could_not_be_renewed_for_its_ttl_counts_as_lost(store, caplog):
    """Renewals that fail past ``ttl_seconds`` let another run take over: the holder must stop."""
    held = leases.acquire_lease(store, ttl_seconds=0.4, renew_seconds=0.1)
    assert not held.lost and held.lost_reason is None
    failing = store.put

    def put(key, data, *args, **kwargs):
        if ".renewed-" in key:
            raise OSError(5, "the storage is away", key)
        return failing(key, data, *args, **kwargs)

    store.put = put
    with caplog.at_level(logging.WARNING, logger="koochak.storage.lease"):
        held.keep_renewed()
        deadline = time.monotonic() + 60
        while not held.lost and time.monotonic() < deadline:
            time.sleep(0.05)
    assert held.lost and "could not be renewed" in held.lost_reason
    assert "the storage is away" in held.lost_reason and "could not renew" in caplog.text
    store.put = failing
    held.renew()  # the storage is back: still lost (someone may have taken it over meanwhile)
    assert held.lost and store.list(f"{leases.LEASE_KEY}.renewed-") == []
    held.release()
    assert store.list() == []


def test_same_hostname_on_another_machine_is_alive_until_its_ttl(store):
    """Another boot id proves a reboot only for this very machine and a record last renewed
    before this boot: a same-named machine renewing 0.5 s ago keeps its lease."""
    import socket

    from koochak.storage import _publish_intent

    now = time.time()
    for machine in ("another-machine", ""):  # a version 2 record, and one that only names a host
        twin = _elsewhere(now - 0.5, host=socket.gethostname(), boot_id="another-boot",
                          machine_id=machine)  # fmt: skip
        store.put(leases.LEASE_KEY, twin.to_bytes())
        with pytest.raises(leases.LeaseHeld, match="another run holds this location"):
            leases.acquire_lease(store)
        assert leases.read_lease(store) == twin
        store.delete(leases.LEASE_KEY)
    # This machine before its reboot (our identity, last renewed before this boot): taken over.
    booted = _publish_intent._boot_time()
    stale = _elsewhere(booted - 60, host=socket.gethostname(), boot_id="another-boot",
                       machine_id=_publish_intent._machine_id())  # fmt: skip
    store.put(leases.LEASE_KEY, stale.to_bytes())
    assert leases.why_gone(store, leases.LEASE_KEY, stale) == "its host has rebooted since"
    leases.acquire_lease(store).release()
