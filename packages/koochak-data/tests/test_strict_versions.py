"""Every koochak-data format reader takes only the exact integer version and no duplicate
fields: collection manifest, shard index.json, per-pack records (issue 9, defect 6)."""

from __future__ import annotations

import json

import pytest
from koochak.data.archive import archive_tree
from koochak.data.collection import parse_manifest
from koochak.data.shards import ShardWriter, load_index, parse_index
from koochak.storage.store import LocalStore

BAD_VERSIONS = [True, 1.0, "1", None]


def _swap(text: str, value) -> str:
    doc = json.loads(text)
    doc["version"] = value
    return json.dumps(doc)


def _duplicate_version(text: str) -> str:
    return text.rstrip().rstrip("}") + ', "version": 1}'


@pytest.fixture
def collection(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"f{i}.txt").write_bytes(b"x" * (100 + i))
    dest = tmp_path / "coll"
    archive_tree(src, dest)
    return src, dest


@pytest.mark.parametrize("value", BAD_VERSIONS)
def test_collection_manifest_version_must_be_the_integer_one(collection, value):
    _, dest = collection
    text = (dest / "manifest.json").read_text()
    with pytest.raises(ValueError, match="manifest.json.*'version'"):
        parse_manifest(_swap(text, value))
    with pytest.raises(ValueError, match="appears twice"):
        parse_manifest(_duplicate_version(text))
    assert parse_manifest(text).version == 1


@pytest.mark.parametrize("value", BAD_VERSIONS)
def test_shard_index_version_must_be_the_integer_one(tmp_path, value):
    store = LocalStore(tmp_path / "ds")
    with ShardWriter(store, "") as writer:
        writer.write({"__key__": "a", "txt": b"hello"})
    text = (tmp_path / "ds" / "index.json").read_text()
    with pytest.raises(ValueError, match="index.json.*'version'"):
        parse_index(_swap(text, value).encode())
    with pytest.raises(ValueError, match="appears twice"):
        parse_index(_duplicate_version(text).encode())
    assert load_index(store).records == 1


@pytest.mark.parametrize("value", [True, 1.0])
def test_pack_record_version_must_be_the_integer_one(collection, value):
    src, dest = collection
    for name in ("manifest.json", "files.jsonl.gz"):
        (dest / name).unlink()  # as if killed before the commit point: the records are read back
    record = dest / "records" / "pack-000000.json"
    text = _swap(record.read_text(), value)
    record.unlink()
    record.write_text(text)
    with pytest.raises(ValueError, match="pack-000000.json.*'version'"):
        archive_tree(src, dest)


def test_pack_record_numbers_must_be_integers(collection):
    src, dest = collection
    for name in ("manifest.json", "files.jsonl.gz"):
        (dest / name).unlink()
    record = dest / "records" / "pack-000000.json"
    doc = json.loads(record.read_text())
    doc["members"][0]["size"] = float(doc["members"][0]["size"])
    record.unlink()
    record.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="must be integers"):
        archive_tree(src, dest)
