"""The replication bandwidth budget: token bucket arithmetic, its config key, and that a paced
copy is still verified, byte-identical and committed last."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from koochak.loop.checkpoint import budget as budget_module
from koochak.loop.checkpoint import save
from koochak.loop.checkpoint.budget import BandwidthBudget, bandwidth_budget
from koochak.loop.checkpoint.replication import ReplicaTier, Replicator
from koochak.loop.checkpoint.tiers import replicate_checkpoint, replication_settings
from koochak.loop.config import ConfigError, load_config
from koochak.loop.resume_config import RESUME_CLASSES, SAME_RUN
from koochak.storage.artifact import READY_SUFFIX, read_manifest
from koochak.storage.store import LocalStore


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_the_bucket_lets_a_burst_through_then_paces_to_the_rate():
    clock = _Clock()
    budget = BandwidthBudget(1000.0, burst_bytes=500, clock=clock, sleep=clock.sleep)
    assert budget.delay_for(500) == 0.0  # the full bucket
    assert budget.delay_for(250) == pytest.approx(0.25)  # 250 bytes of debt at 1000 B/s
    clock.now += 0.25  # the wait pays the debt exactly
    assert budget.delay_for(0) == 0.0
    clock.now += 10.0  # idle: refills, but only up to the burst
    assert budget.delay_for(600) == pytest.approx(0.1)
    assert budget.waited_s == pytest.approx(0.35)


def test_take_sleeps_so_the_average_rate_is_the_budget():
    clock = _Clock()
    budget = BandwidthBudget(2e6, burst_bytes=0, clock=clock, sleep=clock.sleep)
    start = clock.now
    for _ in range(10):
        budget.take(1_000_000)  # a chunk handed to the target
    assert clock.now - start == pytest.approx(5.0)  # 10 MB at 2 MB/s
    assert len(clock.slept) == 10


@pytest.mark.parametrize("rate", [0, -1.0, True])
def test_a_bucket_without_a_positive_rate_is_refused(rate):
    with pytest.raises(ValueError, match="bytes_per_second must be > 0"):
        BandwidthBudget(rate)


def test_no_budget_means_unlimited():
    assert bandwidth_budget(None) is None
    assert bandwidth_budget(40).rate == 40e6


@pytest.mark.parametrize("value", [0, -5, True, "fast"])
def test_a_bad_bandwidth_is_refused_naming_the_key(tmp_path, value):
    path = tmp_path / "cfg.yaml"
    path.write_text(json.dumps({"train": {"checkpoint_replication_bandwidth_mb_s": value}}))
    with pytest.raises(ConfigError, match="train.checkpoint_replication_bandwidth_mb_s"):
        load_config(path)


def test_the_bandwidth_reaches_the_replication_settings_and_is_a_same_run_key():
    cfg = load_config(None, ["train.checkpoint_replicas=[/a]",
                             "train.checkpoint_replication_bandwidth_mb_s=25"])  # fmt: skip
    assert replication_settings(cfg["train"]).bandwidth_mb_s == 25
    unlimited = load_config(None, ["train.checkpoint_replicas=[/a]",
                                   "train.checkpoint_replication_bandwidth_mb_s=null"])  # fmt: skip
    assert replication_settings(unlimited["train"]).bandwidth_mb_s is None
    assert RESUME_CLASSES["train.checkpoint_replication_bandwidth_mb_s"] == SAME_RUN


def _checkpoint(store: LocalStore, parts: int) -> str:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    from koochak.loop.checkpoint import build_checkpoint, checkpoint_name

    save(build_checkpoint(step=3, next_step=4, model=model), store, parts=parts)
    return checkpoint_name(3)


def _files(root) -> dict[str, bytes]:
    """Every checkpoint object under ``root`` (the first tier's ``latest.pt`` pointer is no part
    of a checkpoint, so it is not replicated)."""
    found = {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    found.pop("latest.pt", None)
    return found


@pytest.mark.parametrize("parts", [1, 3])
def test_a_paced_copy_moves_every_byte_through_the_budget_and_commits_last(tmp_path, parts):
    source, target = LocalStore(tmp_path / "first"), LocalStore(tmp_path / "durable")
    name = _checkpoint(source, parts)
    clock = _Clock()
    budget = BandwidthBudget(1e6, burst_bytes=0, clock=clock, sleep=clock.sleep)
    order: list[tuple[int, bool]] = []

    def take(n: int) -> None:
        committed = any(k.endswith(READY_SUFFIX) for k in _files(tmp_path / "durable"))
        order.append((n, committed))
        budget.take(n)

    result = replicate_checkpoint(source, target, name, progress=take)
    assert _files(tmp_path / "durable") == _files(tmp_path / "first")  # byte-identical
    assert read_manifest(target, name)[1] == read_manifest(source, name)[1]
    manifest = len(read_manifest(source, name)[1])
    assert sum(n for n, _ in order) == result.bytes_copied
    # Paced at 1 MB/s: the copy was held back exactly as long as its bytes take at that rate.
    assert sum(clock.slept) == pytest.approx(result.bytes_copied / 1e6)
    # Every byte before the manifest went through the budget while nothing was committed.
    assert all(not committed for n, committed in order[:-1])
    assert order[-1][0] == manifest


def test_the_replicator_paces_each_tier_with_its_own_budget(tmp_path, monkeypatch, caplog):
    taken: list[int] = []

    class Recording(BandwidthBudget):
        def take(self, nbytes: int) -> None:
            taken.append(nbytes)
            super().take(nbytes)

    monkeypatch.setattr(budget_module, "BandwidthBudget", Recording)
    caplog.set_level(logging.INFO, logger="koochak.loop.checkpoint")
    first = LocalStore(tmp_path / "first")
    name = _checkpoint(first, 2)
    replicator = Replicator(first, [ReplicaTier(1, LocalStore(tmp_path / "durable"), None)],
                            first_keep_last_k=None, retry_s=0, bandwidth_mb_s=50)  # fmt: skip
    try:
        replicator.submit(name)
        assert [t.index for t in replicator.settle(name, everywhere=True)] == [1]
    finally:
        replicator.close()
    events = [e for e in replicator.take_events() if e.status == "committed"]
    assert [e.name for e in events] == [name]
    assert sum(taken) == events[0].bytes_copied > 0
    assert _files(tmp_path / "durable") == _files(tmp_path / "first")
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("replicated")]
    assert len(logged) == 1 and "capped at 50 MB/s" in logged[0]  # the lag's cause is said
