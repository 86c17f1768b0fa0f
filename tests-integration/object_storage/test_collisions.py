"""Two writers of one key: on one mount, and through the two mounts (two clients).

Whatever the interleaving, exactly one writer succeeds, the object holds its bytes, and the other
fails loudly (FileExistsError, or a subclass naming the collision) without deleting anything that
is not its own. Each round starts both writers together at a barrier.
"""

from __future__ import annotations

import hashlib
import threading

import pytest
from koochak.storage.artifact import publish, read_verified
from koochak.storage.store import LocalStore

pytestmark = pytest.mark.slow

MIB = 1 << 20


def _race(calls):
    """Run the calls at once; return (index, result) of the winners and the losers' errors."""
    barrier = threading.Barrier(len(calls))
    results: list = [None] * len(calls)

    def run(i, call):
        barrier.wait()
        try:
            results[i] = ("ok", call())
        except Exception as exc:  # the test inspects each outcome
            results[i] = ("error", exc)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [(i, value) for i, (how, value) in enumerate(results) if how == "ok"]
    errors = [value for how, value in results if how == "error"]
    return winners, errors


def _payloads(count: int, size: int) -> list[bytes]:
    return [hashlib.sha256(str(i).encode()).digest() * (size // 32) for i in range(count)]


def test_two_publishers_of_one_name_on_one_mount(mount_dir):
    payloads = _payloads(2, 4 * MIB)
    stores = [LocalStore(mount_dir.path, **mount_dir.settings) for _ in payloads]
    for round_ in range(2):
        name = f"run/step{round_:09d}.pt"
        winners, errors = _race(
            [lambda s=s, p=p, n=name: publish(s, n, p) for s, p in zip(stores, payloads)]
        )
        assert len(winners) == 1, (winners, errors)
        assert len(errors) == 1 and isinstance(errors[0], FileExistsError), errors
        index, publication = winners[0]
        assert read_verified(stores[0], name) == (publication, payloads[index])
        assert mount_dir.server.get(name) == payloads[index]


def test_two_writers_through_the_two_mounts(bucket_dir):
    s3fs, rclone = bucket_dir("s3fs"), bucket_dir("rclone")
    stores = [LocalStore(d.path, **d.settings) for d in (s3fs, rclone)]
    payloads = _payloads(2, 2 * MIB)
    for round_ in range(3):
        key = f"both/{round_}.bin"
        winners, errors = _race(
            [lambda s=s, p=p, k=key: s.put(k, p) for s, p in zip(stores, payloads)]
        )
        assert len(winners) == 1, (winners, errors)
        assert len(errors) == 1 and isinstance(errors[0], FileExistsError), errors
        index, _ = winners[0]
        assert s3fs.server.get(key) == payloads[index]
        for store in stores:
            assert store.get(key) == payloads[index]


def test_two_publishers_of_one_name_through_the_two_mounts(bucket_dir):
    """Two clients publish one checkpoint name at once: one publication, verified through both
    mounts and on the server; the other publisher fails loudly and deletes nothing of it."""
    s3fs, rclone = bucket_dir("s3fs"), bucket_dir("rclone")
    stores = [LocalStore(d.path, **d.settings) for d in (s3fs, rclone)]
    payloads = _payloads(2, 2 * MIB)
    for round_ in range(2):
        name = f"run/step{round_:09d}.pt"
        winners, errors = _race(
            [lambda s=s, p=p, n=name: publish(s, n, p) for s, p in zip(stores, payloads)]
        )
        assert len(winners) == 1, (winners, errors)
        assert len(errors) == 1 and isinstance(errors[0], FileExistsError), errors
        index, publication = winners[0]
        assert s3fs.server.get(name) == payloads[index]
        for store in stores:  # the same publication, whichever mount reads it
            seen, data = read_verified(store, name)
            assert (seen.artifact_id, seen.sha256, data) == (
                publication.artifact_id,
                publication.sha256,
                payloads[index],
            )
        assert not [key for key in s3fs.server.objects("run/") if key.endswith(".publishing.json")]
