"""Resuming with a changed config: breaking changes refused with the fix, harmless ones reported."""

import pytest
from koochak.loop.config import defaults
from koochak.loop.resume_config import ConfigChange, check_resume_config, compare_configs


def _config(**changes):
    config = defaults()
    config["optim"]["scheduler"].update(name="cosine_warmup", warmup_steps=5)
    for path, value in changes.items():
        node = config
        *parents, leaf = path.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return config


def test_the_issues_resume_is_refused_naming_keys_values_and_the_override():
    old = _config(train__max_steps=60)
    new = _config(train__max_steps=120, train__grad_accum=2, data__batch_size=128,
                  optim__optimizer__lr=0.003)  # fmt: skip
    with pytest.raises(ValueError) as caught:
        check_resume_config(old, new, where="runs/x/step000000060.pt")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("resume from runs/x/step000000060.pt: the config changed")
    assert "data.batch_size: 64 -> 128; optim.optimizer.lr: 0.001 -> 0.003; " in message
    assert "train.grad_accum: 1 -> 2" in message and "max_steps" not in message
    assert message.endswith(
        "train.resume_allow_changes=[data.batch_size,optim.optimizer.lr,train.grad_accum]"
    )


def test_the_override_accepts_exactly_what_it_names():
    old, new = _config(), _config(data__batch_size=128, optim__optimizer__lr=0.003)
    drift = check_resume_config(old, new, allow=["data.batch_size", "optim.optimizer"])
    assert drift.breaking == ()
    assert [c.key for c in drift.harmless] == ["data.batch_size", "optim.optimizer.lr"]
    with pytest.raises(ValueError, match=r"resume_allow_changes=\[optim.optimizer.lr\]$"):
        check_resume_config(old, new, allow=["data.batch_size"])
    assert check_resume_config(old, new, allow=["*"]).breaking == ()


def test_cadence_sinks_and_placement_are_harmless_and_a_longer_run_is_an_extension():
    old = _config()
    new = _config(train__log_every=5, train__device="cpu", wandb__enabled=True,
                  logging__csv_path="x.csv", train__max_steps=2000, optim__optimizer__fused=True,
                  entry__eval_fn="m:f", train__ema__decay=0.99)  # fmt: skip
    drift = compare_configs(old, new)
    assert drift.breaking == () and drift.max_steps_extended
    assert ConfigChange("train.max_steps", 1000, 2000) in drift.harmless
    assert {c.key for c in drift.harmless} >= {
        "train.log_every",
        "wandb.enabled",
        "logging.csv_path",
    }


def test_a_shorter_run_breaks_the_schedule_only_when_its_horizon_is_max_steps():
    assert [c.key for c in compare_configs(_config(), _config(train__max_steps=10)).breaking] == [
        "train.max_steps"
    ]
    fixed = {"optim__scheduler__T_max": 1000}
    assert compare_configs(_config(**fixed), _config(train__max_steps=10, **fixed)).breaking == ()


@pytest.mark.parametrize(
    "key",
    ["train__seed", "train__shard_dataset", "train__amp", "train__grad_clip", "model__width",
     "data__split_seed", "entry__model", "optim__scheduler__eta_min"],
)  # fmt: skip
def test_data_order_geometry_model_optimizer_and_schedule_changes_break(key):
    drift = compare_configs(_config(), _config(**{key: 7}))
    assert [c.key for c in drift.breaking] == [key.replace("__", ".")]


def test_a_key_added_by_a_newer_version_is_no_change_when_both_sides_have_defaults():
    assert compare_configs(_config(), _config()) == compare_configs(defaults(), defaults())
    assert compare_configs({"train": {"a": 1}}, {"train": {"a": 1}}).breaking == ()
    assert compare_configs({"train": {}}, {"train": {"b": 2}}).breaking == (
        ConfigChange("train.b", "<absent>", 2),
    )
