"""koochak-train's stderr: Koochak's log lines and warnings, one compact line each (issue 29)."""

from __future__ import annotations

import logging
import re
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
from koochak.loop.cli import main
from koochak.loop.console import console_logging, format_warning

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_project import user_code  # noqa: E402

USER_CODE = user_code(
    '''
def step_fn(model, batch, ctx):
    if ctx.step == 1:
        warnings.warn("user code says: careful")
    x, y = batch
    return {"loss": F.mse_loss(model(x), y)}
''',
)

LINE = re.compile(r"^\d\d:\d\d:\d\d koochak( warning| error)?: \S")


@pytest.fixture
def project(tmp_path, monkeypatch):
    name = f"consolepkg_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{name}.py").write_text(USER_CODE)
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "cfg.yaml"
    config.write_text(
        textwrap.dedent(
            f"""
            train:
              max_steps: 4
              log_every: 2
              ckpt_every: 2
              device: cpu
              out_dir: {tmp_path / "run"}
              checkpoint_replicas: [{tmp_path / "replica"}]
              progress_bar: false
            optim:
              optimizer: {{name: sgd, lr: 0.05}}
            entry:
              model: {name}:make_model
              dataset: {name}:dataset
              step: {name}:step_fn
            """
        )
    )
    (tmp_path / "replica").mkdir()
    return tmp_path, config


def test_replication_and_warnings_are_one_compact_line_each(project, capsys):
    _, config = project
    assert main(["--config", str(config), "--resume", "none"]) == 0
    err = capsys.readouterr().err.splitlines()
    replicated = [line for line in err if re.search(r"replicated step\d+\.pt to tier 1 \(", line)]
    assert replicated and all(LINE.match(line) for line in replicated), err
    assert " s (" in replicated[0] and "still to copy there" in replicated[0]
    warned = [line for line in err if "user code says: careful" in line]
    assert len(warned) == 1 and LINE.match(warned[0]) and " koochak warning: " in warned[0]
    # Python's form names the file and line and repeats the source line: none of that.
    assert not [line for line in err if ".py:" in line or "warnings.warn(" in line], err


def test_logging_level_warning_hides_the_info_lines(project, capsys):
    _, config = project
    assert main(["--config", str(config), "--resume", "none", "logging.level=WARNING"]) == 0
    err = capsys.readouterr().err
    assert "replicated step" not in err
    assert "user code says: careful" in err


def test_a_bad_logging_level_is_one_line_exit_2(project, capsys):
    _, config = project
    assert main(["--config", str(config), "logging.level=LOUD"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "logging.level" in err and "INFO" in err


def test_other_ranks_print_errors_only_and_leaving_restores(capsys):
    log = logging.getLogger("koochak.loop.checkpoint")
    before = logging.getLogger("koochak").level
    with console_logging("INFO", rank=1):
        log.info("an info line")
        log.warning("a warning line")
        log.error("an error line")
    assert logging.getLogger("koochak").level == before
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and re.match(r"^\d\d:\d\d:\d\d koochak\[rank 1\] error: an error", err[0])
    with console_logging("DEBUG", rank=0):
        warnings.warn_explicit("from a library", UserWarning, "/x/site-packages/torch/a.py", 3)
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith("koochak warning: from a library (UserWarning from torch)")


def test_format_warning_names_only_foreign_libraries_and_odd_categories():
    own = "/x/site-packages/koochak/loop/cli.py"
    assert format_warning("a\n  b", UserWarning, own) == "a b"
    assert format_warning("old", DeprecationWarning, "train.py") == "old (DeprecationWarning)"
    assert format_warning("m", RuntimeWarning, "/v/lib/python3.12/site-packages/numpy/x.py") == (
        "m (RuntimeWarning from numpy)"
    )
