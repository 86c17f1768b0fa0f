"""Tiered checkpoints: commit in the first tier, replicate to durable tiers, resume from any tier."""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
import threading

import pytest
import torch
from koochak.loop.checkpoint import load, resolve_auto_resume, save
from koochak.loop.checkpoint.replication import (
    CheckpointReplicationError,
    ReplicaTier,
    Replicator,
)
from koochak.loop.checkpoint.tiers import checkpoint_tiers, replicate_checkpoint
from koochak.loop.config import ConfigError, load_config
from koochak.loop.evacuation import Evacuated, EvacuationController
from koochak.loop.loop import training_loop
from koochak.storage.artifact import READY_SUFFIX, read_manifest
from koochak.storage.store import LocalStore, register_store
from koochak.storage.testing import ThrottledStore


def _batches(start: int, stop: int = 1000):
    for t in range(start, stop):
        g = torch.Generator().manual_seed(t)
        x = torch.randn(8, 4, generator=g)
        yield x, x.sum(1, keepdim=True)


def _step(model, batch, ctx):
    x, y = batch
    return {"loss": torch.nn.functional.mse_loss(model(x), y)}


def _run(first, replicas, *, max_steps=6, hooks=None, step_fn=_step, train=None, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    train_cfg = {"max_steps": max_steps, "log_every": 100, "device": "cpu", "out_dir": str(first),
                 "ckpt_every": 1, "keep_last_k": None, "progress_bar": False,
                 "checkpoint_replicas": replicas, "checkpoint_replication_retry_s": 0}  # fmt: skip
    train_cfg.update(train or {})
    start = kwargs.pop("start", 0)
    return training_loop(
        model=model, dataset=_batches(start), step_fn=step_fn, hooks=hooks,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05), train_cfg=train_cfg, **kwargs,
    )  # fmt: skip


def _recorder(events):
    def on_checkpoint(info):
        events.append(("checkpoint", info["step"], info["path"], info.get("tier")))

    def on_replication(info):
        events.append(("replication", info["status"], info["name"], info["tier"], info["lag"]))

    return {"on_checkpoint": [on_checkpoint], "on_replication": [on_replication]}


def _committed(root):
    return sorted(p.name[: -len(READY_SUFFIX)] for p in root.glob(f"*{READY_SUFFIX}"))


def _name(step):
    return f"step{step:09d}.pt"


def _ckpt(step, value=0.0, reason="periodic"):
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(value)
    from koochak.loop.checkpoint import build_checkpoint

    next_step = step + 1 if reason == "periodic" else step
    return build_checkpoint(step=step, next_step=next_step, model=model, reason=reason)


# ------------------------------------------------------------------ replication in the loop


def test_two_tiers_replicate_every_checkpoint_and_announce_the_replica(tmp_path):
    events: list = []
    final = _run(tmp_path / "fast", [str(tmp_path / "durable")], hooks=_recorder(events))
    steps = [0, 1, 2, 3, 4, 6]  # periodic after each update, then the terminal one
    assert (
        _committed(tmp_path / "fast")
        == _committed(tmp_path / "durable")
        == [_name(s) for s in steps]
    )
    for step in steps:
        # The replica commits with the very manifest the first tier committed with.
        fast, durable = LocalStore(tmp_path / "fast"), LocalStore(tmp_path / "durable")
        assert read_manifest(fast, _name(step))[1] == read_manifest(durable, _name(step))[1]
    announced = [e for e in events if e[0] == "checkpoint"]
    assert [e[1] for e in announced] == steps
    assert all(e[2] == str(tmp_path / "durable" / _name(e[1])) and e[3] == 1 for e in announced)
    replicated = [e for e in events if e[0] == "replication" and e[1] != "published"]
    assert {e[1] for e in replicated} == {"committed"} and len(replicated) == len(steps)
    published = [e for e in events if e[:2] == ("replication", "published")]
    assert [e[2] for e in published] == [_name(s) for s in steps]  # tier 0's, for the history
    assert {e[3] for e in published} == {0}
    # Each announcement comes right after the replica commit it announces.
    for index, event in enumerate(events):
        if event[0] == "checkpoint":
            assert events[index - 1][:4] == ("replication", "committed", _name(event[1]), 1)
    path, ckpt = resolve_auto_resume([tmp_path / "fast", tmp_path / "durable"])
    assert ckpt["step"] == 6 and path == str(tmp_path / "fast" / _name(6))
    assert torch.equal(ckpt["model"]["weight"], final["model"]["weight"])


