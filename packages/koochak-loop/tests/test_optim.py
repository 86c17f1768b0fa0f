import math

import pytest
import torch
from koochak.loop.optim import (
    build_optimizer,
    build_scheduler,
    continued_schedule,
    cosine_schedule,
    step_schedule,
    warmup_cosine_schedule,
)
from omegaconf import OmegaConf


def _params():
    return torch.nn.Linear(3, 2).parameters()


def _lrs(scheduler, optimizer, steps):
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize(
    ("name", "cls"),
    [("AdamW", torch.optim.AdamW), ("adam", torch.optim.Adam), ("SGD", torch.optim.SGD)],
)
def test_build_optimizer_names_are_case_insensitive(name, cls):
    assert type(build_optimizer(_params(), {"name": name, "lr": 0.01})) is cls


def test_build_optimizer_passes_every_key_from_an_omegaconf_section():
    cfg = OmegaConf.create(
        {
            "name": "adamw",
            "lr": 3e-4,
            "weight_decay": 0.05,
            "betas": [0.8, 0.95],
            "eps": 1e-6,
            "momentum": None,
            "nesterov": None,
        }
    )
    group = build_optimizer(_params(), cfg).param_groups[0]
    assert (group["lr"], group["weight_decay"], group["betas"], group["eps"]) == (
        3e-4,
        0.05,
        (0.8, 0.95),
        1e-6,
    )
    sgd = build_optimizer(
        _params(), {"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True}
    ).param_groups[0]
    assert (sgd["momentum"], sgd["nesterov"], sgd["weight_decay"]) == (0.9, True, 0.0)


def test_adamw_keeps_torch_default_decay_when_unset():
    assert build_optimizer(_params(), {"name": "adamw"}).param_groups[0]["weight_decay"] == 0.01


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"name": "lion"}, "optim.optimizer.name.*adamw, adam, sgd"),
        ({"name": "adamw", "lrr": 1.0}, "unknown key.*'lrr'.*supported keys: name, lr"),
        ({"name": "adamw", "lr": -1}, "optim.optimizer.lr must be > 0"),
        ({"name": "adam", "betas": [0.9]}, "optim.optimizer.betas"),
        ({"name": "sgd", "nesterov": True}, "momentum > 0"),
        ({"name": "sgd", "lr": "fast"}, "optim.optimizer.lr must be a number"),
    ],
)
def test_build_optimizer_errors_name_the_key(cfg, message):
    with pytest.raises((ValueError, TypeError), match=message):
        build_optimizer(_params(), cfg)


def test_cosine_warmup_matches_the_hand_computed_formula():
    base, eta_min, warmup, total = 0.1, 0.01, 4, 12
    optimizer = torch.optim.SGD(_params(), lr=base)
    scheduler = build_scheduler(
        optimizer,
        {"name": "cosine_warmup", "warmup_steps": warmup, "T_max": None, "eta_min": eta_min},
        {"max_steps": total},
    )
    expected = []
    for t in range(total + 3):
        if t < warmup:
            expected.append(base * (t + 1) / warmup)
        else:
            progress = min(t - warmup, total - warmup) / (total - warmup)
            expected.append(eta_min + (base - eta_min) * (1 + math.cos(math.pi * progress)) / 2)
    assert _lrs(scheduler, optimizer, total + 3) == pytest.approx(expected)


def test_cosine_equals_torch_cosine_annealing_within_t_max():
    optimizer = torch.optim.SGD(_params(), lr=0.5)
    ours = build_scheduler(optimizer, {"name": "cosine", "T_max": 10, "eta_min": 0.05}, {})
    reference_opt = torch.optim.SGD(_params(), lr=0.5)
    reference = torch.optim.lr_scheduler.CosineAnnealingLR(reference_opt, T_max=10, eta_min=0.05)
    assert _lrs(ours, optimizer, 11) == pytest.approx(_lrs(reference, reference_opt, 11))


