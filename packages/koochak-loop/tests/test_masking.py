"""koochak-train under a runner that names secrets (KOOCHAK_SECRET_NAMES): an exception message,
a warning, a --debug traceback or a GPU health record that quotes a secret's value is masked
before it is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from koochak.loop.cli import main
from koochak.loop.health import GpuHealthWatchdog, GpuReading
from koochak.loop.masking import mask_text

TOKEN = 'trk-"9Zq\\Lw-7f3e1c"-2b'
FRAGMENTS = (TOKEN, json.dumps(TOKEN)[1:-1], repr(TOKEN)[1:-1], "9Zq", "7f3e1c")

USER = """
import os
import warnings

import torch


def make_model(cfg):
    return torch.nn.Linear(2, 1)


def dataset(cfg, start_step=0):
    while True:
        yield torch.ones(2, 2), torch.ones(2, 1)


def leaky_step(model, batch, ctx):
    if ctx.step == 2:
        raise RuntimeError("tracking server said: bad token " + repr(os.environ["TRACKING_TOKEN"]))
    x, y = batch
    return {"loss": ((model(x) - y) ** 2).mean()}


def leaky_model(cfg):
    raise PermissionError("login with " + os.environ["TRACKING_TOKEN"] + " refused")


def leaky_hook(info):
    raise ConnectionError("tracker at https://x/?t=" + os.environ["TRACKING_TOKEN"] + " down")
"""


@pytest.fixture
def project(tmp_path, monkeypatch):
    name = f"masking_user_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{name}.py").write_text(USER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KOOCHAK_SECRET_NAMES", "TRACKING_TOKEN")
    monkeypatch.setenv("TRACKING_TOKEN", TOKEN)
    config = tmp_path / "cfg.yaml"
    config.write_text(
        textwrap.dedent(f"""
        train: {{max_steps: 4, device: cpu, out_dir: {tmp_path / "run"}, progress_bar: false}}
        optim: {{optimizer: {{name: sgd, lr: 0.1}}}}
        logging: {{stdout: false}}
        entry: {{model: "{name}:make_model", dataset: "{name}:dataset", step: "{name}:leaky_step"}}
        """)
    )
    return config, name


def assert_clean(text: str) -> None:
    for fragment in FRAGMENTS:
        assert fragment not in text, fragment
    assert "[masked TRACKING_TOKEN]" in text


def test_a_training_failure_line_masks_the_token(project, capsys):
    config, _ = project
    assert main(["--config", str(config), "--resume", "none"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tracking server said: bad token" in err[0]
    assert_clean(err[0])


def test_an_entry_failure_line_masks_the_token(project, capsys):
    config, name = project
    assert main(["--config", str(config), f"entry.model={name}:leaky_model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "entry.model=" in err[0] and "PermissionError" in err[0]
    assert_clean(err[0])


def test_debug_prints_the_traceback_masked_and_returns_the_code(project, capsys):
    config, _ = project
    assert main(["--config", str(config), "--resume", "none", "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError" in err
    assert_clean(err)


def test_without_named_secrets_nothing_changes(project, monkeypatch, capsys):
    config, _ = project
    monkeypatch.delenv("KOOCHAK_SECRET_NAMES")
    assert mask_text(f"x {TOKEN}") == f"x {TOKEN}"
    with pytest.raises(RuntimeError):  # --debug re-raises, as it always did
        main(["--config", str(config), "--resume", "none", "--debug"])


def test_a_gpu_health_record_masks_a_kernel_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KOOCHAK_SECRET_NAMES", "TRACKING_TOKEN")
    monkeypatch.setenv("TRACKING_TOKEN", TOKEN)
    reading = GpuReading(device="cuda:0", kernel_ok=False, kernel_error=f"driver: {TOKEN}")
    dog = GpuHealthWatchdog(1, "cpu", out_dir=tmp_path, reader=lambda device: reading, env={})
    assert not dog.check(0).healthy
    text = (tmp_path / "gpu_health.jsonl").read_text()
    assert_clean(text)


@pytest.mark.slow
def test_warnings_and_the_error_line_of_a_real_process_are_masked(project, tmp_path):
    """A hook that fails with the token in its message warns (on stderr) and the step's error
    ends the run: the process's whole output holds the masked form only."""
    config, name = project
    argv = [sys.executable, "-m", "koochak.loop.cli", "--config", str(config), "--resume", "none"]
    code = f"import koochak.loop.cli as c, {name} as u, sys\n"
    code += "real = c.build_hooks\n"
    code += "c.build_hooks = lambda cfg: {**real(cfg), 'on_step_end': [u.leaky_hook]}\n"
    code += f"sys.argv = {argv[2:]!r}\nsys.exit(c.main())\n"
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 1, done.stderr
    assert "hook" in done.stderr and "ConnectionError" in done.stderr  # the warning
    assert "tracking server said" in done.stderr  # the error line
    assert_clean(done.stdout + done.stderr)


@pytest.mark.slow
def test_wandb_does_not_copy_unmasked_output_into_its_run_files(project, tmp_path):
    """W&B's console capture would record what the run prints before the masking sees it:
    under named secrets it is off, so the offline run's files never hold the token."""
    pytest.importorskip("wandb")
    config, name = project
    with open(tmp_path / f"{name}.py", "a") as f:
        f.write(
            "\n\ndef chatty_step(model, batch, ctx):\n"
            "    print('using token', os.environ['TRACKING_TOKEN'], flush=True)\n"
            "    x, y = batch\n"
            "    return {'loss': ((model(x) - y) ** 2).mean()}\n"
        )
    home = tmp_path / "wandb-home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(
        {f"WANDB_{k}_DIR": str(home / k.lower()) for k in ("CACHE", "DATA", "CONFIG", "ARTIFACT")}
    )
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    argv = [sys.executable, "-m", "koochak.loop.cli", "--config", str(config), "--resume", "none"]
    argv += [f"entry.step={name}:chatty_step", "wandb.enabled=true", "wandb.mode=offline"]
    argv += [f"wandb.dir={tmp_path / 'wandb-run'}"]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "using token [masked TRACKING_TOKEN]" in done.stdout
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "wandb-run") for f in fs]
    assert any(f.endswith(".wandb") for f in files), files
    for path in files:
        with open(path, "rb") as f:
            data = f.read()
        for fragment in FRAGMENTS:
            assert fragment.encode() not in data, (fragment, path)