def test_three_tiers_a_directory_a_stores_file_scheme_and_a_throttled_store(tmp_path, monkeypatch):
    stores = tmp_path / "stores.yaml"
    stores.write_text(
        f"version: 1\nstores:\n  vault:\n    root: {tmp_path}\n    publish: exclusive\n"
    )
    monkeypatch.setenv("KOOCHAK_STORES", str(stores))
    register_store("slowtier", lambda rest: ThrottledStore(LocalStore(tmp_path / rest), 2e6))
    events: list = []
    replicas = ["vault://archive", {"location": "slowtier://cold", "keep_last_k": 2}]
    _run(tmp_path / "fast", replicas, hooks=_recorder(events), train={"keep_last_k": 3})
    # Per-tier retention: the first tier and the stores-file tier keep 3, the slow one 2.
    assert _committed(tmp_path / "fast") == [_name(3), _name(4), _name(6)]
    assert _committed(tmp_path / "archive") == [_name(3), _name(4), _name(6)]
    assert _committed(tmp_path / "cold") == [_name(4), _name(6)]
    # Pruning is manifest-first and complete: no object is left behind without its manifest.
    for tier in ("fast", "archive", "cold"):
        objects = sorted(p.name for p in (tmp_path / tier).glob("step*.pt"))
        assert objects == _committed(tmp_path / tier), tier
    # on_checkpoint names the first replica (a stores-file scheme, so its path on disk).
    announced = [e for e in events if e[0] == "checkpoint"]
    assert announced[-1] == ("checkpoint", 6, str(tmp_path / "archive" / _name(6)), 1)
    # The terminal save waited for every replica tier.
    assert ("replication", "committed", _name(6), 2, 0) in events
    _, ckpt = resolve_auto_resume(["vault://archive"])
    assert ckpt["step"] == 6


def test_checkpoint_tiers_come_from_the_config(tmp_path):
    cfg = {"out_dir": str(tmp_path), "keep_last_k": 4,
           "checkpoint_replicas": ["/a", {"location": "s3://b/c", "keep_last_k": 1},
                                   {"location": "/d", "keep_last_k": None}]}  # fmt: skip
    tiers = checkpoint_tiers(cfg)
    assert [(t.index, t.location, t.keep_last_k) for t in tiers] == [
        (0, str(tmp_path), 4), (1, "/a", 4), (2, "s3://b/c", 1), (3, "/d", None)
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("/a", "checkpoint_replicas: expected a list"),
        ([3], r"checkpoint_replicas\[0\]: expected a location or a mapping"),
        ([{"where": "/a"}], r"checkpoint_replicas\[0\]: unknown key\(s\) \['where'\]"),
        ([{"keep_last_k": 2}], r"checkpoint_replicas\[0\].location: expected a directory"),
        ([{"location": "/a", "keep_last_k": -1}], r"\[0\].keep_last_k: expected an integer"),
        (["/a", "/a/"], r"checkpoint_replicas\[1\]: '/a' is listed twice"),
    ],
)
def test_bad_replica_lists_are_refused_naming_the_entry(tmp_path, value, message):
    path = tmp_path / "cfg.yaml"
    path.write_text(json.dumps({"train": {"checkpoint_replicas": value}}))
    with pytest.raises(ConfigError, match=message):
        load_config(path)
    with pytest.raises(ConfigError, match="checkpoint_replication_max_lag"):
        load_config(None, ["train.checkpoint_replication_max_lag=0"])


def test_replicas_with_fsdp_are_accepted_and_node_local_first_tiers_are_checked(tmp_path):
    from koochak.loop.checkpoint.tiers import checkpoint_locations, node_index

    path = tmp_path / "cfg.yaml"
    path.write_text(
        json.dumps({"train": {"checkpoint_replicas": ["/a"], "fsdp": {"enabled": True},
                              "checkpoint_dir": str(tmp_path / "n{node}")}})
    )  # fmt: skip
    cfg = load_config(path)
    assert checkpoint_locations(cfg.train) == [str(tmp_path / "n0"), "/a"]
    from koochak.loop.checkpoint.settings import CheckpointConfig

    typed = CheckpointConfig.of(cfg.train)  # the component's one typed record of train.*
    assert typed.location == str(tmp_path / "n0") and typed.node_local and typed.sharded
    assert [t.location for t in typed.replication.replicas] == ["/a"]
    with pytest.raises(ConfigError, match=r"train.checkpoint_dir: .*train.checkpoint_replicas"):
        load_config(None, [f"train.checkpoint_dir='{tmp_path}/n{{node}}'"])
    with pytest.raises(ConfigError, match=r"train.checkpoint_replicas\[0\].*first tier"):
        load_config(None, ["train.checkpoint_dir=/x", "train.checkpoint_replicas=['/r{node}']"])
    with pytest.raises(ConfigError, match="only placeholder is"):
        load_config(None, ["train.checkpoint_dir='/x{rank}'", "train.checkpoint_replicas=[/r]"])
    assert node_index({"GROUP_RANK": "3", "SLURM_NODEID": "5"}) == 3
    assert node_index({"KOOCHAK_NODE_INDEX": "2", "GROUP_RANK": "3"}) == 2
    assert node_index({"SLURM_NODEID": "5"}) == 5
    assert node_index({}) == 0
    with pytest.raises(ValueError, match="SLURM_NODEID='x'"):
        node_index({"SLURM_NODEID": "x"})


