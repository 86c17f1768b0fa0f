"""koochak-export: the console script, the model config beside the weights, and safetensors
streamed with bounded memory (issue 29, item 10)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import weakref

import numpy as np
import pytest
import torch
import yaml
from koochak.loop.checkpoint import safetensors_out, save
from koochak.loop.checkpoint.export import export_weights, main

safetensors_torch = pytest.importorskip("safetensors.torch")

CONFIG = {"model": {"width": 16, "classes": 3}, "entry": {"model": "examples.tiny:make_model"},
          "train": {"lr": 0.1}}  # fmt: skip


@pytest.fixture
def run(tmp_path, make_ckpt):
    ckpt = make_ckpt(4)
    ckpt["config"] = CONFIG
    save(ckpt, tmp_path / "run")
    return tmp_path / "run", ckpt


def test_the_console_script_is_the_export_command():
    (script,) = importlib.metadata.entry_points(group="console_scripts", name="koochak-export")
    assert script.load() is main


@pytest.mark.slow
def test_python_dash_m_runs_without_the_runpy_warning(tmp_path):
    result = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "koochak.loop.checkpoint.export",
         str(tmp_path / "none"), str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "RuntimeWarning" not in result.stderr
    assert "no valid published checkpoint" in result.stderr


def test_the_model_config_goes_beside_the_weights(run, tmp_path):
    location, ckpt = run
    publication = export_weights(location, tmp_path / "out")
    doc = yaml.safe_load((tmp_path / "out" / "model.yaml").read_text())
    assert doc["model"] == CONFIG["model"] and doc["entry"] == CONFIG["entry"]
    assert doc["weights"] == "model.pt" and doc["step"] == 4
    assert (tmp_path / "out" / "model.yaml.ready.json").exists()
    # What inference does: build the model from the section, load the weights.
    model = torch.nn.Sequential(torch.nn.Linear(doc["model"]["width"], doc["model"]["width"]),
                                torch.nn.Linear(doc["model"]["width"], doc["model"]["classes"]))
    model.load_state_dict(torch.load(publication.path, weights_only=True))


def test_a_checkpoint_without_a_config_exports_its_weights_alone(tmp_path, make_ckpt, caplog):
    ckpt = make_ckpt(1)
    ckpt["config"] = None
    save(ckpt, tmp_path / "run")
    export_weights(tmp_path / "run", tmp_path / "out")
    assert "recorded no config" in caplog.text
    assert sorted(os.listdir(tmp_path / "out")) == ["model.pt", "model.pt.ready.json"]


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_safetensors_round_trip(run, tmp_path, dtype):
    location, ckpt = run
    assert main([str(location), str(tmp_path / "out"), "--format", "safetensors"]
                + (["--dtype", dtype] if dtype else [])) == 0  # fmt: skip
    path = tmp_path / "out" / "model.safetensors"
    loaded = safetensors_torch.load_file(str(path))
    want = torch.bfloat16 if dtype else torch.float32
    assert loaded.keys() == ckpt["model"].keys()
    for key, value in ckpt["model"].items():
        assert loaded[key].dtype == want and torch.equal(loaded[key], value.to(want))
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata()["koochak_step"] == "4"
    assert (tmp_path / "out" / "model.yaml").exists()


def test_safetensors_keeps_every_dtype_and_odd_shapes(tmp_path):
    state = {
        "a": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "b": torch.tensor([True, False]),
        "c": torch.randn(3, 4).t(),  # not contiguous
        "d": torch.zeros(0, 5),
        "e": torch.tensor(2.5, dtype=torch.float64),
        "f": torch.randn(5, dtype=torch.float16),
    }
    raw = b"".join(bytes(c) for c in safetensors_out.safetensors_chunks(state))
    loaded = safetensors_torch.load(raw)
    for key, value in state.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value)


def test_the_safetensors_writer_holds_one_piece_at_a_time(tmp_path, monkeypatch):
    """Casting: each tensor goes in pieces, and a piece is freed once the consumer asks for the
    next one, so at most two pieces (the writer's and the consumer's) live at once, however big
    the state. Tensors of the target dtype go out as views of themselves (no copy at all)."""
    monkeypatch.setattr(safetensors_out, "PIECE_ELEMENTS", 1000)
    state = {f"w{i}": torch.randn(10_000 + i) for i in range(4)}
    state["ints"] = torch.arange(5000)  # not cast: a view of the tensor itself
    sources = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in state.values()]
    live: list[tuple[weakref.ref, int]] = []
    peak = 0
    copies = views = 0
    stream = safetensors_out.safetensors_chunks(state, dtype=torch.bfloat16)
    next(stream)  # the header
    for chunk in stream:  # refcounts free a piece at once (no cycles): no gc.collect needed
        address = np.frombuffer(chunk, dtype=np.uint8).ctypes.data if chunk.nbytes else 0
        if any(lo <= address < hi for lo, hi in sources):
            views += 1
        else:
            copies += 1
            live.append((weakref.ref(chunk.obj), chunk.nbytes))
        peak = max(peak, sum(size for ref, size in live if ref() is not None))
        del chunk
    assert copies == sum(-(-t.numel() // 1000) for t in list(state.values())[:4]) and views == 1
    assert peak <= 2 * 1000 * 2  # two bf16 pieces of 1000 elements


def test_without_the_package_the_error_is_one_line_naming_the_extra(run, tmp_path, monkeypatch,
                                                                   capsys):  # fmt: skip
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import safetensors -> ImportError
    location, _ = run
    assert main([str(location), str(tmp_path / "out"), "--format", "safetensors"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "koochak-loop[safetensors]" in err
    assert not (tmp_path / "out").exists()


def test_a_reserved_safetensors_name_is_refused_in_one_line_before_anything_is_written(
    tmp_path, make_ckpt, capsys
):
    ckpt = make_ckpt(4)
    ckpt["model"]["__metadata__"] = torch.zeros(2)
    save(ckpt, tmp_path / "run")
    for _ in range(2):  # and again: never a good export the second time
        assert main([str(tmp_path / "run"), str(tmp_path / "out"), "--format", "safetensors"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "'__metadata__'" in err and "reserved" in err, err
        assert not (tmp_path / "out" / "model.safetensors").exists()
    with pytest.raises(ValueError, match="reserved by the safetensors format"):
        list(safetensors_out.safetensors_chunks({"__metadata__": torch.zeros(1)}))


def test_a_committed_export_that_does_not_read_back_is_never_reported_as_good(
    run, tmp_path, monkeypatch, capsys
):
    """An export committed by an older Koochak that did not check it (an unreadable file with
    its ready manifest): the same export again must not exit 0 and call it good."""
    location, _ = run
    real = safetensors_out.safetensors_chunks

    def torn(state, **kwargs):  # the header of a file cut short: committed, then unreadable
        chunks = real(state, **kwargs)
        yield bytes(next(chunks))

    monkeypatch.setattr("koochak.loop.checkpoint.export.safetensors_chunks", torn)
    with pytest.raises(ValueError, match="does not read back as safetensors.*withdrawn"):
        export_weights(location, tmp_path / "out", format="safetensors")
    assert not (tmp_path / "out" / "model.safetensors.ready.json").exists()
    monkeypatch.setattr("koochak.loop.checkpoint.export.check_written", lambda *a: None)
    export_weights(location, tmp_path / "out", format="safetensors")  # the old, unchecked way
    monkeypatch.undo()
    assert main([str(location), str(tmp_path / "out"), "--format", "safetensors"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not read back" in err and "--replace" in err, err
    out = tmp_path / "out"
    assert main([str(location), str(out), "--format", "safetensors", "--replace"]) == 0
    assert safetensors_torch.load_file(str(out / "model.safetensors")).keys()
