"""The layout contract with a back door (issue 36): every layout, damaged behind its back.

Each fixture writes a tiny checkpoint through one layout (one file, parts, sharded on one gloo
rank, and a sharded head of two writers the fixture writes itself), twice: step 1, then step 2.
The tests then damage step 2's objects directly in the store (flip a byte, truncate, delete, drop
the ready manifest, leave a dead publisher's objects) and check that the layout's read, verify
and objects, and both selections (one process, and the collective one FSDP runs), react as the
contract in ``koochak.loop.checkpoint.layouts`` says. In-process, in seconds; a fourth layout is
one more entry in ``LAYOUTS``. The end-to-end matrix is test_layout_conformance.py.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch
from koochak.loop.checkpoint import build_checkpoint, checkpoint_name, load, publish
from koochak.loop.checkpoint import layouts as layouts_module
from koochak.loop.checkpoint.layouts import layout_of, verify_published
from koochak.loop.checkpoint.layouts.one_file import ONE_FILE
from koochak.loop.checkpoint.layouts.parts import PARTS
from koochak.loop.checkpoint.layouts.sharded import SHARDED
from koochak.loop.checkpoint.resume import resolve_auto_resume
from koochak.loop.checkpoint.selection import resolve_sharded
from koochak.loop.checkpoint.tiers import replicate_checkpoint
from koochak.storage import _publish_intent, artifact
from koochak.storage.store import LocalStore

ROWS = 8


def _ckpt(step: int) -> dict:
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(4, ROWS), torch.nn.Linear(ROWS, 3))
    return build_checkpoint(step=step, next_step=step + 1, model=model)


def _save_one_file(store, step):
    ckpt = _ckpt(step)
    publish(store, checkpoint_name(step), ckpt)
    return ckpt


def _save_parts(store, step):
    ckpt = _ckpt(step)
    publish(store, checkpoint_name(step), ckpt, parts=3)
    return ckpt


def _save_sharded(store, step):
    """The real sharded writer on one gloo rank (a version-2 head of one writer)."""
    from koochak.loop.checkpoint.layouts.sharded import save_sharded

    ckpt = _ckpt(step)
    save_sharded(store, checkpoint_name(step), ckpt)
    return ckpt


def _save_two_writers(store, step):
    """A version-2 head of two writers, each holding half the rows of one tensor, written by
    hand (what two ranks' fragments and the coordinator's head would be)."""
    from koochak.loop.checkpoint.index_fragments import (
        FragmentRef,
        encode_fragment,
        encode_head,
        fragment_key,
    )
    from koochak.loop.checkpoint.parts_index import part_key
    from koochak.loop.checkpoint.parts_tree import TENSOR_TAG, skeleton_bytes

    name = checkpoint_name(step)
    rows = torch.arange(ROWS * 4, dtype=torch.float32).reshape(ROWS, 4) + step
    refs = []
    for writer in range(2):
        half = ROWS // 2
        raw = rows[half * writer : half * (writer + 1)].numpy().tobytes()
        sha = store.put(part_key(name, writer, 0), raw).sha256
        fragment = encode_fragment(name, writer, [(part_key(name, writer, 0), len(raw), sha)],
                                   [], [(0, [(0, 0, len(raw))])])  # fmt: skip
        info = store.put(fragment_key(name, writer), fragment)
        refs.append(FragmentRef(fragment_key(name, writer), writer, len(fragment), info.sha256, 1))
    ckpt = build_checkpoint(step=step, next_step=step + 1, model=torch.nn.Linear(4, ROWS))
    ckpt["model"] = {"weight": rows}
    skeleton = skeleton_bytes({**ckpt, "model": {"weight": (TENSOR_TAG, 0)}})
    publish(store, name, encode_head(name, 2, [("float32", (ROWS, 4), "rows")], refs, skeleton))
    return ckpt


# name -> (writer, the layout its head must be read by, whether it runs the real writer)
LAYOUTS = {
    "one file": (_save_one_file, ONE_FILE, True),
    "parts": (_save_parts, PARTS, True),
    "sharded": (_save_sharded, SHARDED, True),
    "sharded, two writers": (_save_two_writers, SHARDED, False),
}
WRITERS = [name for name, (_, _, real) in LAYOUTS.items() if real]


@pytest.fixture
def one_rank(tmp_path):
    """One gloo rank: the collective selection (and the sharded writer) run as on a cluster."""
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    yield
    torch.distributed.destroy_process_group()


@pytest.fixture(params=list(LAYOUTS))
def written(request, tmp_path, one_rank):
    """``(store, layout, {step: saved checkpoint})``: steps 1 and 2 through one layout."""
    save, layout, _ = LAYOUTS[request.param]
    store = LocalStore(str(tmp_path / "tier"))
    return store, layout, {step: save(store, step) for step in (1, 2)}


NAME = checkpoint_name(2)


def _same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        for x, y in zip(a, b):
            _same(x, y)


def _selected(store, passed=None):
    """The step each selection picks: one process (resume), then every rank together (FSDP)."""
    found = resolve_auto_resume(store, passed)
    together = resolve_sharded(store)
    steps = (found and found.checkpoint["step"], together and together[1]["step"])
    assert steps[0] == steps[1], steps
    return steps[0]


def _others(store, layout):
    """Step 2's objects other than its head and manifest (parts, fragments), by its head."""
    head = store.get(NAME)
    return [k for k in layout.objects(NAME, head) if k not in (NAME, NAME + artifact.READY_SUFFIX)]