# ------------------------------------------------------------------ one checkpoint between tiers


def test_replicating_a_step_the_replica_already_holds_replaces_it_uncommit_first(tmp_path):
    first, replica = LocalStore(tmp_path / "first"), LocalStore(tmp_path / "replica")
    save(_ckpt(5, value=1.0, reason="terminal"), first)
    assert replicate_checkpoint(first, replica, _name(5)).bytes_copied > 0
    # A resumed run saves step 5 again (a periodic save after a terminal one of the same step).
    save(_ckpt(5, value=2.0), first)
    deletions = []
    original_delete = replica.delete
    replica.delete = lambda key: (deletions.append(key), original_delete(key))[1]
    result = replicate_checkpoint(first, replica, _name(5))
    assert deletions == [_name(5) + READY_SUFFIX, _name(5)]  # the re-save rule: manifest first
    assert read_manifest(replica, _name(5))[1] == read_manifest(first, _name(5))[1]
    assert load(replica, _name(5))["model"]["weight"].flatten().tolist() == [2.0, 2.0]
    assert result.publication.sha256 == read_manifest(first, _name(5))[0].sha256
    # The same commit again is left alone: nothing moves.
    assert replicate_checkpoint(first, replica, _name(5)).bytes_copied == 0


def test_a_copy_that_fails_midway_leaves_no_commit_and_the_next_completes(tmp_path):
    first = LocalStore(tmp_path / "first")
    save(_ckpt(1), first)

    class DiesInTheManifest(LocalStore):
        def put(self, key, data, **expected):
            if key.endswith(READY_SUFFIX):
                raise OSError(errno.EIO, "Input/output error", key)
            return super().put(key, data, **expected)

    broken = DiesInTheManifest(tmp_path / "replica")
    with pytest.raises(OSError, match="Input/output error"):
        replicate_checkpoint(first, broken, _name(1))
    assert (tmp_path / "replica" / _name(1)).exists()  # the object, but no commit
    assert resolve_auto_resume(tmp_path / "replica") is None
    replicate_checkpoint(first, LocalStore(tmp_path / "replica"), _name(1))
    assert resolve_auto_resume(tmp_path / "replica")[1]["step"] == 1


# ------------------------------------------------------------------ the replicator


class _GatedStore(LocalStore):
    """A LocalStore whose puts wait for ``gate`` (a slow tier the test controls exactly)."""

    def __init__(self, root, gate: threading.Event, **kwargs):
        super().__init__(root, **kwargs)
        self.gate = gate
        self.puts = 0

    def put(self, key, data, **expected):
        # The tier marker and the run's lease (and its renewals), written when the run starts.
        if key == "koochak-tier.json" or key.startswith("koochak-run.lease"):
            return super().put(key, data, **expected)
        assert self.gate.wait(30), "test gate never opened"
        self.puts += 1
        return super().put(key, data, **expected)


def _publish_first(first, step):
    save(_ckpt(step), first)


def test_a_save_waits_while_a_tier_is_max_lag_checkpoints_behind(tmp_path):
    first = LocalStore(tmp_path / "first")
    gate = threading.Event()
    slow = _GatedStore(tmp_path / "slow", gate)
    replicator = Replicator(first, [ReplicaTier(1, slow, None)], first_keep_last_k=None,
                            max_lag=2, retry_s=0)  # fmt: skip
    try:
        for step in (0, 1):
            _publish_first(first, step)
            replicator.submit(_name(step))
        waited = threading.Event()
        waiter = threading.Thread(target=lambda: (replicator.wait_for_room(), waited.set()))
        waiter.start()
        assert not waited.wait(0.3)  # two checkpoints behind: the third save must wait
        gate.set()
        assert waited.wait(30)
        waiter.join()
        assert replicator.settle(_name(1), everywhere=True)[0].index == 1
        assert _committed(tmp_path / "slow") == [_name(0), _name(1)]  # in order, none skipped
    finally:
        gate.set()
        replicator.close()


