"""Shards, collections, copy_objects and checkpoints on both mounts, read back through the other.

Each test writes through one mount and reads through the other (another client), so the reads
meet the mount's caches as another node would: a reader waits for what a manifest names
(``read_settle_seconds``). The writers use the mount's settings with ``settle_seconds`` 0: that
wait only delays the read-back that catches another client's collision (test_collisions.py),
and paying it for each of these puts would only make CI slower.
"""

from __future__ import annotations

import hashlib
import os
import time

import pytest
import yaml
from koochak.data.archive import archive_tree
from koochak.data.collection import load_collection
from koochak.data.pull import pull_collection
from koochak.data.shards import ShardWriter, load_index, read_shards
from koochak.data.verify import verify_collection
from koochak.storage.artifact import highest_valid, publish
from koochak.storage.store import LocalStore
from koochak.storage.transfer import CopyItem, copy_objects


def _writer(mount_dir, sub: str) -> LocalStore:
    return LocalStore(mount_dir.path / sub, **{**mount_dir.settings, "settle_seconds": 0})


def _reader(mount_dir, sub: str) -> LocalStore:
    """The other client, once ``settle_seconds`` have passed: how long the settings say another
    client may take to see a new object (rclone lists s3fs's new objects after up to ~1 s)."""
    time.sleep(mount_dir.settings["settle_seconds"])
    return LocalStore(mount_dir.peer / sub, **{**mount_dir.settings, "settle_seconds": 0})


def _tree(root, files: int = 24) -> None:
    for i in range(files):
        path = root / f"d{i % 3}" / f"f{i:03d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(hashlib.sha256(str(i).encode()).digest() * (20 + 37 * i))
        os.chmod(path, 0o640 if i % 2 else 0o644)
        os.utime(path, ns=(1, 1_700_000_000_123_456_789 + i))
    (root / "big.bin").write_bytes(os.urandom(3 << 20))


def _same_tree(a, b) -> None:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for rel in files:
        sa, sb = os.stat(a / rel), os.stat(b / rel)
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
        assert (sa.st_mode, sa.st_mtime_ns) == (sb.st_mode, sb.st_mtime_ns), rel


def test_shards_written_on_one_mount_read_verified_through_the_other(mount_dir):
    samples = [
        {"__key__": f"s{i:04d}", "cls": str(i % 5).encode(), "bin": os.urandom(3000 + i)}
        for i in range(40)
    ]
    with ShardWriter(_writer(mount_dir, "ds"), "", target_bytes=48 << 10) as writer:
        for sample in samples:
            writer.write(sample)
    index = writer.close()
    assert len(index.shards) >= 2
    reader = _reader(mount_dir, "ds")
    assert load_index(reader) == index
    assert [dict(s) for s in read_shards(reader, index, verify=True)] == samples


def test_collection_archive_verify_ls_and_pull_across_the_mounts(mount_dir, tmp_path):
    src = tmp_path / "src"
    _tree(src)
    report = archive_tree(
        src, _writer(mount_dir, "coll"), pack_bytes=64 << 10, object_bytes=1 << 20
    )
    assert report.files == 25
    reader = _reader(mount_dir, "coll")
    assert verify_collection(reader, deep=True).ok
    listed = sorted(e.path for e in load_collection(reader).entries)  # what `koochak-data ls` shows
    assert listed == sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file())
    pull_collection(reader, tmp_path / "out")
    _same_tree(src, tmp_path / "out")


def test_copy_objects_up_to_one_mount_and_down_through_the_other(mount_dir, tmp_path):
    local = LocalStore(tmp_path / "local")
    blobs = {f"obj/{i}.bin": os.urandom(size) for i, size in enumerate((0, 100, 70_000, 5 << 20))}
    items = []
    for key, data in blobs.items():
        local.put(key, data)
        items.append(CopyItem(key, len(data), hashlib.sha256(data).hexdigest()))
    up = copy_objects(local, _writer(mount_dir, "copy"), items, part_bytes=1 << 20)
    assert up.copied == len(items)
    back = LocalStore(tmp_path / "back")
    down = copy_objects(_reader(mount_dir, "copy"), back, items, part_bytes=1 << 20)
    assert down.copied == len(items)
    assert {k: back.get(k) for k in blobs} == blobs
    again = copy_objects(local, _writer(mount_dir, "copy"), items)  # a rerun skips them all
    assert again.skipped == len(items) and again.copied == 0


def test_checkpoints_published_on_one_mount_resume_through_the_other(mount_dir):
    writer = _writer(mount_dir, "ckpt")
    for step in (1, 2, 3):
        publish(writer, f"step{step:09d}.pt", f"state {step}".encode() * 1000, keep_last_k=2)
    reader = _reader(mount_dir, "ckpt")
    found = highest_valid(reader, r"step(\d+)\.pt")
    assert found is not None and found[0].key == "step000000003.pt"
    assert found[1] == b"state 3" * 1000
    assert {i.key for i in reader.list()} == {
        f"step{s:09d}.pt{sfx}" for s in (2, 3) for sfx in ("", ".ready.json")
    }


@pytest.mark.slow
def test_training_on_a_mount_resumes_through_the_other(mount_dir, tmp_path, monkeypatch):
    """koochak-train's loop with checkpoint_dir on a mount (a stores-file scheme carrying the
    mount's settings), saving checkpoints in three parts, then a second run that resumes from
    the newest checkpoint through the other mount."""
    torch = pytest.importorskip("torch")
    from koochak.loop import training_loop
    from koochak.loop.checkpoint import resolve_auto_resume

    settings = {**mount_dir.settings, "settle_seconds": 0}
    stores = tmp_path / "stores.yaml"
    entries = {"here": mount_dir.path, "there": mount_dir.peer}
    document = {
        "version": 1,
        "stores": {k: {"root": str(v), **settings} for k, v in entries.items()},
    }
    stores.write_text(yaml.safe_dump(document))
    monkeypatch.setenv("KOOCHAK_STORES", str(stores))

    def run(location, max_steps, checkpoint=None, path=None):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)

        def batches(start):
            for i in range(start, max_steps):
                g = torch.Generator().manual_seed(i)
                yield {"x": torch.randn(8, 4, generator=g)}

        start = checkpoint["next_step"] if checkpoint else 0
        return training_loop(
            model=model,
            dataset=batches(start),
            step_fn=lambda m, b, ctx: {"loss": m(b["x"]).pow(2).mean()},
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            train_cfg={
                "max_steps": max_steps,
                "ckpt_every": 2,
                "keep_last_k": 2,
                "log_every": 1000,
                "device": "cpu",
                "out_dir": str(tmp_path / "out"),
                "checkpoint_dir": location,
                "checkpoint_parts": 3,
                "progress_bar": False,
            },  # fmt: skip
            resume="auto" if checkpoint else "none",
            checkpoint_dict=checkpoint,
            auto_resume_path=path,
        )

    run("here://run", 4)
    assert any(".pt.part-" in name for name in mount_dir.server.objects("run/"))
    time.sleep(mount_dir.settings["settle_seconds"])  # another node starts later than that
    path, checkpoint = resolve_auto_resume("there://run")
    assert checkpoint["step"] == 4 and path.endswith("step000000004.pt")
    final = run("there://run", 6, checkpoint, path)
    assert final["step"] == 6
    assert resolve_auto_resume("here://run")[1]["step"] == 6
