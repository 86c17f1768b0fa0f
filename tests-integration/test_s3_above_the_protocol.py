"""Everything above the Store protocol works on s3:// (koochak-store-s3 on the loopback moto).

Checkpoint publish / prune / auto-resume, ShardWriter and verified reads, collections through the
koochak-data CLI (archive, ls, verify, pull), copy_objects both ways, and koochak-probe. Locations
are plain ``s3://bucket/prefix`` URIs resolved by open_store through the entry point; the
endpoint and the test credentials come from the environment, as they would for a user.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from koochak.storage import CopyItem, LocalStore, copy_objects, open_store

# moto accepts any secret key, so a distinctive one shows whether a credential leaks anywhere.
SECRET = f"koochak-it-secret-{uuid.uuid4().hex}"


@pytest.fixture
def s3_location(local_s3, monkeypatch):
    """A fresh s3:// prefix on moto; the environment points boto3 at it. Afterwards: no object
    written there (manifests, indexes, file lists) holds the secret key, and all are removed."""
    settings = {**local_s3.credentials, "AWS_ENDPOINT_URL_S3": local_s3.endpoint,
                "AWS_SECRET_ACCESS_KEY": SECRET}  # fmt: skip
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    location = f"s3://{local_s3.native_bucket}/it/{uuid.uuid4().hex}"
    yield location
    store = open_store(location)
    for info in store.list():
        if info.size < (1 << 20):
            data = store.get(info.key)
            if info.key.endswith(".gz"):
                data = gzip.decompress(data)
            assert SECRET.encode() not in data, info.key
        store.delete(info.key)


def test_checkpoints_publish_prune_and_auto_resume_on_s3(s3_location):
    torch = pytest.importorskip("torch")
    from koochak.loop.checkpoint import build_checkpoint, publish, resolve_auto_resume

    model = torch.nn.Linear(4, 2)
    for step in (100, 200, 300):
        ckpt = build_checkpoint(step=step, next_step=step + 1, model=model)
        publication = publish(s3_location, f"step{step:09d}.pt", ckpt, keep_last_k=2)
        assert publication.path is None  # no local file behind an S3 object
    store = open_store(s3_location)
    keys = [info.key for info in store.list()]
    assert keys == [
        "step000000200.pt",
        "step000000200.pt.ready.json",
        "step000000300.pt",
        "step000000300.pt.ready.json",
    ]
    path, ckpt = resolve_auto_resume(s3_location)
    assert path == f"{s3_location}/step000000300.pt" and ckpt["step"] == 300
    # A checkpoint without its ready manifest (a killed publish) is never resumed from.
    store.put("step000000400.pt", b"half a checkpoint")
    assert resolve_auto_resume(s3_location)[1]["step"] == 300


def test_shards_are_written_and_read_back_verified_on_s3(s3_location):
    from koochak.data.shards import ShardWriter, load_index, read_shard

    samples = [{"__key__": f"s{i:04d}", "bin": os.urandom(3000 + i)} for i in range(60)]
    with ShardWriter(s3_location, "ds", target_bytes=40_000) as writer:
        for sample in samples:
            writer.write(sample)
    index = load_index(s3_location, "ds")
    assert len(index.shards) > 1
    got = [
        {k: bytes(v) if k != "__key__" else v for k, v in s.items()}
        for shard in index.shards
        for s in read_shard(s3_location, index, shard)
    ]
    assert got == samples


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("koochak-data")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300)


def test_collections_archive_ls_verify_and_pull_on_s3(s3_location, tmp_path):
    tree = tmp_path / "tree"
    for i in range(20):
        (tree / f"d{i % 3}").mkdir(parents=True, exist_ok=True)
        (tree / f"d{i % 3}" / f"f{i}.bin").write_bytes(os.urandom(1000 * (i + 1)))
    (tree / "big.bin").write_bytes(os.urandom(7 << 20))
    dest = f"{s3_location}/coll"
    archived = _cli("archive", str(tree), dest, "--json", "--no-progress")
    assert archived.returncode == 0, archived.stderr
    listed = _cli("ls", dest, "--json")
    assert listed.returncode == 0, listed.stderr
    assert len(json.loads(listed.stdout)) == 21
    verified = _cli("verify", dest, "--deep", "--json", "--no-progress")
    assert verified.returncode == 0, verified.stderr
    pulled = _cli("pull", dest, str(tmp_path / "back"), "--no-progress")
    assert pulled.returncode == 0, pulled.stderr
    for done in (archived, listed, verified, pulled):
        assert SECRET not in done.stdout + done.stderr
    for path in tree.rglob("*.bin"):
        assert (tmp_path / "back" / path.relative_to(tree)).read_bytes() == path.read_bytes()


def test_copy_objects_moves_bytes_local_to_s3_and_back(s3_location, tmp_path):
    local = LocalStore(tmp_path / "a")
    payloads = {f"k/{i}": os.urandom(i * 1000 + 1) for i in range(12)}
    payloads["k/big"] = os.urandom(21 << 20)
    for key, data in payloads.items():
        local.put(key, data)
    items = [CopyItem(i.key, i.size) for i in local.list()]
    s3 = open_store(s3_location)
    report = copy_objects(local, s3, items)
    assert report.copied == len(payloads)
    assert copy_objects(local, s3, items).skipped == len(payloads)  # reruns resume
    back = LocalStore(tmp_path / "b")
    copy_objects(s3, back, items)
    for key, data in payloads.items():
        assert back.get(key) == data


def test_koochak_probe_measures_an_s3_location_and_reports_conditional_writes(s3_location):
    exe = Path(sys.executable).with_name("koochak-probe")
    done = subprocess.run(
        [str(exe), s3_location, "--json", "--read-bytes", "8M", "--small-objects", "10",
         "--streams", "1,2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["conditional_create"]["supported"] is True
    assert report["profile"] is not None
    assert open_store(s3_location).list() == []  # the scratch prefix is gone