# -------------------------------------------------------------------------- undamaged


def test_the_head_names_its_layout_and_every_object_and_reads_back(written):
    store, layout, saved = written
    head = store.get(NAME)
    assert layout_of(head) is layout
    keys = layout.objects(NAME, head)
    assert keys[-2:] == [NAME, NAME + artifact.READY_SUFFIX]  # the commit comes last
    on_disk = {info.key for info in store.list(NAME)}
    assert on_disk == set(keys)  # nothing stored that the head does not name, nothing missing
    _same(saved[2], layout.read(store, NAME, head, "here"))
    _same(saved[2], load(store, NAME))
    verify_published(store, NAME)
    assert _selected(store) == 2


def test_receipts_name_every_object_but_the_head_and_no_remote_writers(written):
    store, layout, _ = written
    head = store.get(NAME)
    local, expected = layout.receipts(store, NAME, head, "here")
    assert expected == {} and {key for key, _, _ in local} == set(_others(store, layout))
    for key, size, _ in local:
        assert store.stat(key).size == size
    if any(".part-00001-" in key for key in _others(store, layout)):  # writer 1 copies its own
        local, expected = layout.receipts(store, NAME, head, "here", remote={1})
        assert set(expected) == {1} and all(".part-00001-" not in key for key, _, _ in local)


def test_a_copy_to_another_tier_moves_the_objects_in_commit_order(written, tmp_path):
    store, layout, saved = written
    replica = LocalStore(str(tmp_path / "replica"))
    replicate_checkpoint(store, replica, NAME)
    assert {info.key for info in replica.list(NAME)} == set(layout.objects(NAME, store.get(NAME)))
    verify_published(replica, NAME)
    assert resolve_auto_resume(replica).checkpoint["step"] == 2


# -------------------------------------------------------------------------- damaged


def _flip(store, key):
    path = Path(store.local_path(key))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(store, key):
    path = Path(store.local_path(key))
    path.write_bytes(path.read_bytes()[:-1])


DAMAGES = {"flip a byte": _flip, "truncate": _truncate, "delete": lambda s, k: s.delete(k)}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_part_or_fragment_fails_verify_and_selection_falls_back(written, damage):
    store, layout, _ = written
    others = _others(store, layout)
    if not others:
        pytest.skip("one file: the head is the only object (the next test damages it)")
    for key in others:
        before = Path(store.local_path(key)).read_bytes()
        DAMAGES[damage](store, key)
        with pytest.raises((ValueError, FileNotFoundError)):
            verify_published(store, NAME)
        passed = []
        assert _selected(store, passed) == 1, key
        assert [p["step"] for p in passed] == [2] and p_names(passed, key)
        Path(store.local_path(key)).write_bytes(before)  # mended for the next object
        assert _selected(store) == 2


def p_names(passed, key):
    """Whether the reason a candidate was passed over names the damaged object (a head that
    no longer matches its manifest is named by the head, whichever object it was)."""
    return any(key in p["why"] or NAME in p["why"] for p in passed)


