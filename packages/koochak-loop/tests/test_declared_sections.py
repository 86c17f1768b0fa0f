"""Free-form sections a factory declares are checked: data.batchsize is refused, not ignored."""

from __future__ import annotations

import re
import textwrap

import pytest
from koochak.loop.cli import main
from koochak.loop.config import ConfigError
from koochak.loop.declared import check_declared_sections, declared_keys, keyword_values

USER_CODE = """
import torch
from torch.nn import functional as F

SEEN = {}


def make_model(cfg, *, width=4):
    SEEN["width"] = width
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.Linear(width, 1))


def listed_model(cfg):
    return make_model(cfg, width=cfg.model.width)


listed_model.config_keys = ["width", "dropout"]


def open_model(cfg, **options):
    return make_model(cfg)


def dataset(cfg, start_step=0, *, noise=0.0):
    SEEN["noise"], SEEN["batch_size"] = noise, cfg.data.batch_size
    gen = torch.Generator().manual_seed(start_step)
    while True:
        x = torch.randn(cfg.data.batch_size, 3, generator=gen)
        yield x, x.sum(1, keepdim=True) + noise


def plain_dataset(cfg, start_step=0):
    return dataset(cfg, start_step)


def step_fn(model, batch, ctx):
    x, y = batch
    return {"loss": F.mse_loss(model(x), y)}
"""


@pytest.fixture
def project(tmp_path, monkeypatch):
    name = f"declared_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{name}.py").write_text(USER_CODE)
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "cfg.yaml"
    config.write_text(textwrap.dedent(f"""
        train: {{max_steps: 2, log_every: 1, device: cpu, out_dir: {tmp_path / "run"},
                 progress_bar: false}}
        data: {{batch_size: 8, noise: 0.5}}
        model: {{width: 6}}
        entry: {{model: {name}:make_model, dataset: {name}:dataset, step: {name}:step_fn}}
        """))  # fmt: skip
    return name, config


def _error(capsys) -> str:
    (line,) = capsys.readouterr().err.strip().splitlines()
    return line


def test_a_misspelt_data_key_is_refused_with_a_did_you_mean(project, capsys):
    _, config = project
    assert main(["--config", str(config), "data.batchsize=16", "--resume", "none"]) == 2
    line = _error(capsys)
    assert line.startswith("koochak-train: error: override 'data.batchsize=16': unknown config "
                           "key 'data.batchsize' (did you mean 'data.batch_size'?)")  # fmt: skip
    assert "(batch_size, data_dir, noise, num_workers)" in line


def test_declared_keys_are_passed_and_a_misspelt_model_key_is_named(project, capsys):
    name, config = project
    assert main(["--config", str(config), "--resume", "none"]) == 0
    import importlib

    seen = importlib.import_module(name).SEEN
    assert seen == {"width": 6, "noise": 0.5, "batch_size": 8}  # keyword-only: passed
    capsys.readouterr()
    assert main(["--config", str(config), "model.widht=8", "--resume", "none"]) == 2
    assert "unknown config key 'model.widht' (did you mean 'model.width'?)" in _error(capsys)


def test_a_config_keys_list_declares_too(project, capsys):
    name, config = project
    listed = f"entry.model={name}:listed_model"
    assert main(["--config", str(config), listed, "model.dropout=0.1", "--resume", "none"]) == 0
    capsys.readouterr()
    assert main(["--config", str(config), listed, "model.dropuot=0.1", "--resume", "none"]) == 2
    assert "'model.dropuot' (did you mean 'model.dropout'?)" in _error(capsys)


@pytest.mark.parametrize("override", ["entry.model={name}:open_model",
                                      "entry.dataset={name}:plain_dataset"])  # fmt: skip
def test_a_factory_that_declares_nothing_leaves_its_section_unchecked(project, override):
    name, config = project
    section = "model" if "model" in override else "data"
    args = ["--config", str(config), override.format(name=name), f"{section}.anything=1"]
    assert main([*args, "--resume", "none"]) == 0


def test_relaxed_config_warns_instead(project, capsys):
    _, config = project
    # koochak-train prints a warning as one line on stderr (its console logging takes Python's
    # warnings), so the line is what a person, and this test, sees.
    assert main(["--config", str(config), "data.batchsize=16", "train.strict_config=false",
                 "--resume", "none"]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert re.search(r"koochak warning: .*unknown config key 'data.batchsize'.*kept", err), err


def test_the_rules_as_functions():
    def kw(cfg, start_step=0, *, a=1, b=2):
        pass

    def listed(cfg):
        pass

    listed.config_keys = ("c",)
    assert declared_keys(kw) == {"a", "b"} and declared_keys(listed) == {"c"}
    assert declared_keys(lambda cfg: None) is None and declared_keys(lambda cfg, **k: 0) is None
    assert keyword_values(kw, {"a": 5, "z": 0}) == {"a": 5}
    assert keyword_values(listed, {"c": 1}) == {}  # a list: the factory reads cfg itself
    # Both data readers must declare; then either's keys are known.
    values = {"data": {"batch_size": 1, "a": 1, "c": 2}}
    check_declared_sections(values, [("entry.dataset", "m:kw", kw),
                                     ("entry.eval_dataset", "m:listed", listed)])  # fmt: skip
    with pytest.raises(ConfigError, match=r"^f.yaml: unknown config key 'data.c': entry.dataset="):
        check_declared_sections(values, [("entry.dataset", "m:kw", kw)], lambda key: "f.yaml")
    listed.config_keys = "c"
    with pytest.raises(ConfigError, match="config_keys must be a list of key names"):
        declared_keys(listed, "entry.model='m:listed'")


def test_koochak_train_refuses_a_resume_into_a_wider_model_naming_the_shapes(project, capsys):
    """Issue 27: the refusal used to suggest train.resume_allow_changes=[model.width], which
    then ended in load_state_dict's size-mismatch dump. Now: exit 2, one line, no override."""
    _, config = project
    assert main(["--config", str(config)]) == 0
    capsys.readouterr()
    for extra in ([], ["train.resume_allow_changes=[model.width]"]):
        assert main(["--config", str(config), "model.width=8", "train.max_steps=4", *extra]) == 2
        line = _error(capsys)
        assert "model parameter '0.weight' has shape [6, 3] in the checkpoint but [8, 3]" in line
        assert "cannot be resumed" in line and "resume_allow_changes" not in line
