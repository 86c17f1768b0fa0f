"""Tiered checkpoints with an s3:// replica (koochak-store-s3 on the loopback moto server).

A training run commits each checkpoint in a local first tier and replicates it to S3 in the
background; the S3 tier then holds every checkpoint committed by the first tier's manifest,
byte for byte, in one file or in parts. With the first tier gone (requeued onto another node) the run resumes from S3,
pulls the checkpoint back into a new first tier and ends where an uninterrupted run ends.
"""

from __future__ import annotations

import shutil
import uuid

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture
def s3_tier(local_s3, monkeypatch):
    """A fresh s3:// prefix on moto with the environment pointing boto3 at it; emptied after."""
    from koochak.storage import open_store

    for name, value in {**local_s3.credentials, "AWS_ENDPOINT_URL_S3": local_s3.endpoint}.items():
        monkeypatch.setenv(name, value)
    location = f"s3://{local_s3.native_bucket}/tiers/{uuid.uuid4().hex}"
    yield location
    store = open_store(location)
    for info in store.list():
        store.delete(info.key)


def _run(first, replica, max_steps, parts=1, **kwargs):
    from koochak.loop import training_loop

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    start = kwargs.pop("start", 0)

    def batches():
        for t in range(start, 100):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(t))
            yield x, x.sum(1, keepdim=True)

    def step(model, batch, ctx):
        x, y = batch
        return {"loss": torch.nn.functional.mse_loss(model(x), y)}

    return training_loop(
        model=model, dataset=batches(), step_fn=step,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        train_cfg={"max_steps": max_steps, "log_every": 100, "device": "cpu",
                   "out_dir": str(first), "ckpt_every": 2, "keep_last_k": 2,
                   "progress_bar": False, "checkpoint_replicas": [replica],
                   "checkpoint_replication_retry_s": 0, "checkpoint_parts": parts},
        **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("parts", [1, 2])
def test_an_s3_replica_holds_every_commit_and_a_run_resumes_from_it(tmp_path, s3_tier, parts):
    from koochak.loop.checkpoint import checkpoint_objects, resolve_auto_resume
    from koochak.storage import LocalStore, open_store
    from koochak.storage.artifact import published_candidates, read_manifest

    announced: list = []
    hooks = {"on_checkpoint": [lambda info: announced.append(info["path"])]}
    _run(tmp_path / "node-a", s3_tier, 4, parts, hooks=hooks)
    s3, first = open_store(s3_tier), LocalStore(tmp_path / "node-a")
    names = [name for _, name in published_candidates(s3, r"step(\d{9})\.pt")]
    assert names == ["step000000004.pt", "step000000001.pt"]  # keep_last_k=2 there too
    for name in names:
        assert read_manifest(s3, name)[1] == read_manifest(first, name)[1]
        objects = checkpoint_objects(s3, name)  # parts (if any), the object, its manifest
        assert objects == checkpoint_objects(first, name) and len(objects) == 2 + (parts > 1) * 2
    # Pruned there with every part: only the kept checkpoints' objects remain, and the tier
    # marker naming the run that owns the tier.
    assert sorted(i.key for i in s3.list()) == sorted(
        ["koochak-tier.json", *(key for name in names for key in checkpoint_objects(s3, name))]
    )
    # on_checkpoint names the S3 tier (no local path there, so a location/key reference).
    assert announced == [f"{s3_tier}/step000000001.pt", f"{s3_tier}/step000000004.pt"]

    shutil.rmtree(tmp_path / "node-a")  # requeued onto another node
    tiers = [tmp_path / "node-b", s3_tier]
    path, ckpt = resolve_auto_resume(tiers)
    assert path == f"{s3_tier}/step000000004.pt" and ckpt["next_step"] == 4
    resumed = _run(tmp_path / "node-b", s3_tier, 8, parts, resume="auto", checkpoint_dict=ckpt,
                   auto_resume_path=path, start=4)  # fmt: skip
    straight = _run(tmp_path / "straight", str(tmp_path / "straight-durable"), 8)
    assert torch.equal(resumed["model"]["weight"], straight["model"]["weight"])
    assert (
        read_manifest(s3, "step000000008.pt")[1]
        == read_manifest(LocalStore(tmp_path / "node-b"), "step000000008.pt")[1]
    )