def test_a_tier_copying_from_the_first_tier_does_not_hold_back_another_tiers_pruning(tmp_path):
    first = LocalStore(tmp_path / "first")
    gate, copying = threading.Event(), threading.Event()

    class Slow(_GatedStore):
        def put(self, key, data, **expected):
            copying.set()
            return super().put(key, data, **expected)

    slow = Slow(tmp_path / "slow", gate)
    small = LocalStore(tmp_path / "small")
    replicator = Replicator(first, [ReplicaTier(1, slow, None), ReplicaTier(2, small, 1)],
                            first_keep_last_k=None, retry_s=0)  # fmt: skip
    try:
        _publish_first(first, 0)
        replicator.submit(_name(0))
        assert copying.wait(30)  # tier 1 is copying step 0 from the first tier, and waits
        _publish_first(first, 1)
        replicator.submit(_name(1))
        events = []
        for _ in range(3000):  # until tier 2 reports step 1's commit (made after its pruning)
            events += replicator.take_events()
            if any((e.status, e.name, e.tier) == ("committed", _name(1), 2) for e in events):
                break
            threading.Event().wait(0.01)
        assert [t.index for t in replicator.committed_in(_name(1))] == [2]
        # Tier 2 keeps 1: step 0 goes although tier 1 still reads it, from another tier.
        assert _committed(tmp_path / "small") == [_name(1)]
        gate.set()
        replicator.settle(_name(1), everywhere=True)
        assert _committed(tmp_path / "slow") == [_name(0), _name(1)]
    finally:
        gate.set()
        replicator.close()


def test_a_failing_tier_is_retried_without_holding_training_up(tmp_path):
    first = LocalStore(tmp_path / "first")

    class FullDisk(LocalStore):
        failures = 2

        def put(self, key, data, **expected):
            if FullDisk.failures:
                FullDisk.failures -= 1
                raise OSError(errno.ENOSPC, "No space left on device", key)
            return super().put(key, data, **expected)

    replicator = Replicator(first, [ReplicaTier(1, FullDisk(tmp_path / "full"), None)],
                            first_keep_last_k=None, max_lag=1, retry_s=0)  # fmt: skip
    try:
        _publish_first(first, 0)
        replicator.submit(_name(0))
        replicator.settle(_name(0), everywhere=True)
        statuses = [(e.status, e.name) for e in replicator.take_events()]
        assert statuses[-1] == ("committed", _name(0))
        assert ("failed", _name(0)) in statuses
        failed = [e for e in statuses if e[0] == "failed"]
        assert len(failed) == 2
    finally:
        replicator.close()


def test_the_first_tier_keeps_what_no_replica_holds_yet(tmp_path):
    first = LocalStore(tmp_path / "first")
    gate = threading.Event()
    slow = _GatedStore(tmp_path / "slow", gate)
    replicator = Replicator(first, [ReplicaTier(1, slow, None)], first_keep_last_k=1,
                            max_lag=10, retry_s=0)  # fmt: skip
    try:
        for step in (0, 1, 2):
            _publish_first(first, step)
            replicator.submit(_name(step))
        # keep_last_k=1, but nothing is durable yet: all three stay in the first tier.
        assert _committed(tmp_path / "first") == [_name(0), _name(1), _name(2)]
        gate.set()
        replicator.settle(_name(2), everywhere=True)
        assert _committed(tmp_path / "first") == [_name(2)]
        assert _committed(tmp_path / "slow") == [_name(0), _name(1), _name(2)]
    finally:
        gate.set()
        replicator.close()


def test_prune_unreplicated_lets_the_first_tier_prune_at_once(tmp_path):
    first = LocalStore(tmp_path / "first")
    gate = threading.Event()
    slow = _GatedStore(tmp_path / "slow", gate)
    replicator = Replicator(first, [ReplicaTier(1, slow, 1)], first_keep_last_k=1,
                            max_lag=10, retry_s=0, prune_unreplicated=True)  # fmt: skip
    try:
        _publish_first(first, 0)
        replicator.submit(_name(0))
        _publish_first(first, 1)
        replicator.submit(_name(1))
        committed = _committed(tmp_path / "first")
        # step 0 goes unless a tier is copying it right now (then it goes after the copy).
        assert committed in ([_name(1)], [_name(0), _name(1)])
        gate.set()
        replicator.settle(_name(1), everywhere=True)
        assert _committed(tmp_path / "first") == [_name(1)]
        assert _committed(tmp_path / "slow") == [_name(1)]
    finally:
        gate.set()
        replicator.close()


