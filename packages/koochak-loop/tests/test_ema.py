"""EMA shadows: hand-computed averages, warm-up, power profile, thinning, checkpoints, the loop."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from koochak.loop import training_loop
from koochak.loop.checkpoint import deserialize_checkpoint, serialize_checkpoint
from koochak.loop.config import ConfigError, load_config, resolve_train_config
from koochak.loop.ema import (
    ModelEma,
    ShadowSpec,
    gamma_to_srel,
    load_ema_weights,
    make_model_ema,
    scheduled_decay,
    shadow_specs,
    srel_to_gamma,
)


def _weights_sequence(model: torch.nn.Module, steps: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(model.weight.shape, generator=g, dtype=torch.float64) for _ in range(steps)]


def _drive(ema: ModelEma, model: torch.nn.Module, weights: list[torch.Tensor]) -> None:
    """Set the model's weight to weights[t-1] after 'model step' t, then update the EMA."""
    for t, w in enumerate(weights, start=1):
        with torch.no_grad():
            model.weight.copy_(w)
        ema.update(t)


def _shadow_weight(ema: ModelEma, index: int = 0) -> torch.Tensor:
    return ema.shadow_state_dict(index)["weight"].double()


def test_constant_decay_matches_the_hand_computed_average():
    model = torch.nn.Linear(4, 3, bias=False)
    expected = model.weight.detach().double().clone()
    ema = ModelEma(model, [ShadowSpec("constant", decay=0.9)])
    weights = _weights_sequence(model, 6)
    _drive(ema, model, weights)
    for w in weights:
        expected = 0.9 * expected + 0.1 * w
    assert torch.allclose(_shadow_weight(ema), expected, rtol=1e-6, atol=1e-6)
    assert (ema.step, ema.updates) == (6, 6)


def test_update_every_k_is_compensated_with_decay_to_the_k():
    model = torch.nn.Linear(4, 3, bias=False)
    expected = model.weight.detach().double().clone()
    ema = ModelEma(model, [ShadowSpec("constant", decay=0.9)], update_every=3)
    weights = _weights_sequence(model, 9)
    _drive(ema, model, weights)
    for t in (3, 6, 9):  # only every third step, each standing in for three
        expected = 0.9**3 * expected + (1 - 0.9**3) * weights[t - 1]
    assert torch.allclose(_shadow_weight(ema), expected, rtol=1e-6, atol=1e-6)
    assert (ema.step, ema.updates) == (9, 3)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_warmup_goes_from_decay_init_to_decay(schedule):
    spec = ShadowSpec("constant", decay=0.99, decay_init=0.5, warmup_steps=10, schedule=schedule)
    assert scheduled_decay(spec, 0) == pytest.approx(0.5)
    assert scheduled_decay(spec, 10) == pytest.approx(0.99)
    assert scheduled_decay(spec, 1000) == pytest.approx(0.99)
    assert scheduled_decay(spec, 5) == pytest.approx(0.745)  # halfway for both shapes
    quarter = 0.25 if schedule == "linear" else 0.5 * (1 - math.cos(math.pi / 4))
    assert scheduled_decay(spec, 2.5) == pytest.approx(0.5 + 0.49 * quarter)
    # The shadow uses it: step 1 keeps decay_init + a tenth of the way.
    model = torch.nn.Linear(2, 2, bias=False)
    start = model.weight.detach().double().clone()
    ema = ModelEma(model, [spec])
    (w,) = _weights_sequence(model, 1)
    _drive(ema, model, [w])
    beta = scheduled_decay(spec, 1)
    assert torch.allclose(_shadow_weight(ema), beta * start + (1 - beta) * w, rtol=1e-6, atol=1e-6)
    assert ShadowSpec("constant", decay=0.9).beta(3) == 0.9  # constant schedule: no warm-up


