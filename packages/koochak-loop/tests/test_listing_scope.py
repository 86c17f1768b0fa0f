"""Listings scoped to the checkpoint being read or pruned (issue 36).

A save's retention needs the checkpoints' names (their ready manifests), then the objects of the
one it prunes; it must never list every part of every retained checkpoint. A counting Store
wrapper records what each listing returned, and the tests bound every listing that is not
scoped to one checkpoint by the checkpoints kept, not by their parts.
"""

from __future__ import annotations

import re

import torch
from koochak.loop.checkpoint.replication import FollowerReplicator, ReplicaTier
from koochak.loop.loop import training_loop
from koochak.storage.store import LocalStore, list_shallow, register_store

ONE_CHECKPOINT = re.compile(r"step\d{9}\.pt")  # a prefix that names one checkpoint


class Counting:
    """A LocalStore that records ``(prefix, entries returned)`` for every listing."""

    def __init__(self, root, seen: list[tuple[str, int]]) -> None:
        self.inner = LocalStore(root)
        self.location = self.inner.location
        self.seen = seen

    def list(self, prefix=""):
        found = self.inner.list(prefix)
        self.seen.append((prefix, len(found)))
        return found

    def list_shallow(self, prefix, delimiter):
        found = list_shallow(self.inner, prefix, delimiter)
        self.seen.append((prefix, len(found)))
        return found

    def __getattr__(self, name):  # get, open, put, stat, delete, local_path, capabilities
        return getattr(self.inner, name)


def _unscoped(seen):
    return [(prefix, n) for prefix, n in seen if not ONE_CHECKPOINT.match(prefix)]


def test_retention_lists_the_checkpoints_kept_not_their_parts(tmp_path):
    seen: list[tuple[str, int]] = []
    register_store("countfirst", lambda rest: Counting(tmp_path / rest, seen))
    register_store("countreplica", lambda rest: Counting(tmp_path / rest, seen))

    def batches():
        for t in range(1000):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(t))
            yield x, x.sum(1, keepdim=True)

    def step_fn(model, batch, ctx):
        x, y = batch
        return {"loss": torch.nn.functional.mse_loss(model(x), y)}

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(6)), torch.nn.Linear(4, 1))
    parts, keep = 12, 2
    train_cfg = {"max_steps": 10, "log_every": 100, "device": "cpu", "out_dir": str(tmp_path / "out"),
                 "checkpoint_dir": "countfirst://first", "ckpt_every": 1, "keep_last_k": keep,
                 "progress_bar": False, "checkpoint_parts": parts,
                 "checkpoint_replicas": [{"location": "countreplica://replica", "keep_last_k": keep}],
                 "checkpoint_replication_retry_s": 0}  # fmt: skip
    training_loop(model=model, dataset=batches(), step_fn=step_fn, train_cfg=train_cfg,
                  optimizer=torch.optim.SGD(model.parameters(), lr=0.01))  # fmt: skip
    saved = sorted((tmp_path / "first").glob("step*.pt.part-*"))
    assert len(saved) >= keep * parts  # every checkpoint kept is in many parts
    unscoped = _unscoped(seen)
    assert unscoped, "retention listed nothing"
    # A checkpoint and its manifest per checkpoint kept (plus the one being committed or
    # pruned), whatever the parts: listing every part would be ~(keep + 1) x (parts + 2).
    most = max(n for _, n in unscoped)
    assert most <= 2 * (keep + 2) + 2, unscoped
    for prefix, n in seen:  # a listing of one checkpoint: at most its own objects
        if ONE_CHECKPOINT.match(prefix):
            assert n <= parts + 3, (prefix, n)


def test_a_followers_prune_lists_the_tier_once_then_only_what_it_prunes(tmp_path):
    seen: list[tuple[str, int]] = []
    first = Counting(tmp_path / "node1", seen)
    replica = LocalStore(tmp_path / "replica")
    rank, parts, keep = 3, 6, 2
    follower = FollowerReplicator(first, [ReplicaTier(1, replica, None)], rank=rank,
                                  keep_last_k=keep, retry_s=0)  # fmt: skip
    try:
        for step in range(1, 9):
            name = f"step{step:09d}.pt"
            written = []
            for n in range(parts):
                key = f"{name}.part-{rank:05d}-{n:05d}"
                info = first.put(key, f"{key} bytes".encode())
                written.append((key, info.size, info.sha256))
            follower.submit(name, written)
            follower.settle()
    finally:
        follower.close()
    kept = sorted(p.name for p in (tmp_path / "node1").iterdir())
    assert len(kept) <= (keep + 1) * parts  # pruned by the retention rule
    # One listing of the tier (what earlier attempts left), then only the pruned ones' parts.
    assert len(_unscoped(seen)) <= 1, _unscoped(seen)
    assert all(n <= parts for prefix, n in seen if ONE_CHECKPOINT.match(prefix))
