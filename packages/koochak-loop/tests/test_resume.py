"""Publication and selection: only fully published, verified checkpoints are resume evidence."""

from __future__ import annotations

import errno
import io
import json
import logging
import os

import pytest
import torch
from koochak.loop.checkpoint import (
    best,
    build_checkpoint,
    checkpoint_store,
    highest_valid_published,
    latest,
    load,
    match_state_dict_to_model,
    publish,
    resolve_auto_resume,
    save,
    serialize_checkpoint,
)
from koochak.storage.store import LocalStore, register_store


def _ckpt(step: int, *, reason: str = "periodic", loss: float | None = None) -> dict:
    torch.manual_seed(step)
    model = torch.nn.Linear(3, 2)
    return build_checkpoint(
        step=step,
        next_step=step + 1 if reason == "periodic" else step,
        reason=reason,
        model=model,
        metrics={"loss": loss if loss is not None else 1.0 / (step + 1)},
    )


class FaultyStore(LocalStore):
    """A LocalStore that raises chosen OSErrors per key, as a flaky object-storage mount would."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.fail_get: dict[str, int] = {}
        self.fail_put: dict[str, int] = {}

    def _maybe_fail(self, failures: dict[str, int], key: str) -> None:
        if key in failures:
            raise OSError(failures[key], os.strerror(failures[key]), key)

    def get(self, key, start=None, end=None):
        self._maybe_fail(self.fail_get, key)
        return super().get(key, start, end)

    def open(self, key):
        self._maybe_fail(self.fail_get, key)
        return super().open(key)

    def put(self, key, data, **expected):
        self._maybe_fail(self.fail_put, key)
        return super().put(key, data, **expected)


def _publish_steps(location, steps) -> None:
    for step in steps:
        save(_ckpt(step), location)


def _rewrite(path: str, data: bytes) -> None:
    os.chmod(path, 0o644)
    with open(path, "wb") as f:
        f.write(data)


def test_save_publishes_with_a_manifest_and_latest_link(tmp_path):
    publication = save(_ckpt(4), tmp_path)
    assert publication.key == "step000000004.pt"
    assert publication.artifact_id == "checkpoint/step000000004.pt"
    assert (tmp_path / "step000000004.pt.ready.json").exists()
    assert os.path.islink(tmp_path / "latest.pt")
    assert latest(tmp_path) == str(tmp_path / "latest.pt")
    path, ckpt = resolve_auto_resume(tmp_path)
    assert path == str(tmp_path / "step000000004.pt")
    assert (ckpt["step"], ckpt["next_step"]) == (4, 5)
    assert highest_valid_published(tmp_path) == path
    assert load(path)["step"] == 4


def test_nothing_published_starts_fresh(tmp_path):
    assert resolve_auto_resume(tmp_path / "new") is None
    assert highest_valid_published(tmp_path / "new") is None
    assert latest(tmp_path / "new") is None


def test_save_to_a_file_path_and_terminal_cursor(tmp_path):
    save(_ckpt(10, reason="terminal"), str(tmp_path / "run" / "step000000010.pt"))
    path, ckpt = resolve_auto_resume(tmp_path / "run")
    assert path.endswith("step000000010.pt") and ckpt["next_step"] == 10


def test_keep_last_k_prunes_older_pairs(tmp_path):
    for step in range(5):
        save(_ckpt(step), tmp_path, keep_last_k=2)
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert names == [
        "latest.pt",
        "step000000003.pt",
        "step000000003.pt.ready.json",
        "step000000004.pt",
        "step000000004.pt.ready.json",
    ]


def test_exclusive_store_gets_no_latest_link(tmp_path):
    store = LocalStore(tmp_path, publish="exclusive")
    save(_ckpt(1), store)
    assert not os.path.lexists(tmp_path / "latest.pt")
    assert latest(store) == str(tmp_path / "step000000001.pt")


def test_best_picks_the_lowest_metric(tmp_path):
    for step, loss in [(0, 0.5), (1, 0.2), (2, 0.9)]:
        save(_ckpt(step, loss=loss), tmp_path)
    assert best(tmp_path, "loss") == str(tmp_path / "step000000001.pt")
    assert best(tmp_path, "missing") is None


def _truncate(path, data):
    _rewrite(path, data[: len(data) // 2])


def _flip_bit(path, data):
    flipped = bytearray(data)
    flipped[len(flipped) // 2] ^= 0x01
    _rewrite(path, bytes(flipped))


def _grow(path, data):
    _rewrite(path, data + b"\0" * 16)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [(_truncate, "manifest says"), (_flip_bit, "sha256"), (_grow, "manifest says")],
    ids=["truncated", "bit-flipped", "wrong-size"],
)
def test_damaged_newest_falls_back_with_a_logged_reason(tmp_path, caplog, damage, reason):
    _publish_steps(tmp_path, [0, 1, 2])
    newest = str(tmp_path / "step000000002.pt")
    with open(newest, "rb") as f:
        data = f.read()
    damage(newest, data)
    with caplog.at_level(logging.INFO):
        path, ckpt = resolve_auto_resume(tmp_path)
    assert ckpt["step"] == 1 and path.endswith("step000000001.pt")
    logged = caplog.text.lower()
    assert "step000000002.pt" in logged and reason in logged


def test_manifest_less_checkpoint_is_not_evidence(tmp_path, caplog):
    _publish_steps(tmp_path, [0, 1])
    os.remove(tmp_path / "step000000001.pt.ready.json")
    with caplog.at_level(logging.INFO):
        assert resolve_auto_resume(tmp_path)[1]["step"] == 0
    assert "step000000001.pt: no ready manifest" in caplog.text


def test_latest_link_and_stray_files_never_count(tmp_path):
    _publish_steps(tmp_path, [0])
    (tmp_path / "step000000009.pt").write_bytes(serialize_checkpoint(_ckpt(9)))
    (tmp_path / "step000000010.pt").mkdir()
    assert resolve_auto_resume(tmp_path)[1]["step"] == 0


def test_wrong_cursor_is_skipped_with_a_reason(tmp_path, caplog):
    _publish_steps(tmp_path, [0])
    store = checkpoint_store(tmp_path)
    # A valid, verified payload published under a name that disagrees with its cursor.
    publish(store, "step000000007.pt", serialize_checkpoint(_ckpt(3)))
    with caplog.at_level(logging.INFO):
        assert resolve_auto_resume(tmp_path)[1]["step"] == 0
    assert "file name says 7" in caplog.text


class _RunsCode:
    def __reduce__(self):
        return (exec, ("raise SystemExit('code ran')",))


def test_published_payload_with_code_is_skipped_not_run(tmp_path, caplog):
    _publish_steps(tmp_path, [0])
    evil = {"version": 1, "step": 1, "next_step": 2, "model": {}, "metrics": _RunsCode()}
    buffer = io.BytesIO()
    torch.save(evil, buffer)
    publish(checkpoint_store(tmp_path), "step000000001.pt", buffer.getvalue())
    with caplog.at_level(logging.INFO):
        assert resolve_auto_resume(tmp_path)[1]["step"] == 0
    assert "weights-only" in caplog.text


def test_eio_on_the_newest_raises_instead_of_rolling_back(tmp_path):
    _publish_steps(tmp_path, [0, 1])
    store = FaultyStore(tmp_path)
    store.fail_get["step000000001.pt"] = errno.EIO
    with pytest.raises(OSError) as info:
        resolve_auto_resume(store)
    assert info.value.errno == errno.EIO


def test_full_disk_during_publication_keeps_the_previous_checkpoint(tmp_path):
    store = FaultyStore(tmp_path)
    save(_ckpt(0), store)
    store.fail_put["step000000001.pt"] = errno.ENOSPC
    with pytest.raises(OSError) as info:
        save(_ckpt(1), store)
    assert info.value.errno == errno.ENOSPC
    path, ckpt = resolve_auto_resume(store)
    assert ckpt["step"] == 0 and path.endswith("step000000000.pt")
    assert not (tmp_path / "step000000001.pt.ready.json").exists()


def test_scheme_uri_location_and_load(tmp_path):
    register_store("ckpttest", lambda rest: LocalStore(tmp_path / rest))
    save(_ckpt(2), "ckpttest://runs/a")
    path, ckpt = resolve_auto_resume("ckpttest://runs/a")
    assert ckpt["step"] == 2
    assert load("ckpttest://runs/a/step000000002.pt")["step"] == 2
    assert load("ckpttest://runs/a", "step000000002.pt")["step"] == 2
    manifest = json.loads((tmp_path / "runs/a/step000000002.pt.ready.json").read_text())
    assert "checkpoint/step000000002.pt" in json.dumps(manifest)


def test_disk_filling_up_mid_write_keeps_the_previous_checkpoint(tmp_path):
    from koochak.storage.testing import Fault
    from koochak.storage.testing import FaultyStore as SyscallFaultyStore

    big = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    first = build_checkpoint(step=0, next_step=1, model=big)
    second = build_checkpoint(step=1, next_step=2, model=big)
    store = SyscallFaultyStore(tmp_path)
    save(first, store)
    writes = store.calls["write"]
    store = SyscallFaultyStore(tmp_path, [Fault("write", nth=2, errno=errno.ENOSPC)])
    with pytest.raises(OSError) as info:
        save(second, store)
    assert info.value.errno == errno.ENOSPC and writes > 2
    path, ckpt = resolve_auto_resume(tmp_path)
    assert ckpt["step"] == 0
    # Nothing of the failed step is left, not even its hidden temp file.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step000000000.pt",
        "step000000000.pt.ready.json",
    ]


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


def test_every_spec_helper_takes_a_directory_a_uri_and_a_store(location):
    where, root, links = location
    assert checkpoint_store(where).local_path("x") == str(root / "x")
    first = publish(where, "step000000000.pt", _ckpt(0, loss=0.5), keep_last_k=2)  # a dict
    assert first.artifact_id == "checkpoint/step000000000.pt"
    data = serialize_checkpoint(_ckpt(1, loss=0.1))  # bytes this time, through the Store itself
    publish(checkpoint_store(where), "step000000001.pt", data, keep_last_k=2)
    save(_ckpt(2, loss=0.3), where, keep_last_k=2)
    published = sorted(p.name for p in root.iterdir() if p.name.endswith(".ready.json"))
    assert published == ["step000000001.pt.ready.json", "step000000002.pt.ready.json"]
    newest = str(root / "step000000002.pt")
    assert os.path.islink(root / "latest.pt") == links  # only directory (link-mode) stores
    assert latest(where) == (str(root / "latest.pt") if links else newest)
    assert highest_valid_published(where) == newest
    path, ckpt = resolve_auto_resume(where)
    assert path == newest and (ckpt["step"], ckpt["next_step"]) == (2, 3)
    assert best(where, "loss") == str(root / "step000000001.pt")
    assert load(newest)["step"] == 2 and load(where, "step000000001.pt")["step"] == 1
    if not isinstance(where, str):
        with pytest.raises(TypeError, match="needs the object's name"):
            load(where)
    model = torch.nn.Linear(3, 2)
    model.load_state_dict(match_state_dict_to_model(model, ckpt["model"]))


def test_looking_in_a_missing_directory_finds_nothing_and_creates_nothing(tmp_path):
    from koochak.loop.checkpoint import highest_valid_published, resolve_auto_resume

    missing = tmp_path / "not" / "yet"
    assert resolve_auto_resume(missing) is None
    assert highest_valid_published(str(missing)) is None
    assert not (tmp_path / "not").exists()


def test_every_resume_helper_answers_path_then_checkpoint(tmp_path):
    from koochak.loop.checkpoint import ResumePoint
    from koochak.loop.checkpoint.resume import resume_checkpoint

    save(_ckpt(3), tmp_path)
    found = resolve_auto_resume(tmp_path)
    assert isinstance(found, ResumePoint) and found.path == str(tmp_path / "step000000003.pt")
    assert found.checkpoint["step"] == 3 and tuple(found) == (found.path, found.checkpoint)
    # training_loop's own lookup: the same record, the same order.
    path, ckpt = resume_checkpoint("auto", tmp_path)
    assert (path, ckpt["step"]) == (found.path, 3)
    given = resume_checkpoint(None, tmp_path, found.checkpoint, found.path)
    assert given.path == found.path and given.checkpoint is not found.checkpoint  # a copy
    assert resume_checkpoint("none", tmp_path) is None
    assert resume_checkpoint("auto", tmp_path / "empty") is None


@pytest.mark.parametrize("old", ["checkpoint_format", "publish", "resume", "checkpoint_saver"])
def test_the_0_2_checkpoint_module_paths_are_gone_in_0_4(old):
    """Deprecated in 0.3 with a warning that promised it; docs/migrating.md maps each name."""
    import importlib
    import sys

    sys.modules.pop(f"koochak.loop.{old}", None)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"koochak.loop.{old}")