def test_step_schedule_and_per_group_eta_min():
    optimizer = torch.optim.SGD(
        [
            {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 1.0},
            {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1},
        ],
        lr=1.0,
    )
    scheduler = build_scheduler(optimizer, {"name": "step", "step_size": 3, "gamma": 0.5}, {})
    assert _lrs(scheduler, optimizer, 7) == pytest.approx([1, 1, 1, 0.5, 0.5, 0.5, 0.25])

    optimizer = torch.optim.SGD(
        [
            {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 1.0},
            {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1},
        ],
        lr=1.0,
    )
    scheduler = build_scheduler(optimizer, {"name": "cosine", "eta_min": 0.01}, {"max_steps": 4})
    for _ in range(6):
        optimizer.step()
        scheduler.step()
    # Both groups end at the absolute eta_min, whatever their base LR.
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.01, 0.01])


def test_schedule_factories_compose_like_their_parts():
    warm = warmup_cosine_schedule(3, 10, 0.2)
    cos = cosine_schedule(7, 0.2)
    assert [warm(t) for t in range(3)] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert [warm(t) for t in range(3, 12)] == pytest.approx([cos(t) for t in range(9)])
    assert [step_schedule(2, 0.1)(t) for t in range(5)] == pytest.approx([1, 1, 0.1, 0.1, 0.01])


def test_scheduler_state_dict_round_trips():
    cfg = {"name": "cosine_warmup", "warmup_steps": 3, "T_max": 20, "eta_min": 0.0}
    optimizer = torch.optim.AdamW(_params(), lr=0.01)
    scheduler = build_scheduler(optimizer, cfg, {})
    _lrs(scheduler, optimizer, 7)
    saved_opt, saved_sched = optimizer.state_dict(), scheduler.state_dict()
    continued = _lrs(scheduler, optimizer, 5)

    optimizer2 = torch.optim.AdamW(_params(), lr=0.01)
    scheduler2 = build_scheduler(optimizer2, cfg, {})
    optimizer2.load_state_dict(saved_opt)
    scheduler2.load_state_dict(saved_sched)
    assert _lrs(scheduler2, optimizer2, 5) == pytest.approx(continued)


def test_plateau_reduces_on_a_stalled_metric_and_names_its_monitor():
    optimizer = torch.optim.SGD(_params(), lr=1.0)
    scheduler = build_scheduler(
        optimizer, {"name": "plateau", "factor": 0.5, "patience": 1, "mode": "min"}, {}
    )
    assert scheduler.monitor == "eval_loss"
    for metric in [1.0, 1.0, 1.0]:
        scheduler.step(metric)
    assert optimizer.param_groups[0]["lr"] == 0.5


def test_none_and_null_build_no_scheduler():
    optimizer = torch.optim.SGD(_params(), lr=1.0)
    assert build_scheduler(optimizer, {"name": "none"}, {}) is None
    assert build_scheduler(optimizer, None, {}) is None


@pytest.mark.parametrize(
    ("cfg", "train", "message"),
    [
        (
            {"name": "linear"},
            {},
            "optim.scheduler.name.*none, cosine, step, plateau, cosine_warmup",
        ),
        ({"name": "cosine", "Tmax": 3}, {}, "unknown key.*'Tmax'"),
        ({"name": "cosine"}, {}, "train.max_steps must be an int"),
        ({"name": "cosine"}, {"max_steps": 10, "scheduler_step": "eval"}, "T_max is null"),
        (
            {"name": "cosine_warmup", "warmup_steps": 10, "T_max": 10},
            {},
            r"warmup_steps=10 must be below the schedule length 10 \(optim.scheduler.T_max\): "
            r"set optim.scheduler.warmup_steps=1 or a longer schedule",
        ),
        (
            {"name": "cosine_warmup", "warmup_steps": 100},
            {"max_steps": 40},
            "length 40.*train.max_steps",
        ),
        ({"name": "step"}, {}, "step_size is required"),
        ({"name": "plateau", "mode": "up"}, {}, "optim.scheduler.mode"),
    ],
)
def test_build_scheduler_errors_name_the_key(cfg, train, message):
    optimizer = torch.optim.SGD(_params(), lr=1.0)
    with pytest.raises((ValueError, TypeError), match=message):
        build_scheduler(optimizer, cfg, train)


# ------------------------------------------------------------------------ parameter groups


