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


# ----------------------------------------------------------------------------- the one table


def _leaf_paths(schema, prefix=""):
    import dataclasses
    import typing

    for name, tp in typing.get_type_hints(schema).items():
        if dataclasses.is_dataclass(tp):
            yield from _leaf_paths(tp, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def test_every_config_key_has_a_resume_class():
    from koochak.loop.config import Config
    from koochak.loop.resume_config import resume_class

    missing = [path for path in _leaf_paths(Config) if resume_class(path) is None]
    assert not missing, (
        f"config key(s) {missing} have no resume class: add a row to RESUME_CLASSES in "
        "packages/koochak-loop/src/koochak/loop/resume_config.py, e.g. "
        f'"{missing[0]}": _SAME, -- SAME_RUN when changing it between attempts leaves the run '
        "the same run (what is observed, where or how it is persisted, how it is executed), "
        "DIFFERENT_RUN when it changes what is trained (data order, batch geometry, model, "
        "numerics, optimizer, schedule)"
    )


def test_a_train_key_without_a_row_is_a_different_run():
    from koochak.loop.resume_config import DIFFERENT_RUN, SAME_RUN, resume_class

    assert resume_class("train.no_such_key") is None  # the test above names it
    assert compare_configs({"train": {"no_such_key": 1}}, {"train": {"no_such_key": 2}}).breaking
    assert resume_class("train.ema.decay") == SAME_RUN  # its section's row
    assert resume_class("optim.optimizer.fused") == SAME_RUN  # the longest row decides
    assert resume_class("optim.optimizer.lr") == DIFFERENT_RUN
    assert resume_class("data.anything_the_user_reads") == DIFFERENT_RUN


@pytest.mark.parametrize(
    ("key", "value"),
    [("train__checkpoint_parts", 2), ("train__checkpoint_parts", "auto"),
     ("train__checkpoint_async", True), ("train__checkpoint_replicas", ["/durable"]),
     ("train__checkpoint_replication_max_lag", 5), ("train__checkpoint_prune_unreplicated", True),
     ("train__checkpoint_dir", "/elsewhere"), ("train__keep_last_k", 9)],
)  # fmt: skip
def test_how_the_run_is_persisted_is_the_same_run(key, value):
    drift = compare_configs(_config(), _config(**{key: value}))
    assert drift.breaking == () and [c.key for c in drift.harmless] == [key.replace("__", ".")]


def test_lowering_max_steps_without_a_schedule_that_follows_it_is_the_same_run():
    old = _config(train__max_steps=100000, optim__scheduler__name="none")
    new = _config(train__max_steps=49, optim__scheduler__name="none")
    drift = check_resume_config(old, new)
    assert drift.harmless == (ConfigChange("train.max_steps", 100000, 49),)
    assert not drift.max_steps_extended


# ----------------------------------------------------------------------------- through the loop


def _loop(out_dir, model=None, steps=6, checkpoint_dict=None, config_json=None, evacuate=False,
          **train):  # fmt: skip
    import torch
    from koochak.loop import training_loop
    from koochak.loop.evacuation import EvacuationController

    torch.manual_seed(0)
    model = model if model is not None else torch.nn.Linear(2, 1)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 2, generator=g), torch.randn(4, 1, generator=g)) for _ in range(12)]
    controller = None
    if evacuate:
        controller = EvacuationController()
        controller.request()  # honoured after the first update

    def step_fn(m, batch, ctx):
        return {"loss": torch.nn.functional.mse_loss(m(batch[0]).sum(-1, keepdim=True), batch[1])}

    return training_loop(
        model=model, dataset=data, step_fn=step_fn,
        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        train_cfg={"max_steps": steps, "device": "cpu", "out_dir": str(out_dir),
                   "log_every": 100, **train},
        resume="auto", checkpoint_dict=checkpoint_dict, config_json=config_json,
        evacuation=controller,
    )  # fmt: skip


