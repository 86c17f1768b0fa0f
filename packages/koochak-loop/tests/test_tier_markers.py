"""Tiers know whose they are (issue 27, defects 2 and 3): a replica that is another tier under
another spelling is refused, and a tier marker names the run that owns each tier."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from koochak.loop.checkpoint import load, resolve_auto_resume
from koochak.loop.checkpoint.tier_marker import MARKER_KEY, claim_tiers, read_marker
from koochak.loop.config import ConfigError, load_config, resolve_train_config
from koochak.loop.loop import training_loop
from koochak.storage.artifact import READY_SUFFIX
from koochak.storage.store import LocalStore, register_store


def _batches(start: int = 0, stop: int = 1000):
    for t in range(start, stop):
        g = torch.Generator().manual_seed(t)
        x = torch.randn(8, 4, generator=g)
        yield x, x.sum(1, keepdim=True)


def _step(model, batch, ctx):
    x, y = batch
    return {"loss": torch.nn.functional.mse_loss(model(x), y)}


def _run(first, replicas, *, max_steps=5, seed=0, **train):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 1)
    cfg = {"max_steps": max_steps, "log_every": 100, "device": "cpu", "out_dir": str(first),
           "ckpt_every": 1, "keep_last_k": 5, "progress_bar": False,
           "checkpoint_replicas": replicas, "checkpoint_replication_retry_s": 0, **train}  # fmt: skip
    return training_loop(model=model, dataset=_batches(), step_fn=_step,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                         train_cfg=cfg, resume="auto")  # fmt: skip


def _committed(root):
    return sorted(p.name[: -len(READY_SUFFIX)] for p in root.glob(f"*{READY_SUFFIX}"))


# ------------------------------------------------------------------ defect 2: paths


@pytest.mark.parametrize("spelling", ["link", "dot", "inside", "above"])
def test_a_replica_that_is_the_first_tier_under_another_spelling_is_refused(tmp_path, spelling):
    first = tmp_path / "ckpt"
    first.mkdir()
    os.symlink(first, tmp_path / "link")
    replica = {"link": str(tmp_path / "link"), "dot": f"{first}/.", "inside": str(first / "sub"),
               "above": str(tmp_path)}[spelling]  # fmt: skip
    with pytest.raises(ConfigError, match=r"train.checkpoint_replicas\[0\]: .*train.out_dir"):
        _run(first, [{"location": replica, "keep_last_k": 1}])
    assert _committed(first) == []  # refused before anything was written


def test_two_replicas_that_are_one_directory_are_refused(tmp_path):
    (tmp_path / "a").mkdir()
    os.symlink(tmp_path / "a", tmp_path / "b")
    with pytest.raises(ConfigError, match=r"train.checkpoint_replicas\[1\]: .*replicas\[0\]"):
        load_config(None, [f"train.out_dir={tmp_path}/run",
                           f"train.checkpoint_replicas=[{tmp_path}/a,{tmp_path}/b]"])  # fmt: skip


def test_an_alias_no_path_shows_is_caught_by_the_tier_marker(tmp_path):
    first = tmp_path / "ckpt"
    register_store("mirror27", lambda uri: LocalStore(str(first)))  # a second mount of one store
    with pytest.raises(ConfigError, match=r"replicas\[0\] \(mirror27://x\): is the same storage"):
        _run(first, ["mirror27://x"])
    assert _committed(first) == []


# ------------------------------------------------------------------ defect 3: two runs


def test_a_second_run_sharing_a_replica_is_refused_and_the_first_run_keeps_its_checkpoints(
    tmp_path, caplog
):
    shared = str(tmp_path / "shared")
    first_a = _run(tmp_path / "a", [{"location": shared, "keep_last_k": 2}], max_steps=5)
    before = {name: (tmp_path / "shared" / name).read_bytes() for name in os.listdir(shared)}
    run_a = read_marker(LocalStore(shared)).run_id
    with pytest.raises(ConfigError) as refused:
        _run(tmp_path / "b", [{"location": shared, "keep_last_k": 2}], max_steps=7, seed=1)
    message = str(refused.value)
    assert "\n" not in message and run_a in message and "train.checkpoint_replicas[0]" in message
    run_b = resolve_train_config({"out_dir": str(tmp_path / "b")})
    from koochak.loop.checkpoint.tier_marker import default_run_id

    assert default_run_id(run_b) in message  # both runs named
    after = {name: (tmp_path / "shared" / name).read_bytes() for name in os.listdir(shared)}
    assert after == before  # never written, never pruned
    # Resuming A over its own tiers selects A's checkpoint, not another run's.
    path, ckpt = resolve_auto_resume([tmp_path / "a", shared])
    assert ckpt["step"] == 5 and ckpt["run_id"] == run_a
    assert torch.equal(ckpt["model"]["weight"], first_a["model"]["weight"])


def test_retries_are_one_run_and_an_explicit_run_id_is_kept_in_every_checkpoint(tmp_path, caplog):
    shared = str(tmp_path / "shared")
    _run(tmp_path / "a", [shared], max_steps=3, run_id="exp-7")
    _run(tmp_path / "a", [shared], max_steps=5, run_id="exp-7")  # a longer retry
    assert load(os.path.join(shared, "step000000005.pt"))["run_id"] == "exp-7"
    assert read_marker(LocalStore(shared)).run_id == "exp-7"
    # A retry that lost its first tier (node-local) and names no run id: the same run, by
    # out_dir, whose durable tier it resumes from.
    _run(tmp_path / "c", [str(tmp_path / "d")], max_steps=2)
    import shutil

    shutil.rmtree(tmp_path / "c")
    with caplog.at_level(logging.WARNING, logger="koochak.loop.checkpoint"):
        final = _run(tmp_path / "c", [str(tmp_path / "d")], max_steps=4)
    assert final["step"] == 4 and _committed(tmp_path / "c")
    gone = [r.getMessage() for r in caplog.records if "it is gone" in r.getMessage()]
    assert len(gone) == 1 and "train.checkpoint_replicas[0]" in gone[0]


def test_a_marker_whose_run_committed_nothing_is_taken_over_with_one_line(tmp_path, caplog):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / MARKER_KEY).write_text(json.dumps({
        "format": "koochak-tier-marker", "version": 1, "run_id": "died-early",
        "tier_id": "0123456789abcdef", "created": "2026-12-01T00:00:00Z", "host": "n1"}))  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="koochak.loop.checkpoint"):
        _run(tmp_path / "a", [str(shared)], max_steps=2, run_id="mine")
    lines = [r.getMessage() for r in caplog.records if "taking over" in r.getMessage()]
    assert len(lines) == 1 and "died-early" in lines[0] and "mine" in lines[0]
    assert read_marker(LocalStore(str(shared))).run_id == "mine"
    assert _committed(shared)


def test_a_malformed_marker_is_refused_naming_the_key(tmp_path):
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / MARKER_KEY).write_text("not json")
    cfg = resolve_train_config({"out_dir": str(tmp_path / "a"),
                                "checkpoint_replicas": [str(tmp_path / "shared")]})  # fmt: skip
    with pytest.raises(ConfigError, match=r"train.checkpoint_replicas\[0\] .*not a tier marker"):
        claim_tiers(cfg)