class _Tiny(torch.nn.Module):
    """nanoGPT's kinds of parameters: an embedding, layer norms, biased linears, a tied head."""

    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(11, 4)
        self.ln = torch.nn.LayerNorm(4)
        self.mlp = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 11, bias=False)
        self.head.weight = self.wte.weight  # tied: one parameter, two names

    def forward(self, idx):
        return self.head(self.mlp(self.ln(self.wte(idx))))


_RULES = [
    {"modules": ["LayerNorm", "Embedding"], "weight_decay": 0.0},
    {"names": ["*.bias"], "weight_decay": 0.0},
    {"names": ["mlp.weight"], "lr": 0.01, "betas": [0.8, 0.9]},
]


def _ids(params):
    return [id(p) for p in params]


def test_param_group_rules_split_the_model_first_match_wins():
    model = _Tiny()
    cfg = {"name": "adamw", "lr": 1e-3, "weight_decay": 0.1, "param_groups": _RULES}
    groups = build_optimizer(model, cfg).param_groups
    # The default group (nothing left: every parameter matched a rule) is left out.
    assert [_ids(g["params"]) for g in groups] == [
        _ids([model.wte.weight, model.ln.weight, model.ln.bias]),  # tied head goes with wte
        _ids([model.mlp.bias]),
        _ids([model.mlp.weight]),
    ]
    assert [(g["lr"], g["weight_decay"], g["betas"]) for g in groups] == [
        (1e-3, 0.0, (0.9, 0.999)),
        (1e-3, 0.0, (0.9, 0.999)),
        (0.01, 0.1, (0.8, 0.9)),
    ]


def test_param_groups_update_exactly_as_the_same_groups_built_by_hand():
    torch.manual_seed(0)
    ours, theirs = _Tiny(), _Tiny()
    theirs.load_state_dict(ours.state_dict())
    rules = [{"max_ndim": 1, "weight_decay": 0.0}, {"names": ["head.*"], "lr": 0.02}]
    built = build_optimizer(ours, {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1,
                                   "param_groups": rules})  # fmt: skip
    by_hand = torch.optim.AdamW(
        [
            {"params": [theirs.mlp.weight]},
            {"params": [theirs.ln.weight, theirs.ln.bias, theirs.mlp.bias], "weight_decay": 0.0},
            {"params": [theirs.wte.weight], "lr": 0.02},  # "head.weight" is one of its names
        ],
        lr=1e-2,
        weight_decay=0.1,
    )
    idx = torch.tensor([[1, 2, 3], [4, 5, 6]])
    for model, optimizer in ((ours, built), (theirs, by_hand)):
        for _ in range(3):
            optimizer.zero_grad()
            model(idx).square().mean().backward()
            optimizer.step()
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(a, b), name


def test_unmatched_parameters_form_the_default_group_and_a_rule_matching_nothing_warns():
    model = _Tiny()
    with pytest.warns(UserWarning, match=r"optim.optimizer.param_groups\[1\] matched no parameter"):
        groups = build_optimizer(
            model,
            {"name": "sgd", "lr": 0.1, "momentum": 0.9,
             "param_groups": [{"names": ["mlp.*"], "momentum": 0.5}, {"modules": ["Conv2d"]}]},
        ).param_groups  # fmt: skip
    assert [len(g["params"]) for g in groups] == [3, 2]
    assert [g["momentum"] for g in groups] == [0.9, 0.5]


