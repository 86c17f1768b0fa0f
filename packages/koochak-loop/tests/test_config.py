"""Config: defaults <- YAML <- overrides, strictness, errors naming keys, the template in sync."""

from __future__ import annotations

import pathlib
import re

import pytest
import yaml
from koochak.loop.config import (
    ConfigError,
    TrainConfig,
    as_dict,
    defaults,
    format_summary,
    get_section,
    load_config,
    load_config_with_report,
    resolve_train_config,
    summarize_config,
    to_container,
)

TEMPLATE = pathlib.Path(__file__).resolve().parents[3] / "examples" / "config_template.yaml"


def write(tmp_path, text: str) -> pathlib.Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_template_lists_every_key_with_its_default():
    assert yaml.safe_load(TEMPLATE.read_text()) == defaults()


def test_template_comments_every_key():
    for line in TEMPLATE.read_text().splitlines():
        if re.match(r"^\s+\w+:", line):
            assert "#" in line, f"template key without a comment: {line!r}"


def test_defaults_then_yaml_then_overrides(tmp_path):
    path = write(tmp_path, "train:\n  max_steps: 5\n  log_every: 2\ndata:\n  batch_size: 8\n")
    cfg = load_config(path, ["train.log_every=3", "optim.optimizer.lr=0.5"])
    assert cfg.train.max_steps == 5  # YAML over default
    assert cfg.train.log_every == 3  # override over YAML
    assert cfg.optim.optimizer.lr == 0.5
    assert cfg.train.grad_accum == 1  # default
    assert cfg.data.batch_size == 8


def test_interpolation_across_sections(tmp_path):
    path = write(
        tmp_path, "train:\n  out_dir: /r/x\nlogging:\n  csv_path: ${train.out_dir}/log.csv\n"
    )
    cfg = load_config(path, ["train.out_dir=/r/y"])
    assert cfg.logging.csv_path == "/r/y/log.csv"
    assert to_container(cfg)["logging"]["csv_path"] == "/r/y/log.csv"


def test_unknown_key_fails_with_full_path_and_suggestion(tmp_path):
    path = write(tmp_path, "train:\n  max_stpes: 5\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert str(path) in message and "'train.max_stpes'" in message
    assert "did you mean 'train.max_steps'" in message
    with pytest.raises(ConfigError, match=r"'optim\.optimizer\.learning_rate'"):
        load_config(None, ["optim.optimizer.learning_rate=1"])
    with pytest.raises(ConfigError, match="'trian' \\(did you mean 'train'\\?\\)"):
        load_config(None, ["trian.max_steps=1"])


def test_relaxed_mode_warns_and_keeps_unknown_keys(tmp_path):
    path = write(tmp_path, "train:\n  strict_config: false\n  max_stpes: 5\n")
    with pytest.warns(UserWarning, match="train.max_stpes"):
        cfg = load_config(path)
    assert cfg.train.max_stpes == 5
    path = write(tmp_path, "train:\n  strict_config: false\n  config_warn_unknown: false\n  x: 1\n")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(path)


def test_data_section_is_free_form():
    cfg = load_config(None, ["data.val_fraction=0.2"])
    assert cfg.data.val_fraction == 0.2


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("train.max_steps=ten", r"train\.max_steps: expected int or null, got 'ten'"),
        ("train.amp=fp8", r"train\.amp: expected one of none\|bf16\|fp16, got 'fp8'"),
        ("train.grad_accum=0", r"train\.grad_accum: expected an integer >= 1, got 0"),
        ("train.ddp=maybe", r"train\.ddp: expected bool, got 'maybe'"),
        ("train.grad_clip=-1", r"train\.grad_clip: expected a positive number"),
        ("optim.scheduler.name=linear", r"optim\.scheduler\.name: expected one of"),
        ("optim.optimizer.betas=[0.9,x]", r"optim\.optimizer\.betas\[1\]: expected float"),
    ],
)
def test_type_and_value_errors_name_key_and_value(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, [override])


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml: config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="section 'train' must be a mapping"):
        load_config(write(tmp_path, "train: 3\n"))
    with pytest.raises(ConfigError, match=r"cannot resolve interpolation at 'logging\.csv_path'"):
        load_config(None, ["logging.csv_path=${train.nope}"])
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(None, ["train.max_steps"])


def test_summary_names_sections_unknown_keys_and_strictness(tmp_path):
    path = write(tmp_path, "train:\n  strict_config: false\n  extra: 1\ndata: {}\n")
    with pytest.warns(UserWarning):
        cfg, report = load_config_with_report(path)
    line = format_summary(report)
    assert "sections train, data" in line
    assert "unknown keys: train.extra" in line and "strict_config: false" in line
    assert "strict_config: true" in summarize_config(load_config(None))


def test_get_section_names_the_missing_section():
    cfg = load_config(None)
    assert get_section(cfg, "train").max_steps == 1000
    with pytest.raises(ConfigError, match="no section 'trainer'"):
        get_section(cfg, "trainer")


def test_the_model_section_is_free_form_like_data(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("model:\n  n_layer: 4\n  attn: {heads: 4, dropout: 0.1}\n")
    cfg = load_config(path, ["model.n_embd=128"])
    assert as_dict(cfg.model) == {"n_layer": 4, "attn": {"heads": 4, "dropout": 0.1}, "n_embd": 128}
    assert load_config(None).model == {}  # nothing needed when a model has no hyperparameters


def test_resolve_train_config_for_plain_dicts():
    assert resolve_train_config({"max_steps": 3}) == TrainConfig(max_steps=3)
    assert resolve_train_config(None) == TrainConfig()
    assert resolve_train_config({"grad_clip": 1}).grad_clip == 1.0
    with pytest.raises(ConfigError, match="train.log_every: expected int, got '5'"):
        resolve_train_config({"log_every": "5"})
    with pytest.raises(ConfigError, match="train.bogus"):
        resolve_train_config({"bogus": 1})
    assert resolve_train_config({"bogus": 1, "strict_config": False}).strict_config is False


def test_config_records_are_frozen_and_helpers_take_them_typed_or_check_a_mapping_once():
    import dataclasses

    from koochak.loop.config import as_train_config
    from koochak.loop.evacuation import make_evacuation

    cfg = resolve_train_config({"ema": {"decay": 0.9}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_steps = 5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.ema.decay = 0.5  # type: ignore[misc]
    assert as_train_config(cfg) is cfg  # already typed: passed on as it is
    assert as_train_config({"max_steps": 3}) == TrainConfig(max_steps=3)
    # A helper called with a plain train mapping checks it like the loop would, naming the key.
    with pytest.raises(ConfigError, match="train.evacuation_enabled: expected bool, got 'yes'"):
        make_evacuation(None, {"evacuation_enabled": "yes"})


def test_a_typo_in_an_override_is_blamed_on_the_override_not_the_file(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("train:\n  max_steps: 5\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path, ["train.max_stpes=7"])
    assert str(caught.value).startswith(
        "override 'train.max_stpes=7': unknown config key 'train.max_stpes' "
        "(did you mean 'train.max_steps'?)"
    )
    with pytest.raises(ConfigError, match=r"^override 'train.max_steps=abc': train.max_steps: "):
        load_config(path, ["train.max_steps=abc"])
    path.write_text("train:\n  max_stpes: 5\n")  # the file's own typo is still the file's
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: unknown config key"):
        load_config(path, ["train.log_every=5"])
