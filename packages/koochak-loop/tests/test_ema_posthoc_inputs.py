"""Post-hoc EMA refuses what would give garbage: a target exponent the EMA library refuses, and
stored shadows of more than one model (other keys, or other shapes that would broadcast). The
CLI then writes nothing at --out."""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch
from koochak.loop import training_loop
from koochak.loop.ema_posthoc import (
    collect_power_ema_states,
    main,
    power_ema_states,
    reconstruct_power_ema_state_dict,
)


def _batches():
    g = torch.Generator().manual_seed(0)
    while True:
        x = torch.randn(8, 4, generator=g)
        yield x, x.sum(1, keepdim=True)


def _step(model, batch, ctx):
    x, y = batch
    width = next(model.parameters()).shape[-1]  # a narrower model reads fewer columns
    return {"loss": torch.nn.functional.mse_loss(model(x[:, :width]), y)}


def _train(out, model, max_steps, every, ema=None):
    torch.manual_seed(0)
    training_loop(
        model=model,
        dataset=_batches(),
        step_fn=_step,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        train_cfg={
            "max_steps": max_steps,
            "ckpt_every": every,
            "keep_last_k": None,
            "log_every": 1000,
            "device": "cpu",
            "out_dir": str(out),
            "ema": ema or {"dual": {"enabled": True, "srel1": 0.05, "srel2": 0.10}},
        },
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A dual-EMA run of Linear(4, 1), of Linear(1, 1) (same keys, shapes that broadcast) and of
    Sequential(Linear(4, 1)) (other keys); their checkpoint names do not collide."""
    base = tmp_path_factory.mktemp("posthoc-inputs")
    _train(base / "linear4", torch.nn.Linear(4, 1), 6, 3)  # step000000002.pt, ...006.pt
    _train(base / "linear1", torch.nn.Linear(1, 1), 8, 4)  # step000000003.pt, ...008.pt
    _train(base / "seq", torch.nn.Sequential(torch.nn.Linear(4, 1)), 10, 5)  # ...004, ...010
    _train(base / "const", torch.nn.Linear(4, 1), 12, 12, ema={"decay": 0.9})  # ...011, ...012
    return base


def _mixed(runs, tmp_path, other):
    """A run directory holding linear4's checkpoints and ``other``'s (files and manifests)."""
    mixed = tmp_path / "mixed"
    shutil.copytree(runs / "linear4", mixed)
    for name in os.listdir(runs / other):
        if name.startswith("step"):
            shutil.copy2(runs / other / name, mixed / name)
    return mixed


def _nothing_written(out):
    assert not out.exists()
    assert os.listdir(out.parent) == [], os.listdir(out.parent)  # no temporary left either


@pytest.mark.parametrize("gamma", ["nan", "inf", "-inf", "-1", "-3", "-0.5"])
def test_the_cli_refuses_a_gamma_the_library_refuses_and_writes_nothing(
    runs, tmp_path, capsys, gamma
):
    out = tmp_path / "out" / "ema.pt"
    out.parent.mkdir()
    assert main([str(runs / "linear4"), f"--gamma={gamma}", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--gamma must be a finite number >= 0" in err[0], err
    _nothing_written(out)


@pytest.mark.parametrize("srel", ["nan", "inf", "0", "0.5", "-0.1"])
def test_the_cli_refuses_a_bad_srel_naming_it(runs, tmp_path, capsys, srel):
    out = tmp_path / "out" / "ema.pt"
    out.parent.mkdir()
    assert main([str(runs / "linear4"), f"--srel={srel}", "--out", str(out)]) == 1
    assert "--srel: srel must be in (0, 0.288675]" in capsys.readouterr().err
    _nothing_written(out)


def test_a_gamma_that_is_not_a_number_is_one_line_exit_2(runs, tmp_path, capsys):
    out = tmp_path / "ema.pt"
    with pytest.raises(SystemExit) as exited:  # argparse's exit, as `python -m` ends with it
        main([str(runs / "linear4"), "--gamma", "wide", "--out", str(out)])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "argument --gamma: invalid float value: 'wide'" in err[0], err


@pytest.mark.parametrize(
    ("other", "expected"),
    [
        ("linear1", "key 'weight' is shape [1, 1], not [1, 4]"),
        ("seq", "other state-dict keys: it lacks bias, weight and has extra 0.bias, 0.weight"),
    ],
)
def test_a_run_directory_of_two_models_is_refused_and_nothing_written(
    runs, tmp_path, capsys, other, expected
):
    mixed = _mixed(runs, tmp_path, other)
    out = tmp_path / "out" / "ema.pt"
    out.parent.mkdir()
    assert main([str(mixed), "--srel", "0.07", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "is not of the same model as step000000002.pt shadow 0" in err
    assert expected.replace("[1, 4]", "shape [1, 4]") in err
    _nothing_written(out)


def test_the_library_checks_shapes_and_the_target_too(runs, tmp_path):
    mixed = _mixed(runs, tmp_path, "linear1")
    states = collect_power_ema_states(mixed)
    with pytest.raises(ValueError, match=r"stored shadow \d+ is not of the same model as shadow 0"):
        reconstruct_power_ema_state_dict(states, srel=0.07)
    one_model = collect_power_ema_states(runs / "linear4")
    for gamma in (math.nan, math.inf, -1.0, -3.0, True):
        with pytest.raises(ValueError, match="gamma must be a finite number >= 0"):
            reconstruct_power_ema_state_dict(one_model, gamma=gamma)
    with pytest.raises(ValueError, match="srel must be in"):
        reconstruct_power_ema_state_dict(one_model, srel=math.nan)
    rebuilt = reconstruct_power_ema_state_dict(one_model, gamma=0.0)  # the uniform average
    assert all(torch.isfinite(t).all() for t in rebuilt.values())


def test_a_stored_shadow_with_a_broken_gamma_is_refused_by_name(runs):
    from koochak.loop.checkpoint import load

    ckpt = load(str(runs / "linear4" / "step000000006.pt"))
    ckpt["ema"]["shadows"][1]["gamma"] = float("nan")
    with pytest.raises(ValueError, match=r"ck.pt: field 'ema.shadows\[1\].gamma' must be a finite"):
        power_ema_states(ckpt, "ck.pt")


def test_a_stored_shadow_holding_nan_gives_no_output(runs, tmp_path):
    states = collect_power_ema_states(runs / "linear4")
    states[-1] = {
        **states[-1],
        "state_dict": {k: v * math.nan for k, v in states[-1]["state_dict"].items()},
    }
    with pytest.raises(ValueError, match="is not finite"):
        reconstruct_power_ema_state_dict(states, srel=0.07)


def test_a_checkpoint_the_first_pass_skips_does_not_fail_the_second(runs, tmp_path, capsys, caplog):
    """A checkpoint whose shadow uses the constant profile is skipped with a logged reason; the
    weighted sum must skip it too (it used to fail there, after the first pass)."""
    mixed = _mixed(runs, tmp_path, "const")
    out = tmp_path / "out" / "ema.pt"
    out.parent.mkdir()
    assert main([str(mixed), "--srel", "0.07", "--out", str(out), "--json"]) == 0, (
        capsys.readouterr().err
    )
    assert "step000000012.pt: its EMA shadows use the constant profile" in caplog.text
    assert out.exists()
