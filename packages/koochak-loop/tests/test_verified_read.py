"""A resume reads its checkpoint verified with no copy before restore, and still refuses a
flipped byte: the one file hashed through a mapping, then mapped by torch from the same open
file; parts each hashed as they are read."""

from __future__ import annotations

import io
import logging
import os

import pytest
import torch
from koochak.loop.checkpoint import build_checkpoint, resolve_auto_resume, save, verified_read
from koochak.loop.checkpoint.restore import restore_training_state

_SIZE = 1 << 20  # one checkpoint's tensor bytes: at the size verified_read maps


def _model(step: int) -> torch.nn.Module:
    torch.manual_seed(step)
    return torch.nn.Linear(512, 512)  # 1 MiB of weights


def _save(root, step: int, parts: int = 1) -> torch.nn.Module:
    model = _model(step)
    save(build_checkpoint(step=step, next_step=step + 1, model=model), root, parts=parts)
    return model


@pytest.fixture
def mapped_loads(monkeypatch):
    """The paths the mapped (copy-free) load was used for."""
    calls: list[str] = []
    load = verified_read.load_checkpoint_file

    def spy(path, source):
        calls.append(source)
        return load(path, source)

    monkeypatch.setattr(verified_read, "load_checkpoint_file", spy)
    return calls


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_a_one_file_checkpoint_is_mapped_verified_and_restores(tmp_path, mapped_loads):
    saved = _save(tmp_path, 3)
    path, ckpt = resolve_auto_resume(tmp_path)
    assert mapped_loads == [path]
    model = torch.nn.Linear(512, 512)
    assert restore_training_state(ckpt, model) == 4
    assert torch.equal(model.weight, saved.weight) and torch.equal(model.bias, saved.bias)
    # restore copied the weights into the model's own memory: changing them leaves the file be
    with torch.no_grad():
        model.weight.add_(1.0)
    assert torch.equal(resolve_auto_resume(tmp_path).checkpoint["model"]["weight"], saved.weight)