def test_a_tier_far_behind_drops_what_its_retention_would_prune_at_once(tmp_path):
    first = LocalStore(tmp_path / "first")
    gate = threading.Event()
    slow = _GatedStore(tmp_path / "slow", gate)
    replicator = Replicator(first, [ReplicaTier(1, slow, 2)], first_keep_last_k=None,
                            max_lag=100, retry_s=0)  # fmt: skip
    try:
        for step in range(6):
            _publish_first(first, step)
            replicator.submit(_name(step))
        gate.set()
        replicator.settle(_name(5), everywhere=True)
        events = replicator.take_events()
        dropped = {e.name for e in events if e.status == "dropped"}
        copied = [e.name for e in events if e.status == "committed"]
        assert copied == sorted(copied)  # in order
        assert set(copied) | dropped == {_name(s) for s in range(6)}
        assert _committed(tmp_path / "slow") == [_name(4), _name(5)]
    finally:
        gate.set()
        replicator.close()


def test_a_tier_far_behind_still_copies_the_best_checkpoint(tmp_path):
    first = LocalStore(tmp_path / "first")
    gate = threading.Event()
    slow = _GatedStore(tmp_path / "slow", gate)

    def spare(store, names):  # keep_best_k: step 1 is the best
        return {name for name in names if name == _name(1)}

    replicator = Replicator(first, [ReplicaTier(1, slow, 2)], first_keep_last_k=None,
                            max_lag=100, retry_s=0, spare=spare)  # fmt: skip
    try:
        for step in range(6):
            _publish_first(first, step)
            replicator.submit(_name(step))
        gate.set()
        replicator.settle(_name(5), everywhere=True)
        dropped = {e.name for e in replicator.take_events() if e.status == "dropped"}
        assert _name(1) not in dropped and dropped
        assert _committed(tmp_path / "slow") == [_name(1), _name(4), _name(5)]
    finally:
        gate.set()
        replicator.close()


def test_a_new_run_replicates_what_an_earlier_attempt_left_behind(tmp_path):
    first = LocalStore(tmp_path / "first")
    replica = LocalStore(tmp_path / "replica")
    for step in (0, 1, 2):
        _publish_first(first, step)
    replicate_checkpoint(first, replica, _name(0))  # the earlier attempt got only this far
    replicator = Replicator(first, [ReplicaTier(1, replica, None)], first_keep_last_k=None,
                            retry_s=0)  # fmt: skip
    try:
        replicator.settle(_name(2), everywhere=True)
        assert _committed(tmp_path / "replica") == [_name(0), _name(1), _name(2)]
    finally:
        replicator.close()


def test_the_only_durable_tier_failing_at_exit_fails_the_run(tmp_path):
    class Broken(LocalStore):
        def put(self, key, data, **expected):
            raise OSError(errno.EIO, "Input/output error", key)

    register_store("brokentier", lambda rest: Broken(tmp_path / rest))
    events: list = []
    with pytest.raises(CheckpointReplicationError, match="committed only in the first tier"):
        _run(tmp_path / "fast", ["brokentier://durable"], hooks=_recorder(events),
             max_steps=2)  # fmt: skip
    # Training itself went on while the tier failed, and the work is safe in the first tier.
    assert resolve_auto_resume(tmp_path / "fast")[1]["step"] == 2
    assert ("replication", "failed", _name(0), 1) in [e[:4] for e in events]
    assert not any(e[0] == "checkpoint" for e in events)  # never announced


def test_another_durable_tier_is_enough_at_exit(tmp_path, caplog):
    class Broken(LocalStore):
        def put(self, key, data, **expected):
            raise OSError(errno.ENOSPC, "No space left on device", key)

    register_store("fulltier", lambda rest: Broken(tmp_path / rest))
    with caplog.at_level(logging.ERROR):
        _run(tmp_path / "fast", ["fulltier://a", str(tmp_path / "b")], max_steps=2)
    assert _committed(tmp_path / "b") == [_name(0), _name(2)]
    assert "could not be committed in tier 1" in caplog.text


# ------------------------------------------------------------------ evacuation