def test_fused_and_foreach_reach_torch():
    assert build_optimizer(_params(), {"name": "adamw", "fused": True}).defaults["fused"] is True
    assert (
        build_optimizer(_params(), {"name": "sgd", "foreach": False}).defaults["foreach"] is False
    )
    defaults = build_optimizer(_params(), {"name": "adam"}).defaults
    assert (defaults["fused"], defaults["foreach"]) == (None, None)


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (
            {"param_groups": [{"names": ["*.bias"], "momentum": 0.9}]},
            r"param_groups\[0\]: unknown key\(s\) 'momentum'.*options of this optimizer \(lr, ",
        ),
        ({"param_groups": [{"weight_decay": 0.0}]}, r"param_groups\[0\]: needs a selector"),
        ({"param_groups": [{"names": "*.bias"}]}, r"param_groups\[0\].names: expected a non-empty"),
        ({"param_groups": [{"max_ndim": -1}]}, r"param_groups\[0\].max_ndim: expected an int"),
        ({"param_groups": [{"names": ["x"], "lr": 0}]}, r"param_groups\[0\].lr must be > 0"),
        ({"param_groups": {"names": ["x"]}}, "param_groups: expected a list of rules"),
        ({"fused": True, "foreach": True}, "fused and optim.optimizer.foreach cannot both"),
        ({"fused": "yes"}, "optim.optimizer.fused must be true, false or null"),
    ],
)
def test_param_group_and_implementation_errors_name_the_key(cfg, message):
    with pytest.raises((ValueError, TypeError), match=message):
        build_optimizer(_Tiny(), {"name": "adamw", **cfg})


def test_rules_need_the_model_not_its_parameters():
    with pytest.raises(ValueError, match=r"needs the model: call build_optimizer\(model, cfg\)"):
        build_optimizer(_params(), {"param_groups": [{"names": ["*.bias"]}]})


# ------------------------------------------------------------------ max_steps extension


def _resumed(stop_at: int, old_max: int, new_max: int, warmup: int = 5):
    """LRs of a run that stepped `stop_at` times under max_steps=old_max, then resumed from its
    state with max_steps=new_max: (before, after) lists."""
    cfg = {"name": "cosine_warmup", "warmup_steps": warmup, "eta_min": 0.01}
    optimizer = torch.optim.SGD(_params(), lr=0.1)
    scheduler = build_scheduler(optimizer, cfg, {"max_steps": old_max})
    before = _lrs(scheduler, optimizer, stop_at)
    checkpoint = {"config": {"train": {"max_steps": old_max}}, "scheduler": scheduler.state_dict(),
                  "optimizer": optimizer.state_dict()}  # fmt: skip
    optimizer = torch.optim.SGD(_params(), lr=0.1)
    scheduler = build_scheduler(optimizer, cfg, {"max_steps": new_max}, checkpoint=checkpoint)
    optimizer.load_state_dict(checkpoint["optimizer"])  # as resume restores them
    scheduler.load_state_dict(checkpoint["scheduler"])
    return before, _lrs(scheduler, optimizer, new_max - stop_at + 2)


def test_an_extended_run_continues_its_decay_from_the_lr_it_reached():
    before, after = _resumed(stop_at=30, old_max=60, new_max=120)
    uninterrupted = _resumed(stop_at=30, old_max=60, new_max=60)[1]
    assert after[0] == pytest.approx(uninterrupted[0])  # no jump at the resume
    assert all(a > b for a, b in zip(after, after[1:90]))  # then a smooth decay ...
    assert after[90] == pytest.approx(0.01) and after[-1] == pytest.approx(0.01)  # to eta_min
    assert min(after) >= 0.01 - 1e-12


def test_an_extension_before_the_decay_began_is_the_longer_schedule():
    _, after = _resumed(stop_at=3, old_max=60, new_max=120)
    fresh_opt = torch.optim.SGD(_params(), lr=0.1)
    fresh = build_scheduler(fresh_opt, {"name": "cosine_warmup", "warmup_steps": 5,
                                        "eta_min": 0.01}, {"max_steps": 120})  # fmt: skip
    assert after == pytest.approx(_lrs(fresh, fresh_opt, 122)[3:])


def test_extending_a_finished_schedule_warns_that_it_stays_at_eta_min():
    with pytest.warns(UserWarning, match=r"schedule had ended \(step 60 of 60"):
        _, after = _resumed(stop_at=60, old_max=60, new_max=90)
    assert after == pytest.approx([0.01] * len(after))


def test_continued_schedule_is_the_schedule_then_a_cosine_from_where_it_was():
    half = continued_schedule(lambda step: 1.0 - step / 10, start=4, total=8, final_factor=0.2)
    assert [half(t) for t in range(4)] == [1.0, 0.9, 0.8, 0.7]
    assert half(4) == pytest.approx(0.6) and half(8) == pytest.approx(0.2) == half(50)
    assert half(6) == pytest.approx(0.4)
