"""verify --deep on damaged packs: the pack digest (hashed on a helper thread) and the file
digests (hashed on the reading thread) each catch what they cover."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from koochak.data.archive import archive_tree
from koochak.data.collection import load_collection
from koochak.data.verify import verify_collection
from koochak.storage.store import LocalStore


@pytest.fixture()
def collection(tmp_path):
    src = tmp_path / "src"
    for i in range(40):
        path = src / f"d{i % 4}" / f"f{i:03d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(3000 + 997 * i))  # ~0.9 MiB in all: several hash batches
    store = LocalStore(tmp_path / "coll", fsync=False)
    archive_tree(src, store, object_bytes=1 << 30, show_progress=False)
    return store


def _damage(store, offset_of, flip_at) -> tuple[str, str]:
    entries = [e for e in load_collection(store).entries if e.pack is not None]
    entry = max(entries, key=lambda e: e.offset or 0)  # late in the pack: after batches of hash
    path = Path(store.local_path(entry.pack))
    data = bytearray(path.read_bytes())
    data[offset_of(entry) + flip_at] ^= 0x01
    path.chmod(0o644)  # the store publishes read-only objects; this test plays the disk
    path.write_bytes(bytes(data))
    return entry.pack, entry.path


def test_an_intact_collection_verifies_deep(collection) -> None:
    report = verify_collection(collection, deep=True, show_progress=False)
    assert report.ok and report.bytes_read == sum(p.size for p in load_collection(collection).manifest.packs)


def test_damage_in_a_tar_header_is_caught_by_the_pack_digest_alone(collection) -> None:
    pack, _ = _damage(collection, lambda e: e.offset - 512, 100)  # the header's mode field
    problems = verify_collection(collection, deep=True, show_progress=False).problems
    assert [(p.key, p.path, p.message) for p in problems] == [
        (pack, None, "pack SHA256 differs from the manifest")
    ]


def test_damage_in_file_bytes_names_the_file_and_the_pack(collection) -> None:
    pack, path = _damage(collection, lambda e: e.offset, 7)
    problems = verify_collection(collection, deep=True, show_progress=False).problems
    assert [(p.key, p.path, p.message) for p in problems] == [
        (pack, path, "SHA256 differs from the manifest"),
        (pack, None, "pack SHA256 differs from the manifest"),
    ]