def test_evacuation_waits_for_the_durable_commit_before_exiting(tmp_path, monkeypatch):
    # The durable tier cannot take a byte before the run has started waiting for it, so a run
    # that exited without waiting would leave it without the evacuation checkpoint.
    gate = threading.Event()
    register_store("gatedevac", lambda rest: _GatedStore(tmp_path / rest, gate))
    settle = Replicator.settle

    def settle_then_open(self, name, *, everywhere):
        gate.set()
        return settle(self, name, everywhere=everywhere)

    monkeypatch.setattr(Replicator, "settle", settle_then_open)
    controller = EvacuationController()
    events: list = []

    def step_fn(model, batch, ctx):
        if ctx.step == 2:
            controller.request()
        return _step(model, batch, ctx)

    with pytest.raises(Evacuated) as info:
        _run(tmp_path / "fast", ["gatedevac://durable"], step_fn=step_fn, evacuation=controller,
             hooks=_recorder(events), train={"ckpt_every": 0})  # fmt: skip
    # Exit 75 only once the durable tier holds the evacuation checkpoint, and it names it there.
    assert info.value.code == 75
    assert info.value.path == str(tmp_path / "durable" / _name(3))
    assert _committed(tmp_path / "durable") == [_name(3)]
    assert ("checkpoint", 3, str(tmp_path / "durable" / _name(3)), 1) in events
    ckpt = resolve_auto_resume(tmp_path / "durable")[1]
    assert (ckpt["step"], ckpt["reason"]) == (3, "evacuation")


def test_evacuation_with_its_only_durable_tier_failing_does_not_exit_75(tmp_path):
    class Broken(LocalStore):
        def put(self, key, data, **expected):
            raise OSError(errno.EIO, "Input/output error", key)

    register_store("brokenevac", lambda rest: Broken(tmp_path / rest))
    controller = EvacuationController()

    def step_fn(model, batch, ctx):
        if ctx.step == 1:
            controller.request()
        return _step(model, batch, ctx)

    with pytest.raises(CheckpointReplicationError):
        _run(tmp_path / "fast", ["brokenevac://durable"], step_fn=step_fn,
             evacuation=controller, train={"ckpt_every": 0})  # fmt: skip
    assert resolve_auto_resume(tmp_path / "fast")[1]["reason"] == "evacuation"


# ------------------------------------------------------------------ resume over tiers


def test_a_vanished_first_tier_resumes_from_the_replica_and_pulls_it_back(tmp_path, caplog):
    first, durable = tmp_path / "node-local", tmp_path / "durable"
    straight = _run(tmp_path / "straight", [], max_steps=8)
    _run(first, [str(durable)], max_steps=4)
    import shutil

    shutil.rmtree(first)  # requeued onto another node: the node-local tier is gone
    with caplog.at_level(logging.WARNING):
        found = resolve_auto_resume([first, durable])
    assert "skipping checkpoint tier 0" in caplog.text and "it is gone" in caplog.text
    path, ckpt = found
    assert path == str(durable / _name(4)) and ckpt["next_step"] == 4
    resumed = _run(first, [str(durable)], max_steps=8, resume="auto", start=4,
                   train={"ckpt_every": 0})  # fmt: skip
    assert torch.equal(straight["model"]["weight"], resumed["model"]["weight"])
    # Pulled back into the first tier for the next cycle (this run saved only step 8 itself);
    # the new one replicated as usual.
    assert _committed(first) == [_name(4), _name(8)]
    assert (
        read_manifest(LocalStore(first), _name(4))[1]
        == read_manifest(LocalStore(durable), _name(4))[1]
    )
    assert _name(8) in _committed(durable)


def test_no_pull_back_where_every_rank_resumed_its_own_share_from_the_replica(tmp_path):
    # Where every rank writes its own parts (FSDP: the others replicate theirs themselves), a
    # pull-back by the coordinator would copy the whole checkpoint on one process: it is not
    # made; one-writer layouts still pull back (the test above).

    first, durable = LocalStore(tmp_path / "first"), LocalStore(tmp_path / "durable")
    save(_ckpt(4), durable)
    for remote, pulled in (({1, 2, 3}, False), ((), True)):
        replicator = Replicator(first, [ReplicaTier(1, durable, None)], first_keep_last_k=None,
                                pull=_name(4), remote_writers=remote)  # fmt: skip
        replicator.before_publish(_name(8))  # waits for the pull-back, if any
        replicator.close()
        assert (_name(4) in _committed(tmp_path / "first")) is pulled, remote


def test_a_resumed_run_re_saving_a_step_replaces_it_in_the_replica_too(tmp_path):
    first, durable = tmp_path / "first", tmp_path / "durable"
    _run(first, [str(durable)], max_steps=4, train={"ckpt_every": 0})  # terminal step 4
    assert load(str(durable / _name(4)))["reason"] == "terminal"
    # Resumed, the run saves periodic step 4 (the update with index 4), under the same name.
    _run(first, [str(durable)], max_steps=6, resume="auto", start=4)
    assert load(str(durable / _name(4)))["reason"] == "periodic"
    assert (
        read_manifest(LocalStore(first), _name(4))[1]
        == read_manifest(LocalStore(durable), _name(4))[1]
    )


