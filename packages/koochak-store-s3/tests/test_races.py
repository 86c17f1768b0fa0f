"""K processes put or publish the same key at once, 100 rounds: exactly one winner per round.

Single-request sizes on moto, which refuses racing conditional PutObjects atomically. (moto's
multipart completion is not atomic when completions race, so a multipart race there proves
nothing either way; an artifact's commit is its small ready manifest, a single PutObject.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from koochak.storage.artifact import read_verified

WORKER = Path(__file__).with_name("race_worker.py")
ROUNDS = 100
pytestmark = pytest.mark.slow


def _racers(store, op: str, k: int, size: int):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                store.config.endpoint,
                store.config.bucket,
                store.config.prefix,
                str(i),
                op,
                str(size),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for i in range(k)
    ]
    for proc in procs:
        assert proc.stdout.readline().strip() == "ready"
    return procs


def _race(store, op: str, k: int, size: int = 64 << 10) -> list[list[str]]:
    race_worker = _load_worker()
    procs = _racers(store, op, k, size)
    outcomes = []
    try:
        for round_ in range(ROUNDS):
            start = time.time() + 0.15
            for proc in procs:
                proc.stdin.write(f"{round_} {start}\n")
                proc.stdin.flush()
            results = [proc.stdout.readline().split(" ", 1)[1].strip() for proc in procs]
            outcomes.append(results)
            assert all(r in ("won", "lost") for r in results), (round_, results)
            winners = [i for i, r in enumerate(results) if r == "won"]
            if op == "put":
                assert len(winners) == 1, (round_, results)
                assert store.get(f"race/{round_}") == race_worker.payload(winners[0], round_, size)
            else:
                _, data = read_verified(store, f"race/step{round_:06d}.bin")
                assert data in [race_worker.payload(i, round_, size) for i in winners]
    finally:
        for proc in procs:
            proc.stdin.close()
        for proc in procs:
            proc.wait(timeout=60)
    return outcomes


def _load_worker():
    import importlib.util

    spec = importlib.util.spec_from_file_location("koochak_s3_race_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("k", [2, 8])
def test_racing_puts_have_exactly_one_winner_every_round(moto_store, k):
    store = moto_store
    outcomes = _race(store, "put", k)
    assert all(r.count("won") == 1 and r.count("lost") == k - 1 for r in outcomes)
    assert len(store.list("race/")) == ROUNDS


@pytest.mark.parametrize("k", [2, 8])
def test_racing_publishes_leave_one_verified_publication_every_round(moto_store, k):
    store = moto_store
    outcomes = _race(store, "publish", k)
    # Racers that start together: one publishes, the others find its object (FileExistsError).
    # publish() replaces a publication it finds already committed, so a racer that starts late
    # may publish after the winner; every round still ends with one verified publication.
    assert sum(r.count("won") == 1 for r in outcomes) >= ROUNDS * 0.9
    assert len(store.list("race/")) == 2 * ROUNDS  # each object with its ready manifest
