"""Progress, ETA, tokens/s and MFU in every logged row (issue 29, item 3)."""

from __future__ import annotations

import pytest
import torch
from koochak.loop import mfu, training_loop
from koochak.loop.config import resolve_train_config
from koochak.loop.hooks import emit
from koochak.loop.throughput import make_throughput_hooks

PEAK = 1e9  # a CPU "measured" peak, pinned so the figures are exact


@pytest.fixture(autouse=True)
def pinned_cpu_peak(monkeypatch):
    monkeypatch.setattr(mfu, "cpu_peak_flops", lambda dtype="fp32", seconds=0.2: PEAK)


def _data(batches=6):
    gen = torch.Generator().manual_seed(0)
    for _ in range(batches):
        x = torch.randn(4, 3, generator=gen)
        yield x, x.sum(1, keepdim=True)


def _run(tmp_path, step_fn, **train):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    rows = []
    cfg = {"max_steps": 6, "log_every": 2, "device": "cpu", "out_dir": str(tmp_path), **train}
    training_loop(model=model, dataset=_data(12), step_fn=step_fn, resume="none",
                  optimizer=torch.optim.SGD(model.parameters(), lr=0.01), train_cfg=cfg,
                  hooks={"on_log": [lambda info: rows.append(dict(info["metrics"]))]})  # fmt: skip
    return model, rows


def _with_tokens(model, batch, ctx):
    x, y = batch
    return {"loss": torch.nn.functional.mse_loss(model(x), y), "tokens": 12}


def _plain(model, batch, ctx):
    x, y = batch
    return {"loss": torch.nn.functional.mse_loss(model(x), y)}


def test_every_row_has_progress_eta_tokens_and_measured_mfu(tmp_path):
    model, rows = _run(tmp_path, _with_tokens, grad_accum=2)
    assert [row["progress"] for row in rows] == [2 / 6, 4 / 6, 1.0]
    assert all(isinstance(value, float) for row in rows for value in row.values())
    assert rows[-1]["eta_s"] == 0 and all(row["eta_s"] >= 0 for row in rows)
    for row in rows:
        assert row["tokens_per_s"] == pytest.approx(12 * 2 / row["step_time_s"])
        # Linear(3, 1) on 4 rows: 2*4*3 forward FLOPs; an update is 3x forward x grad_accum 2.
        assert row["mfu"] == pytest.approx(3 * 24 * 2 / row["step_time_s"] / PEAK)
    assert not model._forward_pre_hooks and not model._forward_hooks  # unhooked after one


def test_stated_tokens_per_sample_and_flops_per_step_win(tmp_path):
    _, rows = _run(tmp_path, _plain, tokens_per_sample=128, flops_per_step=5e6, max_steps=None)
    assert rows and all("eta_s" not in row and "progress" not in row for row in rows)
    row = rows[0]
    assert row["tokens_per_s"] == pytest.approx(row["samples_per_s"] * 128)
    assert row["mfu"] == pytest.approx(5e6 / row["step_time_s"] / PEAK)


def test_an_unknown_device_has_no_mfu_said_once(tmp_path, capsys):
    cfg = resolve_train_config({"max_steps": 10})
    hooks = make_throughput_hooks(cfg)
    model = torch.nn.Linear(3, 1, device="meta")
    emit(hooks, "on_train_start", {"model": model})
    model(torch.ones(2, 3, device="meta"))  # the counted forward
    rows = []
    for step in (1, 3):
        info = {"step": step, "metrics": {"step_time_s": 0.5}}
        emit(hooks, "on_log", info)
        rows.append(info["metrics"])
    assert [row.get("mfu") for row in rows] == [None, None]
    assert rows[1]["progress"] == 0.4 and rows[0]["eta_s"] == pytest.approx(8 * 0.5)
    said = [line for line in capsys.readouterr().err.splitlines() if "no MFU" in line]
    assert said == ["koochak: no MFU in the logged rows: no dense peak is known for a meta device"]


@pytest.mark.parametrize(
    ("name", "dtype", "tflops"),
    [("NVIDIA H200", "bf16", 989.4), ("NVIDIA H100 PCIe", "bf16", 756.0),
     ("NVIDIA H100 80GB HBM3", "tf32", 494.7), ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),
     ("NVIDIA L40S", "fp16", 362.05), ("NVIDIA GeForce GTX 480", "bf16", None),
     ("Tesla V100-SXM2-32GB", "bf16", None)],
)  # fmt: skip
def test_the_dense_peak_table(monkeypatch, name, dtype, tflops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    value, why = mfu.peak_flops(torch.device("cuda"), dtype)
    assert value == (tflops * 1e12 if tflops else None)
    assert name in why


def test_compute_dtype_follows_amp_and_tf32():
    assert mfu.compute_dtype("bf16", torch.device("cuda")) == "bf16"
    assert mfu.compute_dtype("none", torch.device("cpu")) == "fp32"
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        assert mfu.compute_dtype("none", torch.device("cuda")) == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = False
        assert mfu.compute_dtype("none", torch.device("cuda")) == "fp32"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
