"""One live run per checkpoint location (issue 29, item 7): koochak-train refuses a second run
into the same out_dir with exit 2 naming the holder, and takes over a dead holder's lease."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from koochak.loop.cli import main
from koochak.storage.lease import LEASE_KEY, read_lease
from koochak.storage.store import LocalStore

USER_CODE = """
import os
import torch
from torch.nn import functional as F


def make_model(cfg):
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def dataset(cfg, start_step=0):
    gen = torch.Generator().manual_seed(int(cfg.train.seed) + start_step)
    while True:
        x = torch.randn(4, 3, generator=gen)
        yield x, x.sum(1, keepdim=True)


def step_fn(model, batch, ctx):
    x, y = batch
    return {"loss": F.mse_loss(model(x), y)}


def waiting_step(model, batch, ctx):
    import time

    flag = os.environ["LEASE_TEST_FLAG"]
    open(flag + ".running", "w").close()
    while not os.path.exists(flag):
        time.sleep(0.05)
    return step_fn(model, batch, ctx)
"""

HOLDER = textwrap.dedent(
    """
    import sys, time
    from koochak.storage.lease import acquire_lease
    from koochak.storage.store import LocalStore

    acquire_lease(LocalStore(sys.argv[1]), purpose="the other run")
    print("held", flush=True)
    time.sleep(600)
    """
)


@pytest.fixture
def project(tmp_path, monkeypatch):
    name = f"leasepkg_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{name}.py").write_text(USER_CODE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / "cfg.yaml"
    config.write_text(
        textwrap.dedent(
            f"""
            train:
              max_steps: 3
              log_every: 1
              device: cpu
              out_dir: {tmp_path / "run"}
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
    return tmp_path, name, config


def _hold(run_dir) -> subprocess.Popen:
    os.makedirs(run_dir, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_run_into_one_out_dir_is_refused_with_exit_2_naming_the_holder(project, capsys):
    root, _, config = project
    holder = _hold(root / "run")
    try:
        assert main(["--config", str(config), "--resume", "none"]) == 2
        err = capsys.readouterr().err
        assert f"train.out_dir: {root / 'run'}/{LEASE_KEY}" in err
        assert f"another run holds this location: pid {holder.pid}" in err and "the other run" in err
        assert not (root / "run" / "step000000003.pt").exists()  # refused before any update
    finally:
        holder.kill()
        holder.wait()


def test_a_dead_holders_lease_is_taken_over_with_one_line_and_released(project, caplog):
    root, _, config = project
    holder = _hold(root / "run")
    holder.send_signal(signal.SIGKILL)  # kill -9: its lease stays behind
    holder.wait()
    dead = read_lease(LocalStore(root / "run"))
    assert dead is not None and dead.pid == holder.pid
    with caplog.at_level(logging.WARNING, logger="koochak.storage.lease"):
        assert main(["--config", str(config), "--resume", "none"]) == 0
    lines = [r.getMessage() for r in caplog.records if "taking over the lease" in r.getMessage()]
    assert len(lines) == 1 and f"pid {holder.pid} is no longer running" in lines[0]
    assert torch.load(root / "run" / "step000000003.pt", weights_only=True)["step"] == 3
    assert read_lease(LocalStore(root / "run")) is None  # released at the end
    assert main(["--config", str(config), "--resume", "auto"]) == 0  # the next run may start


@pytest.mark.slow
def test_two_koochak_train_runs_into_one_out_dir(project, tmp_path):
    root, name, config = project
    flag = str(tmp_path / "go")
    env = {**os.environ, "LEASE_TEST_FLAG": flag, "PYTHONPATH": str(root)}
    first = subprocess.Popen(
        [sys.executable, "-m", "koochak.loop.cli", "--config", str(config), "--resume", "none",
         f"entry.step={name}:waiting_step"],  # fmt: skip
        cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not os.path.exists(flag + ".running"):
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the first run never started training"
            time.sleep(0.1)
        second = subprocess.run(
            [sys.executable, "-m", "koochak.loop.cli", "--config", str(config), "--resume",
             "auto"],  # fmt: skip
            cwd=root, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert second.returncode == 2, second.stderr
        assert f"another run holds this location: pid {first.pid}" in second.stderr
    finally:
        open(flag, "w").close()
        out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert torch.load(root / "run" / "step000000003.pt", weights_only=True)["step"] == 3
    assert read_lease(LocalStore(root / "run")) is None