def test_the_highest_step_in_any_tier_wins(tmp_path):
    first, replica = LocalStore(tmp_path / "first"), LocalStore(tmp_path / "replica")
    save(_ckpt(3), first)
    save(_ckpt(5), replica)  # e.g. the first tier lost its newest to a node failure
    path, ckpt = resolve_auto_resume([first, replica])
    assert ckpt["step"] == 5 and path == str(tmp_path / "replica" / _name(5))


def test_a_damaged_copy_falls_back_to_the_same_step_in_another_tier(tmp_path, caplog):
    first, replica = LocalStore(tmp_path / "first"), LocalStore(tmp_path / "replica")
    for step in (3, 5):
        save(_ckpt(step, value=step), first)
        replicate_checkpoint(first, replica, _name(step))
    target = tmp_path / "first" / _name(5)
    os.chmod(target, 0o644)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        path, ckpt = resolve_auto_resume([first, replica])
    assert ckpt["step"] == 5 and path == str(tmp_path / "replica" / _name(5))  # no step back
    assert "SHA256" in caplog.text


def test_an_io_error_on_the_newest_in_every_tier_is_raised_not_rolled_back(tmp_path):
    class Eio(LocalStore):
        def get(self, key, start=None, end=None):
            if key == _name(5):
                raise OSError(errno.EIO, "Input/output error", key)
            return super().get(key, start, end)

    first, replica = Eio(tmp_path / "first"), Eio(tmp_path / "replica")
    for step in (3, 5):
        save(_ckpt(step), first)
        replicate_checkpoint(LocalStore(tmp_path / "first"), replica, _name(step))
    with pytest.raises(OSError, match="Input/output error"):
        resolve_auto_resume([first, replica])
    # One readable copy of the newest step is enough.
    path, ckpt = resolve_auto_resume([first, LocalStore(tmp_path / "replica")])
    assert ckpt["step"] == 5 and path == str(tmp_path / "replica" / _name(5))


def test_an_unreachable_tier_is_skipped_with_one_line(tmp_path, caplog):
    class Unreachable(LocalStore):  # every listing fails, the shallow one too
        def list(self, prefix=""):
            raise ConnectionError(errno.ECONNREFUSED, "Connection refused")

        def list_shallow(self, prefix, delimiter):
            raise ConnectionError(errno.ECONNREFUSED, "Connection refused")

    first = LocalStore(tmp_path / "first")
    save(_ckpt(2), first)
    with caplog.at_level(logging.WARNING):
        path, ckpt = resolve_auto_resume([first, Unreachable(tmp_path / "replica")])
    assert ckpt["step"] == 2
    lines = [r for r in caplog.records if "tier 1" in r.getMessage()]
    assert len(lines) == 1 and "cannot list it" in lines[0].getMessage()


def test_the_resume_is_announced_at_its_replica_path_once_the_replica_holds_that_commit(
    tmp_path,
):
    from koochak.loop.checkpoint.resume import resume_publication_path

    first, replica = LocalStore(tmp_path / "first"), LocalStore(tmp_path / "replica")
    tiers = [tmp_path / "first", tmp_path / "replica"]
    save(_ckpt(4, value=1.0), first)
    path, ckpt = resolve_auto_resume(tiers)
    assert resume_publication_path(tiers, path, ckpt) is None  # not replicated yet
    replicate_checkpoint(first, replica, _name(4))
    assert resume_publication_path(tiers, path, ckpt) == str(tmp_path / "replica" / _name(4))
    save(_ckpt(4, value=2.0), first)  # a newer commit of the same step, not replicated
    path, ckpt = resolve_auto_resume(tiers)
    assert resume_publication_path(tiers, path, ckpt) is None


def test_another_rank_reads_rank_0s_commit_from_any_tier_it_can_reach(tmp_path):
    from koochak.loop.checkpoint.resume import _read_same

    first, replica = LocalStore(tmp_path / "first"), LocalStore(tmp_path / "replica")
    save(_ckpt(4), first)
    replicate_checkpoint(first, replica, _name(4))
    sha = read_manifest(first, _name(4))[0].sha256
    elsewhere = LocalStore(tmp_path / "other-node")  # this rank's node-local tier is empty
    point = _read_same([elsewhere, replica], 0, 4, sha)
    assert point.path == str(tmp_path / "replica" / _name(4)) and point.checkpoint["step"] == 4
    with pytest.raises(RuntimeError, match="cannot read that commit"):
        _read_same([elsewhere, replica], 0, 4, "0" * 64)


# ------------------------------------------------------------------ what others see


