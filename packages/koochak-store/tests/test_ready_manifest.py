"""Local ready manifests for job outputs: write_ready_manifest, read_ready_manifest, verify_ready."""

from __future__ import annotations

import json
import os
import stat

import pytest
from koochak.storage.artifact import (
    READY_SUFFIX,
    InvalidArtifact,
    read_ready_manifest,
    verify_ready,
    write_ready_manifest,
)


def _tree(root):
    (root / "b").mkdir(parents=True)
    (root / "a.txt").write_bytes(b"alpha")
    (root / "b" / "c.bin").write_bytes(b"\x00" * 1000)
    (root / "b" / "a.bin").write_bytes(b"x")
    return root


def test_file_manifest_records_size_digest_and_provenance(tmp_path):
    target = tmp_path / "model.pt"
    target.write_bytes(b"weights")
    manifest = write_ready_manifest(target, provenance={"job": "j1"})
    assert manifest == tmp_path / ("model.pt" + READY_SUFFIX)
    doc = read_ready_manifest(target)
    assert doc["type"] == "file" and doc["size"] == 7 and doc["file_count"] == 1
    assert doc["provenance"] == {"job": "j1"} and doc["artifact_id"] == "model.pt"
    assert verify_ready(target) == doc
    assert read_ready_manifest(manifest) == doc  # either spelling works


def test_target_and_manifest_are_made_read_only(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"1")
    manifest = write_ready_manifest(target)
    assert stat.S_IMODE(target.stat().st_mode) & 0o222 == 0
    assert stat.S_IMODE(manifest.stat().st_mode) & 0o222 == 0


def test_directory_manifest_lists_files_in_a_deterministic_order(tmp_path):
    target = _tree(tmp_path / "out")
    write_ready_manifest(target)
    doc = verify_ready(target)
    assert doc["type"] == "directory" and doc["file_count"] == 3 and doc["size"] == 1006
    assert [f["path"] for f in doc["files"]] == ["a.txt", "b/a.bin", "b/c.bin"]
    other = _tree(tmp_path / "again" / "out")
    write_ready_manifest(other)
    assert (tmp_path / "out.ready.json").read_bytes() == (
        tmp_path / "again" / "out.ready.json"
    ).read_bytes()


def test_an_existing_manifest_is_never_replaced(tmp_path):
    target = tmp_path / "o"
    target.write_bytes(b"1")
    first = write_ready_manifest(target).read_bytes()
    with pytest.raises(FileExistsError):
        write_ready_manifest(target, provenance={"second": True})
    assert (tmp_path / ("o" + READY_SUFFIX)).read_bytes() == first
    assert sorted(os.listdir(tmp_path)) == ["o", "o" + READY_SUFFIX]  # no temp left behind


def test_symlinked_targets_are_refused(tmp_path):
    real = tmp_path / "real"
    real.write_bytes(b"1")
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(InvalidArtifact, match="symlink"):
        write_ready_manifest(tmp_path / "link")
    tree = _tree(tmp_path / "tree")
    (tree / "sneaky").symlink_to(real)
    with pytest.raises(InvalidArtifact, match="symlink"):
        write_ready_manifest(tree)
    assert not (tmp_path / ("tree" + READY_SUFFIX)).exists()


def test_a_fifo_in_an_output_is_refused_without_hanging(tmp_path):
    tree = _tree(tmp_path / "tree")
    os.mkfifo(tree / "pipe")
    with pytest.raises(InvalidArtifact, match="not a regular file"):
        write_ready_manifest(tree)


def test_missing_target_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_ready_manifest(tmp_path / "absent")


def _make_writable(path):
    for dirpath, _, names in os.walk(path):
        for name in names:
            os.chmod(os.path.join(dirpath, name), 0o644)
    if path.is_file():
        os.chmod(path, 0o644)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda t: (t / "a.txt").write_bytes(b"ALPHA"), "a.txt: size or SHA256 differs"),
        (lambda t: (t / "new.txt").write_bytes(b""), "new.txt: present but not listed"),
        (lambda t: (t / "b" / "c.bin").unlink(), "c.bin: listed .* but missing"),
        (lambda t: (t / "b" / "a.bin").write_bytes(b"xy"), "a.bin: size or SHA256 differs"),
    ],
)
def test_verify_ready_detects_changed_directories(tmp_path, damage, reason):
    target = _tree(tmp_path / "out")
    write_ready_manifest(target)
    _make_writable(target)
    damage(target)
    with pytest.raises(InvalidArtifact, match=reason):
        verify_ready(target)


def test_verify_ready_detects_a_replaced_file(tmp_path):
    target = tmp_path / "o.bin"
    target.write_bytes(b"original")
    write_ready_manifest(target)
    target.unlink()
    target.write_bytes(b"replaced")
    with pytest.raises(InvalidArtifact, match="SHA256"):
        verify_ready(target)
    target.unlink()
    with pytest.raises(InvalidArtifact, match="missing"):
        verify_ready(target)
    target.symlink_to(tmp_path / ("o.bin" + READY_SUFFIX))
    with pytest.raises(InvalidArtifact, match="symlink"):
        verify_ready(target)


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        ({"version": 7}, "version=7"),
        ({"colour": "red"}, "unknown field 'colour'"),
        ({"type": "blob"}, "field 'type'"),
        ({"size": -1}, "field 'size'"),
        ({"files": []}, "only for type 'directory'"),
    ],
)
def test_read_ready_manifest_rejects_bad_manifests_naming_file_and_field(tmp_path, edit, reason):
    target = tmp_path / "o"
    target.write_bytes(b"1")
    manifest = write_ready_manifest(target)
    doc = json.loads(manifest.read_text())
    doc.update(edit)
    os.chmod(manifest, 0o644)
    manifest.write_text(json.dumps(doc))
    with pytest.raises(InvalidArtifact, match=reason) as caught:
        read_ready_manifest(target)
    assert str(manifest) in str(caught.value)


def test_a_symlinked_manifest_is_refused(tmp_path):
    target = tmp_path / "o"
    target.write_bytes(b"1")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "o").write_bytes(b"1")
    real = write_ready_manifest(elsewhere / "o")
    (tmp_path / ("o" + READY_SUFFIX)).symlink_to(real)
    with pytest.raises(InvalidArtifact, match="symlink"):
        read_ready_manifest(target)


def test_the_manifest_example_in_formats_md_is_a_valid_manifest():
    import pathlib
    import re

    from koochak.storage.ready_manifest import _parse_manifest

    formats = pathlib.Path(__file__).resolve().parents[3] / "docs" / "formats.md"
    section = formats.read_text().split("## Ready manifests", 1)[1].split("\n## ", 1)[0]
    example = re.search(r"```json\n(.*?)```", section, re.S).group(1)
    doc = _parse_manifest(example.encode(), "formats.md")
    assert doc["artifact_id"] == "checkpoint/step000000100.pt"
