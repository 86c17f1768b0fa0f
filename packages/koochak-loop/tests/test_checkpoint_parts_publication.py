"""Checkpoints in parts through every save, load, select and prune path, beside one-file ones."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import time

import pytest
import torch
from koochak.events.envelope import publication_record
from koochak.loop.checkpoint import (
    best,
    build_checkpoint,
    checkpoint_objects,
    checkpoint_store,
    highest_valid_published,
    latest,
    load,
    publish,
    resolve_auto_resume,
    save,
    serialize_checkpoint,
)
from koochak.loop.checkpoint.commit import unpublish_checkpoint
from koochak.loop.checkpoint.parts_index import parse_index, part_key
from koochak.loop.checkpoint.publication import prune_checkpoints
from koochak.loop.seed import get_rng_state
from koochak.storage import artifact
from koochak.storage.store import LocalStore
from koochak.storage.testing import Fault, FaultyStore, visible_files
from koochak.storage.transfer import CopyItem, copy_objects


def _ckpt(step: int, *, loss: float | None = None, width: int = 64) -> dict:
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 3))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    return build_checkpoint(
        step=step,
        next_step=step + 1,
        model=model,
        optimizer=optimizer,
        rng=get_rng_state(),
        metrics={"loss": loss if loss is not None else 1.0 / (step + 1)},
        config={"train": {"lr": 0.1}},
    )


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b) and a.dtype == b.dtype
    elif isinstance(a, dict):
        assert set(a) == set(b)
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif hasattr(a, "shape") and hasattr(a, "dtype"):  # numpy arrays in RNG states
        assert (a == b).all()
    else:
        assert a == b


def _parts_of(root, name):
    return sorted(n for n in os.listdir(root) if n.startswith(name + ".part-"))


@pytest.fixture(params=["directory", "stores-file-uri", "store"])
def location(request, tmp_path, monkeypatch):
    """The same checkpoint location spelled the three ways the spec allows."""
    root = tmp_path / "ckpt"
    if request.param == "directory":
        return str(root), root, True
    if request.param == "store":
        return LocalStore(root, publish="exclusive"), root, False
    stores = tmp_path / "stores.yaml"
    stores.write_text(
        f"version: 1\nstores:\n  vault:\n    root: {tmp_path}\n    publish: exclusive\n"
    )
    monkeypatch.setenv("KOOCHAK_STORES", str(stores))
    return "vault://ckpt", root, False


def test_every_helper_reads_and_selects_parts_beside_one_file_checkpoints(location):
    where, root, links = location
    saved = {step: _ckpt(step, loss=loss) for step, loss in ((0, 0.5), (1, 0.1), (2, 0.3))}
    publish(where, "step000000000.pt", saved[0], keep_last_k=2)  # one file, as before
    first = publish(where, "step000000001.pt", saved[1], keep_last_k=2, parts=3)
    assert first.artifact_id == "checkpoint/step000000001.pt"
    save(saved[2], where, keep_last_k=2, parts=2)
    published = sorted(p.name for p in root.iterdir() if p.name.endswith(".ready.json"))
    assert published == ["step000000001.pt.ready.json", "step000000002.pt.ready.json"]
    assert len(_parts_of(root, "step000000001.pt")) == 3
    assert len(_parts_of(root, "step000000002.pt")) == 2
    newest = str(root / "step000000002.pt")
    assert latest(where) == (str(root / "latest.pt") if links else newest)
    assert highest_valid_published(where) == newest
    path, ckpt = resolve_auto_resume(where)
    assert path == newest
    _same(saved[2], ckpt)
    assert best(where, "loss") == str(root / "step000000001.pt")
    _same(saved[1], load(where, "step000000001.pt"))
    _same(saved[2], load(newest))
    _same(saved[2], load(latest(where)))  # latest.pt is a link to an index: parts beside it


def test_a_checkpoint_in_parts_equals_the_one_file_checkpoint(tmp_path):
    ckpt = _ckpt(5)
    save(ckpt, tmp_path / "one")
    save(ckpt, tmp_path / "parts", parts=4)
    one = load(tmp_path / "one" / "step000000005.pt")
    _same(one, load(tmp_path / "parts" / "step000000005.pt"))
    index = parse_index((tmp_path / "parts" / "step000000005.pt").read_bytes(), "i")
    assert len(index.parts) == 4 and index.writers == 1


def test_the_manifest_and_publication_record_describe_the_index(tmp_path):
    publication = save(_ckpt(3), tmp_path, parts=2)
    index_path = tmp_path / "step000000003.pt"
    raw = index_path.read_bytes()
    assert raw.startswith(b'{"format":"koochak-checkpoint-parts"')
    manifest = json.loads((tmp_path / "step000000003.pt.ready.json").read_text())
    assert manifest["key"] == "step000000003.pt" and manifest["type"] == "file"
    assert manifest["sha256"] == hashlib.sha256(raw).hexdigest() == publication.sha256
    assert manifest["size"] == len(raw) == publication.size
    record = publication_record(
        artifact_id=publication.artifact_id,
        path=publication.path,
        size_bytes=publication.size,
        sha256=publication.sha256,
        manifest_path=str(tmp_path / publication.manifest_key),
    )
    assert set(record) == {"v", "artifact_id", "path", "size_bytes", "sha256", "manifest_path"}
    assert record["artifact_id"] == "checkpoint/step000000003.pt"
    # A consumer that verifies path, size and SHA256 and then reads the index reaches every byte.
    index = parse_index(raw, record["path"])
    for part in index.parts:
        data = (tmp_path / part.key).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (part.size, part.sha256)


def test_auto_parts_choose_from_the_store_and_one_means_one_file(tmp_path):
    save(_ckpt(1), tmp_path, parts="auto")  # a small state: one file
    assert _parts_of(tmp_path, "step000000001.pt") == []
    assert (tmp_path / "step000000001.pt").read_bytes()[:2] == b"PK"
    with pytest.raises(ValueError, match="parts need the checkpoint dict"):
        publish(tmp_path, "step000000002.pt", serialize_checkpoint(_ckpt(2)), parts=2)
    with pytest.raises(ValueError, match="expected an int >= 1"):
        save(_ckpt(2), tmp_path, parts=0)


# -- pruning and removal ---------------------------------------------------------------------


class RecordingStore(LocalStore):
    def __init__(self, root) -> None:
        super().__init__(root)
        self.deleted: list[str] = []

    def delete(self, key):
        super().delete(key)
        if not key.endswith(".publishing.json"):  # each publish's own intent record
            self.deleted.append(key)


def test_pruning_removes_manifest_then_index_then_parts_for_both_layouts(tmp_path):
    store = RecordingStore(tmp_path)
    save(_ckpt(0), store, parts=3)
    save(_ckpt(1), store)  # one file
    save(_ckpt(2), store, parts=2)
    save(_ckpt(3), store, parts=2, keep_last_k=1)
    zero, one, two = "step000000000.pt", "step000000001.pt", "step000000002.pt"
    assert store.deleted == [
        f"{two}.ready.json", two, part_key(two, 0, 0), part_key(two, 0, 1),
        f"{one}.ready.json", one,
        f"{zero}.ready.json", zero, part_key(zero, 0, 0), part_key(zero, 0, 1), part_key(zero, 0, 2),
    ]  # fmt: skip
    assert sorted(visible_files(tmp_path)) == sorted(
        ["latest.pt", "step000000003.pt", "step000000003.pt.ready.json"]
        + _parts_of(tmp_path, "step000000003.pt")
    )


def test_pruning_never_touches_a_checkpoint_still_being_published(tmp_path):
    store = LocalStore(tmp_path)
    save(_ckpt(0), store, parts=2)
    save(_ckpt(1), store, parts=2)
    artifact.unpublish(store, "step000000009.pt")  # nothing there: fine
    (tmp_path / part_key("step000000009.pt", 0, 0)).write_bytes(b"in flight")
    assert prune_checkpoints(store, 1) == ["step000000000.pt"]
    assert (tmp_path / part_key("step000000009.pt", 0, 0)).exists()


def test_resaving_a_name_clears_an_interrupted_attempts_parts(tmp_path):
    store = LocalStore(tmp_path)
    name = "step000000004.pt"
    for n in range(3):  # a crashed save of the same step left parts (and no index)
        (tmp_path / part_key(name, 0, n)).write_bytes(b"stale")
    # ... and its intent record, which proves it dead: the claim takes the name over, and only
    # a taken-over name is cleared of leftovers (a free one costs no listing).
    from koochak.storage import _publish_intent

    dead = dataclasses.replace(_publish_intent.ours(name), deadline=time.time() - 10 * 3600)
    store.put(name + _publish_intent.INTENT_SUFFIX, dead.to_bytes())
    save(_ckpt(4), store, parts=2)
    assert _parts_of(tmp_path, name) == [part_key(name, 0, 0), part_key(name, 0, 1)]
    _same(_ckpt(4), load(store, name))
    unpublish_checkpoint(store, name)
    assert [f for f in visible_files(tmp_path) if f.startswith(name)] == []


def test_a_failed_save_in_parts_leaves_nothing_and_keeps_the_previous(tmp_path):
    good = LocalStore(tmp_path)
    save(_ckpt(1), good, parts=2)
    before = sorted(visible_files(tmp_path))
    store = FaultyStore(tmp_path, [Fault("write", nth=2, errno=28)])
    with pytest.raises(OSError, match="No space left"):
        save(_ckpt(2), store, parts=2)
    assert sorted(visible_files(tmp_path)) == before
    path, ckpt = resolve_auto_resume(tmp_path)
    assert ckpt["step"] == 1

    class ManifestFails(LocalStore):
        def put(self, key, data, **kwargs):
            if key.endswith(".ready.json"):
                raise OSError(28, "No space left on device", key)
            return super().put(key, data, **kwargs)

    with pytest.raises(OSError, match="No space left"):
        save(_ckpt(2), ManifestFails(tmp_path), parts=3)
    assert sorted(visible_files(tmp_path)) == before


# -- a partly written checkpoint is never selected -------------------------------------------


def _damage(root, how):
    name = "step000000002.pt"
    if how == "part missing":
        (root / part_key(name, 0, 1)).unlink()
    elif how == "part bit flipped":
        path = root / part_key(name, 0, 0)
        data = bytearray(path.read_bytes())
        data[7] ^= 0x10
        os.chmod(path, 0o644)
        path.write_bytes(bytes(data))
    elif how == "part truncated":
        path = root / part_key(name, 0, 2)
        os.chmod(path, 0o644)
        path.write_bytes(path.read_bytes()[:-3])
    elif how == "index missing":
        (root / name).unlink()
    elif how == "index rewritten":  # a valid-looking index the manifest does not hash
        path = root / name
        doc = json.loads(path.read_bytes())
        doc["skeleton"] = doc["skeleton"]  # same content, different bytes
        os.chmod(path, 0o644)
        path.write_bytes(json.dumps(doc, indent=1).encode())
    elif how == "manifest missing":
        (root / f"{name}.ready.json").unlink()
    elif how == "parts only":  # a save killed before its index
        (root / name).unlink()
        (root / f"{name}.ready.json").unlink()


@pytest.mark.parametrize(
    "how, reason",
    [
        ("part bit flipped", "part-00000-00000 has SHA256"),
        ("part truncated", "part-00000-00002 has \\d+ bytes"),
        ("index rewritten", "manifest says"),
        ("manifest missing", "no ready manifest"),
        ("parts only", None),
    ],
)
def test_a_partly_written_or_damaged_checkpoint_in_parts_is_never_selected(
    tmp_path, caplog, how, reason
):
    save(_ckpt(1), tmp_path, parts=3)
    save(_ckpt(2), tmp_path, parts=3)
    _damage(tmp_path, how)
    with caplog.at_level(logging.WARNING, logger="koochak"):
        path, ckpt = resolve_auto_resume(tmp_path)
    assert ckpt["step"] == 1 and path == str(tmp_path / "step000000001.pt")
    assert highest_valid_published(tmp_path) == path
    if reason is not None:
        assert re.search(reason, caplog.text), caplog.text
    assert best(tmp_path, "loss") == path  # the damaged one is skipped there too


@pytest.mark.parametrize("how", ["part missing", "index missing"])
def test_a_checkpoint_whose_objects_stay_missing_falls_back(tmp_path, caplog, how):
    """Its manifest names the index and the index its parts. Missing may first mean another
    client's objects not visible yet (a mount): resume waits read_settle_seconds (0 on a plain
    directory); still missing, the checkpoint is not whole and the lower one is taken, with one
    line naming the object (the spec's fallback rule; tests/checkpoint/test_missing_objects.py)."""
    save(_ckpt(1), tmp_path, parts=3)
    save(_ckpt(2), tmp_path, parts=3)
    _damage(tmp_path, how)
    with caplog.at_level(logging.WARNING, logger="koochak"):
        path, ckpt = resolve_auto_resume(tmp_path)
    assert ckpt["step"] == 1
    assert "is missing (after waiting read_settle_seconds=0)" in caplog.text


def test_an_index_copied_under_another_name_is_not_selected(tmp_path, caplog):
    """The index names itself: one published as another step's checkpoint is refused."""
    save(_ckpt(1), tmp_path, parts=2)
    store = LocalStore(tmp_path)
    artifact.publish(store, "step000000007.pt", store.get("step000000001.pt"), latest=False)
    with caplog.at_level(logging.WARNING, logger="koochak"):
        path, ckpt = resolve_auto_resume(tmp_path)
    assert ckpt["step"] == 1
    assert "was read as 'step000000007.pt'" in caplog.text


# -- listing and copying a checkpoint's objects ----------------------------------------------


def test_checkpoint_objects_lists_both_layouts_in_commit_order(tmp_path):
    save(_ckpt(1), tmp_path)
    save(_ckpt(2), tmp_path, parts=3)
    assert checkpoint_objects(tmp_path, "step000000001.pt") == [
        "step000000001.pt",
        "step000000001.pt.ready.json",
    ]
    name = "step000000002.pt"
    assert checkpoint_objects(tmp_path, name) == [
        part_key(name, 0, 0),
        part_key(name, 0, 1),
        part_key(name, 0, 2),
        name,
        f"{name}.ready.json",
    ]


def test_a_checkpoint_copied_object_by_object_loads_on_the_other_store(tmp_path):
    save(_ckpt(2), tmp_path / "fast", parts=3)
    source = checkpoint_store(tmp_path / "fast")
    target = LocalStore(tmp_path / "slow", publish="exclusive")
    keys = checkpoint_objects(source, "step000000002.pt")
    items = [CopyItem(key, source.stat(key).size) for key in keys]
    copy_objects(source, target, items[:-1])  # parts and index first,
    assert resolve_auto_resume(target) is None
    copy_objects(source, target, items[-1:])  # then the manifest commits the copy
    path, ckpt = resolve_auto_resume(target)
    _same(_ckpt(2), ckpt)