def test_power_profile_first_steps_match_the_edm2_betas():
    gamma = srel_to_gamma(0.10)
    model = torch.nn.Linear(3, 2, bias=False)
    ema = ModelEma(model, [ShadowSpec("power", gamma=gamma)])
    weights = _weights_sequence(model, 4)
    _drive(ema, model, weights[:1])
    assert torch.equal(_shadow_weight(ema), weights[0].float().double())  # beta_1 = 0
    expected = weights[0]
    for t in (2, 3, 4):
        _drive_one(ema, model, weights[t - 1], t)
        beta = (1 - 1 / t) ** (gamma + 1)
        expected = beta * expected + (1 - beta) * weights[t - 1]
        assert torch.allclose(_shadow_weight(ema), expected, rtol=1e-5, atol=1e-6)


def _drive_one(ema: ModelEma, model: torch.nn.Module, w: torch.Tensor, t: int) -> None:
    with torch.no_grad():
        model.weight.copy_(w)
    ema.update(t)


def test_srel_and_gamma_convert_both_ways():
    # EDM2's reference points: srel 0.05 <-> gamma 16.97, srel 0.10 <-> gamma 6.94.
    assert srel_to_gamma(0.05) == pytest.approx(16.97, abs=0.01)
    assert srel_to_gamma(0.10) == pytest.approx(6.94, abs=0.01)
    for srel in (0.01, 0.05, 0.07, 0.2, 1 / math.sqrt(12)):
        assert gamma_to_srel(srel_to_gamma(srel)) == pytest.approx(srel, rel=1e-12)
    with pytest.raises(ValueError, match="srel must be in"):
        srel_to_gamma(0.3)


def test_power_with_thinning_uses_the_elapsed_steps():
    spec = ShadowSpec("power", gamma=2.0)
    assert spec.beta(4, elapsed=2) == pytest.approx((1 - 2 / 4) ** 3)
    assert spec.beta(2, elapsed=2) == 0.0


def test_float_buffers_are_averaged_and_the_shadow_loads_into_the_model():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    ema = ModelEma(model, [ShadowSpec("constant", decay=0.5)])
    before = model[1].running_mean.clone()
    model.train()
    model(torch.randn(8, 3) + 3.0)  # moves the running statistics in place
    ema.update(1)
    shadow = ema.shadow_state_dict()
    assert torch.allclose(shadow["1.running_mean"], 0.5 * before + 0.5 * model[1].running_mean)
    assert list(shadow) == list(model.state_dict())  # keys match the model's, in order
    assert shadow["1.num_batches_tracked"] == 1  # non-float entries: the live values
    copy = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    copy.load_state_dict(shadow)


def test_swapped_in_runs_with_the_shadow_and_restores_the_weights_exactly():
    model = torch.nn.Linear(4, 2)
    ema = ModelEma(model, [ShadowSpec("constant", decay=0.5)])
    _drive(ema, model, _weights_sequence(model, 3))
    live = {k: v.clone() for k, v in model.state_dict().items()}
    with ema.swapped_in():
        for key, value in model.state_dict().items():
            assert torch.equal(value, ema.shadow_state_dict()[key])
    for key, value in model.state_dict().items():
        assert torch.equal(value, live[key])


def test_state_round_trips_through_a_weights_only_checkpoint_and_continues_exactly():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    specs = [ShadowSpec("power", gamma=srel_to_gamma(0.05)), ShadowSpec("power", gamma=6.94)]
    weights = _weights_sequence(model, 8)
    straight = ModelEma(model, specs, update_every=2)
    _drive(straight, model, weights)

    model2 = torch.nn.Linear(4, 2)
    first = ModelEma(model2, specs, update_every=2)
    _drive(first, model2, weights[:4])
    ckpt = {"version": 1, "step": 4, "next_step": 4, "reason": "terminal",
            "model": model2.state_dict(), "ema": first.state_dict()}  # fmt: skip
    loaded = deserialize_checkpoint(serialize_checkpoint(ckpt), "ckpt")
    resumed = ModelEma(model2, specs, update_every=2)
    resumed.load_state_dict(loaded["ema"])
    for t in range(5, 9):
        _drive_one(resumed, model2, weights[t - 1], t)
    for i in range(2):
        assert torch.equal(
            resumed.shadow_state_dict(i)["weight"], straight.shadow_state_dict(i)["weight"]
        )
    assert (resumed.step, resumed.updates) == (straight.step, straight.updates) == (8, 4)