def test_a_killed_run_finishes_early_in_parts(tmp_path):
    """The issue's case: a run for 100000 steps, stopped, finished at 6 with checkpoint_parts=2."""
    from koochak.loop.evacuation import Evacuated

    with pytest.raises(Evacuated):
        _loop(tmp_path, steps=100000, evacuate=True)
    with pytest.warns(UserWarning, match=r"train.checkpoint_parts: 1 -> 2; train.max_steps: "
                                         r"100000 -> 6"):  # fmt: skip
        checkpoint = _loop(tmp_path, steps=6, checkpoint_parts=2)
    assert (checkpoint["step"], checkpoint["reason"]) == (6, "terminal")
    assert list(tmp_path.glob("step000000006.pt.part-*"))  # saved in parts from now on


def test_a_checkpoint_without_a_config_resumes_with_one_warning(tmp_path):
    import warnings

    first = _loop(tmp_path / "a", steps=2)
    first.pop("config")  # as user code, or an older tool, writes one
    config_json = {"train": {"max_steps": 4}, "data": {"batch_size": 4}, "model": {"width": 3}}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        checkpoint = _loop(tmp_path / "b", steps=4, checkpoint_dict=first, config_json=config_json)
    notes = [str(w.message) for w in seen if "config" in str(w.message)]
    assert len(notes) == 1, notes
    assert "recorded no config" in notes[0] and "cannot be compared" in notes[0]
    assert "\n" not in notes[0]
    assert (checkpoint["step"], checkpoint["next_step"]) == (4, 4)


def _mlp(width):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2, width), torch.nn.Linear(width, 1))


def test_a_model_of_another_width_is_refused_naming_the_parameter_and_both_shapes(tmp_path):
    from koochak.loop.config import ConfigError

    _loop(tmp_path, model=_mlp(4), steps=2, config_json={"model": {"width": 4}})
    for allow in ([], ["model.width"], ["*"]):  # no override takes another shape
        with pytest.raises(ConfigError) as caught:
            _loop(tmp_path, model=_mlp(8), steps=4, config_json={"model": {"width": 8}},
                  resume_allow_changes=allow)  # fmt: skip
        message = str(caught.value)
        assert "\n" not in message and len(message) < 600
        assert "model parameter '0.weight' has shape [4, 2] in the checkpoint but [8, 2]" in message
        assert "(and 2 more parameter(s))" in message and "cannot be resumed" in message
        assert "resume_allow_changes" not in message and "size mismatch" not in message


def test_a_model_with_other_parameters_is_refused_in_one_line():
    import torch
    from koochak.loop.config import ConfigError
    from koochak.loop.resume_config import check_model_shapes

    saved = _mlp(4).state_dict()
    live = torch.nn.Sequential(*_mlp(4), torch.nn.Linear(1, 1)).state_dict()
    with pytest.raises(ConfigError, match=r"^resume from x: the model's parameters differ: 2 not "
                                          r"in the checkpoint \('2.weight', '2.bias'\); a "
                                          r"checkpoint cannot be resumed"):  # fmt: skip
        check_model_shapes(saved, live, "x")
    check_model_shapes(saved, _mlp(4).state_dict())  # the same architecture: nothing to say


def test_an_unchanged_nan_is_no_change_and_floats_compare_by_their_bits():
    nan = float("nan")
    old = _config(data__pad_value=nan, model__scales=[1.0, nan], optim__optimizer__lr=0.001)
    new = _config(data__pad_value=float("nan"), model__scales=[1, float("nan")])
    assert check_resume_config(old, new).breaking == ()
    assert compare_configs(old, new).harmless == ()
    drift = compare_configs(_config(data__pad_value=0.0), _config(data__pad_value=-0.0))
    assert [c.key for c in drift.breaking] == ["data.pad_value"]
    drift = compare_configs(_config(data__pad_value=nan), _config(data__pad_value=1.5))
    assert [c.key for c in drift.breaking] == ["data.pad_value"]
    assert compare_configs(_config(data__pad_value=10**400), _config(data__pad_value=1.0)).breaking
