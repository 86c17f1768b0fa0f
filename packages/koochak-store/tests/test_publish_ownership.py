"""publish never deletes an object it did not create: the intent record says who is publishing,
and only a provably dead publisher's leftovers are removed."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import threading
import time

import pytest
from koochak.storage import _publish_intent
from koochak.storage.artifact import READY_SUFFIX, publish, read_verified
from koochak.storage.store import LocalStore

NAME = "step000000007.pt"
INTENT = NAME + _publish_intent.INTENT_SUFFIX


@pytest.fixture(params=["link", "exclusive"])
def store(request, tmp_path):
    return LocalStore(tmp_path / "ckpt", publish=request.param)


def _leave_uncommitted(store, intent: _publish_intent.Intent) -> None:
    """What a publisher leaves between its object and its manifest."""
    store.put(INTENT, intent.to_bytes())
    store.put(NAME, b"their bytes")


def _keys(store) -> set[str]:
    return {info.key for info in store.list()}


def test_a_publication_leaves_no_intent_record(store):
    publish(store, NAME, b"mine")
    assert _keys(store) == {NAME, NAME + READY_SUFFIX}


def test_a_live_publishers_object_is_never_removed(store):
    _leave_uncommitted(store, _publish_intent.ours(NAME))  # this very process: alive
    with pytest.raises(FileExistsError, match=r"being published by pid \d+ on"):
        publish(store, NAME, b"mine")
    assert store.get(NAME) == b"their bytes" and _keys(store) == {NAME, INTENT}


def test_a_dead_publishers_leftovers_on_this_host_are_replaced(store, caplog):
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    gone = dataclasses.replace(_publish_intent.ours(NAME), pid=int(child.stdout))
    _leave_uncommitted(store, gone)
    with caplog.at_level(logging.WARNING, logger="koochak.storage.artifact"):
        publication = publish(store, NAME, b"mine")
    assert "is no longer running" in caplog.text
    assert read_verified(store, NAME) == (publication, b"mine")
    assert _keys(store) == {NAME, NAME + READY_SUFFIX}


def _before_this_boot():
    """This machine's intent from its previous boot: another boot id, written before this boot."""
    booted = _publish_intent._boot_time()
    assert booted is not None
    return dataclasses.replace(_publish_intent.ours(NAME), boot_id="before", written=booted - 60)


def test_a_rebooted_hosts_leftovers_are_replaced(store):
    _leave_uncommitted(store, _before_this_boot())
    publish(store, NAME, b"mine")
    assert store.get(NAME) == b"mine"


def test_another_hosts_publisher_counts_as_alive_until_its_deadline(store):
    elsewhere = dataclasses.replace(_publish_intent.ours(NAME), host="node-elsewhere", pid=1,
                                    machine_id="another-machine")  # fmt: skip
    _leave_uncommitted(store, elsewhere)
    with pytest.raises(FileExistsError, match="node-elsewhere"):
        publish(store, NAME, b"mine")
    store.delete(INTENT)
    late = time.time() - _publish_intent.CLOCK_SKEW_SECONDS - 1
    store.put(INTENT, dataclasses.replace(elsewhere, deadline=late).to_bytes())
    publish(store, NAME, b"mine")
    assert store.get(NAME) == b"mine"


def test_an_unreadable_intent_removes_nothing(store):
    store.put(INTENT, b"{not json")
    store.put(NAME, b"their bytes")
    with pytest.raises(FileExistsError, match="intent record is unreadable"):
        publish(store, NAME, b"mine")
    assert store.get(NAME) == b"their bytes"


def test_an_intent_without_an_object_from_a_dead_publisher_is_cleared(store):
    store.put(INTENT, _before_this_boot().to_bytes())
    publish(store, NAME, b"mine")
    assert _keys(store) == {NAME, NAME + READY_SUFFIX}


def test_losing_the_manifest_to_another_publisher_removes_nothing_of_theirs(store, monkeypatch):
    real_put = store.put

    def racing_put(key, data, **kwargs):
        if key == NAME + READY_SUFFIX:  # another publisher committed first
            real_put(key, json.dumps({"theirs": True}).encode())
        return real_put(key, data, **kwargs)

    monkeypatch.setattr(store, "put", racing_put)
    with pytest.raises(FileExistsError):
        publish(store, NAME, b"mine")
    assert NAME in _keys(store) and NAME + READY_SUFFIX in _keys(store)
    assert INTENT not in _keys(store)


def test_a_publication_past_its_deadline_is_not_committed(store, monkeypatch):
    monkeypatch.setattr(_publish_intent, "LEASE_SECONDS", -1.0)
    with pytest.raises(TimeoutError, match="deadline"):
        publish(store, NAME, b"mine")
    assert _keys(store) == set()


def test_intent_records_are_strict(tmp_path):
    good = _publish_intent.ours(NAME)
    assert _publish_intent.parse(good.to_bytes(), "x") == good
    doc = json.loads(good.to_bytes())
    # version 1 had no pid_ns field, versions 1 and 2 no machine_id and written: an older
    # record carrying them is malformed
    for broken in ({**doc, "extra": 1}, {**doc, "version": 4}, {**doc, "pid": "1"},
                   {**doc, "pid_ns": 7}, {**doc, "version": 1}, {**doc, "version": 2},
                   {**doc, "machine_id": 1}, {**doc, "written": "now"}):  # fmt: skip
        with pytest.raises(ValueError, match="x"):
            _publish_intent.parse(json.dumps(broken).encode(), "x")


def test_same_hostname_another_machine_is_alive_until_its_deadline(store):
    """Another boot id is a reboot of this machine only when the machine identity matches and
    the record predates this boot: a same-named machine's live publisher is never taken over."""
    other = dataclasses.replace(_publish_intent.ours(NAME), boot_id="another-boot",
                                machine_id="another-machine", pid=1)  # fmt: skip
    _leave_uncommitted(store, other)
    with pytest.raises(FileExistsError, match="being published"):
        publish(store, NAME, b"mine")
    # Written after this host booted: never "from before a reboot", even with our identity
    # (a cloned machine-id) or an older record that only names the host.
    for record in (dataclasses.replace(other, machine_id=_publish_intent._machine_id()),
                   dataclasses.replace(other, machine_id="")):  # fmt: skip
        assert _publish_intent.why_dead(record) is None
    assert store.get(INTENT)


def test_intent_names_are_not_artifact_names(store):
    with pytest.raises(ValueError, match="intent records"):
        publish(store, INTENT, b"x")


def test_two_threads_publishing_one_name_commit_exactly_one(store):
    payloads = [bytes([i]) * 200_000 for i in range(4)]
    barrier = threading.Barrier(len(payloads))
    outcomes: list = []
    # Make the race real: a publisher that finished before another began would be a re-save,
    # which replaces it by design. The claimant's object put waits until every other publisher
    # has met its intent (or 30 s), so all of them overlap however the threads are scheduled.
    real_put = store.put

    def put(key, data, **expected):
        if key == NAME:
            deadline = time.monotonic() + 30
            while len(outcomes) < len(payloads) - 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        return real_put(key, data, **expected)

    store.put = put

    def run(data):
        barrier.wait()
        try:
            outcomes.append(("ok", publish(store, NAME, data), data))
        except FileExistsError as exc:
            outcomes.append(("lost", exc, None))

    threads = [threading.Thread(target=run, args=(p,)) for p in payloads]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [o for o in outcomes if o[0] == "ok"]
    assert len(winners) == 1 and len(outcomes) == len(payloads)
    _, publication, data = winners[0]
    assert read_verified(store, NAME) == (publication, data)
