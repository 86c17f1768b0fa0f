"""Every failure of an ``entry.*`` import string, whatever the imported module does, is one line
on stderr naming the key and the import string, and exit 2, before any training."""

from __future__ import annotations

import textwrap

import pytest
from koochak.loop.cli import main

GOOD = """
import torch


def make_model(cfg):
    return torch.nn.Linear(2, 1)


def dataset(cfg, start_step=0):
    while True:
        yield torch.ones(2, 2), torch.ones(2, 1)


def step_fn(model, batch, ctx):
    x, y = batch
    return {"loss": ((model(x) - y) ** 2).mean()}


def exploding_model(cfg):
    raise RuntimeError("no GPU memory for the embedding table")


def exiting_model(cfg):
    raise SystemExit(4)


class Lazy:
    @property
    def builder(self):
        raise KeyError("registry not loaded")


lazy = Lazy()
"""

# module name -> source; each is imported by one case below
MODULES = {
    "entry_syntax": "def make_model(cfg)\n    return None\n",
    "entry_raises": "raise RuntimeError('module-level setup failed')\n",
    "entry_exits": "import sys\nsys.exit(3)\n",
    "entry_needs_dep": "import not_installed_anywhere_xyz\n",
}


@pytest.fixture
def project(tmp_path, monkeypatch):
    name = f"entry_good_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{name}.py").write_text(GOOD)
    suffix = abs(hash(str(tmp_path)))
    modules = {}
    for module, source in MODULES.items():
        modules[module] = f"{module}_{suffix}"
        (tmp_path / f"{modules[module]}.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "cfg.yaml"
    config.write_text(
        textwrap.dedent(f"""
        train: {{max_steps: 2, device: cpu, out_dir: {tmp_path / "run"}, progress_bar: false}}
        optim: {{optimizer: {{name: sgd, lr: 0.1}}}}
        logging: {{stdout: false}}
        entry: {{model: "{name}:make_model", dataset: "{name}:dataset", step: "{name}:step_fn"}}
        """)
    )
    return config, name, modules


@pytest.mark.parametrize(
    ("key", "target", "expected"),
    [
        ("entry.model", ":f", "expected 'module:callable' with dotted Python names"),
        (
            "entry.model",
            "{good}:make_model.",
            "expected 'module:callable' with dotted Python names",
        ),
        ("entry.model", ".rel:f", "relative module '.rel' has no package to be relative to"),
        ("entry.model", "{entry_syntax}:make_model", "has a syntax error: expected ':'"),
        (
            "entry.model",
            "{entry_raises}:make_model",
            "raised RuntimeError: module-level setup failed",
        ),
        ("entry.model", "{entry_exits}:make_model", "called sys.exit(3)"),
        (
            "entry.dataset",
            "{entry_needs_dep}:dataset",
            "imports 'not_installed_anywhere_xyz', which is not installed",
        ),
        ("entry.step", "{good}:lazy.builder", "looking up 'lazy.builder' raised KeyError"),
        ("entry.model", "{good}:exploding_model", "the builder raised RuntimeError: no GPU memory"),
        ("entry.model", "{good}:exiting_model", "the builder called sys.exit(4)"),
    ],
)
def test_an_entry_failure_is_one_line_naming_key_and_import_string(
    project, capsys, key, target, expected
):
    config, good, modules = project
    target = target.format(good=good, **modules)
    code = main(["--config", str(config), f"{key}={target}", "--resume", "none"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith(f"koochak-train: error: {key}={target!r}: "), err[0]
    assert expected in err[0]