def test_restoring_other_shadows_than_configured_fails_naming_the_field():
    model = torch.nn.Linear(2, 1)
    saved = ModelEma(model, [ShadowSpec("power", gamma=6.94)]).state_dict()
    with pytest.raises(
        ValueError, match="ema shadow 0 is power .*gamma 6.94.* resume with the same"
    ):
        ModelEma(model, [ShadowSpec("power", gamma=16.97)]).load_state_dict(saved)
    with pytest.raises(ValueError, match="holds 1 shadow"):
        ModelEma(model, [ShadowSpec("power", gamma=1.0)] * 2).load_state_dict(saved)
    with pytest.raises(ValueError, match="'ema.version'"):
        ModelEma(model, [ShadowSpec()]).load_state_dict({**saved, "version": 7})


# ----------------------------------------------------------------------------- config


def test_nested_keys_enable_ema_and_decay_alone_implies_it(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("train:\n  ema:\n    decay: 0.99\n    update_every: 2\n")
    train = resolve_train_config(load_config(path).train)
    assert train.ema.decay == 0.99 and train.ema.enabled is None
    (spec,) = shadow_specs(train.ema)
    assert (spec.profile, spec.decay) == ("constant", 0.99)
    assert shadow_specs(resolve_train_config({}).ema) == []  # nothing given: off
    assert shadow_specs(resolve_train_config({"ema": {"decay": 0.9, "enabled": False}}).ema) == []
    assert len(shadow_specs(resolve_train_config({"ema": {"enabled": True}}).ema)) == 1


def test_srel_or_gamma_alone_implies_the_power_profile():
    (spec,) = shadow_specs(resolve_train_config({"ema": {"srel": 0.1}}).ema)
    assert spec.profile == "power" and spec.gamma == pytest.approx(srel_to_gamma(0.1))


def test_dual_with_srels_gives_two_power_shadows():
    train = resolve_train_config({"ema": {"dual": {"enabled": True, "srel1": 0.05, "srel2": 0.1}}})
    specs = shadow_specs(train.ema)
    assert [s.profile for s in specs] == ["power", "power"]
    assert [round(s.srel, 12) for s in specs] == [0.05, 0.1]


def test_legacy_flat_keys_are_honoured_with_a_note_naming_the_nested_key(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("train:\n  ema_decay: 0.95\n  ema_eval: true\n")
    with pytest.warns(UserWarning) as notes:
        cfg = load_config(path)
    assert sorted(str(n.message).split(": ", 1)[1] for n in notes) == [
        "train.ema_decay is the legacy name of train.ema.decay; it is honoured, but use the nested key",
        "train.ema_eval is the legacy name of train.ema.eval_with_ema; it is honoured, but use the "
        "nested key",
    ]
    assert cfg.train.ema.decay == 0.95 and cfg.train.ema.eval_with_ema is True
    assert "ema_decay" not in cfg.train
    with pytest.warns(UserWarning, match="train.ema_update_every is the legacy name"):
        assert resolve_train_config({"ema_update_every": 4}).ema.update_every == 4
    with pytest.raises(ConfigError, match="train.ema_decay=0.9 .legacy. and train.ema.decay=0.8"):
        resolve_train_config({"ema_decay": 0.9, "ema": {"decay": 0.8}})


@pytest.mark.parametrize(
    ("ema", "message"),
    [
        ({"decya": 0.9}, r"'train.ema.decya' \(did you mean 'train.ema.decay'\?\)"),
        ({"decay": 1.5}, r"train.ema.decay: expected a number in \[0, 1\), got 1.5"),
        ({"profile": "power"}, r"exactly one of train.ema.gamma or train.ema.srel"),
        ({"profile": "power", "gamma": 1.0, "srel": 0.1}, r"exactly one of train.ema.gamma"),
        ({"profile": "cubic"}, r"train.ema.profile: expected one of constant\|power"),
        ({"srel": 0.5, "profile": "power"}, r"train.ema.srel: expected a number in \(0, 0.2887\]"),
        ({"warmup_steps": 10}, r"train.ema.warmup_steps: a warm-up needs train.ema.schedule"),
        ({"update_every": 0}, r"train.ema.update_every: expected an integer >= 1"),
        ({"dual": {"enabled": True, "srel1": 0.05}}, r"train.ema.dual.gamma2 or train.ema.dual.srel2"),
        ({"profile": "power", "srel": 0.1, "decay": 0.9}, r"train.ema.decay: only the constant"),
        ({"srel": 0.1, "warmup_steps": 5, "schedule": "linear"},
         r"train.ema.warmup_steps: only the constant profile warms up"),
        ({"profile": "constant", "gamma": 3.0}, r"train.ema.gamma: only the power profile uses"),
        ({"srel": 0.1, "gamma": 2.0, "dual": {"enabled": True, "srel1": 0.05, "srel2": 0.1}},
         r"train.ema: a power EMA needs exactly one of train.ema.gamma or train.ema.srel"),
        ({"warmup_steps": 5, "schedule": "linear", "dual": {"enabled": True, "gamma1": 1.0,
          "gamma2": 2.0}}, r"train.ema.warmup_steps: only a constant primary shadow warms up"),
    ],
)  # fmt: skip
def test_bad_ema_config_fails_naming_the_key(ema, message):
    with pytest.raises(ConfigError, match=message):
        resolve_train_config({"ema": ema})


def test_one_rule_decides_ema_combinations_for_the_config_and_for_shadow_specs():
    from koochak.loop.config import EmaConfig, EmaDualConfig, ema_profile

    # A record built by hand meets the same rule, in the same words, as a loaded config.
    dual = EmaDualConfig(enabled=True, srel1=0.05, srel2=0.1)
    by_hand = EmaConfig(srel=0.1, gamma=2.0, dual=dual)
    with pytest.raises(ConfigError) as from_config:
        resolve_train_config({"ema": {"srel": 0.1, "gamma": 2.0, "dual": dataclasses.asdict(dual)}})
    with pytest.raises(ConfigError) as from_specs:
        shadow_specs(by_hand)
    assert str(from_specs.value) == str(from_config.value)
    assert str(from_specs.value).startswith("train.ema: a power EMA needs exactly one")
    assert ema_profile(EmaConfig()) is None
    assert ema_profile(EmaConfig(decay=0.9)) == "constant"
    assert ema_profile(EmaConfig(gamma=6.94)) == "power"
    assert ema_profile(EmaConfig(dual=dual)) == "power"


def test_make_model_ema_checks_a_train_ema_mapping_like_the_config():
    model = torch.nn.Linear(2, 1)
    section = load_config(None, ["train.ema.decay=0.9", "train.ema.update_every=2"]).train.ema
    ema = make_model_ema(section, model)  # a DictConfig section, as docs/ema.md shows
    assert ema is not None and ema.update_every == 2 and ema.specs[0].decay == 0.9
    assert make_model_ema({}, model) is None and make_model_ema(None, model) is None
    with pytest.raises(ConfigError, match="train.ema.decay: expected a number in"):
        make_model_ema({"decay": 1.5}, model)
    with pytest.raises(ConfigError, match="train.ema.gamma: only the power profile uses"):
        make_model_ema({"profile": "constant", "gamma": 3.0}, model)


def test_compensate_update_every_false_is_accepted_with_a_note():
    cfg = resolve_train_config({"ema": {"decay": 0.9, "compensate_update_every": False}}).ema
    with pytest.warns(UserWarning, match="compensate_update_every: false has no effect"):
        assert make_model_ema(cfg, torch.nn.Linear(2, 1)) is not None


# ----------------------------------------------------------------------------- the loop


def _batches(n: int, start: int = 0):
    for t in range(start, n):
        g = torch.Generator().manual_seed(t)
        x = torch.randn(8, 4, generator=g)
        yield x, x.sum(dim=1, keepdim=True)


def _step_fn(model, batch, ctx):
    x, y = batch
    return {"loss": torch.nn.functional.mse_loss(model(x), y)}


def _run(tmp_path, steps: int, ema: dict, *, start=None, ckpt=None, eval_fn=None, hooks=None):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, training_loop(
        model=model, dataset=_batches(steps, start or 0), step_fn=_step_fn, optimizer=optimizer,
        train_cfg={"max_steps": steps, "log_every": 1000, "device": "cpu",
                   "out_dir": str(tmp_path), "eval_every": 2 if eval_fn else None, "ema": ema},
        checkpoint_dict=ckpt, eval_dataset=[0] if eval_fn else None, eval_fn=eval_fn, hooks=hooks,
    )  # fmt: skip


def test_the_loop_updates_the_shadow_after_each_optimizer_step(tmp_path):
    weights: list[torch.Tensor] = []

    def record(info):  # on_step_end fires after optimizer -> EMA for that update
        weights.append(model_ref[0].weight.detach().double().clone())

    model_ref: list[torch.nn.Module] = []
    hooks = {"on_train_start": [lambda info: model_ref.append(info["model"])],
             "on_step_end": [record]}  # fmt: skip
    _, ckpt = _run(tmp_path, 5, {"decay": 0.8}, hooks=hooks)
    torch.manual_seed(0)
    expected = torch.nn.Linear(4, 1).weight.detach().double()  # the weights the shadow starts at
    for w in weights:
        expected = 0.8 * expected + 0.2 * w
    (shadow,) = ckpt["ema"]["shadows"]
    assert torch.allclose(shadow["state_dict"]["weight"].double(), expected, rtol=1e-6, atol=1e-6)
    assert ckpt["ema"]["step"] == 5 and "module." not in next(iter(shadow["state_dict"]))


def test_eval_with_ema_evaluates_the_shadow_and_leaves_training_unchanged(tmp_path):
    evaluated = []

    def eval_fn(model, data, ctx):
        evaluated.append(model.weight.detach().clone())
        return {"loss": 0.0}

    _, plain = _run(tmp_path / "plain", 4, {"decay": 0.5})
    _, swapped = _run(tmp_path / "swap", 4, {"decay": 0.5, "eval_with_ema": True}, eval_fn=eval_fn)
    assert torch.equal(plain["model"]["weight"], swapped["model"]["weight"])  # restored exactly
    shadow = swapped["ema"]["shadows"][0]["state_dict"]["weight"]
    assert torch.equal(evaluated[-1], shadow)  # the last eval (after update 4) saw the shadow
    assert not torch.equal(evaluated[-1], swapped["model"]["weight"])


def test_resume_continues_the_shadows_bit_exactly(tmp_path):
    ema = {"dual": {"enabled": True, "srel1": 0.05, "srel2": 0.1}, "update_every": 2}
    _, straight = _run(tmp_path / "straight", 6, ema)
    _, first = _run(tmp_path / "first", 3, ema)
    first = deserialize_checkpoint(serialize_checkpoint(first), "first")  # through the bytes
    _, resumed = _run(tmp_path / "resumed", 6, ema, start=3, ckpt=first)
    for want, got in zip(straight["ema"]["shadows"], resumed["ema"]["shadows"]):
        for key, tensor in want["state_dict"].items():
            assert torch.equal(tensor, got["state_dict"][key]), key
    assert resumed["ema"]["updates"] == straight["ema"]["updates"] == 3


def test_a_primary_ema_beside_the_dual_shadows_is_kept_restored_and_evaluated(tmp_path):
    from koochak.loop.config import EmaConfig, EmaDualConfig

    dual = {"enabled": True, "srel1": 0.05, "srel2": 0.1}
    assert [(s.profile, s.decay) for s in shadow_specs(EmaConfig(decay=0.9999, dual=EmaDualConfig(**dual)))][0] == ("constant", 0.9999)  # fmt: skip
    gammas = [s.gamma for s in shadow_specs(EmaConfig(gamma=7.0, dual=EmaDualConfig(**dual)))]
    assert gammas[0] == 7.0 and len(gammas) == 3
    evaluated = []

    def eval_fn(model, data, ctx):
        evaluated.append(model.weight.detach().clone())
        return {"loss": 0.0}

    ema = {"decay": 0.5, "eval_with_ema": True, "dual": dual}
    _, straight = _run(tmp_path / "straight", 6, ema, eval_fn=eval_fn)
    assert [s["profile"] for s in straight["ema"]["shadows"]] == ["constant", "power", "power"]
    # eval_with_ema evaluates the primary shadow (its decay 0.5), not a dual one.
    assert torch.equal(evaluated[-1], straight["ema"]["shadows"][0]["state_dict"]["weight"])
    _, first = _run(tmp_path / "first", 3, ema, eval_fn=eval_fn)
    first = deserialize_checkpoint(serialize_checkpoint(first), "first")  # through the bytes
    _, resumed = _run(tmp_path / "resumed", 6, ema, start=3, ckpt=first, eval_fn=eval_fn)
    for want, got in zip(straight["ema"]["shadows"], resumed["ema"]["shadows"], strict=True):
        for key, tensor in want["state_dict"].items():
            assert torch.equal(tensor, got["state_dict"][key]), key
    # Post-hoc EMA reads the power shadows only.
    from koochak.loop.ema_posthoc import power_ema_states

    assert [s["gamma"] for s in power_ema_states(resumed)] == [
        s["gamma"] for s in resumed["ema"]["shadows"][1:]
    ]


def test_resuming_a_checkpoint_without_shadows_starts_them_with_a_note(tmp_path):
    _, first = _run(tmp_path / "first", 2, {})
    assert first["ema"] is None
    with pytest.warns(UserWarning, match="has no EMA shadows: they start from its weights"):
        _, resumed = _run(tmp_path / "resumed", 4, {"decay": 0.9}, start=2, ckpt=first)
    assert resumed["ema"]["step"] == 4 and resumed["ema"]["updates"] == 2
    assert resumed["ema"]["start_step"] == 2


def test_load_ema_weights_loads_a_shadow_into_a_wrapped_or_bare_model(tmp_path):
    _, ckpt = _run(tmp_path, 3, {"decay": 0.5})
    ckpt = deserialize_checkpoint(serialize_checkpoint(ckpt), "ckpt")  # weights_only load

    class Wrapped(torch.nn.Module):  # keys carry "module." like a DDP wrapper's
        def __init__(self):
            super().__init__()
            self.module = torch.nn.Linear(4, 1)

    shadow = ckpt["ema"]["shadows"][0]["state_dict"]
    bare = load_ema_weights(torch.nn.Linear(4, 1), ckpt)
    wrapped = load_ema_weights(Wrapped(), ckpt)
    assert torch.equal(bare.weight, shadow["weight"])
    assert torch.equal(wrapped.module.weight, shadow["weight"])
    with pytest.raises(ValueError, match="no EMA shadows"):
        load_ema_weights(bare, {**ckpt, "ema": None})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned offload)")
def test_cpu_offload_keeps_pinned_host_shadows_that_follow_the_device_ones():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64)).cuda()
    spec = ShadowSpec("power", gamma=srel_to_gamma(0.1))
    on_device = ModelEma(model, [spec])
    offloaded = ModelEma(model, [spec], offload_to_cpu=True, pin_memory=True)
    assert all(t.device.type == "cpu" and t.is_pinned() for t in offloaded.shadows[0])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for t in range(1, 6):
        model(torch.randn(16, 64, device="cuda")).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        on_device.update(t)
        offloaded.update(t)
    want, got = on_device.shadow_state_dict(), offloaded.shadow_state_dict()
    for key, tensor in want.items():
        assert torch.allclose(tensor.cpu().double(), got[key].cpu().double(), rtol=1e-5, atol=1e-6)
    live = {k: v.clone() for k, v in model.state_dict().items()}
    with offloaded.swapped_in():
        assert torch.allclose(model[0].weight.cpu(), got["0.weight"])
    assert all(torch.equal(v, live[k]) for k, v in model.state_dict().items())