def test_workload_events_name_the_replica_tier_and_report_the_lag(tmp_path):
    from koochak.events import make_event_hooks

    sent: list = []
    hooks = make_event_hooks(lambda event, wait=False: sent.append((event, wait)))
    _run(tmp_path / "fast", [str(tmp_path / "durable")], hooks=hooks, max_steps=3)
    artifacts = [(e.payload, w) for e, w in sent if e.kind == "workload.artifact"]
    assert [p["step"] for p, _ in artifacts] == [0, 1, 3]
    for payload, wait in artifacts:  # strict, acknowledged, and readable from another node
        assert wait is True
        assert payload["publication"]["path"] == str(tmp_path / "durable" / _name(payload["step"]))
        assert payload["publication"]["manifest_path"].startswith(str(tmp_path / "durable"))
    replicated = [
        e.payload for e, _ in sent if e.payload.get("milestone") == "checkpoint_replicated"
    ]
    assert [m["step"] for m in replicated] == [0, 1, 3]
    assert all(
        m["metrics"]["tier"] == 1.0 and "lag_checkpoints" in m["metrics"] for m in replicated
    )


def test_checkpoints_an_earlier_attempt_left_unreplicated_are_announced_when_they_land(tmp_path):
    class Down(LocalStore):
        def put(self, key, data, **expected):
            raise OSError(errno.EHOSTDOWN, "Host is down", key)

    register_store("downtier", lambda rest: Down(tmp_path / rest))
    with pytest.raises(CheckpointReplicationError):
        _run(tmp_path / "fast", ["downtier://durable"], max_steps=2)
    seen: list = []
    starts: list = []
    hooks = {
        "on_checkpoint": [lambda info: seen.append((info["step"], info["checkpoint"] is None))],
        "on_train_start": [lambda info: starts.append(info.get("resume_publication_path", "-"))],
    }
    # The durable tier is back: the next attempt replicates what the last one could not, in
    # order, and announces each once it lands (no dict for the earlier attempt's checkpoints).
    _run(tmp_path / "fast", [str(tmp_path / "durable")], max_steps=3, resume="auto", start=2,
         hooks=hooks)  # fmt: skip
    assert seen == [(0, True), (2, True), (3, False)]
    assert starts == [None]  # the resumed step 2 was not in the replica yet: not republished
    assert _committed(tmp_path / "durable") == [_name(0), _name(2), _name(3)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priority is Linux's")
def test_replication_threads_yield_the_cpu_to_training(tmp_path):
    first = LocalStore(tmp_path / "first")
    seen = []
    ours = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    class Recording(LocalStore):
        def put(self, key, data, **expected):
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            return super().put(key, data, **expected)

    replicator = Replicator(first, [ReplicaTier(1, Recording(tmp_path / "r"), None)],
                            first_keep_last_k=None)  # fmt: skip
    try:
        _publish_first(first, 0)
        replicator.submit(_name(0))
        replicator.settle(_name(0), everywhere=True)
    finally:
        replicator.close()
    assert seen and min(seen) >= 10  # the copy threads too, not only the worker
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == ours  # training's own


def test_keep_best_k_spares_the_best_checkpoints_in_every_tier(tmp_path):
    losses = iter([5.0, 1.0, 4.0, 3.0, 6.0, 7.0, 8.0])

    def eval_fn(model, data, ctx):
        return {"loss": next(losses)}

    _run(tmp_path / "fast", [str(tmp_path / "durable"), {"location": str(tmp_path / "cold"),
         "keep_last_k": 1}], max_steps=7, eval_fn=eval_fn, eval_dataset=[0],
         train={"eval_every": 1, "keep_last_k": 2, "keep_best_k": 1,
                "keep_best_metric": "eval_loss"})  # fmt: skip
    # The newest of each tier's keep_last_k, and the best (step 1, loss 1.0) everywhere.
    assert _committed(tmp_path / "fast") == [_name(1), _name(5), _name(7)]
    assert _committed(tmp_path / "durable") == [_name(1), _name(5), _name(7)]
    assert _committed(tmp_path / "cold") == [_name(1), _name(7)]


def test_koochak_train_resumes_from_any_tier_of_its_config(tmp_path):
    from koochak.loop.cli import _find_resume

    save(_ckpt(6), LocalStore(tmp_path / "durable"))  # the first tier (out_dir) is empty
    cfg = load_config(None, [f"train.out_dir={tmp_path / 'fast'}",
                             f"train.checkpoint_replicas=[{tmp_path / 'durable'}]"])  # fmt: skip
    path, ckpt = _find_resume(cfg, "auto")
    assert path == str(tmp_path / "durable" / _name(6)) and ckpt["step"] == 6
