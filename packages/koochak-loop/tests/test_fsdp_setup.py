"""FSDP setup and the sharded gradient gate, in process: a gloo group of one rank, and a stand-in
for the cross-rank reductions (the real ones run in test_fsdp.py on 2 and 4 ranks)."""

from __future__ import annotations

import math

import pytest
import torch
from koochak.loop import fsdp
from koochak.loop.config import ConfigError, FsdpConfig, resolve_train_config
from koochak.loop.gradients import (
    NonFiniteGradientError,
    apply_gate,
    check_finite,
    scaled_total_norm,
    total_norm,
)
from torch import nn


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(x)


def _model() -> nn.Module:
    return nn.Sequential(Block(), nn.ReLU(), Block(), nn.Linear(3, 1))


@pytest.fixture
def group(tmp_path):
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    yield
    torch.distributed.destroy_process_group()


def _sharded_modules(model: nn.Module) -> list[str]:
    from torch.distributed.fsdp import FSDPModule

    return [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def test_shard_modules_by_class_name_or_callable_then_the_root(group):
    model = fsdp.shard_model(_model(), FsdpConfig(shard_modules=["Block"]), torch.device("cpu"))
    assert _sharded_modules(model) == ["", "0", "2"]
    assert fsdp.is_sharded(model)
    pick = FsdpConfig(shard_modules=lambda m: isinstance(m, nn.Linear) and m.out_features == 1)
    assert _sharded_modules(fsdp.shard_model(_model(), pick, torch.device("cpu"))) == ["", "3"]


def test_a_shard_module_name_the_model_lacks_is_refused_naming_its_classes(group):
    with pytest.raises(ValueError, match=r"no module of class 'Blok' in the model \(its classes: "):
        fsdp.shard_model(_model(), FsdpConfig(shard_modules=["Blok"]), torch.device("cpu"))


def test_sharding_needs_a_process_group():
    with pytest.raises(RuntimeError, match="launch with torchrun"):
        fsdp.shard_model(_model(), FsdpConfig(), torch.device("cpu"))


def test_fsdp_config_is_checked():
    cfg = resolve_train_config({"fsdp": {"enabled": True, "shard_modules": ["Block"]}})
    assert cfg.fsdp.shard_modules == ["Block"] and cfg.fsdp.mixed_precision == "none"
    with pytest.raises(ConfigError, match="train.fsdp.enabled and train.ddp are both true"):
        resolve_train_config({"ddp": True, "fsdp": {"enabled": True}})
    with pytest.raises(ConfigError, match="train.fsdp.mixed_precision: expected one of none"):
        resolve_train_config({"fsdp": {"mixed_precision": "fp8"}})
    with pytest.raises(ConfigError, match="train.fsdp.shard_modules: expected a list"):
        resolve_train_config({"fsdp": {"shard_modules": "Block"}})
    picker = resolve_train_config({"fsdp": {"shard_modules": callable}}).fsdp.shard_modules
    assert picker is callable
    assert resolve_train_config({"fsdp": {"hsdp": True, "shard_size": 8}}).fsdp.shard_size == 8
    with pytest.raises(ConfigError, match="train.fsdp.shard_size: set only with train.fsdp.hsdp"):
        resolve_train_config({"fsdp": {"shard_size": 8}})
    with pytest.raises(ConfigError, match="train.fsdp.shard_size: expected an integer >= 1"):
        resolve_train_config({"fsdp": {"hsdp": True, "shard_size": 0}})


def test_the_hsdp_shard_group_is_the_ranks_per_node_unless_given():
    hsdp = FsdpConfig(hsdp=True)
    assert fsdp.shard_size(FsdpConfig(), 16) == 16  # 1-D: every rank
    assert fsdp.shard_size(hsdp, 16, {"LOCAL_WORLD_SIZE": "8"}) == 8
    assert fsdp.shard_size(FsdpConfig(hsdp=True, shard_size=4), 16, {}) == 4
    with pytest.raises(ValueError, match="train.fsdp.shard_size: 8 ranks per shard group, but "
                                         "the world size 12 is not a multiple of it"):  # fmt: skip
        fsdp.shard_size(hsdp, 12, {"LOCAL_WORLD_SIZE": "8"})
    with pytest.raises(ValueError, match="train.fsdp.shard_size: null means the ranks per node, "
                                         "but LOCAL_WORLD_SIZE is unset"):  # fmt: skip
        fsdp.shard_size(hsdp, 12, {})


def _train(tmp_path, optimizer, scheduler=None, **cfg):
    from koochak.loop import training_loop

    batches = [{"x": torch.randn(4, 3), "y": torch.randn(4, 1)} for _ in range(3)]
    return training_loop(
        model=_model(),
        dataset=batches,
        step_fn=lambda m, b, ctx: {"loss": nn.functional.mse_loss(m(b["x"]), b["y"])},
        optimizer=optimizer,
        scheduler=scheduler,
        train_cfg={"max_steps": 3, "device": "cpu", "out_dir": str(tmp_path),
                   "progress_bar": False, **cfg},
    )  # fmt: skip


def test_optimizer_and_scheduler_factories_are_built_on_the_model_the_loop_trains(tmp_path):
    built = {}

    def make_optimizer(model):
        built["params"] = list(model.parameters())
        return torch.optim.SGD(model.parameters(), lr=0.1)

    def make_scheduler(optimizer):
        built["optimizer"] = optimizer
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    ckpt = _train(tmp_path, make_optimizer, make_scheduler)
    assert len(built["params"]) == 6
    assert ckpt["scheduler"]["last_epoch"] == 3
    assert ckpt["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.1 * 0.5**3)


def test_under_fsdp_an_optimizer_built_before_sharding_is_refused(group, tmp_path):
    optimizer = torch.optim.SGD(_model().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="pass a factory instead"):
        _train(tmp_path, optimizer, fsdp={"enabled": True})


def test_a_one_rank_fsdp_run_trains_like_the_plain_one(group, tmp_path):
    torch.manual_seed(1)
    plain = _train(tmp_path / "a", lambda m: torch.optim.AdamW(m.parameters(), lr=0.01),
                   grad_clip=0.1, ema={"decay": 0.5})  # fmt: skip
    torch.manual_seed(1)
    sharded = _train(tmp_path / "b", lambda m: torch.optim.AdamW(m.parameters(), lr=0.01),
                     grad_clip=0.1, ema={"decay": 0.5}, fsdp={"enabled": True, "shard_modules": ["Block"]})  # fmt: skip
    sharded = fsdp.full(sharded)  # the loop returns this rank's DTensors; gather them
    for key, value in plain["model"].items():
        assert torch.equal(sharded["model"][key], value), key
    shadow = sharded["ema"]["shadows"][0]["state_dict"]
    for key, value in plain["ema"]["shadows"][0]["state_dict"].items():
        assert torch.equal(shadow[key], value), key


class Across:
    """Two ranks' worth of reductions, this rank's figures counted twice: the global figures of
    a world whose two shards are equal."""

    def __init__(self, other_bad: bool = False) -> None:
        self.other_bad = other_bad

    def sum(self, value):
        return value * 2

    def max(self, value):
        return value

    def any(self, flag, device):
        return flag or self.other_bad


def _named(*grads):
    params = []
    for i, g in enumerate(grads):
        p = nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append((f"p{i}", p))
    return params


def test_the_norm_of_shards_is_the_norm_of_all_of_them():
    grads = [torch.tensor([3.0, 4.0]), torch.tensor([12.0])]
    assert float(total_norm(grads, Across())) == pytest.approx(math.sqrt(2) * 13)
    assert scaled_total_norm(grads, Across()) == pytest.approx(math.sqrt(2) * 13)


def test_an_overflowing_sharded_norm_is_rescaled_over_every_shard():
    named = _named(torch.full((4,), 3e38))
    norm = float(total_norm([p.grad for _, p in named], Across()))
    assert math.isinf(norm)
    gate = apply_gate(named, norm, max_norm=None, step=0, across=Across())
    assert gate["grad_norm_rescaled"] == 1.0
    assert gate["grad_norm"] == pytest.approx(3e38 * math.sqrt(8))


def test_a_nan_on_another_rank_rejects_the_update_here_too():
    named = _named(torch.ones(2))
    with pytest.raises(NonFiniteGradientError, match="on another rank's shard"):
        apply_gate(named, float("nan"), max_norm=1.0, step=4, across=Across(other_bad=True))
    with pytest.raises(NonFiniteGradientError, match="step 5: .*on another rank's shard"):
        check_finite(named, 5, Across(other_bad=True))
    check_finite(named, 5, Across())


def test_cpu_offload_on_a_cpu_device_warns_and_shards_as_usual(group):
    with pytest.warns(UserWarning, match="cpu_offload has no effect on a CPU device"):
        model = fsdp.shard_model(
            _model(), FsdpConfig(shard_modules=["Block"], cpu_offload=True), torch.device("cpu")
        )
    assert _sharded_modules(model) == ["", "0", "2"]


@pytest.mark.parametrize("background", [False, True])
def test_keep_best_k_under_fsdp_never_prunes_the_best_checkpoint(group, tmp_path, background):
    from koochak.loop import training_loop
    from koochak.storage.artifact import published_candidates
    from koochak.storage.store import open_store

    losses = iter([5.0, 1.0, 4.0, 3.0, 6.0, 7.0])
    batches = [{"x": torch.randn(4, 3), "y": torch.randn(4, 1)} for _ in range(6)]
    training_loop(
        model=_model(),
        dataset=batches,
        step_fn=lambda m, b, ctx: {"loss": nn.functional.mse_loss(m(b["x"]), b["y"])},
        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        eval_dataset=[0],
        eval_fn=lambda model, data, ctx: {"loss": next(losses)},
        train_cfg={"max_steps": 6, "device": "cpu", "out_dir": str(tmp_path), "eval_every": 1,
                   "ckpt_every": 1, "keep_last_k": 2, "keep_best_k": 1, "progress_bar": False,
                   "keep_best_metric": "eval_loss", "checkpoint_async": background,
                   "fsdp": {"enabled": True, "shard_modules": ["Block"]}},
    )  # fmt: skip
    names = sorted(
        n for _, n in published_candidates(open_store(str(tmp_path)), r"step(\d{9})\.pt")
    )
    # The two newest (4, and 6: the terminal one) and the best: step 1 (eval_loss 1.0).
    assert names == ["step000000001.pt", "step000000004.pt", "step000000006.pt"]
    assert {p.name.split(".part-")[0] for p in tmp_path.glob("step*.pt.part-*")} == set(names)