@pytest.mark.parametrize("damage", ["flip a byte", "truncate"])
def test_a_damaged_head_fails_its_manifest_and_selection_falls_back(written, damage):
    store, layout, _ = written
    DAMAGES[damage](store, NAME)
    with pytest.raises(artifact.InvalidArtifact):
        verify_published(store, NAME)
    assert _selected(store) == 1


def test_without_its_ready_manifest_a_checkpoint_does_not_exist(written):
    store, layout, _ = written
    keys = layout.objects(NAME, store.get(NAME))
    store.delete(NAME + artifact.READY_SUFFIX)
    assert _selected(store) == 1
    with pytest.raises((FileNotFoundError, ValueError)):
        verify_published(store, NAME)
    assert layouts_module.objects(store, NAME) == keys  # named by the head alone, not listed


# -------------------------------------------------------------------------- ownership


def _leave_dead_publishers_objects(store, layout, tmp_path, *, deadline):
    """Step 2 written elsewhere and copied in without its manifest, plus its publisher's intent
    record: what a publisher killed just before its commit leaves."""
    scratch = LocalStore(str(tmp_path / "scratch"))
    save, _, _ = next(v for v in LAYOUTS.values() if v[1] is layout and v[2])
    save(scratch, 2)
    keys = layout.objects(NAME, scratch.get(NAME))[:-1]
    for key in keys:
        store.put(key, scratch.get(key))
    intent = dataclasses.replace(_publish_intent.ours(NAME), deadline=deadline)
    store.put(NAME + _publish_intent.INTENT_SUFFIX, intent.to_bytes())
    return keys


@pytest.fixture(params=WRITERS)
def empty(request, tmp_path, one_rank):
    save, layout, _ = LAYOUTS[request.param]
    return LocalStore(str(tmp_path / "tier")), layout, save


def test_a_dead_publishers_objects_are_cleared_when_the_name_is_taken_over(empty, tmp_path):
    store, layout, save = empty
    _leave_dead_publishers_objects(store, layout, tmp_path, deadline=time.time() - 10 * 3600)
    saved = save(store, 2)
    assert {info.key for info in store.list(NAME)} == set(layout.objects(NAME, store.get(NAME)))
    _same(saved, load(store, NAME))


def test_a_live_publishers_objects_are_never_touched(empty, tmp_path):
    store, layout, save = empty
    keys = _leave_dead_publishers_objects(store, layout, tmp_path, deadline=time.time() + 3600)
    before = {key: store.get(key) for key in keys}
    with pytest.raises((FileExistsError, RuntimeError), match="FileExistsError|being published"):
        save(store, 2)
    assert {key: store.get(key) for key in keys} == before


class _Counting(LocalStore):
    lists: list[str] = []

    def list(self, prefix=""):
        self.lists.append(prefix)
        return super().list(prefix)

    def list_shallow(self, prefix, delimiter):
        self.lists.append(prefix)
        return super().list_shallow(prefix, delimiter)


def test_a_save_of_a_free_name_lists_nothing(empty, tmp_path):
    _, layout, save = empty
    store = _Counting(str(tmp_path / "counted"))
    store.lists = []
    save(store, 2)
    assert store.lists == []  # a claim that took nothing over clears nothing


class _Unreadable(LocalStore):
    """A first tier whose copy of step 2's head fails with EIO (a failing disk or mount)."""

    def get(self, key, *args):
        if key == NAME:
            raise OSError(5, "Input/output error", key)
        return super().get(key, *args)


def test_an_io_error_in_one_tier_reads_the_same_step_from_another(written, tmp_path):
    """Both selections walk the tiers the same way (selection.walk): a copy that fails with an
    I/O error is passed over for the same step in the next tier, never for an older step."""
    store, layout, saved = written
    replica = LocalStore(str(tmp_path / "replica"))
    replicate_checkpoint(store, replica, NAME)
    first = _Unreadable(store.location)
    passed = []
    found = resolve_auto_resume([first, replica], passed)
    assert found.checkpoint["step"] == 2 and found.path.startswith(replica.location)
    assert [(p["tier"], p["step"]) for p in passed] == [(0, 2)]
    path, _ = resolve_sharded([first, replica])
    assert path.startswith(replica.location)
    with pytest.raises(OSError, match="Input/output error"):  # one tier: raised, no step back
        resolve_sharded(first)
