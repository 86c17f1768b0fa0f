"""Every malformed parts index is InvalidArtifact, caught before anything is allocated or walked
(issue 27, defect 4).

Each case crafts an index and re-hashes it into its ready manifest, so the digest check passes
and the index's own bounds are what must catch it. Auto-resume (one process and the sharded
selection) passes the checkpoint over with one line; ``load`` raises InvalidArtifact.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import io
import json
import logging
import sys

import pytest
import torch
from koochak.loop.checkpoint import load, resolve_auto_resume, save
from koochak.loop.checkpoint.selection import resolve_sharded
from koochak.storage import artifact
from koochak.storage.store import LocalStore

BAD = "step000000002.pt"


def _empty_tensor(shape):
    return {"dtype": "float32", "shape": shape,
            "shards": [{"offsets": [0] * len(shape), "shape": shape, "extents": []}]}  # fmt: skip


def _deep(levels):
    deep = inner = []
    for _ in range(levels):
        inner.append([])
        inner = inner[0]
    return deep


def _nested_skeleton(doc):
    skeleton = torch.load(io.BytesIO(base64.b64decode(doc["skeleton"])), weights_only=True)
    skeleton["config"]["deep"] = _deep(3000)
    buffer = io.BytesIO()
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20000)  # only to write the hostile skeleton
    try:
        torch.save(skeleton, buffer)
    finally:
        sys.setrecursionlimit(limit)
    doc["skeleton"] = base64.b64encode(buffer.getvalue()).decode()


def _edit(how):
    def edit(doc):
        if how == "dim 2**70":
            doc["tensors"].append(_empty_tensor([0, 2**70]))
        elif how == "shape product overflows":
            doc["tensors"].append(_empty_tensor([2**40, 2**40, 0]))
        elif how == "65 dimensions":
            doc["tensors"].append(_empty_tensor([1] * 64 + [0]))
        elif how == "dtype":
            doc["tensors"][0]["dtype"] = "float128"
        elif how == "part size":
            doc["parts"][0]["size"] = 2**70
        elif how == "extent offset":
            doc["tensors"][0]["shards"][0]["extents"][0]["offset"] = 2**64
        elif how == "writers count":
            doc["writers"] = 2**40
        elif how == "nesting 3000 deep":
            _nested_skeleton(doc)
        elif how == "shard offsets":
            doc["tensors"][0]["shards"][0]["offsets"] = [2**63] * len(doc["tensors"][0]["shape"])

    return edit


CASES = ["dim 2**70", "shape product overflows", "65 dimensions", "dtype", "part size",
         "extent offset", "writers count", "nesting 3000 deep", "shard offsets"]  # fmt: skip


def _rehash(store, name, raw):
    """Replace object ``name`` by ``raw`` and commit it again: a manifest that matches it."""
    doc = json.loads(store.get(name + artifact.READY_SUFFIX))
    doc.update(size=len(raw), sha256=hashlib.sha256(raw).hexdigest())
    for key, data in ((name, raw), (name + artifact.READY_SUFFIX, json.dumps(doc).encode())):
        store.delete(key)
        store.put(key, data)


@pytest.fixture
def crafted(tmp_path, make_ckpt):
    def make(how):
        store = LocalStore(tmp_path)
        save(make_ckpt(1), store, parts=2)
        save(make_ckpt(2), store, parts=2)
        doc = json.loads(store.get(BAD))
        original = copy.deepcopy(doc)
        _edit(how)(doc)
        assert doc != original
        _rehash(store, BAD, json.dumps(doc).encode())
        return store

    return make


@pytest.mark.parametrize("how", CASES)
def test_a_malformed_index_is_passed_over_by_auto_resume(crafted, caplog, how):
    store = crafted(how)
    with caplog.at_level(logging.WARNING, logger="koochak"):
        path, ckpt = resolve_auto_resume(store)
    assert ckpt["step"] == 1 and path.endswith("step000000001.pt")
    lines = [r.getMessage() for r in caplog.records if BAD in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines


@pytest.mark.parametrize("how", CASES)
def test_load_of_a_malformed_index_raises_invalid_artifact(crafted, how):
    store = crafted(how)
    with pytest.raises(artifact.InvalidArtifact, match=BAD):
        load(store, BAD)


@pytest.mark.parametrize("how", CASES)
def test_the_sharded_selection_passes_a_malformed_index_over(crafted, caplog, how):
    store = crafted(how)
    with caplog.at_level(logging.WARNING, logger="koochak"):
        path, ckpt = resolve_sharded(store)
    assert ckpt["step"] == 1 and path.endswith("step000000001.pt")
    assert any(BAD in r.getMessage() for r in caplog.records)


def test_a_one_file_checkpoint_nested_3000_deep_is_invalid(tmp_path, make_ckpt):
    store = LocalStore(tmp_path)
    save(make_ckpt(1), store)
    ckpt = make_ckpt(2)
    ckpt["config"]["deep"] = _deep(3000)
    buffer = io.BytesIO()
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20000)
    try:
        torch.save(ckpt, buffer)
    finally:
        sys.setrecursionlimit(limit)
    artifact.publish(store, BAD, buffer.getvalue(), kind="checkpoint", latest=None)
    assert resolve_auto_resume(store).checkpoint["step"] == 1
    with pytest.raises(artifact.InvalidArtifact, match="nested deeper"):
        load(store, BAD)