def test_the_deferred_fold_of_staged_copies_gives_the_same_shadows():
    # The offload path stages the weights and folds them in at the next update or read. On a
    # CPU model offload is a no-op, so give a shadow the staging buffer by hand to exercise it.
    from koochak.loop.ema import _copies

    model = torch.nn.Linear(4, 3)
    spec = ShadowSpec("constant", decay=0.7)
    direct, staged = ModelEma(model, [spec]), ModelEma(model, [spec])
    staged._staging = _copies(staged._live(), False)
    weights = _weights_sequence(model, 5)
    for t, w in enumerate(weights, start=1):
        _drive_one(direct, model, w, t)
        with torch.no_grad():
            model.weight.copy_(w)
        staged.update(t)
        assert staged._pending is not None  # not folded in until read or the next update
    assert torch.equal(staged.shadow_state_dict()["weight"], direct.shadow_state_dict()["weight"])
    assert staged._pending is None
    with torch.no_grad():
        model.weight.add_(1.0)
    staged.update(6)
    direct.update(6)
    with staged.swapped_in():  # a swap folds the pending update in first
        assert torch.equal(model.weight, direct.shadow_state_dict()["weight"])


def test_dotlist_overrides_reach_the_nested_keys(tmp_path):
    cfg = load_config(None, ["train.ema.profile=power", "train.ema.srel=0.1"])
    (spec,) = shadow_specs(resolve_train_config(cfg.train).ema)
    assert spec.profile == "power" and spec.srel == pytest.approx(0.1)


