"""export_weights: one weights_only file with a checkpoint's (or an EMA shadow's) weights."""

from __future__ import annotations

import pytest
import torch
from koochak.loop.checkpoint import build_checkpoint, save
from koochak.loop.checkpoint.export import export_weights, main
from koochak.loop.ema import make_model_ema
from koochak.storage import artifact
from koochak.storage.store import open_store


def _publish(location, step, seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    ema = make_model_ema({"decay": 0.5}, model)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    ema.update(1)
    save(build_checkpoint(step=step, next_step=step, reason="terminal", model=model,
                          ema=ema.state_dict()), location)  # fmt: skip
    return model, ema


def test_the_highest_valid_checkpoint_becomes_one_weights_only_file(tmp_path):
    _publish(tmp_path / "run", 3, seed=0)
    model, _ = _publish(tmp_path / "run", 7, seed=1)
    publication = export_weights(tmp_path / "run", tmp_path / "out")
    assert publication.artifact_id == "weights/model.pt"
    weights = torch.load(publication.path, weights_only=True)
    assert weights.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(weights[key], value)
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    fresh.load_state_dict(weights)
    committed, data = artifact.read_verified(open_store(str(tmp_path / "out")), "model.pt")
    assert committed.sha256 == publication.sha256 and len(data) == publication.size


def test_a_given_step_an_ema_shadow_and_a_dtype(tmp_path):
    model, ema = _publish(tmp_path / "run", 3, seed=0)
    _publish(tmp_path / "run", 7, seed=1)
    pub = export_weights(
        tmp_path / "run", tmp_path / "out", step=3, ema=0, dtype="bf16", name="ema.pt"
    )
    weights = torch.load(pub.path, weights_only=True)
    shadow = ema.shadow_state_dict(0)
    assert torch.equal(weights["0.weight"], shadow["0.weight"].to(torch.bfloat16))
    assert weights["1.num_batches_tracked"].dtype == torch.int64  # integers keep their dtype
    with pytest.raises(ValueError, match="has 1 EMA shadow"):
        export_weights(tmp_path / "run", tmp_path / "out", ema=1)


def test_the_command_line(tmp_path, capsys):
    assert main([str(tmp_path / "none"), str(tmp_path / "out")]) == 1
    assert "no valid published checkpoint" in capsys.readouterr().err
    _publish(tmp_path / "run", 2, seed=0)
    assert main([str(tmp_path / "run"), str(tmp_path / "out"), "--dtype", "fp16"]) == 0
    assert "model.pt sha256=" in capsys.readouterr().out
    assert (tmp_path / "out" / "model.pt.ready.json").exists()
