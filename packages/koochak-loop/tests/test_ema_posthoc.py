"""Post-hoc EMA is right: a width never tracked is reconstructed from dual-EMA checkpoints.

One real training run with dual power EMA (srel 0.05 and 0.10) publishes a checkpoint every 25
updates; a third shadow of srel 0.07 is tracked directly alongside it by a hook. The 0.07
reconstructed from the checkpoints must lie far closer to the directly tracked 0.07 than the two
stored shadows lie to each other, and reconstructing a stored width must give that shadow back.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from koochak.loop import training_loop
from koochak.loop.checkpoint import load
from koochak.loop.ema import ModelEma, ShadowSpec, srel_to_gamma
from koochak.loop.ema_posthoc import (
    collect_power_ema_states,
    main,
    posthoc_coefficients,
    power_ema_states,
    power_profile_inner,
    reconstruct_dual_power_ema_state_dict,
    reconstruct_power_ema_state_dict,
)
from koochak.storage.store import LocalStore

STEPS, EVERY = 400, 25


def _drifting_batches(steps: int):
    # The target rotates slowly, so the weights keep moving and EMA widths really differ.
    g = torch.Generator().manual_seed(0)
    for t in range(steps):
        angle = 2 * math.pi * t / steps
        w = torch.tensor([[math.cos(angle)], [math.sin(angle)], [0.5], [-0.5]])
        x = torch.randn(16, 4, generator=g)
        yield x, x @ w + 0.3 * torch.randn(16, 1, generator=g)


def _step_fn(model, batch, ctx):
    x, y = batch
    return {"loss": torch.nn.functional.mse_loss(model(x), y)}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("posthoc")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    direct = ModelEma(model, [ShadowSpec("power", gamma=srel_to_gamma(0.07))])
    hooks = {"on_step_end": [lambda info: direct.update(info["step"] + 1)]}
    final = training_loop(
        model=model, dataset=_drifting_batches(STEPS), step_fn=_step_fn,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05), hooks=hooks,
        train_cfg={"max_steps": STEPS, "ckpt_every": EVERY, "keep_last_k": None,
                   "log_every": 1000, "device": "cpu", "out_dir": str(out),
                   "ema": {"dual": {"enabled": True, "srel1": 0.05, "srel2": 0.10}}},
    )  # fmt: skip
    return out, final, direct.shadow_state_dict()


def _flat(state) -> torch.Tensor:
    return torch.cat([v.double().flatten() for v in state.values() if v.is_floating_point()])


def test_reconstructed_srel_007_is_far_closer_to_the_tracked_one_than_the_stored_pair(run):
    out, final, direct = run
    states = collect_power_ema_states(out)
    assert len(states) == 2 * (STEPS // EVERY)  # 15 periodic + the terminal, two shadows each
    assert sorted({s["step"] for s in states}) == list(range(EVERY, STEPS + 1, EVERY))
    rebuilt = reconstruct_power_ema_state_dict(states, srel=0.07)
    stored = [s["state_dict"] for s in final["ema"]["shadows"]]
    spread = (_flat(stored[0]) - _flat(stored[1])).norm().item()
    error = (_flat(rebuilt) - _flat(direct)).norm().item()
    print(
        f"\npost-hoc srel 0.07: |rebuilt - tracked| / |srel 0.05 - srel 0.10| = {error / spread:.4f}"
    )
    assert error < 0.01 * spread, (error, spread)
    # Using only the last checkpoint's pair is much worse: that is why several are stored.
    pair_only = reconstruct_dual_power_ema_state_dict(final, srel=0.07)
    assert (_flat(pair_only) - _flat(direct)).norm().item() > 2 * error


@pytest.mark.parametrize("index, srel", [(0, 0.05), (1, 0.10)])
def test_reconstructing_a_stored_width_returns_that_shadow(run, index, srel):
    out, final, _ = run
    rebuilt = reconstruct_power_ema_state_dict(collect_power_ema_states(out), srel=srel)
    shadow = final["ema"]["shadows"][index]["state_dict"]
    for key, tensor in shadow.items():
        assert torch.allclose(rebuilt[key], tensor, rtol=1e-4, atol=1e-5), key


def test_upstream_keyword_spellings_and_list_shapes(run):
    out, final, _ = run
    states = collect_power_ema_states(out)
    per_checkpoint = [states[i : i + 2] for i in range(0, len(states), 2)]  # a list of lists
    first, second = reconstruct_power_ema_state_dict(per_checkpoint, srel_target=[0.05, 0.10])
    for rebuilt, shadow in zip((first, second), final["ema"]["shadows"]):
        for key, tensor in shadow["state_dict"].items():
            assert torch.allclose(rebuilt[key], tensor, rtol=1e-4, atol=1e-5), key
    gamma = final["ema"]["shadows"][1]["gamma"]
    by_gamma = reconstruct_power_ema_state_dict(states, gamma_target=gamma)
    assert all(torch.equal(by_gamma[k], second[k]) for k in second) or all(
        torch.allclose(by_gamma[k], second[k], rtol=1e-6, atol=1e-7) for k in second
    )
    with pytest.raises(ValueError, match="give srel= or srel_target="):
        reconstruct_power_ema_state_dict(states, srel=0.05, srel_target=0.05)


def test_earlier_step_and_gamma_targets(run):
    out, _, _ = run
    ckpt = load(str(out / f"step{2 * EVERY - 1:09d}.pt"))  # after 50 updates
    rebuilt = reconstruct_power_ema_state_dict(
        collect_power_ema_states(out), gamma=ckpt["ema"]["shadows"][1]["gamma"], step=2 * EVERY
    )
    for key, tensor in ckpt["ema"]["shadows"][1]["state_dict"].items():
        assert torch.allclose(rebuilt[key], tensor, rtol=1e-4, atol=1e-5), key


def test_the_cli_writes_the_reconstruction_create_only(run, tmp_path, capsys):
    out, _, _ = run
    target = tmp_path / "ema_0.07.pt"
    assert main([str(out), "--srel", "0.07", "--out", str(target), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["target_step"] == STEPS and len(report["coefficients"]) == 32
    written = torch.load(target, weights_only=True)
    expected = reconstruct_power_ema_state_dict(collect_power_ema_states(out), srel=0.07)
    for key, tensor in expected.items():
        assert torch.allclose(written[key], tensor, rtol=1e-6, atol=1e-7), key
    assert main([str(out), "--srel", "0.07", "--out", str(target)]) == 1  # never overwritten
    assert "already exists" in capsys.readouterr().err


def test_checkpoints_in_parts_give_the_same_shadows(run, tmp_path):
    from koochak.loop.checkpoint import save
    from koochak.storage import artifact

    out, _, _ = run
    for _, name in artifact.published_candidates(LocalStore(out), r"step(\d{9})\.pt"):
        save(load(str(out / name)), tmp_path, parts=2)
    ours, theirs = collect_power_ema_states(tmp_path), collect_power_ema_states(out)
    assert len(ours) == len(theirs) > 0
    for a, b in zip(ours, theirs):
        assert a["step"] == b["step"] and a["gamma"] == b["gamma"]
        assert all(torch.equal(a["state_dict"][k], v) for k, v in b["state_dict"].items())


def test_profile_inner_product_matches_numerical_integration():
    t_a, g_a, t_b, g_b = 300.0, 6.94, 400.0, 16.97
    n = 200_000
    tau = (torch.arange(n, dtype=torch.float64) + 0.5) * (t_b / n)
    p_a = torch.where(tau <= t_a, (g_a + 1) * tau**g_a / t_a ** (g_a + 1), torch.zeros(()))
    p_b = (g_b + 1) * tau**g_b / t_b ** (g_b + 1)
    numeric = (p_a * p_b).sum().item() * (t_b / n)
    assert power_profile_inner(t_a, g_a, t_b, g_b) == pytest.approx(numeric, rel=1e-4)
    assert power_profile_inner(t_b, g_b, t_a, g_a) == power_profile_inner(t_a, g_a, t_b, g_b)
    # A stored profile is reproduced by itself alone.
    x = posthoc_coefficients([(t_a, g_a), (t_b, g_b)], t_b, g_b)
    assert x == pytest.approx([0.0, 1.0], abs=1e-9)


def test_checkpoints_without_power_shadows_are_refused_by_name():
    with pytest.raises(ValueError, match="ck.pt: has no EMA shadows"):
        power_ema_states({"ema": None}, "ck.pt")
    with pytest.raises(ValueError, match="exactly one of srel or gamma"):
        reconstruct_power_ema_state_dict([], srel=0.1, gamma=2.0)
    late = ModelEma(torch.nn.Linear(2, 1), [ShadowSpec("power", gamma=1.0)], start_step=5)
    with pytest.raises(ValueError, match="ck.pt: its EMA shadows started at step 5, not 0"):
        power_ema_states({"ema": late.state_dict()}, "ck.pt")


def test_a_target_beyond_the_latest_stored_step_is_refused(run):
    out, _, _ = run
    with pytest.raises(ValueError, match=f"step must be in 1..{STEPS}"):
        reconstruct_power_ema_state_dict(collect_power_ema_states(out), srel=0.07, step=STEPS + 1)


@pytest.mark.slow
def test_the_cli_as_a_subprocess(run, tmp_path):
    import subprocess
    import sys

    out, _, _ = run
    target = tmp_path / "ema.pt"
    cmd = [
        sys.executable,
        "-m",
        "koochak.loop.ema_posthoc",
        str(out),
        "--srel",
        "0.07",
        "--out",
        str(target),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (
        done.stdout.startswith(f"wrote {target}: gamma 11.2449 at step 400")
        and "from 32 stored shadow(s)" in done.stdout
    )
    empty = subprocess.run([*cmd[:3], str(tmp_path / "nothing"), *cmd[4:6], "--out", str(tmp_path / "x.pt")],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert empty.returncode == 1 and len(empty.stderr.strip().splitlines()) == 1, empty.stderr
    assert "no published checkpoint holds power EMA shadows" in empty.stderr
