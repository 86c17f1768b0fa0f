"""The TensorBoard sink against the real tensorboard package, read back from its event files."""

import sys

import koochak.loop.dist as kdist
import pytest
import torch
from koochak.loop import training_loop
from koochak.loop.hooks import emit
from koochak.loop.logging import make_tensorboard_hooks

pytest.importorskip("tensorboard")


def _read(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }
    texts = {
        tag: [e.tensor_proto.string_val[0].decode() for e in events.Tensors(tag)]
        for tag in events.Tags()["tensors"]
    }
    return scalars, texts


def _step_fn(model, batch, ctx):
    x, y = batch
    loss = torch.nn.functional.mse_loss(model(x), y)
    return {"loss": loss, "tag": "text metrics are skipped"}


def _eval_fn(model, data, ctx):
    return {"loss": sum(float(_step_fn(model, b, ctx)["loss"]) for b in data) / len(data)}


def test_training_loop_writes_scalars_and_the_resolved_config(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(4)]
    config = {"train": {"max_steps": 4, "lr_note": "0.1"}, "data": {"batch_size": 4}}
    log_dir = tmp_path / "tb"
    training_loop(
        model=model,
        dataset=data,
        step_fn=_step_fn,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        train_cfg={
            "max_steps": 4,
            "log_every": 2,
            "eval_every": 2,
            "out_dir": str(tmp_path),
            "device": "cpu",
        },  # fmt: skip
        config_json=config,
        eval_dataset=data[:2],
        eval_fn=_eval_fn,
        hooks=make_tensorboard_hooks(log_dir),
    )

    scalars, texts = _read(log_dir)
    assert [step for step, _ in scalars["loss"]] == [1, 3]
    assert [step for step, _ in scalars["eval_loss"]] == [1, 3]
    assert {"lr", "grad_norm", "step_time_s"} <= set(scalars)
    assert "tag" not in scalars
    assert scalars["lr"][0][1] == pytest.approx(0.1)
    (text,) = texts["config/text_summary"]
    assert "    train:" in text and "lr_note: '0.1'" in text and "batch_size: 4" in text


def test_values_are_written_exactly_at_the_step_given(tmp_path):
    hooks = make_tensorboard_hooks(tmp_path / "tb")
    emit(hooks, "on_train_start", {"step": 0, "train_cfg": {"max_steps": 9}})
    emit(hooks, "on_log", {"step": 7, "metrics": {"loss": torch.tensor(0.25), "flag": True}})
    emit(hooks, "on_train_end", {"step": 8, "checkpoint": {}, "metrics": {}})
    scalars, texts = _read(tmp_path / "tb")
    assert scalars == {"loss": [(7, 0.25)]}
    assert "max_steps: 9" in texts["config/text_summary"][0]


def test_other_ranks_write_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(kdist, "get_rank", lambda: 1)
    hooks = make_tensorboard_hooks(tmp_path / "tb")
    emit(hooks, "on_train_start", {"step": 0, "train_cfg": {}})
    emit(hooks, "on_log", {"step": 0, "metrics": {"loss": 1.0}})
    emit(hooks, "on_train_end", {"step": 1, "checkpoint": {}, "metrics": {}})
    assert not (tmp_path / "tb").exists()


def test_missing_tensorboard_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install 'koochak-loop\[tensorboard\]'"):
        make_tensorboard_hooks(tmp_path / "tb")