@pytest.mark.parametrize("where", ["header", "middle", "end"])
def test_a_flipped_byte_in_the_one_file_passes_it_over_before_torch_reads_it(
    tmp_path, caplog, mapped_loads, where
):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    newest = str(tmp_path / "step000000002.pt")
    size = os.path.getsize(newest)
    assert size >= _SIZE
    _flip(newest, {"header": 40, "middle": size // 2, "end": size - 30}[where])
    with caplog.at_level(logging.WARNING, logger="koochak"):
        path, ckpt = resolve_auto_resume(tmp_path)
    assert ckpt["step"] == 1 and path == str(tmp_path / "step000000001.pt")
    assert "step000000002.pt" in caplog.text and "SHA256" in caplog.text
    assert mapped_loads == [path]  # the damaged file never reached torch.load


def test_a_one_file_checkpoint_of_another_size_is_passed_over(tmp_path, caplog, mapped_loads):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    with open(tmp_path / "step000000002.pt", "ab") as f:
        f.write(b"\0" * 8)
    with caplog.at_level(logging.WARNING, logger="koochak"):
        assert resolve_auto_resume(tmp_path).checkpoint["step"] == 1
    assert "manifest says" in caplog.text


def test_a_flipped_byte_in_a_part_passes_the_checkpoint_over(tmp_path, caplog, mapped_loads):
    _save(tmp_path, 1, parts=2)
    saved = _save(tmp_path, 2, parts=2)
    part = sorted(p for p in os.listdir(tmp_path) if "step000000002.pt" in p and "part" in p)[1]
    _flip(str(tmp_path / part), os.path.getsize(tmp_path / part) // 2)
    with caplog.at_level(logging.WARNING, logger="koochak"):
        path, ckpt = resolve_auto_resume(tmp_path)
    assert ckpt["step"] == 1 and part in caplog.text
    assert not mapped_loads  # an index is read the general way, its parts verified as read
    _flip(str(tmp_path / part), os.path.getsize(tmp_path / part) // 2)  # repaired
    ckpt = resolve_auto_resume(tmp_path).checkpoint
    assert ckpt["step"] == 2 and torch.equal(ckpt["model"]["weight"], saved.weight)


def test_small_checkpoints_and_other_stores_take_the_general_path(tmp_path, mapped_loads):
    torch.manual_seed(0)
    save(build_checkpoint(step=0, next_step=1, model=torch.nn.Linear(3, 2)), tmp_path)
    assert resolve_auto_resume(tmp_path).checkpoint["step"] == 0
    assert not mapped_loads


@pytest.fixture
def mapped_parts(monkeypatch):
    """How many part files were mapped (rather than read into new tensors)."""
    calls: list[int] = []
    mapped = verified_read._mapped_bytes

    def spy(fd, size):
        calls.append(size)
        return mapped(fd, size)

    monkeypatch.setattr(verified_read, "_mapped_bytes", spy)
    return calls


def test_parts_are_mapped_and_every_kind_of_tensor_comes_back_exact(tmp_path, mapped_parts):
    torch.manual_seed(0)
    state = {
        "big": torch.randn(300, 700),  # split across the parts: copied out of both mappings
        "halves": torch.randn(64, 64, dtype=torch.float16),
        "odd": torch.arange(7, dtype=torch.int8),  # leaves the next tensor unaligned
        "doubles": torch.randn(33, dtype=torch.float64),
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "tied": None,
    }
    state["tied"] = state["big"]
    ckpt = build_checkpoint(step=5, next_step=6, model=torch.nn.Linear(2, 2))
    ckpt["model"] = state
    save(ckpt, tmp_path, parts=2)
    loaded = resolve_auto_resume(tmp_path).checkpoint
    assert len(mapped_parts) == 2
    for key, value in state.items():
        got = loaded["model"][key]
        assert got.dtype == value.dtype and got.shape == value.shape and torch.equal(got, value)
    assert loaded["model"]["tied"] is loaded["model"]["big"]
    got = loaded["model"]["halves"]
    got.add_(1)  # the mapping is private: changing a loaded tensor leaves the part file be
    again = resolve_auto_resume(tmp_path).checkpoint["model"]["halves"]
    assert torch.equal(again, state["halves"])


def test_a_part_of_another_size_is_refused_naming_it(tmp_path, caplog, mapped_parts):
    _save(tmp_path, 1, parts=2)
    _save(tmp_path, 2, parts=2)
    part = sorted(p for p in os.listdir(tmp_path) if "step000000002.pt" in p and "part" in p)[0]
    with open(tmp_path / part, "ab") as f:
        f.write(b"\0")
    with caplog.at_level(logging.WARNING, logger="koochak"):
        assert resolve_auto_resume(tmp_path).checkpoint["step"] == 1
    assert f"part {part} has" in caplog.text and "the index says" in caplog.text


class _WrappedOpen:
    """A store with local files whose ``open`` returns a wrapper, not the file (a test store
    that injects faults into reads, say)."""

    def __init__(self, root):
        from koochak.storage.store import LocalStore

        self.inner = LocalStore(root)
        self.location = self.inner.location

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def open(self, key):
        return io.BytesIO(self.inner.get(key))


def test_a_store_whose_open_is_not_a_plain_file_is_read_through_it(
    tmp_path, mapped_loads, mapped_parts
):
    """A wrapper is honoured: its local path is not used to map."""
    _save(tmp_path / "one", 1)
    saved = _save(tmp_path / "parts", 2, parts=2)
    for root, step in ((tmp_path / "one", 1), (tmp_path / "parts", 2)):
        store = _WrappedOpen(root)
        assert store.local_path("x") is not None
        assert resolve_auto_resume(store).checkpoint["step"] == step
    assert not mapped_loads and not mapped_parts
    ckpt = resolve_auto_resume(_WrappedOpen(tmp_path / "parts")).checkpoint
    assert torch.equal(ckpt["model"]["weight"], saved.weight)


def test_a_throttled_tier_is_read_once(tmp_path, monkeypatch, mapped_loads):
    """Resuming from a slow durable tier moves each byte of the checkpoint across its link
    once (a probe for a mappable file once read the whole object before the real read)."""
    from koochak.storage.store import LocalStore
    from koochak.storage.testing import ThrottledStore

    _save(tmp_path, 1)
    size = os.path.getsize(tmp_path / "step000000001.pt")
    moved = []
    store = ThrottledStore(LocalStore(tmp_path), 1e12, sleep=lambda s: None)
    monkeypatch.setattr(store, "_transfer", lambda link, n: moved.append(n))
    assert store.local_path("step000000001.pt") is None
    assert resolve_auto_resume(store).checkpoint["step"] == 1
    assert not mapped_loads
    assert size <= sum(moved) < size + 64 * 1024  # the object once, plus its small manifest


def test_a_file_system_that_cannot_map_is_read_the_general_way(tmp_path, monkeypatch, caplog):
    one = _save(tmp_path / "one", 1)
    parts = _save(tmp_path / "parts", 2, parts=2)

    def refuse(*args, **kwargs):
        raise OSError(19, "No such device")  # ENODEV: what mmap says on FUSE with direct I/O

    def refuse_torch(fd, size):
        raise RuntimeError("unable to mmap")

    monkeypatch.setattr(verified_read.mmap, "mmap", refuse)
    monkeypatch.setattr(verified_read, "_mapped_bytes", refuse_torch)
    with caplog.at_level(logging.WARNING, logger="koochak"):
        first = resolve_auto_resume(tmp_path / "one").checkpoint
        second = resolve_auto_resume(tmp_path / "parts").checkpoint
    assert torch.equal(first["model"]["weight"], one.weight)
    assert torch.equal(second["model"]["weight"], parts.weight)
    assert "skipping" not in caplog.text