def test_async_checkpoints_freeze_the_shadows_of_their_own_step(tmp_path):
    from koochak.loop.checkpoint import load

    weights: list[torch.Tensor] = []
    models: list[torch.nn.Module] = []
    hooks = {"on_train_start": [lambda info: models.append(info["model"])],
             "on_step_end": [lambda info: weights.append(models[0].weight.detach().double().clone())]}  # fmt: skip
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    start = model.weight.detach().double().clone()
    training_loop(
        model=model, dataset=_batches(6), step_fn=_step_fn, hooks=hooks,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        train_cfg={"max_steps": 6, "ckpt_every": 1, "keep_last_k": None, "log_every": 1000,
                   "device": "cpu", "out_dir": str(tmp_path), "checkpoint_async": True,
                   "ema": {"decay": 0.6}},
    )  # fmt: skip
    expected = start
    for index, w in enumerate(weights[:-1]):  # periodic checkpoints 0..4 (5 is the terminal one)
        expected = 0.6 * expected + 0.4 * w
        saved = load(str(tmp_path / f"step{index:09d}.pt"))["ema"]
        assert saved["step"] == index + 1
        assert torch.allclose(
            saved["shadows"][0]["state_dict"]["weight"].double(), expected, rtol=1e-6, atol=1e-6
        )
